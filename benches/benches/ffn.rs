//! The sparse FFN kernel (PowerInfer's CPU side) on Qwen2.5-0.5B's FFN
//! shape (d_model 896, 4864 neurons), four layers' weights taken in turn
//! (a decode step reads each layer's once: the weights come from DRAM, as
//! they do in a model), one token, active lists of 10%, 50% and 100% of the
//! neurons at random, weights f16, Q8_0, Q4_0 and Q5_0 (Qwen2's gate and
//! up format); 1 and 2 threads.
//!
//! Ids: `ffn/{isa}/{format}/list{pct}-t{threads}`. GB/s counts the bytes
//! of the active neurons' three rows (the bytes the kernel must read);
//! "% of probe" compares it with the streaming read probe measured in the
//! same run (the target: >= 60%).

use criterion::Criterion;
use hgca_benches::{Probe, Report, criterion, fill, par};
use hgca_cpu::{CpuBackend, Isa};
use hgca_kernels::{BlockQ4_0, BlockQ5_0, BlockQ8_0, FfnAct, FfnWeights, Neurons, WeightElem, f16};

const D: usize = 896;
const NFF: usize = 4864;
const LAYERS: usize = 4;

/// `LAYERS` layers of weights in format `W`, from `conv` of f32 rows.
fn layers<W: WeightElem>(conv: impl Fn(&[f32]) -> Vec<W>) -> Vec<[Vec<W>; 3]> {
    (0..LAYERS)
        .map(|l| {
            std::array::from_fn(|m| {
                let x = fill(NFF * D, (l * 3 + m) as u64);
                x.chunks(D).flat_map(&conv).collect()
            })
        })
        .collect()
}

/// A row in a GGUF block format.
fn blocks<B>(r: &[f32], quantize: fn(&[f32; 32]) -> B) -> Vec<B> {
    r.chunks_exact(32)
        .map(|c| quantize(c.try_into().expect("32 values")))
        .collect()
}

fn run<W: WeightElem>(crit: &mut Criterion, rep: &Report, isa: &str, ws: &[[Vec<W>; 3]]) {
    let x = fill(D, 42);
    let mut out = vec![0.0f32; D];
    for pct in [10usize, 50, 100] {
        let r = fill(NFF, pct as u64);
        let list: Vec<u32> = (0..NFF as u32)
            .filter(|&i| pct == 100 || (r[i as usize] + 1.0) * 50.0 < pct as f32)
            .collect();
        for threads in [1usize, 2] {
            let cpu = CpuBackend::new().with_par(par(threads)).expect("pool");
            let weights: Vec<FfnWeights<'_, W>> = ws
                .iter()
                .map(|[g, u, d]| FfnWeights::new(D, NFF, g, u, d).expect("lengths"))
                .collect();
            let bytes = (list.len() * weights[0].neuron_bytes()) as u64;
            let set: usize = ws
                .iter()
                .map(|w| w.iter().map(|m| m.len() * size_of::<W>()).sum::<usize>())
                .sum();
            let id = format!("ffn/{isa}/{}/list{pct}-t{threads}", W::NAME);
            let mut layer = 0;
            rep.bench(crit, "ffn", &id, (bytes, set, threads), || {
                layer = (layer + 1) % LAYERS;
                cpu.sparse_ffn(
                    FfnAct::Silu,
                    &weights[layer],
                    &x,
                    1,
                    Neurons::List(&list),
                    &mut out,
                )
                .expect("a valid call");
            });
        }
    }
}

fn main() {
    let probe = Probe::measure();
    let rep = Report::default();
    let mut crit = criterion(300, 1000);
    let isa = Isa::detect().kind().name();
    run(
        &mut crit,
        &rep,
        isa,
        &layers(|r| r.iter().map(|&v| f16::from_f32(v)).collect()),
    );
    run(
        &mut crit,
        &rep,
        isa,
        &layers(|r| blocks(r, BlockQ8_0::quantize)),
    );
    run(
        &mut crit,
        &rep,
        isa,
        &layers(|r| blocks(r, BlockQ4_0::quantize)),
    );
    run(
        &mut crit,
        &rep,
        isa,
        &layers(|r| blocks(r, BlockQ5_0::quantize)),
    );
    rep.print(&probe, |_| None);
    crit.final_summary();
}
