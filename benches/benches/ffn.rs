//! The sparse FFN kernel (PowerInfer's CPU side) on Qwen2.5-0.5B's FFN
//! shape (d_model 896, 4864 neurons) and depth (24 layers, taken in turn:
//! a decode step reads each layer's once, so the weights come from DRAM,
//! as they do in a model), one token, active lists of 10%, 50% and 100% of
//! the neurons at random (seven lists per share, taken in turn with the
//! layers: a token's active rows are not the previous token's, so a small
//! share does not settle in the cache either), weights f16, Q8_0, Q4_0 and
//! Q5_0 (Qwen2's gate and up format); the block formats also with the token
//! quantised to Q8_0 for the gate and up rows (`sparse_ffn_q8`, id suffix
//! `+q8`); 1 and 2 threads. Each neuron's gate, up and down rows lie side
//! by side (`FfnWeights::interleaved`, as a hybrid FFN holds its cold
//! neurons); the 10% lists also run over three separate matrices (id
//! suffix `-3m`).
//!
//! Ids: `ffn/{isa}/{format}/list{pct}-t{threads}[-3m]`. GB/s counts the bytes
//! of the active neurons' three rows (the bytes the kernel must read);
//! "% of probe" compares it with the streaming read probe measured in the
//! same run (the target: >= 60%).

use criterion::Criterion;
use hgca_benches::{Probe, Report, criterion, fill, par};
use hgca_cpu::{CpuBackend, Isa};
use hgca_cpu::{DotBlock, FfnStats};
use hgca_kernels::{
    BlockQ4_0, BlockQ5_0, BlockQ8_0, FfnAct, FfnWeights, Neurons, Result, WeightElem, f16,
};

const D: usize = 896;
const NFF: usize = 4864;
const LAYERS: usize = 24;
/// Active lists per share, taken in turn (coprime with `LAYERS`).
const LISTS: usize = 7;

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

/// How a bench calls the kernel: `sparse_ffn`, or `sparse_ffn_q8`.
type Call<W> =
    fn(&CpuBackend, &FfnWeights<'_, W>, &[f32], Neurons<'_>, &mut [f32]) -> Result<FfnStats>;

fn float_acts<W: WeightElem>(
    c: &CpuBackend,
    w: &FfnWeights<'_, W>,
    x: &[f32],
    nr: Neurons<'_>,
    o: &mut [f32],
) -> Result<FfnStats> {
    c.sparse_ffn(FfnAct::Silu, w, x, 1, nr, o)
}

fn q8_acts<W: WeightElem + DotBlock>(
    c: &CpuBackend,
    w: &FfnWeights<'_, W>,
    x: &[f32],
    nr: Neurons<'_>,
    o: &mut [f32],
) -> Result<FfnStats> {
    c.sparse_ffn_q8(FfnAct::Silu, w, x, 1, nr, o)
}

fn run<W: WeightElem>(
    crit: &mut Criterion,
    rep: &Report,
    isa: &str,
    ws: &[[Vec<W>; 3]],
    calls: &[(&str, Call<W>)],
) {
    let x = fill(D, 42);
    let mut out = vec![0.0f32; D];
    for pct in [10usize, 50, 100] {
        let lists: Vec<Vec<u32>> = (0..LISTS)
            .map(|l| {
                let r = fill(NFF, (pct * LISTS + l) as u64);
                (0..NFF as u32)
                    .filter(|&i| pct == 100 || (r[i as usize] + 1.0) * 50.0 < pct as f32)
                    .collect()
            })
            .collect();
        // Each neuron's three rows side by side (as `FfnOwned` holds a
        // split's cold neurons), and, for the 10% lists, three matrices
        // (ids ending `-3m`).
        let row = D / W::VALUES;
        let rows: Vec<Vec<W>> = ws
            .iter()
            .map(|[g, u, d]| FfnWeights::interleave(NFF, row, g, u, d).expect("lengths"))
            .collect();
        let interleaved: Vec<FfnWeights<'_, W>> = rows
            .iter()
            .map(|r| FfnWeights::interleaved(D, NFF, r).expect("lengths"))
            .collect();
        let separate: Vec<FfnWeights<'_, W>> = ws
            .iter()
            .map(|[g, u, d]| FfnWeights::new(D, NFF, g, u, d).expect("lengths"))
            .collect();
        let mut layouts = vec![("", &interleaved)];
        if pct == 10 {
            layouts.push(("-3m", &separate));
        }
        let count: usize = lists.iter().map(Vec::len).sum();
        let bytes = (count * separate[0].neuron_bytes() / LISTS) as u64;
        let set: usize = ws
            .iter()
            .map(|w| w.iter().map(|m| m.len() * size_of::<W>()).sum::<usize>())
            .sum();
        for ((suffix, call), (layout, weights)) in calls
            .iter()
            .flat_map(|c| layouts.iter().map(move |l| (c, l)))
        {
            for threads in [1usize, 2] {
                let cpu = CpuBackend::new().with_par(par(threads)).expect("pool");
                let id = format!("ffn/{isa}/{}{suffix}/list{pct}-t{threads}{layout}", W::NAME);
                let (mut layer, mut list) = (0, 0);
                rep.bench(crit, "ffn", &id, (bytes, set, threads), || {
                    layer = (layer + 1) % LAYERS;
                    list = (list + 1) % LISTS;
                    call(
                        &cpu,
                        &weights[layer],
                        &x,
                        Neurons::List(&lists[list]),
                        &mut out,
                    )
                    .expect("a valid call");
                });
            }
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
        &[("", float_acts)],
    );
    run(
        &mut crit,
        &rep,
        isa,
        &layers(|r| blocks(r, BlockQ8_0::quantize)),
        &[("", float_acts), ("+q8", q8_acts)],
    );
    run(
        &mut crit,
        &rep,
        isa,
        &layers(|r| blocks(r, BlockQ4_0::quantize)),
        &[("", float_acts), ("+q8", q8_acts)],
    );
    run(
        &mut crit,
        &rep,
        isa,
        &layers(|r| blocks(r, BlockQ5_0::quantize)),
        &[("", float_acts), ("+q8", q8_acts)],
    );
    rep.print(&probe, |_| None);
    crit.final_summary();
}
