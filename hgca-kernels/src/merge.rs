//! The exact, numerically stable log-sum-exp merge of partial results.
//!
//! For partials `(o_i, lse_i)` of disjoint token sets, the merge is
//! `M = max_i lse_i`, `w_i = exp(lse_i - M)`, `o = Σ w_i o_i / Σ w_i`,
//! `lse = M + ln Σ w_i`: exactly the attention over the union.
//!
//! Special values, per row:
//! - `lse = -inf` is the empty partial; its `out` is ignored (only a NaN in
//!   it shows through, see below). All inputs empty gives `(0, -inf)`, never NaN.
//! - `lse = +inf` is also read as *empty*: FlashAttention-2 writes `+inf` for
//!   rows that saw no token. A true log-sum-exp can only reach `+inf` when a
//!   score overflows f32, which the kernels never produce from finite input.
//! - NaN is never hidden: a NaN `lse` makes the whole row NaN; a NaN element
//!   of any input `out` makes that output element NaN, even when its weight
//!   is zero.
//! - Finite inputs never give NaN: the output is a convex combination of the
//!   inputs' outputs, computed with normalised weights.

use crate::{PartialMut, PartialRef, Result};

/// Natural-log lse from a base-2 one (FlashInfer, MagicPIG): `lse2 * ln 2`.
#[inline]
pub fn lse_from_log2(lse2: f32) -> f32 {
    lse2 * core::f32::consts::LN_2
}

/// Base-2 lse from hgca's natural-log one: `lse / ln 2`.
#[inline]
pub fn lse_to_log2(lse: f32) -> f32 {
    lse * core::f32::consts::LOG2_E
}

/// Maps the `+inf` "empty" convention onto `-inf`.
#[inline(always)]
fn canon(lse: f32) -> f32 {
    if lse == f32::INFINITY {
        f32::NEG_INFINITY
    } else {
        lse
    }
}

/// Two-way merge of one row, in place: `(acc, acc_lse) <- merge((acc, acc_lse), (o, lse))`.
///
/// `acc.len() == o.len()` is the caller's promise (checked at the public boundary).
#[inline]
pub fn merge2_row(acc: &mut [f32], acc_lse: &mut f32, o: &[f32], lse: f32) {
    debug_assert_eq!(acc.len(), o.len());
    let a = canon(*acc_lse);
    let b = canon(lse);
    if a.is_nan() || b.is_nan() {
        acc.fill(f32::NAN);
        *acc_lse = f32::NAN;
        return;
    }
    let m = a.max(b);
    if m == f32::NEG_INFINITY {
        for (x, &y) in acc.iter_mut().zip(o) {
            *x = if x.is_nan() || y.is_nan() {
                f32::NAN
            } else {
                0.0
            };
        }
        *acc_lse = f32::NEG_INFINITY;
        return;
    }
    // One weight is exactly 1, the other is exp(-|a - b|) in [0, 1].
    let (wa, wb) = ((a - m).exp(), (b - m).exp());
    let w = wa + wb;
    let (ca, cb) = (wa / w, wb / w);
    if ca == 0.0 {
        for (x, &y) in acc.iter_mut().zip(o) {
            *x = if x.is_nan() { f32::NAN } else { y };
        }
    } else if cb == 0.0 {
        for (x, &y) in acc.iter_mut().zip(o) {
            if y.is_nan() {
                *x = f32::NAN;
            }
        }
    } else {
        for (x, &y) in acc.iter_mut().zip(o) {
            *x = ca * *x + cb * y;
        }
    }
    *acc_lse = m + wa.min(wb).ln_1p();
}

/// N-way merge of row `r` of every part into `out`, `lse`.
#[inline]
fn merge_row_n(parts: &[PartialRef<'_>], r: usize, out: &mut [f32], lse: &mut f32) {
    let mut m = f32::NEG_INFINITY;
    let mut arg = usize::MAX;
    for (i, p) in parts.iter().enumerate() {
        let l = canon(p.row(r).1);
        if l.is_nan() {
            out.fill(f32::NAN);
            *lse = f32::NAN;
            return;
        }
        if l > m {
            m = l;
            arg = i;
        }
    }
    out.fill(0.0);
    if m == f32::NEG_INFINITY {
        *lse = f32::NEG_INFINITY;
        for p in parts {
            propagate_nan(out, p.row(r).0);
        }
        return;
    }
    // Sum of the weights other than the argmax's (which is exactly 1).
    let mut rest = 0.0f32;
    for (i, p) in parts.iter().enumerate() {
        if i != arg {
            rest += (canon(p.row(r).1) - m).exp();
        }
    }
    let total = 1.0 + rest;
    for p in parts {
        let (o, l) = p.row(r);
        let c = (canon(l) - m).exp() / total;
        if c == 0.0 {
            propagate_nan(out, o);
        } else {
            for (x, &y) in out.iter_mut().zip(o) {
                *x += c * y;
            }
        }
    }
    *lse = m + rest.ln_1p();
}

#[inline]
fn propagate_nan(out: &mut [f32], o: &[f32]) {
    for (x, &y) in out.iter_mut().zip(o) {
        if y.is_nan() {
            *x = f32::NAN;
        }
    }
}

/// Merges `src` into `acc` in place (the two-way hot path; no allocation).
///
/// ```
/// use hgca_kernels::{merge_into, Partial, PartialLayout, PartialRef};
/// let l = PartialLayout { n_tokens: 1, q_heads: 1, head_dim: 2 };
/// let mut acc = Partial::from_vecs(l, vec![1.0, 0.0], vec![0.0])?;
/// let other = Partial::from_vecs(l, vec![0.0, 1.0], vec![0.0])?;
/// merge_into(acc.as_mut(), other.as_ref())?;
/// assert_eq!(acc.out(), &[0.5, 0.5]);
/// assert!((acc.lse()[0] - 2f32.ln()).abs() < 1e-7);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
///
/// # Errors
/// [`crate::Error::ShapeMismatch`] when the layouts differ.
pub fn merge_into(mut acc: PartialMut<'_>, src: PartialRef<'_>) -> Result<()> {
    acc.layout().check_same(&src.layout())?;
    let d = src.layout().head_dim;
    let (out, lse) = acc.parts_mut();
    for (r, (acc_row, acc_lse)) in out.chunks_exact_mut(d).zip(lse.iter_mut()).enumerate() {
        let (o, l) = src.row(r);
        merge2_row(acc_row, acc_lse, o, l);
    }
    Ok(())
}

/// Merges any number of partials of disjoint token sets into `dst`.
/// No parts gives the empty partial. No allocation.
///
/// # Errors
/// [`crate::Error::ShapeMismatch`] when a part's layout differs from `dst`'s.
pub fn merge(parts: &[PartialRef<'_>], mut dst: PartialMut<'_>) -> Result<()> {
    let layout = dst.layout();
    for p in parts {
        layout.check_same(&p.layout())?;
    }
    let d = layout.head_dim;
    let (out, lse) = dst.parts_mut();
    for (r, (o, l)) in out.chunks_exact_mut(d).zip(lse.iter_mut()).enumerate() {
        merge_row_n(parts, r, o, l);
    }
    Ok(())
}

/// The portable merge backend (scalar, no SIMD), usable anywhere.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScalarMerge;

impl crate::backend::MergeBackend for ScalarMerge {
    fn merge(&self, parts: &[PartialRef<'_>], dst: PartialMut<'_>) -> Result<()> {
        merge(parts, dst)
    }
    fn merge_into(&self, acc: PartialMut<'_>, src: PartialRef<'_>) -> Result<()> {
        merge_into(acc, src)
    }
}
