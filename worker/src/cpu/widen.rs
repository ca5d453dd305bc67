//! Half-precision values (f16, bf16) widened to f32, by the CPU's conversion instructions where
//! it has them (`half` picks F16C at run time). Exact: every half value is an f32.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// A stored half-precision element type.
pub trait HalfFloat: Copy + Send + Sync + 'static {
    /// IEEE half (F16C converts it); else bfloat16 (the high half of an f32).
    const IS_F16: bool;
    fn widen(src: &[Self], dst: &mut [f32]);
    fn to_f32(self) -> f32;
}

impl HalfFloat for f16 {
    const IS_F16: bool = true;

    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

impl HalfFloat for bf16 {
    const IS_F16: bool = false;

    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    fn widen(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

/// All of `src` into `dst`, on every compute thread (a layer's weight, for one product).
pub fn widen_all<T: HalfFloat>(src: &[T], dst: &mut [f32]) {
    const CHUNK: usize = 1 << 16;
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| T::widen(s, d));
}
