//! The quantised matrix-vector product of decoding (GGUF weight blocks
//! times Q8_0 activations, `CpuBackend::qmatvec`) on Qwen2.5-0.5B's
//! shapes: its stacked FFN gate and up projections (9728 x 896), eight
//! layers' weights taken in turn so they come from DRAM as in a model,
//! in Q8_0, Q5_0, Q4_1 and Q4_0; its down projection (896 x 4864) in Q4_K,
//! Q6_K (the K formats its GGUF stores it in) and Q5_0; and its LM head (151,936 x 896, Q8_0, as
//! the GGUF stores it). One token; 1 and 2 threads; each kernel path the
//! machine has (AVX2 and AVX-512 VNNI side by side where both run).
//!
//! Every format also runs repacked sixteen rows at a time
//! (`PackedRows`, `qmatvec_packed`) on each SIMD path (AVX2, AVX-512 VNNI).
//!
//! A prefill chunk of 512 tokens through the repacked Q5_0 rows prints
//! integer GOP/s against the f32 FMA peak probe (the f32 GEMM it replaces
//! is bounded by that peak).
//!
//! Ids: `qdot/{path}/{format}/{shape}-t{threads}` (`{path}-packed` for
//! the repacked rows). GB/s counts the weight
//! bytes (every block is read once per call); "% of probe" compares it
//! with the streaming read probe measured in the same run.

use criterion::Criterion;
use hgca_benches::{Probe, Report, criterion, fill, fma_peak, par};
use hgca_cpu::{CpuBackend, DotBlock, Isa, IsaKind, PackBlock, PackedRows, Q8Acts, QDotPath};
use hgca_kernels::{BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0};

/// Qwen2.5-0.5B's model width (the inner dimension of gate/up and the head).
const K: usize = 896;
/// Its FFN width (the inner dimension of down: 19 K-format blocks).
const FF: usize = 4864;

/// `mats` matrices of `rows` rows of `k` values in format `B` (blocks of `N`).
fn mats<B: DotBlock, const N: usize>(
    mats: usize,
    rows: usize,
    k: usize,
    quantize: fn(&[f32; N]) -> B,
) -> Vec<Vec<B>> {
    (0..mats)
        .map(|m| {
            fill(rows * k, m as u64)
                .chunks_exact(N)
                .map(|c| quantize(c.try_into().expect("a whole block")))
                .collect()
        })
        .collect()
}

/// Each kernel path the machine has (portable code only where there is
/// no other), on the ISA that takes it.
fn paths() -> Vec<(IsaKind, QDotPath)> {
    let mut v: Vec<(IsaKind, QDotPath)> = Vec::new();
    for isa in Isa::available() {
        let p = CpuBackend::qmatvec_path(isa);
        if !v.iter().any(|&(_, q)| q == p) {
            v.push((isa.kind(), p));
        }
    }
    if v.len() > 1 {
        v.retain(|&(_, p)| p != QDotPath::Portable);
    }
    v
}

fn run<B: DotBlock>(crit: &mut Criterion, rep: &Report, shape: &str, ws: &[Vec<B>], rows: usize) {
    let k = ws[0].len() / rows * B::VALUES;
    let acts = Q8Acts::quantize(&fill(k, 42), 1, k).expect("a whole block");
    let mut y = vec![0.0f32; rows];
    for (isa, path) in paths() {
        for threads in [1usize, 2] {
            let cpu = CpuBackend::new()
                .with_isa(isa)
                .and_then(|c| c.with_par(par(threads)))
                .expect("a detected ISA and a pool");
            let bytes = (ws[0].len() * size_of::<B>()) as u64;
            let set = ws.len() * ws[0].len() * size_of::<B>();
            let id = format!("qdot/{path:?}/{}/{shape}-t{threads}", B::NAME);
            let mut m = 0;
            rep.bench(crit, "qdot", &id, (bytes, set, threads), || {
                m = (m + 1) % ws.len();
                cpu.qmatvec(&ws[m], rows, &acts, &mut y)
                    .expect("a valid call");
            });
        }
    }
}

/// A backend per SIMD kernel path of [`paths`] (the repacked rows'
/// kernels) and thread count (1, 2); `what` is skipped, with a printed
/// reason, where there is none.
fn simd_backends(what: &str) -> Vec<(QDotPath, usize, CpuBackend)> {
    let mut v = paths();
    v.retain(|&(_, p)| p != QDotPath::Portable);
    if v.is_empty() {
        eprintln!("qdot: {what} skipped: no SIMD path on this machine");
    }
    let mut out = Vec::new();
    for (isa, path) in v {
        for threads in [1usize, 2] {
            let cpu = CpuBackend::new()
                .with_isa(isa)
                .and_then(|c| c.with_par(par(threads)))
                .expect("a detected ISA and a pool");
            out.push((path, threads, cpu));
        }
    }
    out
}

/// The same matrices repacked sixteen rows at a time
/// (`CpuBackend::qmatvec_packed`), on each SIMD path (skipped with a
/// printed reason where there is none).
fn run_packed<B: PackBlock>(
    crit: &mut Criterion,
    rep: &Report,
    shape: &str,
    ws: &[Vec<B>],
    rows: usize,
) {
    let k = ws[0].len() / rows * B::VALUES;
    let packed: Vec<PackedRows<B>> = ws
        .iter()
        .map(|w| PackedRows::new(w, rows, k).expect("whole blocks"))
        .collect();
    let acts = Q8Acts::quantize(&fill(k, 42), 1, k).expect("a whole block");
    let mut y = vec![0.0f32; rows];
    for (path, threads, cpu) in simd_backends("packed rows") {
        let bytes = packed[0].bytes() as u64;
        let set = packed.len() * packed[0].bytes();
        let id = format!("qdot/{path:?}-packed/{}/{shape}-t{threads}", B::NAME);
        let mut m = 0;
        rep.bench(crit, "qdot", &id, (bytes, set, threads), || {
            m = (m + 1) % packed.len();
            cpu.qmatvec_packed(&packed[m], &acts, &mut y)
                .expect("a valid call");
        });
    }
}

/// `ws` in GGUF's layout ([`run`]) and repacked ([`run_packed`]).
fn both<B: PackBlock>(crit: &mut Criterion, rep: &Report, shape: &str, ws: &[Vec<B>], rows: usize) {
    run(crit, rep, shape, ws, rows);
    run_packed(crit, rep, shape, ws, rows);
}

/// Tokens of the prefill chunk [`prefill`] multiplies.
const PREFILL: usize = 512;

/// A prefill chunk of [`PREFILL`] tokens through the repacked rows on each
/// SIMD path: the integer kernel that replaces an f32 GEMM there.
/// Returns (id, integer operations per call, threads) per run.
fn prefill<B: PackBlock>(
    crit: &mut Criterion,
    rep: &Report,
    w: &[B],
    rows: usize,
) -> Vec<(String, f64, usize)> {
    let k = w.len() / rows * B::VALUES;
    let packed = PackedRows::new(w, rows, k).expect("whole blocks");
    let acts = Q8Acts::quantize(&fill(PREFILL * k, 7), PREFILL, k).expect("whole blocks");
    let mut y = vec![0.0f32; PREFILL * rows];
    let mut out = Vec::new();
    for (path, threads, cpu) in simd_backends("packed prefill") {
        let id = format!(
            "qdot/{path:?}-packed/{}/ffn-prefill{PREFILL}-t{threads}",
            B::NAME
        );
        let bytes = packed.bytes() as u64;
        rep.bench(crit, "qdot", &id, (bytes, packed.bytes(), threads), || {
            cpu.qmatvec_packed(&packed, &acts, &mut y)
                .expect("a valid call");
        });
        out.push((id, 2.0 * (rows * k * PREFILL) as f64, threads));
    }
    out
}

fn main() {
    let probe = Probe::measure();
    let rep = Report::default();
    let mut crit = criterion(300, 1000);
    let ff = 2 * 4864;
    both(
        &mut crit,
        &rep,
        "ffn",
        &mats(8, ff, K, BlockQ8_0::quantize),
        ff,
    );
    both(
        &mut crit,
        &rep,
        "ffn",
        &mats(8, ff, K, BlockQ5_0::quantize),
        ff,
    );
    both(
        &mut crit,
        &rep,
        "ffn",
        &mats(8, ff, K, BlockQ4_1::quantize),
        ff,
    );
    both(
        &mut crit,
        &rep,
        "ffn",
        &mats(8, ff, K, BlockQ4_0::quantize),
        ff,
    );
    // Qwen2's down projection (896 x 4864) in the K formats its GGUF uses
    // for it, and in Q5_0 for comparison.
    both(
        &mut crit,
        &rep,
        "down",
        &mats(8, K, FF, BlockQ4K::quantize),
        K,
    );
    both(
        &mut crit,
        &rep,
        "down",
        &mats(8, K, FF, BlockQ6K::quantize),
        K,
    );
    both(
        &mut crit,
        &rep,
        "down",
        &mats(8, K, FF, BlockQ5_0::quantize),
        K,
    );
    let vocab = 151_936;
    both(
        &mut crit,
        &rep,
        "head",
        &mats(1, vocab, K, BlockQ8_0::quantize),
        vocab,
    );
    // Its own report: GB/s of weights mean nothing for a compute-bound chunk.
    let pre = Report::default();
    let prefill = prefill(&mut crit, &pre, &mats(1, ff, K, BlockQ5_0::quantize)[0], ff);
    rep.print(&probe, |_| None);
    if !prefill.is_empty() {
        let peak = [fma_peak(1, 5), fma_peak(2, 5)];
        println!(
            "\nprefill ({PREFILL} tokens; GOP/s: a multiply-add counts 2; f32 FMA peak probe {:.1} / {:.1} GFLOP/s on 1 / 2 threads)",
            peak[0] / 1e9,
            peak[1] / 1e9
        );
        for (id, ops, threads) in prefill {
            let Some(mean) = pre.mean(&id) else { continue };
            let rate = ops / mean;
            println!(
                "{id:<58} {:>8.1} GOP/s {:>6.2}x the f32 FMA peak",
                rate / 1e9,
                rate / peak[threads - 1]
            );
        }
    }
    crit.final_summary();
}
