//! The quantised matrix-vector product of decoding (GGUF weight blocks
//! times Q8_0 activations, `CpuBackend::qmatvec`) on Qwen2.5-0.5B's
//! shapes: its stacked FFN gate and up projections (9728 x 896), eight
//! layers' weights taken in turn so they come from DRAM as in a model,
//! in Q8_0, Q5_0, Q4_1 and Q4_0; and its LM head (151,936 x 896, Q8_0, as
//! the GGUF stores it). One token; 1 and 2 threads; each kernel path the
//! machine has (AVX2 and AVX-512 VNNI side by side where both run).
//!
//! Ids: `qdot/{path}/{format}/{shape}-t{threads}`. GB/s counts the weight
//! bytes (every block is read once per call); "% of probe" compares it
//! with the streaming read probe measured in the same run.

use criterion::Criterion;
use hgca_benches::{Probe, Report, criterion, fill, par};
use hgca_cpu::{CpuBackend, DotBlock, Isa, IsaKind, Q8Acts, QDotPath};
use hgca_kernels::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8_0};

const K: usize = 896;

/// `mats` matrices of `rows` rows in format `B`.
fn mats<B: DotBlock>(mats: usize, rows: usize, quantize: fn(&[f32; 32]) -> B) -> Vec<Vec<B>> {
    (0..mats)
        .map(|m| {
            fill(rows * K, m as u64)
                .chunks_exact(32)
                .map(|c| quantize(c.try_into().expect("32 values")))
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
    let acts = Q8Acts::quantize(&fill(K, 42), 1, K).expect("a whole block");
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

fn main() {
    let probe = Probe::measure();
    let rep = Report::default();
    let mut crit = criterion(300, 1000);
    let ff = 2 * 4864;
    run(
        &mut crit,
        &rep,
        "ffn",
        &mats(8, ff, BlockQ8_0::quantize),
        ff,
    );
    run(
        &mut crit,
        &rep,
        "ffn",
        &mats(8, ff, BlockQ5_0::quantize),
        ff,
    );
    run(
        &mut crit,
        &rep,
        "ffn",
        &mats(8, ff, BlockQ4_1::quantize),
        ff,
    );
    run(
        &mut crit,
        &rep,
        "ffn",
        &mats(8, ff, BlockQ4_0::quantize),
        ff,
    );
    let vocab = 151_936;
    run(
        &mut crit,
        &rep,
        "head",
        &mats(1, vocab, BlockQ8_0::quantize),
        vocab,
    );
    rep.print(&probe, |_| None);
    crit.final_summary();
}
