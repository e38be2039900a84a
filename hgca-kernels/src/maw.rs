//! Moving average of attention weights (MAW) and the per-head selection rule.
//!
//! Every KV entry carries, per KV head, `maw <- alpha * maw + (1 - alpha) * a`
//! with `a` its attention weight in the latest step, normalised over the
//! union of GPU and CPU tokens (for GQA, the mean over the query group).
//! The paper's rule selects entry `j` of KV head `h` for the CPU's sparse
//! attention when `maw[h][j] > beta_h / n_gpu`.

use crate::{
    Error, Result, Selection,
    error::{check_len, check_len_of},
};

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

/// `maw[idx[i]] <- alpha * maw[idx[i]] + (1 - alpha) * weights[i]`: the update of
/// the CPU entries that were attended.
///
/// # Errors
/// [`Error::Length`] when `idx` and `weights` differ in length, [`Error::Index`]
/// for an index out of range.
pub fn maw_update_gather(
    maw: &mut [f32],
    idx: &[u32],
    weights: &[f32],
    alpha: Alpha,
) -> Result<()> {
    check_len("maw weights", idx.len(), weights.len())?;
    if let Some(&j) = idx.iter().find(|&&j| j as usize >= maw.len()) {
        return Err(Error::Index {
            what: "maw index",
            index: j as usize,
            len: maw.len(),
        });
    }
    let a = alpha.get();
    for (&j, &w) in idx.iter().zip(weights) {
        let m = &mut maw[j as usize];
        *m = a * *m + (1.0 - a) * w;
    }
    Ok(())
}

/// The paper's rule over a head-major MAW table `[kv_heads, tokens]`: fills
/// `sel` with, for each head `h`, every `j` with `maw[h][j] > beta_h / n_gpu`.
///
/// ```
/// use hgca_kernels::{select_paper, Beta, Selection};
/// let maw = [0.5, 0.01, 0.2, /* head 1 */ 0.0, 0.3, 0.0];
/// let mut sel = Selection::new();
/// select_paper(&maw, 3, &Beta::uniform(2, 0.3)?, 2, &mut sel)?; // threshold 0.15
/// assert_eq!(sel.head(0), &[0, 2]);
/// assert_eq!(sel.head(1), &[1]);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
///
/// # Errors
/// [`Error::Length`] when `maw` is not `beta heads * tokens` long.
pub fn select_paper(
    maw: &[f32],
    tokens: usize,
    beta: &Beta,
    n_gpu: usize,
    sel: &mut Selection,
) -> Result<()> {
    let heads = beta.values().len();
    check_len_of("maw", &[heads, tokens], maw.len())?;
    sel.clear();
    for h in 0..heads {
        let t = beta.threshold(h, n_gpu);
        let row = &maw[h * tokens..(h + 1) * tokens];
        sel.push_head(
            row.iter()
                .enumerate()
                .filter(|(_, m)| **m > t)
                .map(|(j, _)| j as u32),
        );
    }
    Ok(())
}
