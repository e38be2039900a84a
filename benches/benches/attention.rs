//! CPU attention kernels: sparse gather-attention and dense decode, per ISA,
//! dtype, shape, selected fraction and thread count, beside the same sparse
//! decode done with candle-core. Ids: `{kernel}/{isa}/{dtype}/{shape}`.
//!
//! Throughput counts the bytes of the K/V rows actually read, the queries
//! and the outputs. The report at the end divides it by the streaming-read
//! bandwidth measured by a probe in the same run (DRAM or last-level cache,
//! by working set; 1 or 2 threads as the bench), and a sparse kernel's over
//! 10% single random tokens (f16/bf16, d 128) also by the gather probe's: the
//! same access pattern (their K and V rows, block by block, prefetched)
//! with almost no arithmetic, the most the memory system gives for it.
//! GB/s is shown as the mean of criterion's samples and as the best
//! sample; the percentages use the best sample, since each probe reports
//! the best of its repetitions (on a host whose load moves, a mean against
//! a best would charge the kernel for the host's noise).
//!
//! `HGCA_BENCH_FULL=1` runs the whole grid (d 64/128, kv 8/32, 4k..1M
//! tokens, 5..100% selected, every dtype and ISA); the default is the
//! subset that answers the targets.

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use half::{bf16, f16};
use hgca_benches::{BenchBuf, Probe, Report, criterion, fill, par};
use hgca_cpu::{CpuBackend, Isa, IsaKind};
use hgca_kernels::{
    AttnShape, KvElem, KvSlices, Partial, PartialLayout, Selection, SparseAttention,
};

#[derive(Clone, Copy, Debug)]
struct Cfg {
    kernel: &'static str, // "sparse" | "dense" | "candle-sparse"
    isa: IsaKind,
    dtype: &'static str,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    tokens: usize,
    frac: f64,
    threads: usize,
    /// Tokens per selected run: 1 selects single tokens at random; 64
    /// selects whole random 64-token blocks, the pattern the hybrid
    /// layer's block bounds produce.
    run: usize,
}

impl Cfg {
    fn id(&self) -> String {
        let isa = if self.kernel.starts_with("candle") {
            "candle"
        } else {
            self.isa.name()
        };
        let run = if self.run > 1 {
            format!("-b{}", self.run)
        } else {
            String::new()
        };
        format!(
            "{}/{}/{}/q{}-kv{}-d{}-n{}k-sel{}{run}-t{}",
            self.kernel,
            isa,
            self.dtype,
            self.q_heads,
            self.kv_heads,
            self.d,
            self.tokens / 1024,
            (self.frac * 100.0).round(),
            self.threads
        )
    }
}

/// Exactly `m` sorted distinct indices of `0..n` (selection sampling).
fn sample(n: usize, m: usize, seed: u64) -> Vec<u32> {
    let r = fill(n, seed);
    let mut left = m;
    let mut out = Vec::with_capacity(m);
    for (j, x) in r.iter().enumerate() {
        if left == 0 {
            break;
        }
        if ((x + 1.0) * 0.5) as f64 * ((n - j) as f64) < left as f64 {
            out.push(j as u32);
            left -= 1;
        }
    }
    out
}

struct Data<T> {
    k: BenchBuf<T>,
    v: BenchBuf<T>,
    q: Vec<f32>,
    /// Selections the iterations take in turn (see [`data`]).
    sels: Vec<Selection>,
}

fn data<T: KvElem>(c: &Cfg) -> Data<T> {
    let n = c.kv_heads * c.tokens * c.d;
    let conv = |x: Vec<f32>| BenchBuf::from_fn(x.len(), |i| T::from_f32(x[i]));
    let m = ((c.tokens as f64 * c.frac).round() as usize).min(c.tokens);
    // Iterations rotate over several random selections whose union is
    // about half the store: one selection repeated would leave its rows in
    // the last-level cache (10% of a 1 GiB store is 102 MiB; this host has
    // 260 MiB), and a "DRAM" figure would time cache hits. A store that
    // fits the cache stays there either way.
    let rotate = if m == c.tokens {
        1
    } else {
        (0.8 / c.frac).ceil().clamp(1.0, 32.0) as usize
    };
    let sels = (0..rotate)
        .map(|r| {
            let mut sel = Selection::new();
            for g in 0..c.kv_heads {
                if m == c.tokens {
                    sel.push_head(0..c.tokens as u32);
                } else {
                    let seed = 1000 + (r * c.kv_heads + g) as u64;
                    let blocks = sample(c.tokens / c.run, m / c.run, seed);
                    let run = c.run as u32;
                    sel.push_head(blocks.into_iter().flat_map(|b| b * run..(b + 1) * run));
                }
            }
            sel
        })
        .collect();
    Data {
        k: conv(fill(n, 1)),
        v: conv(fill(n, 2)),
        q: fill(c.q_heads * c.d, 3),
        sels,
    }
}

fn bytes(c: &Cfg, elem: usize, selected: usize) -> u64 {
    (selected * c.d * 2 * elem + c.q_heads * c.d * 4 + c.q_heads * (c.d + 1) * 4) as u64
}

fn run_hgca<T: KvElem>(crit: &mut Criterion, rep: &Report, c: Cfg) {
    let Ok(b) = CpuBackend::new().with_isa(c.isa) else {
        eprintln!("skip {}: no {} on this CPU", c.id(), c.isa.name());
        return;
    };
    let b = b.with_par(par(c.threads)).unwrap();
    let shape = AttnShape::new(c.q_heads, c.kv_heads, c.d).unwrap();
    let dat = data::<T>(&c);
    let kv = KvSlices::new(c.kv_heads, c.d, c.tokens, &dat.k, &dat.v).unwrap();
    let mut out = Partial::empty(PartialLayout::decode(&shape));
    let elem = core::mem::size_of::<T>();
    let sel_total = if c.kernel == "dense" {
        c.kv_heads * c.tokens
    } else {
        dat.sels[0].total()
    };
    let by = bytes(&c, elem, sel_total);
    let ws = 2 * c.kv_heads * c.tokens * c.d * elem;
    let id = c.id();
    let mut g = crit.benchmark_group("attention");
    g.throughput(Throughput::Bytes(by));
    // Set here, not left to criterion's default: the report keeps exactly
    // these last calls (the measurement, not the warm-up).
    let samples = if by > 64 << 20 { 10 } else { 100 };
    g.sample_size(samples);
    let mut turn = 0;
    g.bench_function(&id, |bch| {
        bch.iter_custom(|iters| {
            rep.time(&id, by, ws, c.threads, samples, iters, || {
                if c.kernel == "dense" {
                    b.dense_decode(&shape, black_box(&dat.q), &kv, out.as_mut(), None)
                        .unwrap()
                } else {
                    let sel = &dat.sels[turn % dat.sels.len()];
                    turn += 1;
                    b.sparse_decode(&shape, black_box(&dat.q), &kv, sel, out.as_mut(), None)
                        .unwrap()
                }
            })
        })
    });
    g.finish();
}

/// The same sparse decode with candle-core on the CPU, as a Rust user would
/// write it: gather the selected rows (`index_select`), widen to f32
/// (candle's CPU matmul has no mixed f16 x f32), Q·Kᵀ, softmax, ·V.
fn run_candle(crit: &mut Criterion, rep: &Report, c: Cfg) {
    use candle_core::{D, DType, Device, Tensor};
    let dev = Device::Cpu;
    let dat = data::<f16>(&c);
    // One selection: candle is ~25x slower than hgca here; its gathers are
    // not what it waits on.
    let sel = &dat.sels[0];
    let m = sel.head(0).len();
    let (hk, n, d, g) = (c.kv_heads, c.tokens, c.d, c.q_heads / c.kv_heads);
    let k = Tensor::from_vec(dat.k.to_vec(), (hk * n, d), &dev).unwrap();
    let v = Tensor::from_vec(dat.v.to_vec(), (hk * n, d), &dev).unwrap();
    let flat: Vec<u32> = (0..hk)
        .flat_map(|h| sel.head(h).iter().map(move |&j| (h * n) as u32 + j))
        .collect();
    let idx = Tensor::from_vec(flat, hk * m, &dev).unwrap();
    let q = Tensor::from_vec(dat.q.clone(), (hk, g, d), &dev).unwrap();
    let scale = 1.0 / (d as f64).sqrt();
    let attend = || -> candle_core::Result<Tensor> {
        let ks = k
            .index_select(&idx, 0)?
            .to_dtype(DType::F32)?
            .reshape((hk, m, d))?;
        let vs = v
            .index_select(&idx, 0)?
            .to_dtype(DType::F32)?
            .reshape((hk, m, d))?;
        let s = (q.matmul(&ks.t()?)? * scale)?;
        let p = candle_core::Tensor::exp(&s.broadcast_sub(&s.max_keepdim(D::Minus1)?)?)?;
        let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
        p.matmul(&vs)
    };
    let by = bytes(&c, 2, hk * m);
    let ws = 2 * hk * n * d * 2;
    let id = c.id();
    let mut grp = crit.benchmark_group("attention");
    grp.throughput(Throughput::Bytes(by));
    let samples = 10;
    grp.sample_size(samples);
    grp.bench_function(&id, |b| {
        b.iter_custom(|iters| {
            rep.time(&id, by, ws, c.threads, samples, iters, || {
                black_box(attend().unwrap());
            })
        })
    });
    grp.finish();
}

fn configs() -> Vec<Cfg> {
    let full = std::env::var_os("HGCA_BENCH_FULL").is_some();
    let best = Isa::detect().kind();
    let base = Cfg {
        kernel: "sparse",
        isa: best,
        dtype: "f16",
        q_heads: 32,
        kv_heads: 8,
        d: 128,
        tokens: 256 << 10,
        frac: 0.10,
        threads: 2,
        run: 1,
    };
    let mut v = Vec::new();
    // The targets: KV of 1 GiB (DRAM) and 64 MiB (in the last-level cache), 1 and 2 threads.
    for tokens in [256 << 10, 16 << 10] {
        for threads in [1, 2] {
            v.push(Cfg {
                tokens,
                threads,
                ..base
            });
            v.push(Cfg {
                tokens,
                threads,
                kernel: "dense",
                ..base
            });
        }
        v.push(Cfg {
            tokens,
            kernel: "candle-sparse",
            ..base
        });
    }
    // Whole 64-token blocks (what the hybrid layer selects with block
    // bounds) from DRAM: rows the hardware prefetchers can stream.
    for threads in [1, 2] {
        v.push(Cfg {
            threads,
            run: 64,
            ..base
        });
    }
    for dtype in ["f32", "bf16"] {
        v.push(Cfg { dtype, ..base });
    }
    for isa in [IsaKind::V3, IsaKind::Scalar] {
        v.push(Cfg {
            isa,
            tokens: 16 << 10,
            ..base
        });
    }
    v.push(Cfg { d: 64, ..base });
    v.push(Cfg {
        kv_heads: 32,
        tokens: 64 << 10,
        ..base
    });
    for frac in [0.05, 0.25] {
        v.push(Cfg { frac, ..base });
    }
    if full {
        for d in [64, 128] {
            for kv_heads in [8, 32] {
                for tokens in [4 << 10, 64 << 10, 1 << 20] {
                    if kv_heads == 32 && tokens == 1 << 20 {
                        continue; // 16 GiB of f16 KV does not fit this machine's 24 GiB with its copy
                    }
                    for frac in [0.05, 0.10, 0.25, 1.0] {
                        for dtype in ["f32", "f16", "bf16"] {
                            for threads in [1, 2] {
                                for isa in Isa::available().iter().map(|i| i.kind()) {
                                    v.push(Cfg {
                                        d,
                                        kv_heads,
                                        tokens,
                                        frac,
                                        dtype,
                                        threads,
                                        isa,
                                        ..base
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    v
}

fn main() {
    let probe = Probe::measure();
    let rep = Report::default();
    let mut crit = criterion(500, 2000);
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    for c in configs() {
        if filter.as_deref().is_some_and(|f| !c.id().contains(f)) {
            continue;
        }
        match (c.kernel, c.dtype) {
            ("candle-sparse", _) => run_candle(&mut crit, &rep, c),
            (_, "f32") => run_hgca::<f32>(&mut crit, &rep, c),
            (_, "bf16") => run_hgca::<bf16>(&mut crit, &rep, c),
            _ => run_hgca::<f16>(&mut crit, &rep, c),
        }
    }
    // The peer of an hgca sparse bench is candle on the same shape.
    rep.print(&probe, |id| {
        let parts: Vec<&str> = id.split('/').collect();
        (parts[0] == "sparse" && parts[2] == "f16")
            .then(|| format!("candle-sparse/candle/f16/{}", parts[3]))
    });
    crit.final_summary();
}
