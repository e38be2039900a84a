//! Engine-owned caches: the same tokens and the same selection read from
//! hgca's own `KvStore` and from paged views at block sizes 1, 16, 64 and
//! 256 (pages shuffled over the pool, as an engine's allocator leaves
//! them); a batch of 8 sequences x 32k tokens in one call; and 8 threads
//! sharing one backend against one thread (`Par::Seq` per call).
//!
//! Ids: `{kernel}/{isa}/f16/{source}-n{k}k-sel{pct}-t{threads}`, kernel
//! `sparse` (10% single random tokens per KV head) or `dense`; source
//! `store` or `{layout}-bs{N}`. The report's "x peer" column gives, for a
//! paged view, the store's time over the view's (1.00 = as fast; the
//! target is >= 0.95 at block size >= 16), and for `shared/..-t8x` the
//! time of 8 calls on one thread over that of 8 calls on 8 threads (the
//! throughput gain of sharing; no serialisation means >= 1.7 on 2 cores;
//! `-t2x` is the same 8 calls on 2 threads, one per core).

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use half::f16;
use hgca_benches::{BenchBuf, Probe, Report, criterion, fill, par};
use hgca_cpu::{BatchTokens, CpuBackend, Isa};
use hgca_kernels::{
    AttnShape, BlockTable, KvStore, LseFormat, PagedBatch, PagedPool, Partial, PartialLayout,
    Selection, SparseAttention,
};

const HK: usize = 8;
const QH: usize = 32;
const D: usize = 128;

/// A sequence's K and V head-major `[HK, n, D]` and its selections.
struct Seq {
    n: usize,
    k: Vec<f16>,
    v: Vec<f16>,
    sels: Vec<Selection>,
}

fn seq(n: usize, seed: u64) -> Seq {
    let conv = |x: Vec<f32>| x.into_iter().map(f16::from_f32).collect::<Vec<_>>();
    // Several random selections taken in turn: one repeated would stay in
    // the last-level cache.
    let sels = (0..8)
        .map(|r| {
            let mut sel = Selection::new();
            for g in 0..HK {
                let x = fill(n, seed * 1000 + (r * HK + g) as u64);
                sel.push_head((0..n as u32).filter(|&j| x[j as usize] > 0.8));
            }
            sel
        })
        .collect();
    Seq {
        n,
        k: conv(fill(HK * n * D, seed)),
        v: conv(fill(HK * n * D, seed + 1)),
        sels,
    }
}

/// A vLLM CPU cache `(2, nb, HK, bs, D)` holding `seqs`, pages shuffled;
/// returns the cache and each sequence's page list.
fn vllm_cpu(seqs: &[&Seq], bs: usize) -> (BenchBuf<f16>, usize, Vec<Vec<u32>>) {
    let nb: usize = seqs.iter().map(|s| s.n.div_ceil(bs)).sum();
    let mut order: Vec<u32> = (0..nb as u32).collect();
    let r = fill(nb, 99);
    for i in (1..nb).rev() {
        let j = (((r[i] + 1.0) * 0.5) as f64 * (i + 1) as f64) as usize;
        order.swap(i, j.min(i));
    }
    // owner[page] = (sequence, slot)
    let mut owner = vec![(0usize, 0usize); nb];
    let mut pages = Vec::new();
    let mut it = order.into_iter();
    for (b, s) in seqs.iter().enumerate() {
        let p: Vec<u32> = (0..s.n.div_ceil(bs)).map(|_| it.next().unwrap()).collect();
        for (slot, &pg) in p.iter().enumerate() {
            owner[pg as usize] = (b, slot);
        }
        pages.push(p);
    }
    let page = HK * bs * D;
    let half = nb * page;
    let buf = BenchBuf::from_fn(2 * half, |off| {
        let (which, off) = (off / half, off % half);
        let (p, r) = (off / page, off % page);
        let (h, i, c) = (r / (bs * D), (r / D) % bs, r % D);
        let (b, slot) = owner[p];
        let s = seqs[b];
        let j = slot * bs + i;
        if j >= s.n {
            return f16::ZERO;
        }
        let src = if which == 0 { &s.k } else { &s.v };
        src[(h * s.n + j) * D + c]
    });
    (buf, nb, pages)
}

fn backend(threads: usize) -> CpuBackend {
    CpuBackend::new().with_par(par(threads)).unwrap()
}

fn bytes(selected: usize, b: usize) -> u64 {
    (selected * D * 2 * 2 + b * QH * D * 4 + b * QH * (D + 1) * 4) as u64
}

fn group(
    crit: &mut Criterion,
    by: u64,
) -> criterion::BenchmarkGroup<'_, criterion::measurement::WallTime> {
    let mut g = crit.benchmark_group("paged");
    g.throughput(Throughput::Bytes(by));
    g.sample_size(20);
    g
}

/// One sequence's decode on a backend, dense or over its selections in turn.
struct Run<'a> {
    cpu: &'a CpuBackend,
    shape: &'a AttnShape,
    q: &'a [f32],
    sels: &'a [Selection],
    dense: bool,
}

impl Run<'_> {
    /// Benches the decode over `kv` as `id` (store and views alike).
    #[allow(clippy::too_many_arguments)]
    fn bench<K: hgca_kernels::KvSource<f16>>(
        &self,
        crit: &mut Criterion,
        rep: &Report,
        id: &str,
        by: u64,
        ws: usize,
        threads: usize,
        kv: &K,
        out: &mut Partial,
    ) {
        let mut turn = 0;
        let mut g = group(crit, by);
        g.bench_function(id, |bch| {
            bch.iter_custom(|iters| {
                rep.time(id, by, ws, threads, 20, iters, || {
                    let (shape, q) = (self.shape, black_box(self.q));
                    if self.dense {
                        self.cpu
                            .dense_decode(shape, q, kv, out.as_mut(), None)
                            .unwrap();
                    } else {
                        turn += 1;
                        let sel = &self.sels[turn % self.sels.len()];
                        self.cpu
                            .sparse_decode(shape, q, kv, sel, out.as_mut(), None)
                            .unwrap();
                    }
                })
            })
        });
        g.finish();
    }
}

/// One sequence, store against paged views.
fn single(crit: &mut Criterion, rep: &Report, filter: &Option<String>, isa: &str) {
    let n = 64 << 10;
    let s = seq(n, 1);
    let shape = AttnShape::new(QH, HK, D).unwrap();
    let q = fill(QH * D, 3);
    let ws = 2 * HK * n * D * 2;
    let mut store = KvStore::<f16>::new(HK, D, 64).unwrap();
    store.push_head_major(n, &s.k, &s.v).unwrap();
    let mut out = Partial::empty(PartialLayout::decode(&shape));
    for threads in [1, 2] {
        let cpu = backend(threads);
        for kernel in ["sparse", "dense"] {
            let id = |src: &str| {
                format!(
                    "{kernel}/{isa}/f16/{src}-n{}k-sel{}-t{threads}",
                    n >> 10,
                    if kernel == "sparse" { 10 } else { 100 }
                )
            };
            let sel_total = if kernel == "dense" {
                HK * n
            } else {
                s.sels[0].total()
            };
            let by = bytes(sel_total, 1);
            let sid = id("store");
            let run = Run {
                cpu: &cpu,
                shape: &shape,
                q: &q,
                sels: &s.sels,
                dense: kernel == "dense",
            };
            if filter.as_deref().is_none_or(|f| sid.contains(f)) {
                run.bench(crit, rep, &sid, by, ws, threads, &store, &mut out);
            }
            for bs in [1usize, 16, 64, 256] {
                let pid = id(&format!("vllm_cpu-bs{bs}"));
                if filter.as_deref().is_some_and(|f| !pid.contains(f)) {
                    continue;
                }
                let (buf, nb, pages) = vllm_cpu(&[&s], bs);
                let pool = PagedPool::vllm_cpu(&buf, nb, HK, bs, D).unwrap();
                let lens = [n as u32];
                let batch = PagedBatch::new(
                    pool,
                    BlockTable::dense(&pages[0], pages[0].len(), &lens).unwrap(),
                )
                .unwrap();
                let view = batch.seq(0).unwrap();
                run.bench(crit, rep, &pid, by, ws, threads, &view, &mut out);
            }
        }
    }
}

/// A batch of 8 sequences x 32k tokens in one call (block size 16).
fn batch(crit: &mut Criterion, rep: &Report, filter: &Option<String>, isa: &str) {
    let n = 32 << 10;
    let seqs: Vec<Seq> = (0..8).map(|b| seq(n, 10 + 2 * b)).collect();
    let refs: Vec<&Seq> = seqs.iter().collect();
    let (buf, nb, pages) = vllm_cpu(&refs, 16);
    let pool = PagedPool::vllm_cpu(&buf, nb, HK, 16, D).unwrap();
    let mb = pages[0].len();
    let table: Vec<u32> = pages.concat();
    let lens = vec![n as u32; 8];
    let kv = PagedBatch::new(pool, BlockTable::dense(&table, mb, &lens).unwrap()).unwrap();
    let shape = AttnShape::new(QH, HK, D).unwrap();
    let q = fill(8 * QH * D, 5);
    let (mut o, mut l) = (vec![0.0f32; 8 * QH * D], vec![0.0f32; 8 * QH]);
    let ws = 8 * 2 * HK * n * D * 2;
    for threads in [1, 2] {
        let cpu = backend(threads);
        for sparse in [true, false] {
            let kernel = if sparse { "sparse" } else { "dense" };
            let id = format!(
                "{kernel}/{isa}/f16/batch8-vllm_cpu-bs16-n32k-sel{}-t{threads}",
                if sparse { 10 } else { 100 }
            );
            if filter.as_deref().is_some_and(|f| !id.contains(f)) {
                continue;
            }
            let sets: Vec<Vec<Selection>> = (0..8)
                .map(|r| seqs.iter().map(|s| s.sels[r].clone()).collect())
                .collect();
            let total = if sparse {
                sets[0].iter().map(Selection::total).sum()
            } else {
                8 * HK * n
            };
            let by = bytes(total, 8);
            let mut turn = 0;
            let mut g = group(crit, by);
            g.sample_size(10);
            g.bench_function(&id, |bch| {
                bch.iter_custom(|iters| {
                    rep.time(&id, by, ws, threads, 10, iters, || {
                        turn += 1;
                        let tokens = if sparse {
                            BatchTokens::Sparse(&sets[turn % 8])
                        } else {
                            BatchTokens::Dense
                        };
                        cpu.decode_batch(
                            &shape,
                            black_box(&q),
                            &kv,
                            tokens,
                            &mut o,
                            &mut l,
                            LseFormat::NATURAL,
                            None,
                        )
                        .unwrap();
                    })
                })
            });
            g.finish();
        }
    }
}

/// 8 calls on one thread against 8 calls on 8 threads sharing the backend.
fn shared(crit: &mut Criterion, rep: &Report, filter: &Option<String>, isa: &str) {
    let n = 32 << 10;
    let s = seq(n, 40);
    let mut store = KvStore::<f16>::new(HK, D, 64).unwrap();
    store.push_head_major(n, &s.k, &s.v).unwrap();
    let shape = AttnShape::new(QH, HK, D).unwrap();
    let q = fill(QH * D, 7);
    let cpu = backend(1);
    let ws = 2 * HK * n * D * 2;
    let by = 8 * bytes(s.sels[0].total(), 1);
    for threads in [1usize, 2, 8] {
        let id = format!("shared/{isa}/f16/store-n32k-sel10-t{threads}x");
        if filter.as_deref().is_some_and(|f| !id.contains(f)) {
            continue;
        }
        let mut g = group(crit, by);
        g.bench_function(&id, |bch| {
            bch.iter_custom(|iters| {
                rep.time(&id, by, ws, threads.min(2), 20, iters, || {
                    let one = |t: usize| {
                        let mut out = Partial::empty(PartialLayout::decode(&shape));
                        for c in 0..8 / threads {
                            let sel = &s.sels[(t + c) % s.sels.len()];
                            cpu.sparse_decode(
                                &shape,
                                black_box(&q),
                                &store,
                                sel,
                                out.as_mut(),
                                None,
                            )
                            .unwrap();
                        }
                    };
                    if threads == 1 {
                        one(0);
                    } else {
                        std::thread::scope(|sc| {
                            for t in 0..threads {
                                sc.spawn(move || one(t));
                            }
                        });
                    }
                })
            })
        });
        g.finish();
    }
}

fn main() {
    let probe = Probe::measure();
    let rep = Report::default();
    let mut crit = criterion(500, 2000);
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let isa = Isa::detect().kind().name();
    single(&mut crit, &rep, &filter, isa);
    batch(&mut crit, &rep, &filter, isa);
    shared(&mut crit, &rep, &filter, isa);
    rep.print(&probe, |id| {
        if id.starts_with("shared/") && !id.ends_with("-t1x") {
            return Some(id.replace("-t8x", "-t1x").replace("-t2x", "-t1x"));
        }
        let (src, _) = id.split_once("-n")?;
        let src = src.rsplit('/').next()?;
        (src.starts_with("vllm_cpu")).then(|| id.replace(src, "store"))
    });
    crit.final_summary();
}
