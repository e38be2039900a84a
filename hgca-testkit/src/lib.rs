//! # hgca-testkit: one conformance suite for every backend
//!
//! Problem generators (values that do not hide wrong indexing), per-dtype
//! tolerances written once, and checks of a backend's partial against
//! `hgca-ref`. Every window backend instantiates
//! [`dense_backend_suite!`] (built on [`conformance`] and [`dense`]); every
//! test that needs what a machine may lack skips through [`require`].
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod conformance;
pub mod dense;
pub mod ffn;
pub mod require;
mod seq;
pub mod stress;
mod suite;

/// Re-exported for [`dense_backend_suite!`].
pub use proptest;

pub use seq::KvLog;

use hgca_kernels::{AttnShape, DType, KvElem, KvSlices, PartialLayout};
use hgca_ref::RefRow;
use proptest::prelude::*;

/// An error bound `{abs, rel}`, per dtype.
///
/// The bound for an output element is `vmax * (abs + rel * smag)` and for an
/// lse `abs + rel * (|lse| + smag)`, where `vmax` is the largest |value| and
/// `smag` the largest `scale * Σ|q_i k_i|` of the token set: an f32 score
/// carries an absolute error proportional to it, which every weight inherits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Absolute part.
    pub abs: f64,
    /// Part relative to the size of scores and lse.
    pub rel: f64,
}

impl Tolerance {
    /// The tolerance of kernels reading KV stored as `dtype` (queries and
    /// accumulation are f32 for all three).
    pub const fn of(dtype: DType) -> Tolerance {
        match dtype {
            DType::F32 => Tolerance {
                abs: 2e-5,
                rel: 2e-6,
            },
            DType::F16 | DType::BF16 => Tolerance {
                abs: 4e-5,
                rel: 4e-6,
            },
        }
    }
}

/// `err <= bound`, false for NaN: an unwritten (poisoned) element fails.
#[inline]
pub fn within(err: f64, bound: f64) -> bool {
    matches!(
        err.partial_cmp(&bound),
        Some(core::cmp::Ordering::Less | core::cmp::Ordering::Equal)
    )
}

/// Checks one kernel partial `(out, lse)` against reference rows.
///
/// # Errors
/// A message naming the first element out of bounds (NaN, such as an
/// unwritten poisoned element, always fails).
pub fn check_rows(
    layout: PartialLayout,
    out: &[f32],
    lse: &[f32],
    refs: &[RefRow],
    vmax: f64,
    tol: Tolerance,
) -> Result<(), String> {
    let d = layout.head_dim;
    if out.len() != layout.out_len() || lse.len() != layout.rows() || refs.len() != layout.rows() {
        return Err(format!(
            "lengths: out {} lse {} refs {} for {layout:?}",
            out.len(),
            lse.len(),
            refs.len()
        ));
    }
    for (r, rr) in refs.iter().enumerate() {
        let got = lse[r] as f64;
        let lse_ok = if rr.lse == f64::NEG_INFINITY {
            got == f64::NEG_INFINITY
        } else {
            (got - rr.lse).abs() <= tol.abs + tol.rel * (rr.lse.abs() + rr.score_mag)
        };
        if !lse_ok {
            return Err(format!("row {r}: lse {got} vs reference {}", rr.lse));
        }
        let bound = vmax.max(1e-30) * (tol.abs + tol.rel * rr.score_mag);
        for (i, (&o, &x)) in out[r * d..(r + 1) * d].iter().zip(&rr.out).enumerate() {
            let err = (o as f64 - x).abs();
            if !within(err, bound) {
                return Err(format!(
                    "row {r} elem {i}: out {o} vs reference {x} (err {err:.3e} > bound {bound:.3e})"
                ));
            }
        }
    }
    Ok(())
}

/// Small deterministic generator (SplitMix64) for data inside a proptest case.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[-1, 1)`.
    pub fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A decode problem: queries and a head-major KV cache stored as `T`.
#[derive(Debug, Clone)]
pub struct Problem<T> {
    /// Head geometry.
    pub shape: AttnShape,
    /// Tokens in the cache.
    pub tokens: usize,
    /// Queries `[q_heads, d]`.
    pub q: Vec<f32>,
    /// Keys `[kv_heads, tokens, d]`, storage type.
    pub k: Vec<T>,
    /// Values, storage type.
    pub v: Vec<T>,
    /// Keys widened to f32 (what the reference reads).
    pub k32: Vec<f32>,
    /// Values widened to f32.
    pub v32: Vec<f32>,
    /// Largest |value|.
    pub vmax: f64,
}

impl<T: KvElem> Problem<T> {
    /// Random problem whose scores are of size about `spread`; every value
    /// differs, so a wrong row or head shows.
    pub fn random(shape: AttnShape, tokens: usize, spread: f32, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let d = shape.head_dim();
        // |s| ~ scale * d * a^2 / 3 with scale = 1/sqrt(d): a = sqrt(3 spread / sqrt(d)).
        let a = (3.0 * spread / (d as f32).sqrt()).sqrt();
        let n = shape.kv_heads() * tokens * d;
        let q: Vec<f32> = (0..shape.q_len()).map(|_| a * rng.sym()).collect();
        let k: Vec<T> = (0..n).map(|_| T::from_f32(a * rng.sym())).collect();
        let v: Vec<T> = (0..n).map(|_| T::from_f32(rng.sym() + 0.25)).collect();
        let k32: Vec<f32> = k.iter().map(|x| x.to_f32()).collect();
        let v32: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
        let vmax = v32.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64));
        Self {
            shape,
            tokens,
            q,
            k,
            v,
            k32,
            v32,
            vmax,
        }
    }
    /// The cache as a [`KvSlices`] view.
    pub fn kv(&self) -> KvSlices<'_, T> {
        KvSlices::new(
            self.shape.kv_heads(),
            self.shape.head_dim(),
            self.tokens,
            &self.k,
            &self.v,
        )
        .expect("problem lengths are consistent by construction")
    }
    /// Reference rows (one per query head) over per-KV-head token sets.
    pub fn reference(&self, sets: &[Vec<usize>]) -> Vec<RefRow> {
        let s = &self.shape;
        hgca_ref::attend(
            &self.q,
            &self.k32,
            &self.v32,
            s.q_heads(),
            s.kv_heads(),
            s.head_dim(),
            self.tokens,
            s.scale() as f64,
            sets,
        )
    }
}

/// Head geometries that hit the edges: GQA groups 1..8, 12 and 16 (larger
/// than one kernel call's heads on the CPU, so groups are split), head dims around
/// SIMD lane counts (1, 7, 8, 9, 15, 16, 17, 31..33, 64, 80, 96, 127..129, 256, 257).
pub fn arb_shape() -> impl Strategy<Value = AttnShape> {
    let dims = prop::sample::select(vec![
        1usize, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 80, 96, 127, 128, 129, 256, 257,
    ]);
    (
        1usize..=4,
        prop::sample::select(vec![1usize, 2, 3, 4, 8, 12, 16]),
        dims,
    )
        .prop_map(|(kv, g, d)| AttnShape::new(kv * g, kv, d).expect("valid by construction"))
}

/// Score sizes from gentle to extreme.
pub fn arb_spread() -> impl Strategy<Value = f32> {
    prop::sample::select(vec![0.01f32, 1.0, 10.0, 100.0, 1e3, 1e4])
}

/// The edge table of (q_heads, kv_heads, d, tokens), shared by every backend.
pub const EDGE_SHAPES: &[(usize, usize, usize, usize)] = &[
    (1, 1, 1, 1),
    (1, 1, 1, 0),
    (2, 1, 1, 17),
    (1, 1, 257, 3),
    (4, 4, 15, 16),
    (4, 2, 16, 15),
    (8, 2, 17, 33),
    (32, 8, 64, 65),
    (32, 8, 128, 300),
    (8, 1, 256, 129),
    (6, 3, 80, 7),
    (12, 4, 96, 63),
    (32, 32, 128, 31),
    (24, 2, 33, 40),
    (32, 2, 64, 70),
];
