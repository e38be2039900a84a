//! The hybrid FFN (hot neurons on the dense side, cold on the CPU) against
//! hgca-ref: the CPU standing in for the dense side over the edge table;
//! proptest over shapes, splits and thresholds (the reference sums the hot
//! neurons and the cold ones whose activation passes); every split with
//! threshold 0 is the dense FFN; the planner's hot sets; typed errors.

use hgca_cpu::CpuBackend;
use hgca_hybrid::HybridFfn;
use hgca_hybrid::planner::plan_hot_neurons;
use hgca_kernels::{Error, FfnAct, f16};
use hgca_testkit::Rng;
use hgca_testkit::ffn::{
    DENSE_FFN_EDGE, FfnProblem, check_dense_ffn, check_dense_ffn_errors, gap_threshold,
    random_subset,
};
use proptest::prelude::*;

fn cpu() -> CpuBackend {
    CpuBackend::new()
}

#[test]
fn cpu_dense_side_matches_the_reference_on_the_edge_table() {
    let b = cpu();
    for (k, &(d, n_ff, n)) in DENSE_FFN_EDGE.iter().enumerate() {
        for act in [FfnAct::Silu, FfnAct::Relu] {
            check_dense_ffn(&b, act, d, n_ff, n, 100 + k as u64).unwrap();
        }
    }
    check_dense_ffn_errors(&b).unwrap();
}

/// The cold neurons' threshold: in a gap of their `|act|`, or 0 with
/// fewer than four values.
fn cold_threshold(acts: &[Vec<f64>], cold: &[usize]) -> f64 {
    let vals = acts.iter().flat_map(|a| cold.iter().map(move |&i| a[i]));
    if vals.clone().count() < 4 {
        return 0.0;
    }
    gap_threshold(vals, 0.0)
}

/// Per token, the neurons the reference sums: every hot one, and the cold
/// ones that pass `t` (with threshold 0, every cold neuron: one whose
/// activation is exactly 0 adds nothing either way).
fn reference_sets(acts: &[Vec<f64>], is_hot: &[bool], t: f64) -> Vec<Vec<usize>> {
    acts.iter()
        .map(|a| {
            (0..is_hot.len())
                .filter(|&i| is_hot[i] || t == 0.0 || a[i].abs() > t)
                .collect()
        })
        .collect()
}

/// One hybrid case: returns an error message on a mismatch.
fn hybrid_case(
    act: FfnAct,
    d: usize,
    n_ff: usize,
    n: usize,
    share: f64,
    use_threshold: bool,
    seed: u64,
) -> Result<(), String> {
    let p = FfnProblem::<f16>::random(d, n_ff, n, seed);
    let w = p.weights().map_err(|e| e.to_string())?;
    let mut rng = Rng::new(seed ^ 0x5eed);
    let hot = random_subset(&mut rng, n_ff, share);
    let is_hot: Vec<bool> = (0..n_ff).map(|i| hot.contains(&(i as u32))).collect();
    let cold: Vec<usize> = (0..n_ff).filter(|&i| !is_hot[i]).collect();
    let acts: Vec<Vec<f64>> = (0..n).map(|t| p.activations(act, t)).collect();
    let t = if use_threshold {
        cold_threshold(&acts, &cold)
    } else {
        0.0
    };
    let ffn = HybridFfn::new(cpu(), cpu(), act, &w, &hot, t as f32).map_err(|e| e.to_string())?;
    let mut out = vec![f32::NAN; n * d];
    let st = ffn.forward(&p.x, n, &mut out).map_err(|e| e.to_string())?;
    let sets = reference_sets(&acts, &is_hot, t);
    if st.hot != hot.len() * n {
        return Err(format!("{} hot pairs, want {}", st.hot, hot.len() * n));
    }
    if use_threshold && t > 0.0 {
        let passing: usize = sets.iter().map(Vec::len).sum::<usize>() - hot.len() * n;
        if st.cold.active != passing {
            return Err(format!("{} cold pairs, want {passing}", st.cold.active));
        }
        let rows = n * cold.len() + 2 * passing;
        if st.cold.rows != rows || st.cold_bytes != (rows * d * 2) as u64 {
            return Err(format!(
                "{} cold rows ({} bytes), want {rows}",
                st.cold.rows, st.cold_bytes
            ));
        }
    }
    p.check(act, &sets, &out)
        .map_err(|e| format!("hot {} of {n_ff}, threshold {t}: {e}", hot.len()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn hybrid_is_the_reference_over_hot_and_passing_cold(
        d in 1usize..80,
        n_ff in 1usize..90,
        n in 1usize..4,
        share in 0.0f64..1.0,
        thr in any::<bool>(),
        relu in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let act = if relu { FfnAct::Relu } else { FfnAct::Silu };
        hybrid_case(act, d, n_ff, n, share, thr, seed).map_err(TestCaseError::fail)?;
    }
}

#[test]
fn every_split_with_threshold_zero_is_the_dense_ffn() {
    for (k, &(d, n_ff, n)) in DENSE_FFN_EDGE.iter().enumerate() {
        for share in [0.0, 0.3, 1.0] {
            hybrid_case(FfnAct::Silu, d, n_ff, n, share, false, 7 + k as u64).unwrap();
        }
        hybrid_case(FfnAct::Relu, d, n_ff, n, 0.5, true, 11 + k as u64).unwrap();
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let p = FfnProblem::<f16>::random(16, 8, 2, 3);
    let w = p.weights().unwrap();
    let new = |hot: &[u32], t: f32| HybridFfn::new(cpu(), cpu(), FfnAct::Silu, &w, hot, t);
    assert!(matches!(new(&[8], 0.0), Err(Error::Index { .. })));
    assert!(matches!(new(&[1, 1], 0.0), Err(Error::Param { .. })));
    for t in [f32::NAN, -1.0, f32::INFINITY] {
        assert!(matches!(new(&[1], t), Err(Error::Param { .. })), "{t}");
    }
    let mut ffn = new(&[1, 5], 0.1).unwrap();
    assert!(matches!(
        ffn.set_threshold(f32::NAN),
        Err(Error::Param { .. })
    ));
    assert_eq!(ffn.threshold(), 0.1);
    ffn.set_threshold(0.0).unwrap();
    assert_eq!(ffn.split().cold(), &[0, 2, 3, 4, 6, 7]);
    let mut out = vec![0.0f32; 32];
    assert!(matches!(
        ffn.forward(&p.x[..31], 2, &mut out),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        ffn.forward(&p.x, 2, &mut out[..16]),
        Err(Error::Length { .. })
    ));
    ffn.forward(&p.x, 2, &mut out).unwrap();
}

#[test]
fn planner_takes_the_most_frequent_neurons_that_fit() {
    let mut rng = Rng::new(9);
    let freq: Vec<Vec<f32>> = (0..5)
        .map(|_| {
            (0..40)
                .map(|_| (rng.next_u64() % 1000) as f32 / 1000.0)
                .collect()
        })
        .collect();
    for budget in [0u64, 99, 100, 1234, 20_000, 1 << 40] {
        let hot = plan_hot_neurons(&freq, 100, budget).unwrap();
        let taken: usize = hot.iter().map(Vec::len).sum();
        assert_eq!(taken, ((budget / 100) as usize).min(200), "budget {budget}");
        // Nothing left out is more frequent than anything taken.
        let mut min_in = f32::INFINITY;
        let mut max_out = f32::NEG_INFINITY;
        for (l, f) in freq.iter().enumerate() {
            assert!(hot[l].windows(2).all(|w| w[0] < w[1]), "ascending");
            for (i, &v) in f.iter().enumerate() {
                if hot[l].contains(&(i as u32)) {
                    min_in = min_in.min(v);
                } else {
                    max_out = max_out.max(v);
                }
            }
        }
        assert!(min_in >= max_out, "budget {budget}: {min_in} < {max_out}");
    }
    assert!(matches!(
        plan_hot_neurons(&freq, 0, 10),
        Err(Error::Zero { .. })
    ));
    let bad = vec![vec![0.5, f32::NAN]];
    assert!(matches!(
        plan_hot_neurons(&bad, 1, 10),
        Err(Error::Param { .. })
    ));
}

/// Cold rows in a GGUF block format (Q8_0) stay in it on the CPU; hot rows
/// go to the dense side as f16. With power-of-two block scales every
/// dequantised value is exact in f16, so both sides see the same weights
/// and the sum is the reference's, with and without a threshold.
#[test]
fn block_format_cold_side() {
    use hgca_kernels::BlockQ8_0;
    for (seed, (d, n_ff, n)) in [(64usize, 40usize, 1usize), (96, 75, 3), (32, 1, 2)]
        .into_iter()
        .enumerate()
    {
        let mut p = FfnProblem::<BlockQ8_0>::random(d, n_ff, n, 50 + seed as u64);
        for b in p.gate.iter_mut().chain(&mut p.up).chain(&mut p.down_t) {
            let e = b.d.to_f32().log2().round();
            b.d = f16::from_f32(e.exp2());
        }
        let w = p.weights().unwrap();
        let mut rng = Rng::new(seed as u64);
        let hot = random_subset(&mut rng, n_ff, 0.4);
        let is_hot: Vec<bool> = (0..n_ff).map(|i| hot.contains(&(i as u32))).collect();
        let cold: Vec<usize> = (0..n_ff).filter(|&i| !is_hot[i]).collect();
        let acts: Vec<Vec<f64>> = (0..n).map(|t| p.activations(FfnAct::Silu, t)).collect();
        for t in [0.0, cold_threshold(&acts, &cold)] {
            let ffn = HybridFfn::new(cpu(), cpu(), FfnAct::Silu, &w, &hot, t as f32).unwrap();
            let mut out = vec![f32::NAN; n * d];
            let st = ffn.forward(&p.x, n, &mut out).unwrap();
            let sets = reference_sets(&acts, &is_hot, t);
            p.check(FfnAct::Silu, &sets, &out).unwrap();
            // Bytes counted in the block format: 34 bytes per 32 weights.
            assert_eq!(st.cold_bytes, (st.cold.rows * d / 32 * 34) as u64);
        }
    }
}

/// `with_q8_acts`: the cold side's gate and up rows see the tokens through
/// Q8_0 (every neuron cold here, so the reference takes those tokens), one
/// token (the integer dot products) and a chunk.
#[test]
fn q8_acts_cold_side() {
    use hgca_kernels::{BlockQ4_0, BlockQ8_0, WeightElem};
    for (seed, (d, n_ff, n)) in [(64usize, 40usize, 1usize), (96, 75, 3), (32, 1, 1)]
        .into_iter()
        .enumerate()
    {
        let mut p = FfnProblem::<BlockQ4_0>::random(d, n_ff, n, 70 + seed as u64);
        let w = p.weights().unwrap();
        let ffn = HybridFfn::new(cpu(), cpu(), FfnAct::Silu, &w, &[], 0.0)
            .unwrap()
            .with_q8_acts();
        let mut out = vec![f32::NAN; n * d];
        ffn.forward(&p.x, n, &mut out).unwrap();
        drop((w, ffn));
        p.x =
            p.x.chunks_exact(32)
                .flat_map(|c| {
                    let mut o = [0.0f32; 32];
                    BlockQ8_0::quantize(c.try_into().unwrap()).dequant(&mut o);
                    o
                })
                .collect();
        let all: Vec<usize> = (0..n_ff).collect();
        p.check(FfnAct::Silu, &vec![all; n], &out).unwrap();
    }
}

/// A gate predictor on the cold side: each token computes the hot neurons
/// and exactly the cold ones its predictor lists (their rows only), at any
/// rank; the counts say so; a predictor of another layer is refused.
#[test]
fn predictor_cold_side_is_the_reference_over_its_lists() {
    for (k, &(d, n_ff, n, rank)) in [
        (16usize, 40usize, 3usize, 4usize),
        (33, 70, 2, 33),
        (8, 5, 1, 1),
    ]
    .iter()
    .enumerate()
    {
        for act in [FfnAct::Silu, FfnAct::Relu] {
            let seed = 70 + k as u64;
            let p = FfnProblem::<f16>::random(d, n_ff, n, seed);
            let w = p.weights().unwrap();
            let mut rng = Rng::new(seed);
            let hot = random_subset(&mut rng, n_ff, 0.3);
            let is_hot: Vec<bool> = (0..n_ff).map(|i| hot.contains(&(i as u32))).collect();
            let cold: Vec<usize> = (0..n_ff).filter(|&i| !is_hot[i]).collect();
            let acts: Vec<Vec<f64>> = (0..n).map(|t| p.activations(act, t)).collect();
            let t = cold_threshold(&acts, &cold).max(0.05) as f32;
            let mut ffn = HybridFfn::new(cpu(), cpu(), act, &w, &hot, t).unwrap();
            // Calibration inputs: the problem's tokens and more like them.
            let tokens = 50;
            let mut xs = p.x.clone();
            xs.extend((0..(tokens - n) * d).map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0));
            let pred = ffn.fit_predictor(&xs, tokens, rank, 1.0).unwrap();
            let bytes = pred.bytes();
            ffn.set_predictor(Some(pred)).unwrap();
            let mut out = vec![f32::NAN; n * d];
            let st = ffn.forward(&p.x, n, &mut out).unwrap();
            let mut sets = Vec::new();
            let mut listed = 0;
            let mut list = Vec::new();
            for tk in 0..n {
                let x = &p.x[tk * d..(tk + 1) * d];
                ffn.predictor()
                    .unwrap()
                    .select(x, act, t, &mut list)
                    .unwrap();
                listed += list.len();
                let mut set: Vec<usize> = hot.iter().map(|&i| i as usize).collect();
                set.extend(list.iter().map(|&j| cold[j as usize]));
                set.sort_unstable();
                sets.push(set);
            }
            assert_eq!(st.cold.active, listed, "{act:?} case {k}");
            assert_eq!(st.cold.rows, 3 * listed, "{act:?} case {k}");
            assert_eq!(st.predictor_bytes, (bytes * n) as u64);
            p.check(act, &sets, &out)
                .unwrap_or_else(|e| panic!("{act:?} case {k}, rank {rank}: {e}"));
            // Back to the threshold form: every cold gate row is read again.
            ffn.set_predictor(None).unwrap();
            let st = ffn.forward(&p.x, n, &mut out).unwrap();
            assert!(st.cold.rows >= n * cold.len());
            assert_eq!(st.predictor_bytes, 0);
        }
    }
    // A predictor fitted on another layer's cold side.
    let p = FfnProblem::<f16>::random(16, 8, 1, 5);
    let w = p.weights().unwrap();
    let mut a = HybridFfn::new(cpu(), cpu(), FfnAct::Silu, &w, &[1], 0.1).unwrap();
    let b = HybridFfn::new(cpu(), cpu(), FfnAct::Silu, &w, &[1, 2], 0.1).unwrap();
    let other = b.fit_predictor(&p.x, 1, 2, 1.0).unwrap();
    assert!(matches!(
        a.set_predictor(Some(other)),
        Err(Error::Param { .. })
    ));
}
