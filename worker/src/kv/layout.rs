//! Where each K/V element of a token lives inside a page.
//!
//! A page holds `page_size` token slots for *every* layer, laid out
//! `[layer][k|v][slot][kv_head][head_dim]`. Keeping all layers of a page together makes a page one
//! contiguous byte range: it is scrubbed with one write and moved over the wire as one frame.
//! Offsets are in bytes: a slot's row of `kv_heads * head_dim` values takes `row_bytes`, which for
//! `q8_0` is blocks of 32 values (an f16 scale and 32 signed bytes, ggml's `block_q8_0`).

use std::fmt;
use std::str::FromStr;

use xxhash_rust::xxh3::xxh3_64;

/// Bumped whenever the in-page layout above changes, so old and new workers never pair.
const LAYOUT_VERSION: u32 = 1;

/// Element type of stored K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    F16,
    BF16,
    /// 8-bit values in blocks of [`Q8_BLOCK`], each with its own f16 scale: 8.5 bits a value.
    Q8_0,
}

/// Values per `q8_0` block, and the bytes a block takes (an f16 scale, then one byte a value).
pub const Q8_BLOCK: usize = 32;
pub const Q8_BLOCK_BYTES: usize = 2 + Q8_BLOCK;

impl KvDtype {
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::Q8_0];

    /// Bytes `values` values take (for `q8_0`, `values` is a multiple of [`Q8_BLOCK`]).
    pub fn bytes_for(self, values: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * values,
            KvDtype::F16 | KvDtype::BF16 => 2 * values,
            KvDtype::Q8_0 => values / Q8_BLOCK * Q8_BLOCK_BYTES,
        }
    }

    /// Values a stored row must be a multiple of.
    pub fn block(self) -> usize {
        match self {
            KvDtype::Q8_0 => Q8_BLOCK,
            _ => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
            KvDtype::Q8_0 => "q8_0",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "bf16" => Ok(KvDtype::BF16),
            "q8_0" => Ok(KvDtype::Q8_0),
            other => Err(format!("unknown KV dtype `{other}`: expected f32, f16, bf16 or q8_0")),
        }
    }
}

/// Which half of a layer's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    K = 0,
    V = 1,
}

/// Shape of the KV cache: fixed at start-up, identical on every worker that may exchange pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub page_size: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Values of one token in one layer's K (or V): `kv_heads * head_dim`.
    pub fn token_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Whether the dtype can store this shape's rows: `q8_0` needs whole blocks of 32 values.
    pub fn check(&self) -> Result<(), String> {
        let block = self.dtype.block();
        if !self.token_elems().is_multiple_of(block) {
            return Err(format!(
                "KV dtype {} stores blocks of {block} values, but this model's K/V row (kv heads {} x head dim {}) has {}",
                self.dtype,
                self.num_kv_heads,
                self.head_dim,
                self.token_elems()
            ));
        }
        Ok(())
    }

    /// Bytes of one token's K (or V) in one layer.
    pub fn row_bytes(&self) -> usize {
        self.dtype.bytes_for(self.token_elems())
    }

    /// Bytes one token occupies across all layers, K and V.
    pub fn bytes_per_token(&self) -> usize {
        self.num_layers * 2 * self.row_bytes()
    }

    pub fn page_bytes(&self) -> usize {
        self.page_size * self.bytes_per_token()
    }

    /// Byte offset, inside a page, of the run `[slot][kv_head][head_dim]` for `layer`/`half`.
    /// The run for all `page_size` slots is contiguous, which is what attention iterates over.
    pub fn block_offset(&self, layer: usize, half: Half) -> usize {
        (layer * 2 + half as usize) * self.page_size * self.row_bytes()
    }

    /// Byte offset, inside a page, of one token slot's K or V in `layer`.
    pub fn slot_offset(&self, layer: usize, half: Half, slot: usize) -> usize {
        self.block_offset(layer, half) + slot * self.row_bytes()
    }

    /// Byte ranges, inside a page, of the slots from `used` on (every layer's K and V): what a
    /// page holds beyond its last written token, which must never leave the worker.
    pub fn unwritten_byte_ranges(&self, used: usize) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let used = used.min(self.page_size);
        (0..self.num_layers).flat_map(move |layer| {
            [Half::K, Half::V].into_iter().map(move |half| self.slot_offset(layer, half, used)..self.slot_offset(layer, half, self.page_size))
        })
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// A hash of everything that decides where bytes go; workers whose fingerprints differ must
    /// never exchange pages.
    pub fn fingerprint(&self) -> String {
        let text = format!(
            "kvgate-layout-v{LAYOUT_VERSION}:layers={}:kv_heads={}:head_dim={}:page={}:dtype={}",
            self.num_layers, self.num_kv_heads, self.head_dim, self.page_size, self.dtype
        );
        format!("{:016x}", xxh3_64(text.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unwritten_ranges_cover_exactly_the_slots_past_the_last_token() {
        let l = KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 4, page_size: 4, dtype: KvDtype::F32 };
        let mut covered = vec![false; l.page_bytes()];
        for r in l.unwritten_byte_ranges(1) {
            covered[r].iter_mut().for_each(|c| *c = true);
        }
        for layer in 0..2 {
            for half in [Half::K, Half::V] {
                for slot in 0..4 {
                    let at = l.slot_offset(layer, half, slot);
                    let want = slot >= 1;
                    assert!(covered[at..at + l.row_bytes()].iter().all(|c| *c == want), "layer {layer} slot {slot}");
                }
            }
        }
        assert_eq!(l.unwritten_byte_ranges(4).map(|r| r.len()).sum::<usize>(), 0);
    }

    fn layout() -> KvLayout {
        KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 16, page_size: 16, dtype: KvDtype::BF16 }
    }

    #[test]
    fn sizes_follow_the_shape() {
        let l = layout();
        assert_eq!(l.bytes_per_token(), 2 * 2 * 2 * 16 * 2);
        assert_eq!(l.page_bytes(), 16 * l.bytes_per_token());
        assert_eq!(l.pages_for(0), 0);
        assert_eq!(l.pages_for(16), 1);
        assert_eq!(l.pages_for(17), 2);
    }

    #[test]
    fn q8_0_takes_34_bytes_a_block_of_32_and_whole_blocks_only() {
        let l = KvLayout { dtype: KvDtype::Q8_0, ..layout() };
        assert_eq!(l.row_bytes(), 34, "2 kv heads x 16 dims = one block");
        assert_eq!(l.bytes_per_token(), 2 * 2 * 34);
        assert!(l.check().is_ok());
        let odd = KvLayout { num_kv_heads: 1, ..l };
        let err = odd.check().unwrap_err();
        assert!(err.contains("q8_0") && err.contains("blocks of 32") && err.contains("has 16"), "{err}");
        assert!(KvLayout { num_kv_heads: 1, ..layout() }.check().is_ok(), "bf16 stores any row");
    }

    #[test]
    fn blocks_tile_the_page_without_overlap() {
        let l = layout();
        let mut starts: Vec<usize> = (0..l.num_layers).flat_map(|layer| [Half::K, Half::V].map(|h| l.block_offset(layer, h))).collect();
        starts.sort();
        let block = l.page_size * l.row_bytes();
        for (i, s) in starts.iter().enumerate() {
            assert_eq!(*s, i * block);
        }
        assert_eq!(starts.len() * block, l.page_bytes());
        assert_eq!(l.slot_offset(1, Half::V, 3), 3 * block + 3 * l.row_bytes());
    }

    #[test]
    fn fingerprint_changes_with_every_field() {
        let base = layout();
        let variants = [
            KvLayout { num_layers: 3, ..base },
            KvLayout { num_kv_heads: 4, ..base },
            KvLayout { head_dim: 32, ..base },
            KvLayout { page_size: 32, ..base },
            KvLayout { dtype: KvDtype::F16, ..base },
            KvLayout { dtype: KvDtype::Q8_0, ..base },
        ];
        for v in variants {
            assert_ne!(v.fingerprint(), base.fingerprint(), "{v:?}");
        }
        assert_eq!(layout().fingerprint(), base.fingerprint());
    }

    #[test]
    fn dtype_parses_its_own_names_only() {
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
        }
        assert!("fp8".parse::<KvDtype>().unwrap_err().contains("fp8"));
    }
}
