//! A contiguous-KV reference forward: the whole sequence at once, attention as plain tensor
//! algebra with a causal mask, no pool. Tests and benchmarks compare the paged path against it.

use candle_core::{Module, Result, Tensor};

use super::llama::{Llama, softmax_last};

impl Llama {
    /// Logits for every position of `tokens`, `[tokens.len(), vocab]`.
    pub fn forward_reference(&self, tokens: &[u32]) -> Result<Tensor> {
        let n = tokens.len();
        let dev = &self.device;
        let shape = self.attn_shape();
        let (h_n, kv_n, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let positions: Vec<u32> = (0..n as u32).collect();
        let (cos, sin) = self.rope.tables(&positions, dev)?;
        // Causal, and on sliding layers only the last `window` positions (itself included).
        let mask = |window: Option<usize>| {
            let visible = move |i: usize, j: usize| j <= i && window.is_none_or(|w| i - j < w);
            let m: Vec<f32> = (0..n).flat_map(|i| (0..n).map(move |j| if visible(i, j) { 0.0 } else { f32::NEG_INFINITY })).collect();
            Tensor::from_vec(m, (n, n), dev)
        };

        let mut x = self.embed.forward(&Tensor::new(tokens, dev)?)?;
        for (layer, block) in self.blocks.iter().enumerate() {
            let mask = mask(self.cfg.window(layer))?;
            let h = block.input_norm.forward(&x)?;
            let heads = |t: Tensor, count: usize| t.reshape((n, count, d))?.transpose(0, 1)?.contiguous();
            let (q, k, v) = block.attn.qkv(&h, |l, x| l.forward(x))?;
            let q = heads(self.rotate(&q, h_n, &cos, &sin)?, h_n)?;
            let k = heads(self.rotate(&k, kv_n, &cos, &sin)?, kv_n)?;
            let v = heads(v, kv_n)?;
            // Repeat each K/V head for its group of query heads.
            let group = h_n / kv_n;
            let k = Tensor::cat(&vec![k.unsqueeze(1)?; group], 1)?.reshape((h_n, n, d))?;
            let v = Tensor::cat(&vec![v.unsqueeze(1)?; group], 1)?.reshape((h_n, n, d))?;
            let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(&mask)?;
            let attn = softmax_last(&scores)?.matmul(&v)?; // [heads, n, d]
            let attn = attn.transpose(0, 1)?.reshape((n, h_n * d))?;
            x = (x + block.attn.o.forward(&attn)?)?;
            x = (&x + block.mlp(&block.post_norm.forward(&x)?, |l, x| l.forward(x))?)?;
        }
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?;
        logits.to_dtype(candle_core::DType::F32)
    }
}
