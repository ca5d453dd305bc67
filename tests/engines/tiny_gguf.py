"""A random Llama as an f32 GGUF, written with the `gguf` package: the model the llama.cpp tests and
the demo serve (no download, the same file every time: seeded weights).

  python tiny_gguf.py OUT.gguf

Two layers, hidden size 64, 4 query and 2 key/value heads, a byte-level vocabulary of 259 tokens
(<unk>, <s>, </s> and the 256 bytes, SentencePiece byte fallback), trained context 8192.
"""
import sys

import gguf
import numpy as np

out = sys.argv[1]
rng = np.random.default_rng(7)
n_vocab, d, layers, heads, kv, ffn, ctx = 259, 64, 2, 4, 2, 128, 8192
w = gguf.GGUFWriter(out, "llama")
w.add_name("kvgate-tiny-random")
w.add_context_length(ctx)
w.add_embedding_length(d)
w.add_block_count(layers)
w.add_feed_forward_length(ffn)
w.add_head_count(heads)
w.add_head_count_kv(kv)
w.add_rope_dimension_count(d // heads)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_freq_base(10000.0)
w.add_file_type(gguf.LlamaFileType.ALL_F32)
tokens = [b"<unk>", b"<s>", b"</s>"] + [("<0x%02X>" % i).encode() for i in range(256)]
w.add_tokenizer_model("llama")
w.add_token_list(tokens)
w.add_token_scores([0.0] * n_vocab)
w.add_token_types([2, 3, 3] + [6] * 256)
w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)
w.add_add_bos_token(True)
def t(name, *shape):
    w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
t("token_embd.weight", n_vocab, d)
hd = d // heads
for i in range(layers):
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
    t(f"blk.{i}.attn_q.weight", d, d)
    t(f"blk.{i}.attn_k.weight", kv * hd, d)
    t(f"blk.{i}.attn_v.weight", kv * hd, d)
    t(f"blk.{i}.attn_output.weight", d, d)
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    t(f"blk.{i}.ffn_gate.weight", ffn, d)
    t(f"blk.{i}.ffn_up.weight", ffn, d)
    t(f"blk.{i}.ffn_down.weight", d, ffn)
w.add_tensor("output_norm.weight", np.ones(d, np.float32))
t("output.weight", n_vocab, d)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print(f"wrote {out}")
