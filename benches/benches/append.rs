//! The causal append (prefill) kernel: a 512-token prompt chunk of
//! Qwen2.5-0.5B's attention shape (14 query heads, 2 KV heads, d 64) at
//! depths 0 and 4096 (query `i` sees the depth plus `i + 1` tokens), KV
//! f32, f16 and bf16, on each ISA, 1 and 2 threads. `tiled` is the call as
//! it is (512 queries: the tiled kernel); `per-query` the same work in
//! calls of 7 queries, which take the decode kernel query by query (the
//! path every chunk took before the tiled kernel).
//!
//! And the sliding-window form (`dense_append_window`) on Gemma 3's local
//! layers' shape (4 query heads, 1 KV head, d 256, a 512-token window), f16
//! KV at depth 4096: `tiled` the 512-query call, `per-query` one query per
//! call (the path `SlidingAttention` took for every chunk before).
//!
//! Ids: `append/{isa}/{dtype}/{path}/depth{n}-t{threads}` and
//! `append-window/{isa}/f16/{path}/depth4096-t{threads}`. GFLOP/s counts
//! 4 d FLOPs per (query head, visible token): the scores and the values;
//! "% of peak" compares it with the f32 FMA probe of the same run on as
//! many threads (the target: >= 50% on one core).

use std::time::Instant;

use criterion::Criterion;
use hgca_benches::{criterion, fill, fma_peak, par};
use hgca_cpu::{CpuBackend, IsaKind};
use hgca_kernels::{AttnShape, KvElem, KvSlices, Partial, PartialLayout, bf16, f16};

const CHUNK: usize = 512;
/// Queries per call of the `per-query` path (below the tiled kernel's 8).
const SMALL: usize = 7;

struct Case<T> {
    k: Vec<T>,
    v: Vec<T>,
    q: Vec<f32>,
    tokens: usize,
    depth: usize,
}

fn case<T: KvElem>(shape: &AttnShape, depth: usize) -> Case<T> {
    let tokens = depth + CHUNK;
    let n = shape.kv_heads() * tokens * shape.head_dim();
    let conv = |x: Vec<f32>| x.into_iter().map(T::from_f32).collect::<Vec<T>>();
    Case {
        k: conv(fill(n, 1)),
        v: conv(fill(n, 2)),
        q: fill(CHUNK * shape.q_len(), 3),
        tokens,
        depth,
    }
}

fn call<T: KvElem>(
    cpu: &CpuBackend,
    shape: &AttnShape,
    c: &Case<T>,
    per: usize,
    out: &mut Partial,
) {
    let kv = KvSlices::new(shape.kv_heads(), shape.head_dim(), c.tokens, &c.k, &c.v).expect("kv");
    let ql = shape.q_len();
    let mut i0 = 0;
    while i0 < CHUNK {
        let n = per.min(CHUNK - i0);
        let mut part = Partial::empty(PartialLayout::append(shape, n));
        cpu.dense_append(
            shape,
            &c.q[i0 * ql..(i0 + n) * ql],
            n,
            c.depth + i0 + 1,
            &kv,
            part.as_mut(),
        )
        .expect("a valid call");
        if n == CHUNK {
            *out = part;
        }
        i0 += n;
    }
}

/// Benches `call` as `id` in `group` (ten samples); the best single call's
/// seconds (`f64::MAX` when the command line's filter skipped it).
fn best_call(crit: &mut Criterion, group: &str, id: &str, mut call: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    let mut g = crit.benchmark_group(group);
    g.sample_size(10);
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                let t1 = Instant::now();
                call();
                best = best.min(t1.elapsed().as_secs_f64());
            }
            t.elapsed()
        })
    });
    g.finish();
    best
}

fn flops(shape: &AttnShape, depth: usize) -> f64 {
    window_flops(shape, depth, usize::MAX)
}

/// FLOPs of a chunk whose queries see at most `window` tokens each.
fn window_flops(shape: &AttnShape, depth: usize, window: usize) -> f64 {
    let pairs: usize = (0..CHUNK).map(|i| (depth + i + 1).min(window)).sum();
    (pairs * shape.q_heads() * shape.head_dim() * 4) as f64
}

/// Gemma 3's local layers: the chunk over a sliding window.
fn run_window(crit: &mut Criterion, rows: &mut Vec<(String, f64, usize)>) {
    const WINDOW: usize = 512;
    const DEPTH: usize = 4096;
    let shape = AttnShape::new(4, 1, 256).expect("shape");
    let c = case::<f16>(&shape, DEPTH);
    let kv = KvSlices::new(1, 256, c.tokens, &c.k, &c.v).expect("kv");
    let ql = shape.q_len();
    for isa in [IsaKind::V3, IsaKind::V4, IsaKind::Neon] {
        let Ok(base) = CpuBackend::new().with_isa(isa) else {
            continue;
        };
        for threads in [1usize, 2] {
            let cpu = base.clone().with_par(par(threads)).expect("pool");
            for (path, per) in [("tiled", CHUNK), ("per-query", 1)] {
                let id = format!(
                    "append-window/{}/f16/{path}/depth{DEPTH}-t{threads}",
                    isa.name()
                );
                let best = best_call(crit, "append-window", &id, || {
                    let mut i0 = 0;
                    while i0 < CHUNK {
                        let n = per.min(CHUNK - i0);
                        let mut part = Partial::empty(PartialLayout::append(&shape, n));
                        cpu.dense_append_window(
                            &shape,
                            &c.q[i0 * ql..(i0 + n) * ql],
                            n,
                            DEPTH + i0 + 1,
                            WINDOW,
                            &kv,
                            part.as_mut(),
                        )
                        .expect("a valid call");
                        i0 += n;
                    }
                });
                if best < f64::MAX {
                    rows.push((id, window_flops(&shape, DEPTH, WINDOW) / best, threads));
                }
            }
        }
    }
}

fn run<T: KvElem>(crit: &mut Criterion, rows: &mut Vec<(String, f64, usize)>, shape: &AttnShape) {
    let name = match T::DTYPE {
        hgca_kernels::DType::F32 => "f32",
        hgca_kernels::DType::F16 => "f16",
        hgca_kernels::DType::BF16 => "bf16",
    };
    for isa in [IsaKind::V3, IsaKind::V4, IsaKind::Neon] {
        let Ok(base) = CpuBackend::new().with_isa(isa) else {
            continue;
        };
        for depth in [0usize, 4096] {
            let c = case::<T>(shape, depth);
            for threads in [1usize, 2] {
                let cpu = base.clone().with_par(par(threads)).expect("pool");
                for (path, per) in [("tiled", CHUNK), ("per-query", SMALL)] {
                    let id = format!(
                        "append/{}/{name}/{path}/depth{depth}-t{threads}",
                        isa.name()
                    );
                    let mut out = Partial::empty(PartialLayout::append(shape, CHUNK));
                    let best =
                        best_call(crit, "append", &id, || call(&cpu, shape, &c, per, &mut out));
                    // A bench the command line's filter skipped has no time.
                    if best < f64::MAX {
                        rows.push((id, flops(shape, depth) / best, threads));
                    }
                }
            }
        }
    }
}

fn main() {
    let peak = [fma_peak(1, 5), fma_peak(2, 5)];
    let shape = AttnShape::new(14, 2, 64).expect("shape");
    let mut crit = criterion(300, 1000);
    let mut rows = Vec::new();
    run::<f32>(&mut crit, &mut rows, &shape);
    run::<f16>(&mut crit, &mut rows, &shape);
    run::<bf16>(&mut crit, &mut rows, &shape);
    run_window(&mut crit, &mut rows);
    println!(
        "\nf32 FMA peak probe (this run): {:.1} GFLOP/s on 1 thread, {:.1} on 2",
        peak[0] / 1e9,
        peak[1] / 1e9
    );
    println!("| bench | GFLOP/s (best call) | % of peak |");
    println!("|---|---|---|");
    for (id, f, threads) in rows {
        println!(
            "| {id} | {:.1} | {:.0}% |",
            f / 1e9,
            100.0 * f / peak[threads - 1]
        );
    }
    crit.final_summary();
}
