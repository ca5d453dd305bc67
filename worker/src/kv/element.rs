//! Conversions between the f32 the model computes in and the dtype the pool stores.

use bytemuck::Pod;
use half::{bf16, f16};

use super::KvDtype;

pub trait KvElem: Pod {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;

    /// `values` as f32: themselves for f32, else converted into `buf`.
    fn as_f32<'a>(values: &'a [Self], buf: &'a mut Vec<f32>) -> &'a [f32] {
        buf.clear();
        buf.extend(values.iter().map(|v| v.to_f32()));
        buf
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn as_f32<'a>(values: &'a [f32], _: &'a mut Vec<f32>) -> &'a [f32] {
        values
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl KvElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Encodes `values` as `dtype` into `out` (which must be `values.len() * dtype.size()` bytes).
pub fn encode(dtype: KvDtype, values: &[f32], out: &mut [u8]) {
    fn go<E: KvElem>(values: &[f32], out: &mut [u8]) {
        let out: &mut [E] = bytemuck::cast_slice_mut(out);
        for (o, v) in out.iter_mut().zip(values) {
            *o = E::from_f32(*v);
        }
    }
    match dtype {
        KvDtype::F32 => go::<f32>(values, out),
        KvDtype::F16 => go::<f16>(values, out),
        KvDtype::BF16 => go::<bf16>(values, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_round_trips_within_the_dtype_precision() {
        let values = [0.0f32, 1.5, -2.25, 1e-3];
        for (dtype, tol) in [(KvDtype::F32, 0.0), (KvDtype::F16, 1e-3), (KvDtype::BF16, 1e-2)] {
            let mut bytes = vec![0u8; values.len() * dtype.size()];
            encode(dtype, &values, &mut bytes);
            let back: Vec<f32> = match dtype {
                KvDtype::F32 => bytemuck::cast_slice::<u8, f32>(&bytes).to_vec(),
                KvDtype::F16 => bytemuck::cast_slice::<u8, f16>(&bytes).iter().map(|x| x.to_f32()).collect(),
                KvDtype::BF16 => bytemuck::cast_slice::<u8, bf16>(&bytes).iter().map(|x| x.to_f32()).collect(),
            };
            for (a, b) in values.iter().zip(&back) {
                assert!((a - b).abs() <= tol * a.abs().max(1.0), "{dtype}: {a} vs {b}");
            }
        }
    }
}
