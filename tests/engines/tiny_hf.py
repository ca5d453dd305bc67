"""A random Llama in transformers' checkpoint layout (config.json and model.safetensors, the
tensor names LlamaForCausalLM saves), written with numpy and safetensors: the model the vLLM
tests serve (no download, the same weights every time).

  python tiny_hf.py OUT_DIR

Two layers, hidden size 256, 4 query and 2 key/value heads (head size 64, which vLLM's CPU
attention supports), vocabulary 512, 8,192 positions. No tokenizer: vLLM runs it with
--skip-tokenizer-init and token-id prompts.
"""
import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
vocab, d, layers, heads, kv, ffn = 512, 256, 2, 4, 2, 512
hd = d // heads
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": d,
    "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
    "head_dim": hd, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
rng = np.random.default_rng(7)
def w(*shape):
    return (rng.standard_normal(shape) * 0.05).astype(np.float32)
tensors = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": np.ones(d, np.float32), "lm_head.weight": w(vocab, d)}
for i in range(layers):
    p = f"model.layers.{i}."
    tensors.update({
        p + "input_layernorm.weight": np.ones(d, np.float32),
        p + "post_attention_layernorm.weight": np.ones(d, np.float32),
        p + "self_attn.q_proj.weight": w(heads * hd, d),
        p + "self_attn.k_proj.weight": w(kv * hd, d),
        p + "self_attn.v_proj.weight": w(kv * hd, d),
        p + "self_attn.o_proj.weight": w(d, heads * hd),
        p + "mlp.gate_proj.weight": w(ffn, d),
        p + "mlp.up_proj.weight": w(ffn, d),
        p + "mlp.down_proj.weight": w(d, ffn),
    })
save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
print(f"wrote {out}")
