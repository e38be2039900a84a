//! A low-rank predictor of the FFN's active neurons (PowerInfer's online
//! predictor, here fitted without training): the gate pre-activations
//! `g = W_gate x` are estimated as `ĝ = A (B x)`, where the `rank` rows of
//! `B` are the principal directions of the layer's inputs on a calibration
//! text (the top eigenvectors of their second-moment matrix) and
//! `A = W_gate Bᵀ`. A neuron is predicted active when `|act(g)| > t` can
//! hold anywhere within `z` of its calibration residual's standard
//! deviation `σ_i` around `ĝ_i`. The CPU then reads the gate, up and down
//! rows of the predicted neurons only, and computes them exactly; what the
//! prediction misses is lost (a false negative), what it adds is computed
//! (a false positive costs bytes, not accuracy).
//!
//! Per token it reads `rank (d + n)` f32 values instead of the `n` gate
//! rows the threshold form (CATS) reads to decide.
//!
//! ```
//! use hgca_hybrid::GatePredictor;
//! use hgca_kernels::{FfnAct, FfnWeights};
//! let (d, n) = (4, 3);
//! // Gate rows that only see the first two input dimensions.
//! let gate = [1.0f32, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0];
//! let w = FfnWeights::new(d, n, &gate, &gate, &gate)?;
//! // Calibration inputs in the same two dimensions: rank 2 is exact.
//! let xs = [1.0f32, 0.5, 0.0, 0.0, -0.3, 1.0, 0.0, 0.0, 0.7, 0.2, 0.0, 0.0];
//! let p = GatePredictor::fit(&w, &xs, 3, 2, 1.0)?;
//! let mut list = Vec::new();
//! p.select(&[2.0, 0.0, 0.0, 0.0], FfnAct::Silu, 0.5, &mut list)?;
//! assert_eq!(list, vec![0, 2]); // g = (2, 0, 2)
//! # Ok::<(), hgca_kernels::Error>(())
//! ```

use hgca_kernels::{Error, FfnAct, FfnWeights, Result, WeightElem, check_len_of};

/// Subspace iterations of the fit (the eigenvectors converge geometrically
/// in the eigenvalue gaps; more changed the selections of the tests' and
/// models' layers by nothing measurable).
const ITERATIONS: usize = 24;
/// Extra directions iterated beside the `rank` kept (they speed up the
/// convergence of the last kept ones).
const OVERSAMPLE: usize = 8;
/// Calibration tokens the residuals' deviations are measured on (spread
/// over the text).
const SIGMA_TOKENS: usize = 256;
/// Where `|silu|` is largest on the negative side: `g = -1.27846`,
/// `|silu(g)| = 0.278465`.
const SILU_MIN_AT: f32 = -1.278_464_5;

/// A layer's low-rank gate predictor: `ĝ = A (B x)`, `B` the principal
/// directions of calibration inputs, `A = W_gate Bᵀ`, and a margin of `z`
/// residual deviations per neuron.
#[derive(Debug, Clone)]
pub struct GatePredictor {
    d: usize,
    n: usize,
    rank: usize,
    z: f32,
    /// `[rank, d]`: the inputs' principal directions.
    basis: Vec<f32>,
    /// `[n, rank]`: each neuron's gate row in those directions.
    coef: Vec<f32>,
    /// `[n]`: each neuron's residual deviation on the calibration text.
    sigma: Vec<f32>,
}

impl GatePredictor {
    /// Fits a predictor of `w`'s gate from `tokens` calibration inputs `xs`
    /// (`[tokens, d_model]`: the FFN's inputs, after its norm), keeping
    /// `rank` directions and a margin of `z` deviations.
    ///
    /// # Errors
    /// [`Error::Param`] for a rank outside `1..=d_model`, no tokens, or a
    /// `z` that is not finite and `>= 0`; [`Error::Length`] for `xs`.
    pub fn fit<W: WeightElem>(
        w: &FfnWeights<'_, W>,
        xs: &[f32],
        tokens: usize,
        rank: usize,
        z: f32,
    ) -> Result<Self> {
        let (d, n) = (w.d_model, w.n_ff);
        if rank == 0 || rank > d {
            return Err(Error::Param {
                what: "predictor rank",
                value: rank as f64,
                expected: "1 to d_model",
            });
        }
        if tokens == 0 {
            return Err(Error::Param {
                what: "calibration tokens",
                value: 0.0,
                expected: "at least 1",
            });
        }
        check_z(z)?;
        check_len_of("xs", &[tokens, d], xs.len())?;
        if xs.iter().any(|v| !v.is_finite()) {
            return Err(Error::Param {
                what: "calibration inputs",
                value: f64::NAN,
                expected: "finite values",
            });
        }
        let basis = principal_directions(xs, tokens, d, rank);
        // The gate rows, dequantised one at a time.
        let mut row = vec![0.0f32; d];
        let mut coef = vec![0.0f32; n * rank];
        let mut gate = vec![0.0f32; n * d];
        for i in 0..n {
            W::dequant_slice(w.rows(i)[0], &mut row);
            gate[i * d..(i + 1) * d].copy_from_slice(&row);
            for (j, b) in basis.chunks_exact(d).enumerate() {
                coef[i * rank + j] = dot(&row, b);
            }
        }
        let mut p = Self {
            d,
            n,
            rank,
            z,
            basis,
            coef,
            sigma: vec![0.0; n],
        };
        // Residual deviations on tokens spread over the text.
        let step = tokens.div_ceil(SIGMA_TOKENS).max(1);
        let mut sum2 = vec![0.0f64; n];
        let mut ghat = vec![0.0f32; n];
        let mut used = 0usize;
        for x in xs.chunks_exact(d).step_by(step) {
            p.estimate(x, &mut ghat);
            for ((s, g), gh) in sum2.iter_mut().zip(gate.chunks_exact(d)).zip(&ghat) {
                let e = f64::from(dot(g, x) - gh);
                *s += e * e;
            }
            used += 1;
        }
        for (s, q) in p.sigma.iter_mut().zip(&sum2) {
            *s = (q / used as f64).sqrt() as f32;
        }
        Ok(p)
    }

    /// Model width.
    pub fn d_model(&self) -> usize {
        self.d
    }

    /// Neurons predicted.
    pub fn n_ff(&self) -> usize {
        self.n
    }

    /// Directions kept.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The margin, in residual deviations.
    pub fn z(&self) -> f32 {
        self.z
    }

    /// Sets the margin.
    ///
    /// # Errors
    /// [`Error::Param`] unless finite and `>= 0`.
    pub fn set_z(&mut self, z: f32) -> Result<()> {
        check_z(z)?;
        self.z = z;
        Ok(())
    }

    /// Bytes a prediction reads (the basis and the coefficients, f32).
    pub fn bytes(&self) -> usize {
        (self.basis.len() + self.coef.len()) * size_of::<f32>()
    }

    /// `B x`: the token in the kept directions (`[rank]`).
    fn project(&self, x: &[f32]) -> Vec<f32> {
        self.basis.chunks_exact(self.d).map(|b| dot(b, x)).collect()
    }

    /// `ĝ` of one token `x` into `out` (`[n_ff]`). Lengths are the
    /// caller's to check.
    fn estimate(&self, x: &[f32], out: &mut [f32]) {
        let proj = self.project(x);
        for (o, c) in out.iter_mut().zip(self.coef.chunks_exact(self.rank)) {
            *o = dot(c, &proj);
        }
    }

    /// The estimated gate pre-activations `ĝ` of one token `x`
    /// (`[d_model]`) into `out` (`[n_ff]`).
    ///
    /// # Errors
    /// [`Error::Length`] for `x` or `out`.
    pub fn predict(&self, x: &[f32], out: &mut [f32]) -> Result<()> {
        check_len_of("x", &[self.d], x.len())?;
        check_len_of("out", &[self.n], out.len())?;
        self.estimate(x, out);
        Ok(())
    }

    /// Replaces `list` with the neurons predicted to pass `|act(g)| > t`
    /// for the token `x` (ascending).
    ///
    /// # Errors
    /// [`Error::Length`] for `x`; [`Error::Param`] for a threshold that is
    /// not finite and `>= 0`.
    pub fn select(&self, x: &[f32], act: FfnAct, t: f32, list: &mut Vec<u32>) -> Result<()> {
        check_len_of("x", &[self.d], x.len())?;
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::Param {
                what: "threshold",
                value: f64::from(t),
                expected: "finite and >= 0",
            });
        }
        // Each neuron's estimate tested as it is made (no [n_ff] buffer per
        // token).
        let proj = self.project(x);
        list.clear();
        for (i, (c, &s)) in self
            .coef
            .chunks_exact(self.rank)
            .zip(&self.sigma)
            .enumerate()
        {
            let gh = dot(c, &proj);
            let m = self.z * s;
            if max_abs_act(act, gh - m, gh + m) > t {
                list.push(i as u32);
            }
        }
        Ok(())
    }
}

fn check_z(z: f32) -> Result<()> {
    if z.is_finite() && z >= 0.0 {
        Ok(())
    } else {
        Err(Error::Param {
            what: "predictor margin z",
            value: f64::from(z),
            expected: "finite and >= 0",
        })
    }
}

/// The largest `|act(g)|` over `g` in `[lo, hi]`.
fn max_abs_act(act: FfnAct, lo: f32, hi: f32) -> f32 {
    match act {
        // 0 at 0, increasing from there: the largest at hi.
        FfnAct::Relu => hi.max(0.0),
        // Decreasing to its minimum at SILU_MIN_AT, then increasing: the
        // ends, or the minimum's depth when the interval holds it.
        FfnAct::Silu => {
            let ends = act.apply(lo).abs().max(act.apply(hi).abs());
            if lo <= SILU_MIN_AT && SILU_MIN_AT <= hi {
                ends.max(act.apply(SILU_MIN_AT).abs())
            } else {
                ends
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight lanes of partial sums: the compiler vectorises this.
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The top `rank` eigenvectors of `Σ x xᵀ` over the rows of `xs`, as
/// `[rank, d]` rows (descending eigenvalue): subspace iteration in f64 with
/// a Rayleigh-Ritz step (Jacobi on the small projected matrix).
fn principal_directions(xs: &[f32], tokens: usize, d: usize, rank: usize) -> Vec<f32> {
    // The second-moment matrix.
    let mut c = vec![0.0f64; d * d];
    for x in xs.chunks_exact(d).take(tokens) {
        for i in 0..d {
            let xi = f64::from(x[i]);
            let row = &mut c[i * d..(i + 1) * d];
            for (cj, &xj) in row[i..].iter_mut().zip(&x[i..]) {
                *cj += xi * f64::from(xj);
            }
        }
    }
    for i in 0..d {
        for j in 0..i {
            c[i * d + j] = c[j * d + i];
        }
    }
    let k = (rank + OVERSAMPLE).min(d);
    // Columns stored as rows: v[j] is the j-th vector. A fixed start
    // (splitmix64), so a fit is reproducible.
    let mut state = 0x853c_49e6_748f_ea9bu64;
    let mut v: Vec<Vec<f64>> = (0..k)
        .map(|_| {
            (0..d)
                .map(|_| {
                    state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    z ^= z >> 31;
                    (z >> 11) as f64 / (1u64 << 53) as f64 - 0.5
                })
                .collect()
        })
        .collect();
    orthonormalise(&mut v);
    let times = |c: &[f64], u: &[f64]| -> Vec<f64> {
        c.chunks_exact(d)
            .map(|r| r.iter().zip(u).map(|(a, b)| a * b).sum())
            .collect()
    };
    for _ in 0..ITERATIONS {
        v = v.iter().map(|u| times(&c, u)).collect();
        orthonormalise(&mut v);
    }
    // Rayleigh-Ritz: T = Vᵀ C V, its eigenvectors rotate V.
    let cv: Vec<Vec<f64>> = v.iter().map(|u| times(&c, u)).collect();
    let mut t = vec![0.0f64; k * k];
    for a in 0..k {
        for b in 0..k {
            t[a * k + b] = v[a].iter().zip(&cv[b]).map(|(x, y)| x * y).sum();
        }
    }
    let (vals, vecs) = jacobi_eigen(&mut t, k);
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&a, &b| vals[b].total_cmp(&vals[a]));
    let mut out = Vec::with_capacity(rank * d);
    for &e in order.iter().take(rank) {
        let mut u = vec![0.0f64; d];
        for (a, va) in v.iter().enumerate() {
            let q = vecs[a * k + e];
            u.iter_mut().zip(va).for_each(|(x, y)| *x += q * y);
        }
        out.extend(u.iter().map(|&x| x as f32));
    }
    out
}

/// Modified Gram-Schmidt on the vectors `v`, each projected out twice
/// (once leaves rounding's share of the earlier vectors in one that
/// mostly cancels). A vector that (nearly) vanishes becomes zero: the
/// inputs span fewer dimensions than asked for.
fn orthonormalise(v: &mut [Vec<f64>]) {
    for j in 0..v.len() {
        let (done, rest) = v.split_at_mut(j);
        let u = &mut rest[0];
        let norm0 = u.iter().map(|x| x * x).sum::<f64>().sqrt();
        for _pass in 0..2 {
            for p in done.iter() {
                let r: f64 = p.iter().zip(u.iter()).map(|(a, b)| a * b).sum();
                for (x, y) in u.iter_mut().zip(p) {
                    *x -= r * y;
                }
            }
        }
        let norm = u.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm > 1e-9 * norm0 && norm > 1e-300 {
            u.iter_mut().for_each(|x| *x /= norm);
        } else {
            u.iter_mut().for_each(|x| *x = 0.0);
        }
    }
}

/// Eigenvalues and eigenvectors (columns of the returned `[k, k]`) of the
/// symmetric `a` (`[k, k]`, overwritten): cyclic Jacobi rotations.
fn jacobi_eigen(a: &mut [f64], k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut q = vec![0.0f64; k * k];
    for i in 0..k {
        q[i * k + i] = 1.0;
    }
    for _sweep in 0..100 {
        let off: f64 = (0..k)
            .flat_map(|i| (0..k).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * k + j] * a[i * k + j])
            .sum();
        let diag: f64 = (0..k).map(|i| a[i * k + i] * a[i * k + i]).sum();
        if off <= 1e-30 * diag.max(1e-300) {
            break;
        }
        for p in 0..k {
            for r in p + 1..k {
                let apr = a[p * k + r];
                if apr == 0.0 {
                    continue;
                }
                let theta = (a[r * k + r] - a[p * k + p]) / (2.0 * apr);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for i in 0..k {
                    let (aip, air) = (a[i * k + p], a[i * k + r]);
                    a[i * k + p] = c * aip - s * air;
                    a[i * k + r] = s * aip + c * air;
                }
                for i in 0..k {
                    let (api, ari) = (a[p * k + i], a[r * k + i]);
                    a[p * k + i] = c * api - s * ari;
                    a[r * k + i] = s * api + c * ari;
                }
                for i in 0..k {
                    let (qip, qir) = (q[i * k + p], q[i * k + r]);
                    q[i * k + p] = c * qip - s * qir;
                    q[i * k + r] = s * qip + c * qir;
                }
            }
        }
    }
    ((0..k).map(|i| a[i * k + i]).collect(), q)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    #[test]
    fn directions_are_the_covariance_eigenvectors() {
        // Inputs along three scaled axes of a rotated frame: the
        // directions come out in order of scale, orthonormal.
        let d = 6;
        let axes = [
            [1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 1.0, 0.0, 0.0, 1.0],
            [1.0, -1.0, 0.0, 1.0, 0.0, 0.0],
        ];
        let scale = [5.0f32, 2.0, 0.5];
        // One axis per token, signs alternating: the second moments are
        // exactly diagonal in the axes' frame.
        let mut xs = Vec::new();
        for t in 0..200 {
            let (a, s) = (axes[t % 3], scale[t % 3]);
            let c = if t % 2 == 0 { s } else { -s };
            let n = (a.iter().map(|v: &f32| v * v).sum::<f32>()).sqrt();
            xs.extend(a.iter().map(|ai| c * ai / n));
        }
        let b = principal_directions(&xs, 200, d, 3);
        for (j, a) in axes.iter().enumerate() {
            let n = (a.iter().map(|v: &f32| v * v).sum::<f32>()).sqrt();
            let cos = dot(&b[j * d..(j + 1) * d], a) / n;
            assert!((cos.abs() - 1.0).abs() < 1e-4, "direction {j}: cos {cos}");
        }
        assert!(dot(&b[..d], &b[d..2 * d]).abs() < 1e-5);
    }

    #[test]
    fn full_rank_predicts_exactly_and_selects_the_threshold_set() {
        let (d, n, tokens) = (16, 40, 64);
        let mut r = rng(7);
        let gate: Vec<f32> = (0..n * d).map(|_| r()).collect();
        let xs: Vec<f32> = (0..tokens * d).map(|_| 2.0 * r()).collect();
        let w = FfnWeights::new(d, n, &gate, &gate, &gate).unwrap();
        let p = GatePredictor::fit(&w, &xs, tokens, d, 0.0).unwrap();
        assert!(p.sigma.iter().all(|&s| s < 1e-4), "{:?}", p.sigma);
        let x: Vec<f32> = (0..d).map(|_| r()).collect();
        let mut g = vec![0.0; n];
        p.predict(&x, &mut g).unwrap();
        let mut list = Vec::new();
        for act in [FfnAct::Silu, FfnAct::Relu] {
            for t in [0.0f32, 0.1, 0.3, 1.0] {
                p.select(&x, act, t, &mut list).unwrap();
                let want: Vec<u32> = (0..n as u32)
                    .filter(|&i| {
                        let gi = dot(&gate[i as usize * d..(i as usize + 1) * d], &x);
                        act.apply(gi).abs() > t
                    })
                    .collect();
                // Exact up to rounding at the threshold's edge.
                let diff = list.iter().filter(|i| !want.contains(i)).count()
                    + want.iter().filter(|i| !list.contains(i)).count();
                assert!(diff <= 1, "{act:?} t {t}: {list:?} vs {want:?}");
            }
        }
        for (i, gi) in g.iter().enumerate() {
            let exact = dot(&gate[i * d..(i + 1) * d], &x);
            assert!(
                (gi - exact).abs() < 1e-4 * (1.0 + exact.abs()),
                "{i}: {gi} vs {exact}"
            );
        }
    }

    #[test]
    fn a_margin_only_adds_neurons() {
        let (d, n, tokens) = (32, 100, 80);
        let mut r = rng(3);
        let gate: Vec<f32> = (0..n * d).map(|_| r()).collect();
        let xs: Vec<f32> = (0..tokens * d).map(|_| r()).collect();
        let w = FfnWeights::new(d, n, &gate, &gate, &gate).unwrap();
        let mut p = GatePredictor::fit(&w, &xs, tokens, 4, 0.0).unwrap();
        assert!(p.sigma.iter().all(|&s| s > 0.0));
        let x = &xs[..d];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        p.select(x, FfnAct::Silu, 0.3, &mut a).unwrap();
        p.set_z(3.0).unwrap();
        p.select(x, FfnAct::Silu, 0.3, &mut b).unwrap();
        assert!(a.iter().all(|i| b.contains(i)) && b.len() > a.len());
        // A margin wide enough for everything at threshold 0.
        p.select(x, FfnAct::Silu, 0.0, &mut b).unwrap();
        assert_eq!(b.len(), n);
    }

    #[test]
    fn silu_interval_maximum() {
        assert!((max_abs_act(FfnAct::Silu, -3.0, 0.0) - 0.278_464_5).abs() < 1e-6);
        assert_eq!(
            max_abs_act(FfnAct::Silu, -0.5, 2.0),
            FfnAct::Silu.apply(2.0)
        );
        assert_eq!(max_abs_act(FfnAct::Relu, -2.0, -1.0), 0.0);
        assert_eq!(max_abs_act(FfnAct::Relu, -2.0, 1.5), 1.5);
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let gate = vec![0.5f32; 8 * 3];
        let w = FfnWeights::new(8, 3, &gate, &gate, &gate).unwrap();
        let xs = vec![1.0f32; 16];
        assert!(matches!(
            GatePredictor::fit(&w, &xs, 2, 0, 1.0),
            Err(Error::Param { .. })
        ));
        assert!(matches!(
            GatePredictor::fit(&w, &xs, 2, 9, 1.0),
            Err(Error::Param { .. })
        ));
        assert!(matches!(
            GatePredictor::fit(&w, &xs, 0, 2, 1.0),
            Err(Error::Param { .. })
        ));
        assert!(matches!(
            GatePredictor::fit(&w, &xs, 3, 2, 1.0),
            Err(Error::Length { .. })
        ));
        assert!(matches!(
            GatePredictor::fit(&w, &xs, 2, 2, f32::NAN),
            Err(Error::Param { .. })
        ));
        let mut bad = xs.clone();
        bad[3] = f32::INFINITY;
        assert!(matches!(
            GatePredictor::fit(&w, &bad, 2, 2, 1.0),
            Err(Error::Param { .. })
        ));
        let p = GatePredictor::fit(&w, &xs, 2, 2, 1.0).unwrap();
        let mut l = Vec::new();
        assert!(matches!(
            p.select(&xs[..7], FfnAct::Silu, 0.1, &mut l),
            Err(Error::Length { .. })
        ));
        assert!(matches!(
            p.select(&xs[..8], FfnAct::Silu, -1.0, &mut l),
            Err(Error::Param { .. })
        ));
        assert!(matches!(
            p.predict(&xs[..8], &mut [0.0; 2]),
            Err(Error::Length { .. })
        ));
    }
}
