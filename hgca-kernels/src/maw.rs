//! Moving average of attention weights (MAW) and the per-head selection rule.
//!
//! Every KV entry carries, per KV head, `maw <- alpha * maw + (1 - alpha) * a`
//! with `a` its attention weight in the latest step, normalised over the
//! union of GPU and CPU tokens (for GQA, the mean over the query group).
//! The paper's rule selects entry `j` of KV head `h` for the CPU's sparse
//! attention when `maw[h][j] > beta_h / n_gpu` ([`Beta::threshold`]).
//!
//! This module holds the rule's parameters, validated; the update and the
//! scan are the CPU backend's vectorised kernels
//! (`CpuBackend::decay_accumulate`, `CpuBackend::indices_above`), which the
//! hybrid layer and the C ABI both run.

use crate::{Error, Result};

/// Per-KV-head `beta` of the paper's selection rule, validated: finite and `>= 0`.
///
/// ```
/// use hgca_kernels::Beta;
/// assert!(Beta::new(vec![1.0, 0.5]).is_ok());
/// assert!(Beta::new(vec![f32::NAN]).is_err());
/// assert!(Beta::uniform(2, -1.0).is_err());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Beta(Vec<f32>);

impl Beta {
    /// From one value per KV head.
    ///
    /// # Errors
    /// [`Error::Param`] when a value is NaN, infinite or negative;
    /// [`Error::Zero`] for an empty list.
    pub fn new(values: Vec<f32>) -> Result<Self> {
        if values.is_empty() {
            return Err(Error::Zero { what: "beta heads" });
        }
        if let Some(&b) = values.iter().find(|b| !(b.is_finite() && **b >= 0.0)) {
            return Err(Error::Param {
                what: "beta",
                value: b as f64,
                expected: "a finite number >= 0",
            });
        }
        Ok(Self(values))
    }
    /// The same `beta` for every one of `kv_heads` heads.
    ///
    /// # Errors
    /// As [`Beta::new`].
    pub fn uniform(kv_heads: usize, beta: f32) -> Result<Self> {
        Self::new(vec![beta; kv_heads])
    }
    /// The values.
    pub fn values(&self) -> &[f32] {
        &self.0
    }
    /// The paper's threshold `beta_h / n_gpu` for head `h` (`n_gpu = 0` is
    /// read as 1); `+inf`, which no MAW passes, for a head past the last.
    #[inline]
    pub fn threshold(&self, h: usize, n_gpu: usize) -> f32 {
        self.0
            .get(h)
            .map_or(f32::INFINITY, |b| b / n_gpu.max(1) as f32)
    }
}

/// MAW smoothing factor `alpha` in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Alpha(f32);

impl Alpha {
    /// Validates `alpha`.
    ///
    /// # Errors
    /// [`Error::Param`] unless `0 <= alpha <= 1`.
    pub fn new(alpha: f32) -> Result<Self> {
        if (0.0..=1.0).contains(&alpha) {
            Ok(Self(alpha))
        } else {
            Err(Error::Param {
                what: "alpha",
                value: alpha as f64,
                expected: "a number in [0, 1]",
            })
        }
    }
    /// The value.
    pub fn get(self) -> f32 {
        self.0
    }
}
