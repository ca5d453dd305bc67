//! Attention of a step's one-token sequences (decode), spread over the compute threads: each
//! sequence's query against its own pages, split by sequence and, when there are too few
//! sequences to keep every thread busy, by K/V head. One stream's attention used to run on the
//! stepping thread alone while the rest of the pool waited for the next matrix product.

use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;

use crate::kv::{AttnShape, KvError, KvPool, Lease, Scratch};

/// One sequence's query token: `q` and `out` are `[heads][head_dim]`.
pub struct TokenQuery<'a> {
    pub lease: &'a Lease,
    /// The positions the token sees (itself included).
    pub ctx: Range<usize>,
    pub q: &'a [f32],
    pub out: &'a mut [f32],
}

thread_local! {
    /// Each compute thread's softmax state and conversion buffers, kept between steps.
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Attends every query of `layer` over its sequence's pages. A head's result is the same bits
/// whichever thread computes it and whatever it is grouped with (`attention::attend`).
pub fn attend_tokens(kv: &KvPool, layer: usize, shape: AttnShape, queries: Vec<TokenQuery<'_>>) -> Result<(), KvError> {
    if queries.is_empty() {
        return Ok(());
    }
    let heads_per_task = shape.num_kv_heads.div_ceil(splits(queries.len(), shape.num_kv_heads, rayon::current_num_threads()));
    let floats = heads_per_task * shape.num_heads / shape.num_kv_heads * shape.head_dim;
    let tasks: Vec<_> = queries
        .into_iter()
        .flat_map(|t| {
            let TokenQuery { lease, ctx, q, out } = t;
            q.chunks(floats).zip(out.chunks_mut(floats)).enumerate().map(move |(i, (q, out))| {
                let heads = i * heads_per_task..((i + 1) * heads_per_task).min(shape.num_kv_heads);
                (lease, ctx.clone(), heads, q, out)
            })
        })
        .collect();
    tasks
        .into_par_iter()
        .try_for_each(|(lease, ctx, heads, q, out)| SCRATCH.with_borrow_mut(|scratch| kv.attend(lease, layer, ctx, shape, heads, q, out, scratch)))
}

/// Into how many K/V-head ranges each of `tokens` queries is split: enough for two tasks per
/// thread (so a slow one is balanced by stealing), never finer than one K/V head.
fn splits(tokens: usize, kv_heads: usize, threads: usize) -> usize {
    (2 * threads).div_ceil(tokens).clamp(1, kv_heads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_sequences_are_split_by_kv_head_and_many_are_not() {
        assert_eq!(splits(1, 8, 2), 4, "one stream on two threads: four ranges of two K/V heads");
        assert_eq!(splits(1, 2, 16), 2, "never finer than one K/V head");
        assert_eq!(splits(3, 8, 2), 2);
        assert_eq!(splits(8, 8, 2), 1, "eight streams keep two threads busy whole");
    }
}
