//! The sparse FFN kernel against hgca-ref (f64), for every ISA the machine
//! has and every weight format: proptest over shapes, active sets, tokens
//! and both activations, a table of edge shapes, the partition identity
//! (hot + cold = all), and typed errors for bad input; the one-token
//! threshold form with repacked gate rows (`sparse_ffn_q8_gated`) beside
//! `sparse_ffn_q8`'s. Every case also
//! runs on the same rows interleaved ([`FfnWeights::interleaved`]) and
//! paired ([`FfnWeights::paired`]), which must give the same bits.

use hgca_cpu::{CpuBackend, DotBlock, FfnStats, PackBlock, PackedRows, Par};
use hgca_kernels::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, Error, FfnAct, FfnWeights,
    Neurons, WeightElem, bf16, f16,
};
use hgca_testkit::Rng;
use hgca_testkit::ffn::{FfnProblem, TestWeight, gap_threshold, random_subset};
use proptest::prelude::*;

use crate::common::backend;

/// One case: a list (`threshold: None`) or a threshold chosen away from
/// every activation (f32 and f64 then agree on each comparison).
fn case<W: TestWeight>(
    b: &CpuBackend,
    act: FfnAct,
    d: usize,
    n_ff: usize,
    n: usize,
    threshold: bool,
    seed: u64,
) -> Result<(), String> {
    let run = |w: &FfnWeights<'_, W>, x: &[f32], nr: Neurons<'_>, o: &mut [f32]| {
        b.sparse_ffn(act, w, x, n, nr, o)
    };
    case_with(act, d, n_ff, n, threshold, seed, false, run)
}

/// [`case`] for `sparse_ffn_q8`: the reference takes the tokens quantised
/// to Q8_0 and dequantised.
fn case_q8<W: TestWeight + DotBlock>(
    b: &CpuBackend,
    act: FfnAct,
    d: usize,
    n_ff: usize,
    n: usize,
    threshold: bool,
    seed: u64,
) -> Result<(), String> {
    let run = |w: &FfnWeights<'_, W>, x: &[f32], nr: Neurons<'_>, o: &mut [f32]| {
        b.sparse_ffn_q8(act, w, x, n, nr, o)
    };
    case_with(act, d, n_ff, n, threshold, seed, true, run)
}

/// [`case_q8`]'s threshold form of one token through
/// `sparse_ffn_q8_gated`, the gate rows repacked (a list, or several
/// tokens, take `sparse_ffn_q8`: the gated call has no such form).
fn case_q8_gated<W: TestWeight + PackBlock>(
    b: &CpuBackend,
    act: FfnAct,
    d: usize,
    n_ff: usize,
    n: usize,
    threshold: bool,
    seed: u64,
) -> Result<(), String> {
    let run = |w: &FfnWeights<'_, W>, x: &[f32], nr: Neurons<'_>, o: &mut [f32]| match nr {
        Neurons::Threshold(t) if n == 1 => {
            let gate = PackedRows::new(&w.matrices()[0], n_ff, d)?;
            b.sparse_ffn_q8_gated(act, w, &gate, x, t, o)
        }
        _ => b.sparse_ffn_q8(act, w, x, n, nr, o),
    };
    case_with(act, d, n_ff, n, threshold, seed, true, run)
}

/// One case run by `run` on the problem's tokens; the reference sees them
/// through Q8_0 where `q8`.
#[allow(clippy::too_many_arguments)]
fn case_with<W: TestWeight>(
    act: FfnAct,
    d: usize,
    n_ff: usize,
    n: usize,
    threshold: bool,
    seed: u64,
    q8: bool,
    run: impl Fn(&FfnWeights<'_, W>, &[f32], Neurons<'_>, &mut [f32]) -> hgca_kernels::Result<FfnStats>,
) -> Result<(), String> {
    let mut p = FfnProblem::<W>::random(d, n_ff, n, seed);
    let x = p.x.clone();
    if q8 {
        p.x = x
            .chunks_exact(32)
            .flat_map(|c| {
                let mut o = [0.0f32; 32];
                BlockQ8_0::quantize(c.try_into().expect("32 values")).dequant(&mut o);
                o
            })
            .collect();
    }
    let w = p.weights().map_err(|e| e.to_string())?;
    // The same neurons with each one's three rows side by side: the same
    // arithmetic in the same order, so the same bits.
    let rows = FfnWeights::interleave(n_ff, w.row_len(), w.gate, w.up, w.down_t)
        .map_err(|e| e.to_string())?;
    let wi = FfnWeights::interleaved(w.d_model, n_ff, &rows).map_err(|e| e.to_string())?;
    // And the gate matrix alone with each neuron's up and down rows side by
    // side (as `FfnOwned` holds them).
    let pairs = FfnWeights::pair(n_ff, w.row_len(), w.up, w.down_t).map_err(|e| e.to_string())?;
    let wp = FfnWeights::paired(w.d_model, n_ff, w.gate, &pairs).map_err(|e| e.to_string())?;
    let run = |w: &FfnWeights<'_, W>, x: &[f32], nr: Neurons<'_>, o: &mut [f32]| {
        let st = run(w, x, nr, o)?;
        for (layout, other) in [("interleaved", &wi), ("paired", &wp)] {
            let mut oi = vec![f32::NAN; o.len()];
            let sti = run(other, x, nr, &mut oi)?;
            let same = o.iter().zip(&oi).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same && (st.active, st.rows) == (sti.active, sti.rows),
                "{layout} rows differ: {oi:?} ({sti:?}) against {o:?} ({st:?})"
            );
        }
        Ok::<_, hgca_kernels::Error>(st)
    };
    let mut rng = Rng::new(seed ^ 77);
    let mut out = vec![f32::NAN; n * d];
    let (sets, st) = if threshold {
        let acts: Vec<Vec<f64>> = (0..n).map(|t| p.activations(act, t)).collect();
        let t = gap_threshold(acts.iter().flatten().copied(), 0.5);
        let sets: Vec<Vec<usize>> = acts
            .iter()
            .map(|a| (0..n_ff).filter(|&i| a[i].abs() > t).collect())
            .collect();
        let st = run(&w, &x, Neurons::Threshold(t as f32), &mut out).map_err(|e| e.to_string())?;
        (sets, st)
    } else {
        let list = random_subset(&mut rng, n_ff, 0.3);
        let st = run(&w, &x, Neurons::List(&list), &mut out).map_err(|e| e.to_string())?;
        let set: Vec<usize> = list.iter().map(|&i| i as usize).collect();
        (vec![set; n], st)
    };
    let active: usize = sets.iter().map(Vec::len).sum();
    if st.active != active {
        return Err(format!(
            "{} active pairs reported, {active} expected",
            st.active
        ));
    }
    let gate_rows = if threshold { n * n_ff } else { active };
    if st.rows != gate_rows + 2 * active {
        return Err(format!(
            "{} rows reported, {} expected",
            st.rows,
            gate_rows + 2 * active
        ));
    }
    p.check(act, &sets, &out)
}

/// Every format at once (block formats at a width that is a multiple of 32).
fn all_formats(
    b: &CpuBackend,
    act: FfnAct,
    d: usize,
    n_ff: usize,
    n: usize,
    thr: bool,
    seed: u64,
) -> Result<(), String> {
    case::<f32>(b, act, d, n_ff, n, thr, seed)?;
    case::<f16>(b, act, d, n_ff, n, thr, seed)?;
    case::<bf16>(b, act, d, n_ff, n, thr, seed)?;
    let d32 = d.div_ceil(32).max(1) * 32;
    case::<BlockQ8_0>(b, act, d32, n_ff, n, thr, seed)?;
    case::<BlockQ4_0>(b, act, d32, n_ff, n, thr, seed)?;
    case::<BlockQ4_1>(b, act, d32, n_ff, n, thr, seed)?;
    case::<BlockQ5_0>(b, act, d32, n_ff, n, thr, seed)?;
    let d256 = d.div_ceil(256).max(1) * 256;
    case::<BlockQ4K>(b, act, d256, n_ff, n, thr, seed)?;
    case::<BlockQ6K>(b, act, d256, n_ff, n, thr, seed)?;
    // Tokens through Q8_0 for the gate and up rows.
    case_q8::<BlockQ8_0>(b, act, d32, n_ff, n, thr, seed)?;
    case_q8::<BlockQ4_0>(b, act, d32, n_ff, n, thr, seed)?;
    case_q8::<BlockQ4_1>(b, act, d32, n_ff, n, thr, seed)?;
    case_q8::<BlockQ5_0>(b, act, d32, n_ff, n, thr, seed)?;
    case_q8::<BlockQ4K>(b, act, d256, n_ff, n, thr, seed)?;
    case_q8::<BlockQ6K>(b, act, d256, n_ff, n, thr, seed)?;
    if thr && n == 1 {
        // The threshold form with the gate pass over repacked rows.
        case_q8_gated::<BlockQ8_0>(b, act, d32, n_ff, n, thr, seed)?;
        case_q8_gated::<BlockQ4_0>(b, act, d32, n_ff, n, thr, seed)?;
        case_q8_gated::<BlockQ4_1>(b, act, d32, n_ff, n, thr, seed)?;
        case_q8_gated::<BlockQ5_0>(b, act, d32, n_ff, n, thr, seed)?;
        case_q8_gated::<BlockQ4K>(b, act, d256, n_ff, n, thr, seed)?;
        case_q8_gated::<BlockQ6K>(b, act, d256, n_ff, n, thr, seed)?;
    }
    Ok(())
}

/// (d_model, n_ff, tokens): widths around the 16 lanes and the 32-value
/// chunks, one neuron, many neurons over the thread split.
const EDGE: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (15, 3, 2),
    (16, 17, 1),
    (31, 40, 3),
    (32, 1, 1),
    (33, 64, 2),
    (64, 200, 1),
    (96, 33, 4),
];

/// The suites' bodies, compiled once: each ISA's module (below) runs
/// them with its kind (expanded per ISA, the proptests were most of
/// this binary's build).
mod suite {
    use super::*;
    use hgca_cpu::IsaKind;

    pub fn sparse_ffn_matches_the_reference(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 48, ..ProptestConfig::default() }, |(
            d in 1usize..100,
            n_ff in 1usize..90,
            n in 1usize..4,
            silu in any::<bool>(),
            threshold in any::<bool>(),
            seed in any::<u64>(),
        )| {
            let act = if silu { FfnAct::Silu } else { FfnAct::Relu };
            for par in [Par::Seq, Par::Rayon(3)] {
                if let Some(b) = backend(isa, par) {
                    let r = all_formats(&b, act, d, n_ff, n, threshold, seed);
                    prop_assert!(r.is_ok(), "{par:?}: {}", r.unwrap_err());
                }
            }
        });
    }

    pub fn edge_table(isa: IsaKind) {
        for par in [Par::Seq, Par::Rayon(2)] {
            let Some(b) = backend(isa, par) else { return };
            for (i, &(d, n_ff, n)) in EDGE.iter().enumerate() {
                for act in [FfnAct::Silu, FfnAct::Relu] {
                    for thr in [false, true] {
                        all_formats(&b, act, d, n_ff, n, thr, i as u64).unwrap_or_else(|e| {
                            panic!("d {d} n_ff {n_ff} n {n} {act:?} threshold {thr}: {e}")
                        });
                    }
                }
            }
        }
    }

    /// One token over lists long enough for the sixteen-row walk
    /// (gate and up rows sixteen at a time, scattered, where the
    /// ISA has it; one thread's list and two threads' parts, whole
    /// groups and a partial one after them), and the gated threshold
    /// form (its kept neurons' up rows sixteen at a time), for the
    /// 32-value formats through Q8_0.
    pub fn sixteen_row_walks_match_the_reference(isa: IsaKind) {
        for par in [Par::Seq, Par::Rayon(2)] {
            let Some(b) = backend(isa, par) else { return };
            let shapes = [(32, 60), (64, 107), (96, 250), (160, 400)];
            for (i, &(d, n_ff)) in shapes.iter().enumerate() {
                for act in [FfnAct::Silu, FfnAct::Relu] {
                    let s = 11 + i as u64;
                    let r = case_q8::<BlockQ8_0>(&b, act, d, n_ff, 1, false, s)
                        .and_then(|()| case_q8::<BlockQ4_0>(&b, act, d, n_ff, 1, false, s))
                        .and_then(|()| case_q8::<BlockQ4_1>(&b, act, d, n_ff, 1, false, s))
                        .and_then(|()| case_q8::<BlockQ5_0>(&b, act, d, n_ff, 1, false, s))
                        .and_then(|()| case_q8_gated::<BlockQ8_0>(&b, act, d, n_ff, 1, true, s))
                        .and_then(|()| case_q8_gated::<BlockQ4_0>(&b, act, d, n_ff, 1, true, s))
                        .and_then(|()| case_q8_gated::<BlockQ4_1>(&b, act, d, n_ff, 1, true, s))
                        .and_then(|()| case_q8_gated::<BlockQ5_0>(&b, act, d, n_ff, 1, true, s));
                    r.unwrap_or_else(|e| panic!("{par:?} d {d} n_ff {n_ff} {act:?}: {e}"));
                }
            }
        }
    }

    /// Hot + cold = all neurons, and all neurons is the dense FFN.
    pub fn a_partition_sums_to_the_dense_ffn(isa: IsaKind) {
        let Some(b) = backend(isa, Par::Rayon(2)) else {
            return;
        };
        let (d, n_ff, n) = (64, 150, 3);
        let p = FfnProblem::<f16>::random(d, n_ff, n, 5);
        let w = p.weights().unwrap();
        let mut rng = Rng::new(6);
        let hot = random_subset(&mut rng, n_ff, 0.2);
        let cold: Vec<u32> = (0..n_ff as u32).filter(|i| !hot.contains(i)).collect();
        let all: Vec<u32> = (0..n_ff as u32).collect();
        let run = |l: &[u32]| {
            let mut o = vec![f32::NAN; n * d];
            b.sparse_ffn(FfnAct::Silu, &w, &p.x, n, Neurons::List(l), &mut o)
                .unwrap();
            o
        };
        let (h, c, a) = (run(&hot), run(&cold), run(&all));
        let sum: Vec<f32> = h.iter().zip(&c).map(|(x, y)| x + y).collect();
        let every: Vec<usize> = (0..n_ff).collect();
        p.check(FfnAct::Silu, &vec![every; n], &sum).unwrap();
        p.check(FfnAct::Silu, &vec![(0..n_ff).collect(); n], &a)
            .unwrap();
        // The threshold 0 under ReLU keeps exactly the positive gates.
        let mut o = vec![f32::NAN; n * d];
        b.sparse_ffn(FfnAct::Relu, &w, &p.x, n, Neurons::Threshold(0.0), &mut o)
            .unwrap();
        let sets: Vec<Vec<usize>> = (0..n)
            .map(|t| {
                let a = p.activations(FfnAct::Relu, t);
                (0..n_ff).filter(|&i| a[i] > 0.0).collect()
            })
            .collect();
        p.check(FfnAct::Relu, &sets, &o).unwrap();
    }
}

macro_rules! isa_suite {
    ($name:ident, $kind:expr) => {
        mod $name {
            use hgca_cpu::IsaKind;
            const KIND: IsaKind = $kind;

            #[test]
            fn sparse_ffn_matches_the_reference() {
                super::suite::sparse_ffn_matches_the_reference(KIND)
            }
            #[test]
            fn edge_table() {
                super::suite::edge_table(KIND)
            }
            #[test]
            fn sixteen_row_walks_match_the_reference() {
                super::suite::sixteen_row_walks_match_the_reference(KIND)
            }
            #[test]
            fn a_partition_sums_to_the_dense_ffn() {
                super::suite::a_partition_sums_to_the_dense_ffn(KIND)
            }
        }
    };
}

every_isa!(isa_suite);

#[test]
fn bad_input_is_a_typed_error_and_writes_nothing() {
    let b = CpuBackend::new();
    let p = FfnProblem::<f32>::random(8, 10, 2, 1);
    let w = p.weights().unwrap();
    let mut out = vec![7.0f32; 16];
    let run =
        |nr: Neurons<'_>, x: &[f32], out: &mut [f32]| b.sparse_ffn(FfnAct::Silu, &w, x, 2, nr, out);
    assert!(matches!(
        run(Neurons::List(&[3, 10]), &p.x, &mut out),
        Err(Error::Index {
            what: "neuron",
            index: 10,
            len: 10
        })
    ));
    assert!(matches!(
        run(Neurons::List(&[3, 3]), &p.x, &mut out),
        Err(Error::Param { .. })
    ));
    for t in [f32::NAN, f32::INFINITY, -1.0] {
        assert!(matches!(
            run(Neurons::Threshold(t), &p.x, &mut out),
            Err(Error::Param {
                what: "ffn threshold",
                ..
            })
        ));
    }
    assert!(matches!(
        run(Neurons::List(&[1]), &p.x[..15], &mut out),
        Err(Error::Length { what: "x", .. })
    ));
    assert!(matches!(
        run(Neurons::List(&[1]), &p.x, &mut out[..15]),
        Err(Error::Length { what: "out", .. })
    ));
    assert!(out.iter().all(|&v| v == 7.0), "an error wrote the output");
    // Matrices of the wrong size, and a block format at a width not a multiple of 32.
    let short = &p.gate[..p.gate.len() - 1];
    assert!(matches!(
        hgca_kernels::FfnWeights::new(8, 10, short, &p.up, &p.down_t),
        Err(Error::Length { what: "gate", .. })
    ));
    let q = FfnProblem::<BlockQ8_0>::random(32, 2, 1, 1);
    assert!(matches!(
        hgca_kernels::FfnWeights::new(16, 2, &q.gate[..1], &q.up[..1], &q.down_t[..1]),
        Err(Error::Param { .. })
    ));
    // Interleaved rows of the wrong length, or a block width not whole.
    assert!(matches!(
        FfnWeights::interleaved(8, 10, &vec![0.0f32; 3 * 80 - 1]),
        Err(Error::Length {
            what: "interleaved rows",
            ..
        })
    ));
    assert!(matches!(
        FfnWeights::interleave(10, 8, &p.gate, short, &p.down_t),
        Err(Error::Length { what: "up", .. })
    ));
    assert!(matches!(
        FfnWeights::interleaved(16, 2, &[q.gate[0]; 3]),
        Err(Error::Param { .. })
    ));
    // Paired rows: a gate or pair array of the wrong length, a width not whole.
    assert!(matches!(
        FfnWeights::paired(8, 10, short, &vec![0.0f32; 160]),
        Err(Error::Length { what: "gate", .. })
    ));
    assert!(matches!(
        FfnWeights::paired(8, 10, &p.gate, &vec![0.0f32; 159]),
        Err(Error::Length {
            what: "paired up and down rows",
            ..
        })
    ));
    assert!(matches!(
        FfnWeights::pair(10, 8, &p.up, short),
        Err(Error::Length { what: "down_t", .. })
    ));
    assert!(matches!(
        FfnWeights::paired(16, 2, &q.gate[..1], &[q.gate[0]; 2]),
        Err(Error::Param { .. })
    ));
    // An empty list computes nothing: zeros.
    run(Neurons::List(&[]), &p.x, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 0.0));
    // The gated threshold form: packed gate rows of another shape, a bad
    // threshold, wrong lengths; nothing written.
    let q = FfnProblem::<BlockQ8_0>::random(64, 3, 1, 2);
    let qw = q.weights().unwrap();
    let gate = PackedRows::new(&q.gate, 3, 64).unwrap();
    let fewer = PackedRows::new(&q.gate[..4], 2, 64).unwrap();
    let narrow = PackedRows::new(&q.gate[..3], 3, 32).unwrap();
    let mut o = vec![7.0f32; 64];
    let gated = |g: &PackedRows<BlockQ8_0>, x: &[f32], t: f32, o: &mut [f32]| {
        b.sparse_ffn_q8_gated(FfnAct::Silu, &qw, g, x, t, o)
    };
    for g in [&fewer, &narrow] {
        assert!(matches!(
            gated(g, &q.x, 0.1, &mut o),
            Err(Error::ShapeMismatch {
                what: "packed gate rows",
                ..
            })
        ));
    }
    for t in [f32::NAN, f32::INFINITY, -1.0] {
        assert!(matches!(
            gated(&gate, &q.x, t, &mut o),
            Err(Error::Param {
                what: "ffn threshold",
                ..
            })
        ));
    }
    assert!(matches!(
        gated(&gate, &q.x[..63], 0.1, &mut o),
        Err(Error::Length { what: "x", .. })
    ));
    assert!(matches!(
        gated(&gate, &q.x, 0.1, &mut o[..63]),
        Err(Error::Length { what: "out", .. })
    ));
    assert!(o.iter().all(|&v| v == 7.0), "an error wrote the output");
}
