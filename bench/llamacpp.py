"""llama.cpp as a peer for bench/peer.py: the same safetensors checkpoint written as an f32 GGUF
with the `gguf` package, served by llama.cpp's own HTTP server (the `xllamacpp` wheel, a prebuilt
CPU build) with token-id prompts.

The GGUF carries llama.cpp's tensor names, and Q and K rows permuted as llama.cpp's converter
(convert_hf_to_gguf.py) does for Llama: transformers rotates the two halves of each head, llama.cpp
rotates adjacent pairs. The vocabulary is placeholder pieces (prompts are token ids, answers are
read as token ids), with no BOS added and EOS ignored, as transformers runs it here.
"""

import json
import os
import sys
import threading
import time

import numpy as np

import serve


def gguf_from_checkpoint(model_dir, out, bpe=None):
    """`bpe`: (tokens, merges) of a byte-level BPE vocabulary (bench/load.py's) written as
    llama.cpp's `gpt2` tokenizer; without it, placeholder pieces for token-id prompts."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or d // heads
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}

    def permute(w, n):
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(out, "llama")
    w.add_name("kvgate-bench-random")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = cfg["vocab_size"]
    if bpe:
        tokens, merges = bpe
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([t.encode() for t in tokens])
        w.add_token_merges(merges)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"t{i}".encode() for i in range(vocab)])
        w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    f32 = lambda name: np.ascontiguousarray(t[name], dtype=np.float32)
    w.add_tensor("token_embd.weight", f32("model.embed_tokens.weight"))
    for i in range(layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", f32(p + "input_layernorm.weight"))
        w.add_tensor(f"blk.{i}.attn_q.weight", np.ascontiguousarray(permute(f32(p + "self_attn.q_proj.weight"), heads)))
        w.add_tensor(f"blk.{i}.attn_k.weight", np.ascontiguousarray(permute(f32(p + "self_attn.k_proj.weight"), kv)))
        w.add_tensor(f"blk.{i}.attn_v.weight", f32(p + "self_attn.v_proj.weight"))
        w.add_tensor(f"blk.{i}.attn_output.weight", f32(p + "self_attn.o_proj.weight"))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", f32(p + "post_attention_layernorm.weight"))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", f32(p + "mlp.gate_proj.weight"))
        w.add_tensor(f"blk.{i}.ffn_up.weight", f32(p + "mlp.up_proj.weight"))
        w.add_tensor(f"blk.{i}.ffn_down.weight", f32(p + "mlp.down_proj.weight"))
    w.add_tensor("output_norm.weight", f32("model.norm.weight"))
    w.add_tensor("output.weight", f32("lm_head.weight" if "lm_head.weight" in t else "model.embed_tokens.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class LlamaCpp:
    """llama.cpp's server in a child process: `slots` parallel sequences over one unified KV
    cache of `ctx` tokens, `threads` CPU threads (prompt batches and generation alike)."""

    def __init__(self, gguf_path, ctx, slots, threads):
        import xllamacpp  # fails here, with its name, when the wheel is missing

        self.url = f"http://127.0.0.1:{(port := serve.free_port())}"
        launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "images", "llamacpp", "llama-server")
        cmd = [sys.executable, launcher, "-m", gguf_path, "-c", str(ctx), "-np", str(slots), "--kv-unified",
               "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
        self.proc = serve.Process("llama.cpp's server", cmd, self.url + "/health")
        self.version = xllamacpp.__version__

    def _body(self, prompt, n, stream):
        return {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True, "stream": stream}

    def complete(self, prompt, n):
        return serve.post(self.url + "/completion", self._body(prompt, n, False))["tokens"]

    def stream(self, prompt, n, out, i):
        """Streams one completion; records (time of the first token, time of the end, ids)."""
        r = serve.post(self.url + "/completion", self._body(prompt, n, True), stream=True)
        first, ids = None, []
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("tokens") and first is None:
                first = time.perf_counter()
            ids += chunk.get("tokens") or []
            if chunk.get("stop"):
                break
        out[i] = (first, time.perf_counter(), ids)

    def close(self):
        self.proc.close()


def concurrent(server, prompts, n):
    """Runs one streamed completion per prompt at once; their (first, end, ids)."""
    out = [None] * len(prompts)
    threads = [threading.Thread(target=server.stream, args=(p, n, out, i)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
