//! Rotary position embeddings, computed for exactly the positions of a step.
//!
//! Tables are built per call rather than once for the whole window: a worker may declare a
//! million-token window, and a step touches only a few positions.

use candle_core::{Device, Result, Tensor};

use super::config::ModelConfig;

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        let d = cfg.head_dim();
        let mut inv_freq: Vec<f64> = (0..d / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64)).collect();
        let scaling = cfg.rope_scaling.as_ref();
        if let Some(s) = scaling.filter(|s| s.rope_type == "linear") {
            let factor = s.factor.unwrap_or(1.0);
            inv_freq.iter_mut().for_each(|f| *f /= factor);
        }
        if let Some(s) = scaling.filter(|s| s.rope_type == "llama3") {
            let factor = s.factor.unwrap_or(1.0);
            let low = s.low_freq_factor.unwrap_or(1.0);
            let high = s.high_freq_factor.unwrap_or(4.0);
            let original = s.original_max_position_embeddings.unwrap_or(8192) as f64;
            let (low_wavelen, high_wavelen) = (original / low, original / high);
            for f in &mut inv_freq {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                *f = if wavelen < high_wavelen {
                    *f
                } else if wavelen > low_wavelen {
                    *f / factor
                } else {
                    let smooth = (original / wavelen - low) / (high - low);
                    (1.0 - smooth) * *f / factor + smooth * *f
                };
            }
        }
        Rope { inv_freq }
    }

    /// `(cos, sin)`, each `[positions.len(), head_dim / 2]`.
    pub fn tables(&self, positions: &[u32], device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for f in &self.inv_freq {
                let angle = p as f64 * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = (positions.len(), half);
        Ok((Tensor::from_vec(cos, shape, device)?, Tensor::from_vec(sin, shape, device)?))
    }
}
