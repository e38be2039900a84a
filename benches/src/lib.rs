//! Shared helpers of hgca's criterion benches: deterministic data, the
//! streaming-read bandwidth probe, and a report of bytes/s against it.
#![deny(missing_docs)]

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hgca_kernels::{HostBuf, KvElem};
use pulp::Simd;

/// Deterministic pseudo-random f32 in `[-1, 1)` (no dependency, no hidden zeros).
pub fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Host memory for a bench's big buffers (KV, probes): a [`HostBuf`] on
/// transparent huge pages, as hgca's own stores are, unless
/// `HGCA_BENCH_NO_HUGEPAGES` is set (then a plain `Vec`, to see what the
/// page size is worth). The streaming and gather probes use the same memory
/// as the kernels, so a percentage compares like with like.
#[derive(Debug)]
pub enum BenchBuf<T> {
    /// Transparent huge pages requested.
    Huge(HostBuf<T>),
    /// The allocator's memory.
    Plain(Vec<T>),
}

impl<T: KvElem> BenchBuf<T> {
    /// `n` elements `f(0), f(1), ..`.
    pub fn from_fn(n: usize, f: impl FnMut(usize) -> T) -> Self {
        if std::env::var_os("HGCA_BENCH_NO_HUGEPAGES").is_some() {
            BenchBuf::Plain((0..n).map(f).collect())
        } else {
            let mut b = HostBuf::zeroed(n).expect("bench buffer");
            b.iter_mut().zip((0..n).map(f)).for_each(|(d, x)| *d = x);
            BenchBuf::Huge(b)
        }
    }
}

impl<T: KvElem> core::ops::Deref for BenchBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            BenchBuf::Huge(b) => b,
            BenchBuf::Plain(v) => v,
        }
    }
}

/// Sums a slice with the best SIMD of the machine (the probe's kernel).
fn simd_sum(x: &[f32]) -> f32 {
    struct Sum<'a>(&'a [f32]);
    impl pulp::WithSimd for Sum<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            let (head, tail) = S::as_simd_f32s(self.0);
            let mut acc = [s.splat_f32s(0.0); 8];
            let mut chunks = head.chunks_exact(8);
            for c in &mut chunks {
                for i in 0..8 {
                    acc[i] = s.add_f32s(acc[i], c[i]);
                }
            }
            for (i, &v) in chunks.remainder().iter().enumerate() {
                acc[i] = s.add_f32s(acc[i], v);
            }
            let mut t = acc[0];
            for a in &acc[1..] {
                t = s.add_f32s(t, *a);
            }
            s.reduce_sum_f32s(t) + tail.iter().sum::<f32>()
        }
    }
    pulp::Arch::new().dispatch(Sum(x))
}

/// Sums the rows `idx` (of `per` floats each) of `k` and of `v` the way a
/// sparse decode reads them: in blocks of 32 tokens, the block's K rows,
/// then its V rows, each pass prefetching the next block's rows of the same
/// array (as the kernel does). One SIMD dispatch, vector loads, four
/// accumulators: the arithmetic is light, so this is what the memory
/// system gives for the pattern.
fn gather_sum(k: &[f32], v: &[f32], idx: &[usize], per: usize) -> f32 {
    struct Gather<'a>(&'a [f32], &'a [f32], &'a [usize], usize);
    impl pulp::WithSimd for Gather<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            let Gather(k, v, idx, per) = self;
            let mut acc = [s.splat_f32s(0.0); 4];
            let mut blocks = idx.chunks(32).peekable();
            while let Some(blk) = blocks.next() {
                let next = blocks.peek().copied().unwrap_or(&[]);
                #[cfg(not(target_arch = "x86_64"))]
                let _ = next;
                for buf in [k, v] {
                    for (n, &j) in blk.iter().enumerate() {
                        #[cfg(target_arch = "x86_64")]
                        if let Some(&a) = next.get(n) {
                            let row = buf[a * per..].as_ptr().cast::<i8>();
                            for line in (0..per * 4).step_by(64) {
                                use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
                                // SAFETY: SSE (prefetch) is part of every
                                // x86-64 CPU; a prefetch never dereferences
                                // its address.
                                unsafe { _mm_prefetch::<{ _MM_HINT_T0 }>(row.wrapping_add(line)) };
                            }
                        }
                        let (head, _) = S::as_simd_f32s(&buf[j * per..(j + 1) * per]);
                        for (i, &x) in head.iter().enumerate() {
                            acc[i % 4] = s.add_f32s(acc[i % 4], x);
                        }
                    }
                }
            }
            let t = s.add_f32s(s.add_f32s(acc[0], acc[1]), s.add_f32s(acc[2], acc[3]));
            s.reduce_sum_f32s(t)
        }
    }
    pulp::Arch::new().dispatch(Gather(k, v, idx, per))
}

/// Streaming-read bandwidth in bytes/s over a buffer of `bytes`, on
/// `threads` threads (each sums its own contiguous part), best of `reps`.
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let buf = {
        let x = fill(bytes / 4, 77);
        BenchBuf::from_fn(x.len(), |i| x[i])
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("probe threads");
    let part = buf.len().div_ceil(threads);
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        let s: f32 = pool.install(|| {
            use rayon::prelude::*;
            buf.par_chunks(part).map(simd_sum).sum()
        });
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best
}

/// Bytes of one gathered row of the gather probe: a K or V row of f16, d 128.
const GATHER_ROW: usize = 256;

/// Random-token read bandwidth in bytes/s, in the access pattern of a
/// sparse decode (`gather_sum`): a K and a V array of `bytes / 2` each,
/// 256-byte rows (f16, d 128), 10% of the tokens at random, sorted; each
/// thread takes its half of the tokens. Each repetition takes a new
/// selection, so that a store larger than the cache is not read from it;
/// within one, the gather runs `inner` times (more than once for a store in
/// the cache, whose gather is short next to waking the threads).
pub fn gather_bandwidth(bytes: usize, threads: usize, reps: usize, inner: usize) -> f64 {
    let half = bytes / 2 / 4;
    let k = BenchBuf::from_fn(half, |i| (i % 7) as f32);
    let v = BenchBuf::from_fn(half, |i| (i % 5) as f32);
    let per = GATHER_ROW / 4;
    let rows = half / per;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("probe threads");
    let mut best = 0.0f64;
    for r in 0..reps {
        let noise = fill(rows, 500 + r as u64);
        let idx: Vec<usize> = (0..rows).filter(|&j| noise[j] < -0.8).collect();
        let part = idx.len().div_ceil(threads);
        let t = Instant::now();
        let s: f32 = pool.install(|| {
            use rayon::prelude::*;
            (0..inner)
                .map(|_| {
                    idx.par_chunks(part)
                        .map(|c| gather_sum(&k, &v, c, per))
                        .sum::<f32>()
                })
                .sum()
        });
        std::hint::black_box(s);
        let moved = (inner * 2 * idx.len() * GATHER_ROW) as f64;
        best = best.max(moved / t.elapsed().as_secs_f64());
    }
    best
}

/// Measured streaming-read bandwidths of this machine, taken in the bench run.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    /// From DRAM (1 GiB buffer), 1 thread, bytes/s.
    pub dram1: f64,
    /// From DRAM, 2 threads.
    pub dram2: f64,
    /// From the last-level cache (buffer of a quarter of L3), 1 thread.
    pub llc1: f64,
    /// From the last-level cache, 2 threads.
    pub llc2: f64,
    /// Last-level cache size in bytes (from sysfs; 32 MiB if unknown).
    pub llc_bytes: usize,
    /// Random tokens' K and V rows from DRAM ([`gather_bandwidth`], 1 GiB
    /// store), 1 thread.
    pub gather1: f64,
    /// The same, 2 threads.
    pub gather2: f64,
    /// Random tokens' K and V rows from a store of the last-level cache
    /// probe's size, 1 thread.
    pub gather_llc1: f64,
    /// The same, 2 threads.
    pub gather_llc2: f64,
}

impl Probe {
    /// Runs the probe (a few seconds).
    pub fn measure() -> Self {
        let llc_bytes = llc_size().unwrap_or(32 << 20);
        let small = (llc_bytes / 4).max(1 << 20);
        let p = Probe {
            dram1: read_bandwidth(1 << 30, 1, 5),
            dram2: read_bandwidth(1 << 30, 2, 5),
            llc1: read_bandwidth(small, 1, 30),
            llc2: read_bandwidth(small, 2, 30),
            llc_bytes,
            gather1: gather_bandwidth(1 << 30, 1, 4, 1),
            gather2: gather_bandwidth(1 << 30, 2, 4, 1),
            gather_llc1: gather_bandwidth(small, 1, 30, 4),
            gather_llc2: gather_bandwidth(small, 2, 30, 4),
        };
        eprintln!(
            "probe: streaming read DRAM {:.1} GB/s (1 thread), {:.1} GB/s (2 threads); last-level cache ({} MiB) {:.1} / {:.1} GB/s; random tokens' K+V rows (10%, f16 d128) from DRAM {:.1} / {:.1} GB/s, from the cache probe's size {:.1} / {:.1} GB/s",
            p.dram1 / 1e9,
            p.dram2 / 1e9,
            llc_bytes >> 20,
            p.llc1 / 1e9,
            p.llc2 / 1e9,
            p.gather1 / 1e9,
            p.gather2 / 1e9,
            p.gather_llc1 / 1e9,
            p.gather_llc2 / 1e9
        );
        p
    }
    /// The random-token yardstick for a sparse kernel with this working
    /// set and thread count (DRAM or cache, as [`Probe::reference`]).
    pub fn gather(&self, working_set: usize, threads: usize) -> f64 {
        self.pick(
            working_set,
            threads,
            [self.gather_llc1, self.gather_llc2],
            [self.gather1, self.gather2],
        )
        .0
    }
    fn in_cache(&self, working_set: usize) -> bool {
        working_set * 2 < self.llc_bytes
    }
    /// The bandwidth a kernel with this working set and thread count should be compared with.
    pub fn reference(&self, working_set: usize, threads: usize) -> (f64, &'static str) {
        self.pick(
            working_set,
            threads,
            [self.llc1, self.llc2],
            [self.dram1, self.dram2],
        )
    }
    /// The 1- or 2-thread figure of the cache or the DRAM pair, by working set.
    fn pick(
        &self,
        working_set: usize,
        threads: usize,
        llc: [f64; 2],
        dram: [f64; 2],
    ) -> (f64, &'static str) {
        let t = usize::from(threads > 1);
        if self.in_cache(working_set) {
            (llc[t], "LLC")
        } else {
            (dram[t], "DRAM")
        }
    }
}

fn llc_size() -> Option<usize> {
    let mut best = None;
    for i in 0..8 {
        let p = format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size");
        if let Ok(s) = std::fs::read_to_string(p) {
            let s = s.trim();
            let n: usize = s.trim_end_matches(['K', 'M']).parse().ok()?;
            let n = if s.ends_with('K') {
                n << 10
            } else if s.ends_with('M') {
                n << 20
            } else {
                n
            };
            best = Some(best.map_or(n, |b: usize| b.max(n)));
        }
    }
    best
}

/// One measured row of the report.
#[derive(Debug, Clone)]
pub struct Row {
    /// Bytes a call moves (by the kernel's own definition).
    pub bytes: u64,
    /// Bytes the call's data occupies (decides DRAM vs cache).
    pub working_set: usize,
    /// Threads.
    pub threads: usize,
    /// Every call criterion made, in order: (time, iterations). Warm-up
    /// calls come first, the measurement's samples last.
    pub calls: Vec<(Duration, u64)>,
    /// How many of the last calls are criterion's measurement samples.
    pub samples: usize,
}

impl Row {
    /// Mean seconds per iteration over the measurement samples only (the
    /// warm-up's calls, cold caches and page faults included, are left out).
    pub fn per_call(&self) -> f64 {
        let m = &self.calls[self.calls.len().saturating_sub(self.samples)..];
        let time: f64 = m.iter().map(|c| c.0.as_secs_f64()).sum();
        let iters: u64 = m.iter().map(|c| c.1).sum();
        time / iters.max(1) as f64
    }
    /// Seconds per iteration of the fastest measurement sample: the
    /// statistic the probes report (each the best of its repetitions), so
    /// the percentages compare like with like on a host whose load moves.
    pub fn best_call(&self) -> f64 {
        self.calls[self.calls.len().saturating_sub(self.samples)..]
            .iter()
            .map(|c| c.0.as_secs_f64() / c.1.max(1) as f64)
            .fold(f64::INFINITY, f64::min)
    }
}

/// Collects criterion's own measurements (through `iter_custom`) for the report.
#[derive(Debug, Default)]
pub struct Report(Mutex<BTreeMap<String, Row>>);

impl Report {
    /// Benchmarks `f` under `id` in criterion group `group` (10 samples),
    /// recording each sample for the report: `bytes` per call over a
    /// working set of `working_set` bytes, on `threads` threads.
    pub fn bench(
        &self,
        crit: &mut criterion::Criterion,
        group: &str,
        id: &str,
        (bytes, working_set, threads): (u64, usize, usize),
        mut f: impl FnMut(),
    ) {
        let mut g = crit.benchmark_group(group);
        g.sample_size(10);
        g.bench_function(id, |b| {
            b.iter_custom(|iters| self.time(id, bytes, working_set, threads, 10, iters, &mut f))
        });
        g.finish();
    }

    /// Times `iters` calls of `f` for criterion and records them under `id`;
    /// `samples` is the group's sample size (the report keeps that many of
    /// the last calls: criterion's measurement, not its warm-up).
    #[allow(clippy::too_many_arguments)]
    pub fn time(
        &self,
        id: &str,
        bytes: u64,
        working_set: usize,
        threads: usize,
        samples: usize,
        iters: u64,
        mut f: impl FnMut(),
    ) -> Duration {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        let e = t.elapsed();
        let mut m = self.0.lock().unwrap();
        let row = m.entry(id.to_string()).or_insert(Row {
            bytes,
            working_set,
            threads,
            calls: Vec::new(),
            samples,
        });
        row.calls.push((e, iters));
        e
    }
    /// Mean seconds per call of `id` over the measurement samples.
    pub fn mean(&self, id: &str) -> Option<f64> {
        let m = self.0.lock().unwrap();
        m.get(id).map(Row::per_call)
    }
    /// Prints the table: id, mean time per call, GB/s (mean and best
    /// sample), % of the probe and % of the gather probe (best sample
    /// against the probes' best repetition), and the ratio to a peer (means).
    pub fn print(&self, probe: &Probe, peer_of: impl Fn(&str) -> Option<String>) {
        let m = self.0.lock().unwrap();
        println!(
            "\n{:<58} {:>10} {:>8} {:>8} {:>12} {:>10} {:>9}",
            "bench", "time/call", "GB/s", "best", "% of probe", "x peer", "% gather"
        );
        for (id, r) in m.iter() {
            let t = r.per_call();
            let gbs = r.bytes as f64 / t;
            let best = r.bytes as f64 / r.best_call();
            let (bw, kind) = probe.reference(r.working_set, r.threads);
            let ratio = peer_of(id)
                .and_then(|p| m.get(&p).map(|pr| pr.per_call() / t))
                .map(|x| format!("{x:.1}"))
                .unwrap_or_default();
            // Sparse kernels over single random tokens of 256-byte rows,
            // 10% of them: also against the gather probe, which reads that
            // pattern (whole blocks, other rows or another density, where
            // more selected rows are neighbours, are other patterns).
            let probe_pattern = (id.contains("/f16/") || id.contains("/bf16/"))
                && id.contains("-d128-")
                && id.contains("-sel10-")
                && !id.split('-').any(|p| p.starts_with('b'));
            let gather = if id.starts_with("sparse") && probe_pattern {
                format!(
                    "{:.0}%",
                    100.0 * best / probe.gather(r.working_set, r.threads)
                )
            } else {
                String::new()
            };
            println!(
                "{id:<58} {:>8.1}us {:>8.1} {:>8.1} {:>7.0}% {:<4} {ratio:>10} {gather:>9}",
                t * 1e6,
                gbs / 1e9,
                best / 1e9,
                100.0 * best / bw,
                kind
            );
        }
    }
}

/// f32 FMA throughput in FLOP/s (an FMA counts 2) on `threads` threads:
/// each runs 16 independent chains of vector FMAs on the best ISA pulp
/// detects (enough chains to cover the FMA latency on two pipes), best of
/// `reps`. The peak the compute-bound kernels are judged against.
pub fn fma_peak(threads: usize, reps: usize) -> f64 {
    struct Chains(usize);
    impl pulp::WithSimd for Chains {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            let a = s.splat_f32s(0.999_999);
            let b = s.splat_f32s(1e-7);
            let mut acc = [s.splat_f32s(1.0); 16];
            for _ in 0..self.0 {
                for x in acc.iter_mut() {
                    *x = s.mul_add_f32s(*x, a, b);
                }
            }
            let mut t = s.splat_f32s(0.0);
            for x in acc {
                t = s.add_f32s(t, x);
            }
            s.reduce_sum_f32s(t)
        }
    }
    let lanes = pulp::Arch::new().dispatch(Lanes);
    struct Lanes;
    impl pulp::WithSimd for Lanes {
        type Output = usize;
        #[inline(always)]
        fn with_simd<S: Simd>(self, _: S) -> usize {
            S::F32_LANES
        }
    }
    let iters = 20_000_000usize;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("probe threads");
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        let s: f32 = pool.install(|| {
            use rayon::prelude::*;
            (0..threads)
                .into_par_iter()
                .map(|_| pulp::Arch::new().dispatch(Chains(std::hint::black_box(iters))))
                .sum()
        });
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (threads * iters * 16 * lanes * 2) as f64 / best
}

/// The backend threading of a bench run on `threads` threads: sequential
/// for one (no pool to wake), rayon's pool otherwise.
pub fn par(threads: usize) -> hgca_cpu::Par {
    if threads == 1 {
        hgca_cpu::Par::Seq
    } else {
        hgca_cpu::Par::Rayon(threads)
    }
}

/// Criterion with the given warm-up and measurement times (milliseconds),
/// then the command line's options.
pub fn criterion(warm_up_ms: u64, measurement_ms: u64) -> criterion::Criterion {
    criterion::Criterion::default()
        .warm_up_time(Duration::from_millis(warm_up_ms))
        .measurement_time(Duration::from_millis(measurement_ms))
        .configure_from_args()
}
