#!/usr/bin/env python3
"""guidellm (PyPI 0.8.1) against kvgate colocated, kvgate disaggregated and llama.cpp, on the same
CPU and the same weights: requests/s, time to first token and inter-token latency percentiles at
1 to 32 concurrent streams.

The weights are bench/peer.py's random Llama. guidellm sends text, so every server must turn the
same text into the same tokens: the checkpoint gets a byte-level BPE tokenizer in which every byte
is one token (256 byte tokens, one merge, placeholders for the rest of the vocabulary), written as
`tokenizer.json` for kvgate and as llama.cpp's `gpt2` tokenizer into the GGUF. Prompts are
guidellm's synthetic text; every request asks for the same number of tokens (the random model has
no end-of-sequence token in kvgate; llama.cpp is told to ignore its placeholder one). Writes a
Markdown table, target/bench/load.csv and docs/bench-load.png. Run it through bench/venv.sh
(`make bench` does: `bench/venv.sh bench/load.py --worker target/release/kvgate-worker`).
"""

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile

import llamacpp
import peer
import serve

STREAMS = [1, 2, 4, 8, 16, 32]
PROMPT_TOKENS = 256
OUTPUT_TOKENS = 64
SECONDS = 20  # per concurrency level
# Every server generates exactly OUTPUT_TOKENS per request, end-of-sequence or not (vLLM's
# `ignore_eos`, which kvgate and llama.cpp's server both take).
SAME_LENGTH = {"ignore_eos": True}


def byte_level_bpe(vocab_size):
    """GPT-2's byte-to-character map as the first 256 tokens, one merge ("<" + "|"), and
    placeholders the text never produces up to `vocab_size`."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tokens = [chars[b] for b in range(256)] + ["<|"]
    tokens += [f"<|{i}|>" for i in range(len(tokens), vocab_size)]
    return tokens, ["< |"]


def write_tokenizer(model_dir, tokens, merges):
    """`tokenizer.json` for kvgate and guidellm (transformers' plain fast tokenizer: no BOS)."""
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}, f)
    with open(os.path.join(model_dir, "tokenizer.json"), "w") as f:
        json.dump({
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [m.split(" ") for m in merges]},
        }, f)


def guidellm(target, model, tokenizer_dir, out_json, health, extras=None):
    """One guidellm run over every concurrency level; its JSON report's path. `health`: the
    server's health path (guidellm checks it first)."""
    backend = {"kind": "openai_http", "target": target, "model": model, "request_format": "/v1/completions",
               "max_tokens": OUTPUT_TOKENS, "timeout": 600, "api_routes": {"/health": health}}
    if extras:
        backend["extras"] = {"body": extras}
    scenario = {"spec": {
        "backend": backend,
        "profile": {"kind": "concurrent", "streams": STREAMS},
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer_dir},
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS}],
        "constraints": [{"kind": "max_duration", "seconds": SECONDS}],
        "outputs": [{"kind": "json", "path": out_json}],
    }}
    path = out_json + ".scenario.json"
    with open(path, "w") as f:
        json.dump(scenario, f)
    exe = os.path.join(os.path.dirname(sys.executable), "guidellm")
    r = subprocess.run([exe, "run", "-c", path, "--disable-console-interactive"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"guidellm against {target} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return out_json


def rows_of(report, server):
    """(server, streams, requests/s, TTFT p50/p99 ms, ITL p50/p99 ms, output tokens/s, errors)."""
    with open(report) as f:
        data = json.load(f)
    rows = []
    for b in data["benchmarks"]:
        m = b["metrics"]
        pct = lambda name, p: m[name]["successful"]["percentiles"][p]
        streams = b["config"]["strategy"]["streams"] if "streams" in b["config"]["strategy"] else b["config"]["strategy"].get("max_concurrency")
        rows.append((server, streams, m["requests_per_second"]["successful"]["mean"],
                     pct("time_to_first_token_ms", "p50"), pct("time_to_first_token_ms", "p99"),
                     pct("inter_token_latency_ms", "p50"), pct("inter_token_latency_ms", "p99"),
                     m["output_tokens_per_second"]["successful"]["mean"], b["scheduler_metrics"]["requests_made"]["errored"]))
    return rows


def plot(rows, path):
    """Requests/s, TTFT p50 and ITL p50 against streams, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=100)
    for ax, (col, label) in zip(axes, ((2, "requests/s"), (3, "TTFT p50 (ms, log)"), (5, "ITL p50 (ms, log)"))):
        for server in dict.fromkeys(r[0] for r in rows):
            mine = [r for r in rows if r[0] == server]
            ax.plot([r[1] for r in mine], [r[col] for r in mine], marker="o", label=server)
        ax.set_xscale("log", base=2)
        ax.set_xticks(STREAMS, [str(s) for s in STREAMS])
        if col != 2:
            ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"guidellm, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} tokens each (2 cores)")
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    print(f"wrote {path}")


def main():
    global SECONDS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", required=True, help="path of the release kvgate-worker binary")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for llama.cpp (kvgate uses every core)")
    ap.add_argument("--out", default="target/bench", help="directory for load.csv and guidellm's reports")
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)), help="concurrency levels, comma-separated")
    ap.add_argument("--seconds", type=int, default=SECONDS, help="how long each level runs")
    args = ap.parse_args()
    STREAMS[:] = [int(s) for s in args.streams.split(",")]
    SECONDS = args.seconds
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvgate-load-")
    rows = []
    try:
        model_dir = os.path.join(tmp, "bench-llama")
        os.makedirs(model_dir)
        cfg = peer.checkpoint(model_dir).config
        tokens, merges = byte_level_bpe(cfg.vocab_size)
        write_tokenizer(model_dir, tokens, merges)
        window = PROMPT_TOKENS * 4 + OUTPUT_TOKENS
        for name, colocated in (("kvgate colocated", True), ("kvgate disaggregated", False)):
            port = serve.free_port()
            cmd = [args.worker, "local", "--model", model_dir, "--listen", f"127.0.0.1:{port}", "--context-window", str(window),
                   "--kv-pool-tokens", str(max(STREAMS) * window), "--max-requests-per-client", str(2 * max(STREAMS))]
            proc = serve.Process(name, cmd + (["--colocated"] if colocated else []), f"http://127.0.0.1:{port}/v1/models")
            try:
                served = json.loads(proc.ready)["data"][0]["id"]
                report = guidellm(f"http://127.0.0.1:{port}", served, model_dir, os.path.join(args.out, f"guidellm-{name.replace(' ', '-')}.json"), "healthz",
                                  extras=SAME_LENGTH)
                rows += rows_of(report, name)
            finally:
                proc.close()
        gguf_path = os.path.join(tmp, "model.gguf")
        llamacpp.gguf_from_checkpoint(model_dir, gguf_path, bpe=(tokens, merges))
        server = llamacpp.LlamaCpp(gguf_path, ctx=max(STREAMS) * window, slots=max(STREAMS), threads=args.threads)
        try:
            report = guidellm(server.url, "bench-llama", model_dir, os.path.join(args.out, "guidellm-llama.cpp.json"), "health", extras=SAME_LENGTH)
            rows += rows_of(report, f"llama.cpp {server.version}")
        finally:
            server.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    header = ["server", "streams", "requests/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tokens/s", "errored"]
    with open(os.path.join(args.out, "load.csv"), "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    plot(rows, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "bench-load.png"))
    print(f"| guidellm 0.8.1, concurrent streams, {PROMPT_TOKENS}-token synthetic prompts, {OUTPUT_TOKENS} tokens each, {SECONDS} s per level | " + " | ".join(header[1:]) + " |")
    print("| " + " | ".join(["---"] * len(header)) + " |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.0f} | {r[8]} |")
    if any(r[8] for r in rows):
        sys.exit("some requests failed (the errored column)")


if __name__ == "__main__":
    main()
