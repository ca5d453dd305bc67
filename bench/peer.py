#!/usr/bin/env python3
"""kvgate against Hugging Face transformers and llama.cpp on the same CPU, same weights, same
prompts, same threads, greedy.

Writes a random-weight Llama checkpoint with transformers (`from_config` + `save_pretrained`),
serves it with `kvgate-worker local --colocated`, and runs transformers (f32, its default SDPA
attention, KV cache on) beside it; then the same weights as an f32 GGUF under llama.cpp's own
server (bench/llamacpp.py). Prints two Markdown tables: against transformers, prefill tokens/s for
512, 2k and 8k prompts and decode tokens/s at batch 1 and 8 (exits non-zero when the two produce
different tokens); against llama.cpp, prefill at 2k and 8k and decode at 1, 8 and 32 concurrent
streams, with the share of greedy tokens that agree (f32 kernels may flip near-ties); then kvgate
alone with its CPU kernels at the widest level this CPU offers, forced to AVX-512, to AVX2 and to
the portable baseline (KVGATE_CPU_KERNELS; a level the CPU lacks is reported, not run). Run it
through `bench/venv.sh`, which makes the venv (`make bench` does:
`bench/venv.sh bench/peer.py --worker target/release/kvgate-worker`).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import llamacpp
import serve

VOCAB = 4096
PREFILL = (512, 2048, 8192)
DECODE_PROMPT = 128
DECODE_TOKENS = 64
RUNS = 5
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16384,
    # Wider than training's 0.02, so greedy choices are not near-ties that rounding could flip.
    initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


def checkpoint(d):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    model.save_pretrained(d)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                   "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                   "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}, f)
    return model


def ids_of(text):
    words = text.split()
    if not all(w.startswith("t") for w in words):
        sys.exit(f"unexpected completion text {text[:80]!r}")
    return [int(w[1:]) for w in words]


class Kvgate:
    def __init__(self, worker, model_dir, kernels=None):
        port = serve.free_port()
        self.url = f"http://127.0.0.1:{port}"
        window = max(PREFILL) + DECODE_TOKENS + 1
        cmd = [worker, "local", "--colocated", "--model", model_dir, "--listen", f"127.0.0.1:{port}",
               "--context-window", str(window), "--kv-pool-tokens", str(8 * window),
               # One client drives every stream here (the default fair share is 16).
               "--max-requests-per-client", "64"]
        env = dict(os.environ, KVGATE_CPU_KERNELS=kernels) if kernels else None
        self.proc = serve.Process("kvgate-worker", cmd, self.url + "/v1/models", env)
        self.model = json.loads(self.proc.ready)["data"][0]["id"]

    def complete(self, prompt, max_tokens):
        r = serve.post(self.url + "/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        return ids_of(r["choices"][0]["text"])

    def stream(self, prompt, max_tokens, out, i):
        """Streams one completion; records (time of the first token, time of the end, ids)."""
        r = serve.post(self.url + "/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}, stream=True)
        first, text = None, ""
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece and first is None:
                first = time.perf_counter()
            text += piece
        out[i] = (first, time.perf_counter(), ids_of(text))

    def close(self):
        self.proc.close()


def median_time(f):
    return side_by_side(f)[0]


def side_by_side(*fs):
    """Each function warmed up, then run RUNS times in turn (the machine's speed drifts between
    runs here, so each side sees the same drift): [(median time, last output)] per function."""
    for f in fs:
        f()
    times, outs = [[] for _ in fs], [None] * len(fs)
    for _ in range(RUNS):
        for i, f in enumerate(fs):
            t = time.perf_counter()
            outs[i] = f()
            times[i].append(time.perf_counter() - t)
    return [(statistics.median(t), out) for t, out in zip(times, outs)]


def served_decode(server, prompts):
    """One round: aggregate decode tokens/s of len(prompts) concurrent greedy streams on a server
    (kvgate or llama.cpp: from the last first token to the last end), and their tokens."""
    out = llamacpp.concurrent(server, prompts, DECODE_TOKENS + 1)
    return len(prompts) * DECODE_TOKENS / (max(o[1] for o in out) - max(o[0] for o in out)), [o[2] for o in out]


def rates_side_by_side(*fs):
    """Like side_by_side, for functions that measure their own rate: each returns (rate, output);
    [(median rate, last output)] per function, the functions run in turn."""
    for f in fs:
        f()
    rates, outs = [[] for _ in fs], [None] * len(fs)
    for _ in range(RUNS):
        for i, f in enumerate(fs):
            rate, outs[i] = f()
            rates[i].append(rate)
    return [(statistics.median(r), out) for r, out in zip(rates, outs)]


def agreement(a, b):
    """The share of positions where two greedy token lists agree, up to the first difference
    in each (after a flip, both go on from different contexts)."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same, total = same + n, total + max(len(x), len(y))
    return same / total


def hf_decode(model, prompts):
    """One round of transformers' decode: tokens/s after the first token, and the tokens."""
    ids = torch.tensor(prompts)
    gen = lambda n: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    with torch.no_grad():
        t = time.perf_counter()
        gen(1)
        t_first = time.perf_counter() - t
        t = time.perf_counter()
        out = gen(DECODE_TOKENS + 1)
        t_all = time.perf_counter() - t
    return len(prompts) * DECODE_TOKENS / (t_all - t_first), out[:, ids.shape[1]:].tolist()


def against_llamacpp(k, model_dir, g, threads):
    """Prefill at 2k and 8k and decode at 1, 8 and 32 streams, kvgate and llama.cpp side by side."""
    path = os.path.join(model_dir, "model.gguf")
    llamacpp.gguf_from_checkpoint(model_dir, path)
    streams = 32
    server = llamacpp.LlamaCpp(path, ctx=max(PREFILL) + streams * (DECODE_PROMPT + DECODE_TOKENS + 2), slots=streams, threads=threads)
    rows = []
    try:
        for n in PREFILL[1:]:
            prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
            (tk, ktok), (tl, ltok) = side_by_side(lambda: k.complete(prompt, 1), lambda: server.complete(prompt, 1))
            rows.append((f"prefill, {n}-token prompt (tokens/s)", n / tk, n / tl, agreement([ktok], [ltok])))
        prompts = [torch.randint(0, VOCAB, (DECODE_PROMPT,), generator=g).tolist() for _ in range(streams)]
        for batch in (1, 8, streams):
            (rk, ktoks), (rl, ltoks) = rates_side_by_side(lambda: served_decode(k, prompts[:batch]), lambda: served_decode(server, prompts[:batch]))
            rows.append((f"decode, {batch} concurrent streams, {DECODE_PROMPT}-token prompts (tokens/s)", rk, rl, agreement(ktoks, ltoks)))
    finally:
        server.close()
    return rows, server.version


def by_kernel_level(worker, model_dir, g):
    """kvgate alone at each CPU kernel level (KVGATE_CPU_KERNELS): the widest this CPU offers,
    forced down to AVX2, and the portable baseline; a level the CPU lacks is reported as such."""
    prompt = torch.randint(0, VOCAB, (PREFILL[1],), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (DECODE_PROMPT,), generator=g).tolist() for _ in range(8)]
    rows = []
    for level in ("widest", "avx512", "avx2", "portable"):
        try:
            k = Kvgate(worker, model_dir, level)
        except SystemExit as e:
            rows.append((level, None, None, None, str(e).strip().splitlines()[-1].split("kvgate-worker: ")[-1]))
            continue
        try:
            t, _ = median_time(lambda: k.complete(prompt, 1))
            [(d1, _)] = rates_side_by_side(lambda: served_decode(k, prompts[:1]))
            [(d8, _)] = rates_side_by_side(lambda: served_decode(k, prompts))
            rows.append((level, PREFILL[1] / t, d1, d8, ""))
        finally:
            k.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", required=True, help="path of the release kvgate-worker binary")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for transformers (kvgate uses every core)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="kvgate-peer-")
    try:
        model = checkpoint(tmp)
        k = Kvgate(args.worker, tmp)
        try:
            rows, same = [], True
            g = torch.Generator().manual_seed(1)
            for n in PREFILL:
                prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
                with torch.no_grad():
                    (tk, ktok), (th, logits) = side_by_side(lambda: k.complete(prompt, 1), lambda: model(torch.tensor([prompt]), logits_to_keep=1).logits)
                htok = [int(logits[0, -1].argmax())]
                same &= ktok == htok
                rows.append((f"prefill, {n}-token prompt", n / tk, n / th, "tokens/s (prompt tokens / time to the first token)", ktok == htok))
            prompts = [torch.randint(0, VOCAB, (DECODE_PROMPT,), generator=g).tolist() for _ in range(8)]
            for batch in (1, 8):
                (rk, ktoks), (rh, htoks) = rates_side_by_side(lambda: served_decode(k, prompts[:batch]), lambda: hf_decode(model, prompts[:batch]))
                equal = ktoks == htoks
                same &= equal
                rows.append((f"decode, batch {batch}, {DECODE_PROMPT}-token prompts", rk, rh, f"tokens/s over {DECODE_TOKENS} tokens after the first", equal))
            lrows, version = against_llamacpp(k, tmp, g, args.threads)
        finally:
            k.close()
        level_rows = by_kernel_level(args.worker, tmp, g)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    import transformers
    shape = f"Llama {SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, {SHAPE['num_attention_heads']}/{SHAPE['num_key_value_heads']} heads, vocab {VOCAB}, f32"
    print(f"| benchmark ({shape}; transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} threads) | kvgate | transformers | kvgate / transformers | same tokens |")
    print("| --- | --- | --- | --- | --- |")
    for what, k_rate, h_rate, unit, equal in rows:
        print(f"| {what} | {k_rate:.0f} | {h_rate:.0f} | {k_rate / h_rate:.2f}x | {'yes' if equal else 'NO'} |")
    print()
    print(f"(rates in {rows[0][3]} and {rows[-1][3]}; median of {RUNS} after a warm-up, the two sides run in turn)")
    print()
    print(f"| benchmark (same weights as an f32 GGUF; llama.cpp's server from xllamacpp {version}, {args.threads} threads, 32 slots over one unified KV cache) | kvgate | llama.cpp | kvgate / llama.cpp | greedy agreement |")
    print("| --- | --- | --- | --- | --- |")
    for what, k_rate, l_rate, agree in lrows:
        print(f"| {what} | {k_rate:.0f} | {l_rate:.0f} | {k_rate / l_rate:.2f}x | {agree:.0%} |")
    print()
    print(f"(aims: at least 0.8x at one stream, ahead at 8 and 32; agreement counts tokens up to each stream's first difference)")
    print()
    widest = level_rows[0]
    print(f"| kvgate's CPU kernels (KVGATE_CPU_KERNELS) | prefill, {PREFILL[1]}-token prompt (tokens/s) | decode, batch 1 (tokens/s) | decode, batch 8 (tokens/s) | prefill / decode 1 / decode 8 against widest |")
    print("| --- | --- | --- | --- | --- |")
    for level, p, d1, d8, why in level_rows:
        if p is None:
            print(f"| {level} | - | - | - | not run: {why} |")
        else:
            print(f"| {level} | {p:.0f} | {d1:.0f} | {d8:.0f} | {p / widest[1]:.2f}x / {d1 / widest[2]:.2f}x / {d8 / widest[3]:.2f}x |")
    if not same:
        sys.exit("kvgate and transformers produced different greedy tokens")


if __name__ == "__main__":
    main()
