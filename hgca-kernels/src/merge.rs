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
    // In f64 like `merge_rows`, and bit for bit what it gives for the two
    // rows (part 0 the accumulator): one weight is exactly 1, the other
    // exp(-|a - b|) in [0, 1].
    let m64 = f64::from(m);
    let (wa, wb) = ((f64::from(a) - m64).exp(), (f64::from(b) - m64).exp());
    let total = wa + wb;
    let (ca, cb) = (wa / total, wb / total);
    let term = |c: f64, x: f32| {
        if c == 0.0 {
            if x.is_nan() { f64::NAN } else { 0.0 }
        } else {
            c * f64::from(x)
        }
    };
    for (x, &y) in acc.iter_mut().zip(o) {
        *x = (term(ca, *x) + term(cb, y)) as f32;
    }
    *acc_lse = (m64 + total.ln()) as f32;
}

/// N-way merge of row `r` of every part into `out`, `lse`.
#[inline]
fn merge_row_n(parts: &[PartialRef<'_>], r: usize, out: &mut [f32], lse: &mut f32) {
    merge_rows(parts.len(), |i| parts[i].row(r), out, lse);
}

/// Elements of `out` accumulated at once in f64 on the stack.
const ACC_BLOCK: usize = 64;

/// N-way merge of `n` rows `row(i) = (o_i, lse_i)` into `out`, `lse`, with
/// the special values of the module docs.
///
/// The weights `exp(lse_i - M)`, their sum and the weighted sum of the
/// outputs are formed in f64 (an f32 difference of lse is exact there), and
/// rounded to f32 once: the result is within about half an ulp of the exact
/// merge (plus `2^-50` of `Σ c_i |o_i|` where the outputs cancel), whatever
/// `n`, where an f32 accumulation drifts by tens of ulp at a thousand parts.
/// No allocation: the output is accumulated in blocks of a fixed size.
/// `o_i.len() == out.len()` is the caller's promise.
#[inline]
pub fn merge_rows<'a>(
    n: usize,
    row: impl Fn(usize) -> (&'a [f32], f32),
    out: &mut [f32],
    lse: &mut f32,
) {
    let mut m = f32::NEG_INFINITY;
    for i in 0..n {
        let l = canon(row(i).1);
        if l.is_nan() {
            out.fill(f32::NAN);
            *lse = f32::NAN;
            return;
        }
        m = m.max(l);
    }
    if m == f32::NEG_INFINITY {
        out.fill(0.0);
        *lse = f32::NEG_INFINITY;
        for i in 0..n {
            propagate_nan(out, row(i).0);
        }
        return;
    }
    let m64 = f64::from(m);
    let weight = |l: f32| (f64::from(canon(l)) - m64).exp();
    let total: f64 = (0..n).map(|i| weight(row(i).1)).sum();
    let mut acc = [0.0f64; ACC_BLOCK];
    for (b, dst) in out.chunks_mut(ACC_BLOCK).enumerate() {
        let acc = &mut acc[..dst.len()];
        acc.fill(0.0);
        for i in 0..n {
            let (o, l) = row(i);
            let o = &o[b * ACC_BLOCK..][..dst.len()];
            let c = weight(l) / total;
            if c == 0.0 {
                // A zero weight hides everything but NaN (and `0 * inf`
                // must not make one).
                for (a, &y) in acc.iter_mut().zip(o) {
                    if y.is_nan() {
                        *a = f64::NAN;
                    }
                }
            } else {
                for (a, &y) in acc.iter_mut().zip(o) {
                    *a += c * f64::from(y);
                }
            }
        }
        for (x, &a) in dst.iter_mut().zip(acc.iter()) {
            *x = a as f32;
        }
    }
    *lse = (m64 + total.ln()) as f32;
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
    // By row index, not `chunks_exact(d)`: `head_dim` 0 still has lse rows.
    for (r, acc_lse) in lse.iter_mut().enumerate() {
        let (o, l) = src.row(r);
        merge2_row(&mut out[r * d..(r + 1) * d], acc_lse, o, l);
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
    for (r, l) in lse.iter_mut().enumerate() {
        merge_row_n(parts, r, &mut out[r * d..(r + 1) * d], l);
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
