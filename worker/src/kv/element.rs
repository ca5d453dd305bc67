//! Conversions between the f32 the model computes in and the dtype the pool stores.

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::KvDtype;
use super::layout::{Q8_BLOCK, Q8_BLOCK_BYTES};
use crate::cpu::level::multiversion;
use crate::cpu::widen::HalfFloat;

/// Encodes `values` as `dtype` into `out` (exactly `dtype.bytes_for(values.len())` bytes; half
/// types by the CPU's conversion instructions where it has them, as `decode` widens them).
pub fn encode(dtype: KvDtype, values: &[f32], out: &mut [u8]) {
    debug_assert_eq!(out.len(), dtype.bytes_for(values.len()), "{dtype}: {} values", values.len());
    match dtype {
        KvDtype::F32 => bytemuck::cast_slice_mut::<u8, f32>(out).copy_from_slice(values),
        KvDtype::F16 => bytemuck::cast_slice_mut::<u8, f16>(out).convert_from_f32_slice(values),
        KvDtype::BF16 => bytemuck::cast_slice_mut::<u8, bf16>(out).convert_from_f32_slice(values),
        KvDtype::Q8_0 => {
            for (x, block) in values.chunks_exact(Q8_BLOCK).zip(out.chunks_exact_mut(Q8_BLOCK_BYTES)) {
                quantize_q8_0(x.try_into().unwrap(), block);
            }
        }
    }
}

/// One block as ggml's `quantize_row_q8_0_ref` does: the scale maps the largest magnitude to
/// 127, values round to the nearest step, and the scale is stored as f16.
fn quantize_q8_0(x: &[f32; Q8_BLOCK], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, v) in out[2..].iter_mut().zip(x) {
        *q = (v * inv).round() as i8 as u8;
    }
}

/// `bytes` stored as `dtype`, as f32: the bytes themselves for f32, else decoded into `buf`
/// (half types by the CPU's conversion instructions, as half weights are).
pub fn decode<'a>(dtype: KvDtype, bytes: &'a [u8], buf: &'a mut Vec<f32>) -> &'a [f32] {
    fn go<'a, E: HalfFloat + Pod>(bytes: &[u8], buf: &'a mut Vec<f32>) -> &'a [f32] {
        let src = bytemuck::cast_slice::<u8, E>(bytes);
        buf.resize(src.len(), 0.0);
        E::widen(src, buf);
        buf
    }
    match dtype {
        KvDtype::F32 => bytemuck::cast_slice(bytes),
        KvDtype::F16 => go::<f16>(bytes, buf),
        KvDtype::BF16 => go::<bf16>(bytes, buf),
        KvDtype::Q8_0 => {
            buf.resize(bytes.len() / Q8_BLOCK_BYTES * Q8_BLOCK, 0.0);
            dequantize_q8_0(bytes, buf);
            buf
        }
    }
}

multiversion! {
    /// Whole `q8_0` blocks to f32 (each byte times its block's scale), compiled per CPU level so
    /// the 32 products of a block are a few vector instructions.
    fn dequantize_q8_0 / dequantize_q8_0_at(bytes: &[u8], out: &mut [f32]) => dequantize_q8_0_body
}

#[inline(always)]
fn dequantize_q8_0_body(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes.chunks_exact(Q8_BLOCK_BYTES).zip(out.chunks_exact_mut(Q8_BLOCK)) {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let qs: &[u8; Q8_BLOCK] = block[2..].try_into().unwrap();
        let out: &mut [f32; Q8_BLOCK] = out.try_into().unwrap();
        for (o, q) in out.iter_mut().zip(qs) {
            *o = d * f32::from(*q as i8);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::pseudo;

    #[test]
    fn every_dtype_round_trips_within_its_precision() {
        let values: Vec<f32> = pseudo(64, 9).iter().map(|x| x * 3.0).chain([0.0, 1.5, -2.25, 1e-3].into_iter().cycle().take(32)).collect();
        // q8_0: half a step of the block's scale (its largest magnitude / 127), plus f16's
        // rounding of the scale.
        for (dtype, tol) in [(KvDtype::F32, 0.0), (KvDtype::F16, 1e-3), (KvDtype::BF16, 1e-2), (KvDtype::Q8_0, 0.5 / 127.0 + 1e-3)] {
            let mut bytes = vec![0u8; dtype.bytes_for(values.len())];
            encode(dtype, &values, &mut bytes);
            let mut buf = Vec::new();
            let back = decode(dtype, &bytes, &mut buf);
            assert_eq!(back.len(), values.len(), "{dtype}");
            for (block, got) in values.chunks(32).zip(back.chunks(32)) {
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (a, b) in block.iter().zip(got) {
                    let scale = if dtype == KvDtype::Q8_0 { amax } else { a.abs().max(1.0) };
                    assert!((a - b).abs() <= tol * scale, "{dtype}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn every_level_the_cpu_offers_dequantizes_q8_0_to_the_same_bits() {
        let values: Vec<f32> = pseudo(32 * 9, 3);
        let mut bytes = vec![0u8; KvDtype::Q8_0.bytes_for(values.len())];
        encode(KvDtype::Q8_0, &values, &mut bytes);
        let run = |level| {
            let mut out = vec![0.0f32; values.len()];
            dequantize_q8_0_at(level, &bytes, &mut out);
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        let want = run(crate::cpu::Level::Portable);
        for level in crate::cpu::Level::available() {
            assert_eq!(run(level), want, "{level:?} differs from portable");
        }
    }

    #[test]
    fn q8_0_blocks_are_ggmls_block_q8_0() {
        // Scale f16 first, then one signed byte a value; the largest magnitude maps to +-127.
        let mut x = [0.0f32; 32];
        x[0] = -2.54;
        x[1] = 1.0;
        x[2] = 0.02;
        let mut block = [0u8; 34];
        encode(KvDtype::Q8_0, &x, &mut block);
        assert_eq!(f16::from_le_bytes([block[0], block[1]]), f16::from_f32(0.02));
        assert_eq!(&block[2..5], &[(-127i8) as u8, 50, 1]);
        assert!(block[5..].iter().all(|b| *b == 0));
        // An all-zero block has scale 0 and decodes to zeros, not NaN.
        encode(KvDtype::Q8_0, &[0.0; 32], &mut block);
        assert!(decode(KvDtype::Q8_0, &block, &mut Vec::new()).iter().all(|v| *v == 0.0));
    }
}
