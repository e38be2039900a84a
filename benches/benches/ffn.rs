//! The sparse FFN kernel (PowerInfer's CPU side) on Qwen2.5-0.5B's FFN
//! shape (d_model 896, 4864 neurons) and depth (24 layers, taken in turn:
//! a decode step reads each layer's once, so the weights come from DRAM,
//! as they do in a model), one token, active lists of 10%, 50% and 100% of
//! the neurons at random (seven lists per share, taken in turn with the
//! layers: a token's active rows are not the previous token's, so a small
//! share does not settle in the cache either), weights f16, Q8_0, Q4_0 and
//! Q5_0 (Qwen2's gate and up format); the block formats also with the token
//! quantised to Q8_0 for the gate and up rows (`sparse_ffn_q8`, id suffix
//! `+q8`); 1 and 2 threads. The lists run on each neuron's gate, up and
//! down rows side by side (`FfnWeights::interleaved`: a scattered neuron
//! in one read); the 10% lists also over three separate matrices (id
//! suffix `-3m`).
//!
//! The threshold form (CATS: the gate pass over every neuron decides which
//! up and down rows are read) runs on Q4_0 and Q5_0 with thresholds that
//! keep about 10% and 50% of the neurons, on the gate matrix alone and each
//! neuron's up and down rows side by side (`FfnWeights::paired`, as
//! `FfnOwned` holds them): the gate pass a row at a time (`sparse_ffn_q8`)
//! or over the gate rows repacked sixteen at a time (`sparse_ffn_q8_gated`,
//! id suffix `-packed`); at 10% also on interleaved rows (suffix `-il`).
//!
//! Ids: `ffn/{isa}/{format}/list{pct}-t{threads}[-3m]`,
//! `ffn/{isa}/{format}+q8/thr{pct}-t{threads}[-packed|-il]`. GB/s counts the
//! bytes of the active neurons' three rows, for a threshold every gate row
//! and the kept neurons' up and down rows (the bytes the kernel must read);
//! "% of probe" compares it with the streaming read probe measured in the
//! same run (the target: >= 60%).

use criterion::Criterion;
use hgca_benches::{Probe, Report, criterion, fill, par};
use hgca_cpu::{CpuBackend, Isa};
use hgca_cpu::{DotBlock, FfnStats, PackBlock, PackedRows, Q8Acts};
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

/// Each layer's `[n_ff, 3, row]` array (`FfnWeights::interleave`).
fn interleave_layers<W: WeightElem>(ws: &[[Vec<W>; 3]]) -> Vec<Vec<W>> {
    ws.iter()
        .map(|[g, u, d]| FfnWeights::interleave(NFF, D / W::VALUES, g, u, d).expect("lengths"))
        .collect()
}

/// Views of [`interleave_layers`]' arrays.
fn interleaved_views<W: WeightElem>(rows: &[Vec<W>]) -> Vec<FfnWeights<'_, W>> {
    rows.iter()
        .map(|r| FfnWeights::interleaved(D, NFF, r).expect("lengths"))
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
        // Each neuron's three rows side by side (a scattered neuron in one
        // read), and, for the 10% lists, three matrices (ids ending `-3m`).
        let rows = interleave_layers(ws);
        let interleaved = interleaved_views(&rows);
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

/// The threshold form (CATS), one token through Q8_0, on paired rows
/// (`FfnWeights::paired`): thresholds that keep about 10% and 50% of each
/// layer's neurons; the gate pass a row at a time (`sparse_ffn_q8`, id
/// `thr{pct}`) or over the gate rows repacked (`sparse_ffn_q8_gated`, id
/// `thr{pct}-packed`); at 10% also on interleaved rows (`thr10-il`).
/// GB/s counts every gate row and the kept neurons' up and down rows.
fn run_threshold<W: WeightElem + PackBlock>(
    crit: &mut Criterion,
    rep: &Report,
    isa: &str,
    ws: &[[Vec<W>; 3]],
) {
    let x = fill(D, 42);
    let acts = Q8Acts::quantize(&x, 1, D).expect("a whole block");
    let mut out = vec![0.0f32; D];
    let row = D / W::VALUES;
    let row_bytes = row * size_of::<W>();
    // As `FfnOwned` holds a split's cold neurons: the gate matrix alone,
    // each neuron's up and down rows side by side; and, for comparison,
    // each neuron's three rows side by side (ids ending `-il`).
    let pairs: Vec<Vec<W>> = ws
        .iter()
        .map(|[_, u, d]| FfnWeights::pair(NFF, row, u, d).expect("lengths"))
        .collect();
    let paired: Vec<FfnWeights<'_, W>> = ws
        .iter()
        .zip(&pairs)
        .map(|([g, _, _], p)| FfnWeights::paired(D, NFF, g, p).expect("lengths"))
        .collect();
    let rows = interleave_layers(ws);
    let interleaved = interleaved_views(&rows);
    let packed: Vec<PackedRows<W>> = ws
        .iter()
        .map(|[g, _, _]| PackedRows::new(g, NFF, D).expect("whole blocks"))
        .collect();
    // Each layer's |silu(gate)|, sorted: the thresholds keeping a share.
    let cpu = CpuBackend::new();
    let mags: Vec<Vec<f32>> = ws
        .iter()
        .map(|[g, _, _]| {
            let mut y = vec![0.0f32; NFF];
            cpu.qmatvec(g, NFF, &acts, &mut y).expect("shapes");
            let mut m: Vec<f32> = y.iter().map(|&v| FfnAct::Silu.apply(v).abs()).collect();
            m.sort_by(f32::total_cmp);
            m
        })
        .collect();
    let set: usize = ws
        .iter()
        .map(|w| w.iter().map(|m| m.len() * size_of::<W>()).sum::<usize>())
        .sum();
    for pct in [10usize, 50] {
        let keep = NFF * pct / 100;
        let ths: Vec<f32> = mags.iter().map(|m| m[NFF - keep - 1]).collect();
        let bytes = ((NFF + 2 * keep) * row_bytes) as u64;
        let mut variants = vec![("", false, &paired), ("-packed", true, &paired)];
        if pct == 10 {
            variants.push(("-il", false, &interleaved));
        }
        for (suffix, packed_gate, weights) in variants {
            for threads in [1usize, 2] {
                let cpu = CpuBackend::new().with_par(par(threads)).expect("pool");
                let id = format!("ffn/{isa}/{}+q8/thr{pct}-t{threads}{suffix}", W::NAME);
                let mut layer = 0;
                rep.bench(crit, "ffn", &id, (bytes, set, threads), || {
                    layer = (layer + 1) % LAYERS;
                    let (w, t) = (&weights[layer], ths[layer]);
                    if packed_gate {
                        cpu.sparse_ffn_q8_gated(FfnAct::Silu, w, &packed[layer], &x, t, &mut out)
                    } else {
                        cpu.sparse_ffn_q8(FfnAct::Silu, w, &x, 1, Neurons::Threshold(t), &mut out)
                    }
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
    let q4 = layers(|r| blocks(r, BlockQ4_0::quantize));
    run(
        &mut crit,
        &rep,
        isa,
        &q4,
        &[("", float_acts), ("+q8", q8_acts)],
    );
    run_threshold(&mut crit, &rep, isa, &q4);
    drop(q4);
    let q5 = layers(|r| blocks(r, BlockQ5_0::quantize));
    run(
        &mut crit,
        &rep,
        isa,
        &q5,
        &[("", float_acts), ("+q8", q8_acts)],
    );
    run_threshold(&mut crit, &rep, isa, &q5);
    drop(q5);
    rep.print(&probe, |_| None);
    crit.final_summary();
}
