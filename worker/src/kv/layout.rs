//! Where each K/V element of a token lives inside a page.
//!
//! A page holds `page_size` token slots for *every* layer, laid out
//! `[layer][k|v][slot][kv_head][head_dim]`. Keeping all layers of a page together makes a page one
//! contiguous byte range: it is scrubbed with one write and moved over the wire as one frame.

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
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
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
            other => Err(format!("unknown KV dtype `{other}`: expected f32, f16 or bf16")),
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
    /// Elements of one token in one layer's K (or V): `kv_heads * head_dim`.
    pub fn token_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes one token occupies across all layers, K and V.
    pub fn bytes_per_token(&self) -> usize {
        self.num_layers * 2 * self.token_elems() * self.dtype.size()
    }

    /// Elements in one page.
    pub fn page_elems(&self) -> usize {
        self.page_size * self.num_layers * 2 * self.token_elems()
    }

    pub fn page_bytes(&self) -> usize {
        self.page_elems() * self.dtype.size()
    }

    /// Element offset, inside a page, of the run `[slot][kv_head][head_dim]` for `layer`/`half`.
    /// The run for all `page_size` slots is contiguous, which is what attention iterates over.
    pub fn block_offset(&self, layer: usize, half: Half) -> usize {
        (layer * 2 + half as usize) * self.page_size * self.token_elems()
    }

    /// Element offset, inside a page, of one token slot's K or V in `layer`.
    pub fn slot_offset(&self, layer: usize, half: Half, slot: usize) -> usize {
        self.block_offset(layer, half) + slot * self.token_elems()
    }

    /// Byte ranges, inside a page, of the slots from `used` on (every layer's K and V): what a
    /// page holds beyond its last written token, which must never leave the worker.
    pub fn unwritten_byte_ranges(&self, used: usize) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let size = self.dtype.size();
        let used = used.min(self.page_size);
        (0..self.num_layers).flat_map(move |layer| {
            [Half::K, Half::V].into_iter().map(move |half| {
                let start = self.slot_offset(layer, half, used) * size;
                let end = self.slot_offset(layer, half, self.page_size) * size;
                start..end
            })
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
                    let at = l.slot_offset(layer, half, slot) * 4;
                    let want = slot >= 1;
                    assert!(covered[at..at + l.token_elems() * 4].iter().all(|c| *c == want), "layer {layer} slot {slot}");
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
    fn blocks_tile_the_page_without_overlap() {
        let l = layout();
        let mut starts: Vec<usize> = (0..l.num_layers).flat_map(|layer| [Half::K, Half::V].map(|h| l.block_offset(layer, h))).collect();
        starts.sort();
        let block = l.page_size * l.token_elems();
        for (i, s) in starts.iter().enumerate() {
            assert_eq!(*s, i * block);
        }
        assert_eq!(starts.len() * block, l.page_elems());
        assert_eq!(l.slot_offset(1, Half::V, 3), 3 * block + 3 * l.token_elems());
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
        ];
        for v in variants {
            assert_ne!(v.fingerprint(), base.fingerprint(), "{v:?}");
        }
        assert_eq!(layout().fingerprint(), base.fingerprint());
    }

    #[test]
    fn dtype_parses_its_own_names_only() {
        for d in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
        }
        assert!("fp8".parse::<KvDtype>().unwrap_err().contains("fp8"));
    }
}
