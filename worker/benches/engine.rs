//! Worker benchmarks, printed as a Markdown table (see docs/benchmarks.md). Run with
//! `cargo bench -p kvgate-worker --bench engine`. Each row is measured side by side in one run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::Device;
use kvgate_worker::kv::attention::{AttnShape, Scratch, attend};
use kvgate_worker::kv::{KvDtype, KvLayout, KvPool};
use kvgate_worker::model::{Model, SeqStep};

/// Runs `f` repeatedly for about `budget` and returns the best time of one call.
fn best_of(budget: Duration, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut runs = 0;
    while runs < 3 || start.elapsed() < budget {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        runs += 1;
    }
    best
}

fn bytes(x: &[f32]) -> &[u8] {
    bytemuck::cast_slice(x)
}

fn row(name: &str, value: String, note: &str) {
    println!("| {name} | {value} | {note} |");
}

fn main() {
    kvgate_heap::one_arena();
    kvgate_worker::cpu::prepare_model_process();
    let model = Model::tiny(&Device::Cpu).unwrap();
    let layout = model.kv_layout(16, KvDtype::F32);
    let pool = KvPool::host(layout, 4096).unwrap();
    println!("| benchmark | result | notes |");
    println!("| --- | --- | --- |");

    // Prefill: one 1024-token prompt in one forward pass.
    let prompt: Vec<u32> = (0..1024u32).map(|i| i % 256).collect();
    let lease = pool.lease(prompt.len()).unwrap();
    let t = best_of(Duration::from_secs(3), || {
        let step = SeqStep { tokens: &prompt, start: 0, lease: &lease, every_row: false };
        black_box(model.llama.forward(&[step], &pool).unwrap());
    });
    row("tiny prefill, 1024-token prompt", format!("{:.0} tokens/s", 1024.0 / t.as_secs_f64()), "one sequence, CPU, f32 KV");
    drop(lease);

    // Prefill of a long prompt as the engine runs it: 2048-token chunks (--max-batch-tokens).
    let long: Vec<u32> = (0..8192u32).map(|i| (i * 31) % 256).collect();
    let lease = pool.lease(long.len()).unwrap();
    let t = best_of(Duration::from_secs(5), || {
        for start in (0..long.len()).step_by(2048) {
            let step = SeqStep { tokens: &long[start..start + 2048], start, lease: &lease, every_row: false };
            black_box(model.llama.forward(&[step], &pool).unwrap());
        }
    });
    row(
        "tiny prefill, 8192-token prompt",
        format!("{:.2} s ({:.0} tokens/s)", t.as_secs_f64(), 8192.0 / t.as_secs_f64()),
        "four 2048-token chunks, as the engine runs them",
    );
    drop(lease);

    // Decode: one token per sequence per step at context 512, batch 1 and 8.
    for batch in [1usize, 8] {
        let ctx: Vec<u32> = (0..512u32).map(|i| (i * 7) % 256).collect();
        let leases: Vec<_> = (0..batch).map(|_| pool.lease(600).unwrap()).collect();
        for l in &leases {
            let step = SeqStep { tokens: &ctx, start: 0, lease: l, every_row: false };
            model.llama.forward(&[step], &pool).unwrap();
        }
        let next = [65u32];
        let t = best_of(Duration::from_secs(2), || {
            let steps: Vec<SeqStep> = leases.iter().map(|l| SeqStep { tokens: &next, start: 512, lease: l, every_row: false }).collect();
            black_box(model.llama.forward(&steps, &pool).unwrap());
        });
        row(&format!("tiny decode, batch {batch}, context 512"), format!("{:.0} tokens/s", batch as f64 / t.as_secs_f64()), "one batched forward per step");
    }

    // Paged vs contiguous attention: same kernel, same data; pages scattered through a pool vs
    // one contiguous run.
    let shape = AttnShape { num_heads: 32, num_kv_heads: 8, head_dim: 128 };
    let page = 16;
    let ctx = 4096;
    let row_elems = shape.num_kv_heads * shape.head_dim;
    let pages = ctx / page;
    let values: Vec<f32> = (0..ctx * row_elems).map(|i| ((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5).collect();
    // Scatter the pages in a bigger arena in a shuffled order.
    let order: Vec<usize> = (0..pages).map(|i| (i * 97) % pages).collect();
    let mut arena_k = vec![0.0f32; pages * page * row_elems * 2];
    let mut arena_v = arena_k.clone();
    for (logical, &physical) in order.iter().enumerate() {
        let src = &values[logical * page * row_elems..][..page * row_elems];
        arena_k[physical * 2 * page * row_elems..][..page * row_elems].copy_from_slice(src);
        arena_v[physical * 2 * page * row_elems..][..page * row_elems].copy_from_slice(src);
    }
    let q: Vec<f32> = (0..shape.num_heads * shape.head_dim).map(|i| (i % 13) as f32 / 13.0).collect();
    let mut out = vec![0.0f32; q.len()];
    let mut scratch = Scratch::default();
    let contiguous = best_of(Duration::from_secs(2), || {
        let blocks = values.chunks(page * row_elems).map(|b| (bytes(b), bytes(b), page));
        attend(shape, 0..shape.num_kv_heads, &q, KvDtype::F32, blocks, &mut out, &mut scratch);
        black_box(&out);
    });
    let paged = best_of(Duration::from_secs(2), || {
        let blocks = order.iter().map(|&p| {
            let off = p * 2 * page * row_elems;
            (bytes(&arena_k[off..off + page * row_elems]), bytes(&arena_v[off..off + page * row_elems]), page)
        });
        attend(shape, 0..shape.num_kv_heads, &q, KvDtype::F32, blocks, &mut out, &mut scratch);
        black_box(&out);
    });
    row(
        "attention, contiguous KV, 4096 tokens",
        format!("{:.1} us", contiguous.as_secs_f64() * 1e6),
        "32 heads / 8 KV heads x 128, one query, 16-token blocks in order",
    );
    row(
        "attention, paged KV (16-token pages, shuffled)",
        format!("{:.1} us", paged.as_secs_f64() * 1e6),
        "same blocks, scattered and read through a page table",
    );
    row("paged / contiguous speed", format!("{:.2}x", contiguous.as_secs_f64() / paged.as_secs_f64()), "aim: at least 0.8x");

    // The pool's own attention (pages read under their locks, decoded a page at a time) over the
    // same 4096 tokens stored in each KV type: what an 8-bit pool costs a decode step, beside the
    // tokens it holds in the same bytes.
    let mut by_dtype = Vec::new();
    for dtype in KvDtype::ALL {
        let layout = KvLayout { num_layers: 1, num_kv_heads: shape.num_kv_heads, head_dim: shape.head_dim, page_size: page, dtype };
        let pool = KvPool::host(layout, pages).unwrap();
        let lease = pool.lease(ctx).unwrap();
        for pos in 0..ctx {
            let v = &values[pos * row_elems..][..row_elems];
            pool.write_token(&lease, pos, 0, v, v).unwrap();
        }
        let t = best_of(Duration::from_secs(2), || {
            pool.attend(&lease, 0, 0..ctx, shape, 0..shape.num_kv_heads, &q, &mut out, &mut scratch).unwrap();
            black_box(&out);
        });
        by_dtype.push((dtype, t, layout.row_bytes()));
    }
    let f16 = by_dtype.iter().find(|(d, ..)| *d == KvDtype::F16).unwrap().1;
    for (dtype, t, row_bytes) in &by_dtype {
        row(
            &format!("pool attention, {dtype} KV, 4096 tokens"),
            format!("{:.1} us ({:.2}x f16's speed)", t.as_secs_f64() * 1e6, f16.as_secs_f64() / t.as_secs_f64()),
            &format!(
                "same shape; {row_bytes} bytes a token's K per layer, {:.2}x the tokens of f16 in the same memory",
                2.0 * row_elems as f64 / *row_bytes as f64
            ),
        );
    }

    // Pool allocation, committed memory, per GiB.
    let big = KvLayout { num_layers: 32, num_kv_heads: 8, head_dim: 128, page_size: 16, dtype: KvDtype::BF16 };
    let pages_per_gib = (1usize << 30) / big.page_bytes();
    let t = best_of(Duration::from_secs(2), || {
        black_box(KvPool::host(big, pages_per_gib).unwrap());
    });
    row(
        "KV pool allocation (committed)",
        format!("{:.0} ms/GiB", t.as_secs_f64() * 1e3),
        "host memory in one mapping advised for huge pages, every 4 KiB touched once (the kernel zeroes it)",
    );
}
