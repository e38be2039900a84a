//! Sparse FFN problems and their check against `hgca-ref` (f64), for any
//! backend's kernel: random weights in any row format, tokens, and the
//! comparison of an output with the reference over the same active sets.

use hgca_kernels::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, DenseFfnBackend, FfnAct,
    FfnWeights, Result, WeightElem, bf16, f16,
};

use crate::{Rng, within};

/// The tolerance of the FFN kernels, for every weight format (the
/// reference reads the same dequantised values, so only the f32
/// accumulation differs): `abs + rel * mag`, `mag` the reference's
/// magnitude bound ([`hgca_ref::ffn_row`]).
pub const FFN_TOLERANCE: (f64, f64) = (1e-6, 2e-6);

/// A weight format the tests can write from f32 rows.
pub trait TestWeight: WeightElem {
    /// One row of `x.len()` values (a multiple of `VALUES`).
    fn from_row(x: &[f32]) -> Vec<Self>;
}

impl TestWeight for f32 {
    fn from_row(x: &[f32]) -> Vec<Self> {
        x.to_vec()
    }
}

impl TestWeight for f16 {
    fn from_row(x: &[f32]) -> Vec<Self> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }
}

impl TestWeight for bf16 {
    fn from_row(x: &[f32]) -> Vec<Self> {
        x.iter().map(|&v| bf16::from_f32(v)).collect()
    }
}

/// `TestWeight` for GGUF block types: rows cut into blocks of `$n` values,
/// each quantised by the type's own `quantize`.
macro_rules! block_test_weight {
    ($($t:ty: $n:literal),* $(,)?) => {$(
        impl TestWeight for $t {
            fn from_row(x: &[f32]) -> Vec<Self> {
                x.chunks_exact($n)
                    .map(|c| <$t>::quantize(c.try_into().expect("a whole block")))
                    .collect()
            }
        }
    )*};
}

block_test_weight!(
    BlockQ8_0: 32,
    BlockQ4_0: 32,
    BlockQ4_1: 32,
    BlockQ5_0: 32,
    BlockQ4K: 256,
    BlockQ6K: 256,
);

/// Dequantises a matrix of rows.
pub fn dequant<W: WeightElem>(m: &[W]) -> Vec<f32> {
    let mut out = vec![0.0; m.len() * W::VALUES];
    for (e, o) in m.iter().zip(out.chunks_exact_mut(W::VALUES)) {
        e.dequant(o);
    }
    out
}

/// A random gated FFN and `n` tokens.
#[derive(Debug, Clone)]
pub struct FfnProblem<W> {
    /// Model width.
    pub d: usize,
    /// Neurons.
    pub n_ff: usize,
    /// `W_gate`, `W_up`, `W_downᵀ` (`[n_ff, d]` each).
    pub gate: Vec<W>,
    /// See `gate`.
    pub up: Vec<W>,
    /// See `gate`.
    pub down_t: Vec<W>,
    /// Tokens.
    pub n: usize,
    /// `[n, d]`.
    pub x: Vec<f32>,
}

impl<W: TestWeight> FfnProblem<W> {
    /// Weights uniform in `[-1, 1]`, tokens in `[-2, 2]`.
    pub fn random(d: usize, n_ff: usize, n: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut m = || {
            let v: Vec<f32> = (0..n_ff * d).map(|_| rng.sym()).collect();
            v.chunks(d.max(1)).flat_map(W::from_row).collect::<Vec<W>>()
        };
        let (gate, up, down_t) = (m(), m(), m());
        let x = (0..n * d).map(|_| 2.0 * rng.sym()).collect();
        Self {
            d,
            n_ff,
            gate,
            up,
            down_t,
            n,
            x,
        }
    }

    /// The weights, checked.
    ///
    /// # Errors
    /// As [`FfnWeights::new`].
    pub fn weights(&self) -> Result<FfnWeights<'_, W>> {
        FfnWeights::new(self.d, self.n_ff, &self.gate, &self.up, &self.down_t)
    }

    /// The activations `act(g_i)` of token `t` in f64 (to choose sets).
    pub fn activations(&self, act: FfnAct, t: usize) -> Vec<f64> {
        let g = dequant(&self.gate);
        let x = &self.x[t * self.d..(t + 1) * self.d];
        (0..self.n_ff)
            .map(|i| act.apply_f64(hgca_ref::dot(&g[i * self.d..(i + 1) * self.d], x)))
            .collect()
    }

    /// Compares `got` (`[n, d]`) with the reference over `sets[t]` per token.
    ///
    /// # Errors
    /// A message naming the first element out of tolerance.
    pub fn check(
        &self,
        act: FfnAct,
        sets: &[Vec<usize>],
        got: &[f32],
    ) -> std::result::Result<(), String> {
        let (g, u, dt) = (
            dequant(&self.gate),
            dequant(&self.up),
            dequant(&self.down_t),
        );
        let d = self.d;
        if got.len() != self.n * d {
            return Err(format!(
                "output of {} values, want {}",
                got.len(),
                self.n * d
            ));
        }
        for t in 0..self.n {
            let x = &self.x[t * d..(t + 1) * d];
            let (want, mag) = hgca_ref::ffn_row(|v| act.apply_f64(v), d, &g, &u, &dt, x, &sets[t]);
            for j in 0..d {
                let err = (f64::from(got[t * d + j]) - want[j]).abs();
                let bound = FFN_TOLERANCE.0 + FFN_TOLERANCE.1 * mag[j];
                if !within(err, bound) {
                    return Err(format!(
                        "{} token {t} [{j}]: {} vs {} (bound {bound:e}, {} neurons)",
                        W::NAME,
                        got[t * d + j],
                        want[j],
                        sets[t].len()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Shapes for the dense side of a hybrid FFN: `(d_model, n_ff, tokens)`,
/// no neuron at all, one, widths around vector lanes and workgroup sizes,
/// a prompt chunk.
pub const DENSE_FFN_EDGE: &[(usize, usize, usize)] = &[
    (8, 0, 1),
    (2, 1, 1),
    (16, 1, 3),
    (30, 7, 2),
    (64, 33, 1),
    (64, 65, 5),
    (130, 129, 2),
    (256, 300, 1),
    (576, 96, 4),
];

/// Checks a [`DenseFfnBackend`] on one random problem: random f16 weights
/// made resident, `n` tokens, every neuron against the reference.
///
/// # Errors
/// The backend's error, or the first element out of tolerance.
pub fn check_dense_ffn<B: DenseFfnBackend>(
    b: &B,
    act: FfnAct,
    d: usize,
    n_ff: usize,
    n: usize,
    seed: u64,
) -> std::result::Result<(), String> {
    let p = FfnProblem::<f16>::random(d, n_ff, n, seed);
    let w = p.weights().map_err(|e| e.to_string())?;
    let r = b.upload_ffn(&w).map_err(|e| hgca_kernels::report(&e))?;
    let mut out = vec![f32::NAN; n * d];
    b.dense_ffn(act, &r, &p.x, n, &mut out)
        .map_err(|e| hgca_kernels::report(&e))?;
    let all: Vec<usize> = (0..n_ff).collect();
    p.check(act, &vec![all; n], &out)
        .map_err(|e| format!("dense FFN d {d} n_ff {n_ff} n {n} {act:?}: {e}"))
}

/// A dense side's bad input gives typed errors: `x` and `out` of the wrong
/// length.
///
/// # Errors
/// A message when a call succeeds or fails with another error.
pub fn check_dense_ffn_errors<B: DenseFfnBackend>(b: &B) -> std::result::Result<(), String> {
    let p = FfnProblem::<f16>::random(16, 4, 2, 1);
    let w = p.weights().map_err(|e| e.to_string())?;
    let r = b.upload_ffn(&w).map_err(|e| e.to_string())?;
    let mut out = [0.0f32; 2 * 16 + 1];
    for (x_len, out_len) in [(31, 32), (32, 33), (0, 32), (32, 31)] {
        let x = vec![0.0f32; x_len];
        match b.dense_ffn(FfnAct::Silu, &r, &x, 2, &mut out[..out_len]) {
            Err(hgca_kernels::Error::Length { .. }) => {}
            other => {
                return Err(format!(
                    "x of {x_len} and out of {out_len}: {other:?}, want a length error"
                ));
            }
        }
    }
    Ok(())
}

/// The dense side's whole check: every shape of [`DENSE_FFN_EDGE`] and
/// `extra` in both activations against the reference, the typed errors of
/// [`check_dense_ffn_errors`], and weights made resident by `b` refused by
/// `other` (another instance) with [`hgca_kernels::Error::ForeignObject`].
///
/// # Errors
/// The first failure, as a message.
pub fn check_dense_ffn_backend<B: DenseFfnBackend>(
    b: &B,
    other: &B,
    extra: &[(usize, usize, usize)],
) -> std::result::Result<(), String> {
    for (k, &(d, n_ff, n)) in DENSE_FFN_EDGE.iter().chain(extra).enumerate() {
        for act in [FfnAct::Silu, FfnAct::Relu] {
            check_dense_ffn(b, act, d, n_ff, n, 300 + k as u64)?;
        }
    }
    check_dense_ffn_errors(b)?;
    let p = FfnProblem::<f16>::random(16, 4, 1, 5);
    let w = p.weights().map_err(|e| e.to_string())?;
    let r = b.upload_ffn(&w).map_err(|e| hgca_kernels::report(&e))?;
    let mut out = vec![0.0f32; 16];
    match other.dense_ffn(FfnAct::Silu, &r, &p.x, 1, &mut out) {
        Err(hgca_kernels::Error::ForeignObject { .. }) => Ok(()),
        res => Err(format!(
            "weights of another instance: {res:?}, want ForeignObject"
        )),
    }
}

/// A random subset of `0..n` (about `share` of it), in random order: an
/// active list, or a hot set.
pub fn random_subset(rng: &mut Rng, n: usize, share: f64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32)
        .filter(|_| (rng.next_u64() % 1000) as f64 / 1000.0 < share)
        .collect();
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i + 1));
    }
    v
}

/// A threshold on `|act|` in the widest gap of the middle half of the
/// magnitudes `acts` (so an f32 kernel and the f64 reference agree on
/// every comparison with it); `fallback` with fewer than two values.
pub fn gap_threshold(acts: impl IntoIterator<Item = f64>, fallback: f64) -> f64 {
    let mut all: Vec<f64> = acts.into_iter().map(f64::abs).collect();
    if all.len() < 2 {
        return fallback;
    }
    all.sort_by(f64::total_cmp);
    let lo = all.len() / 4;
    let hi = (3 * all.len() / 4).max(lo + 1).min(all.len() - 1);
    let (mut best, mut t) = (-1.0, fallback);
    for k in lo..hi {
        let gap = all[k + 1] - all[k];
        if gap > best {
            (best, t) = (gap, (all[k] + all[k + 1]) / 2.0);
        }
    }
    t
}
