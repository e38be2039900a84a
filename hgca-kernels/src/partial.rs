//! Partial attention results: `out [n_tokens, q_heads, d]` f32 and `lse [n_tokens, q_heads]` f32.

use crate::{AttnShape, Error, Result, error::check_len};

/// The layout of a partial result: `n_tokens` query tokens (1 for decode) of
/// `q_heads` heads with `head_dim` outputs each.
///
/// `out` is row-major `[n_tokens, q_heads, head_dim]`, `lse` is
/// `[n_tokens, q_heads]`; a *row* is one (token, head) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PartialLayout {
    /// Query tokens (1 for decode, `n_q` for an append chunk).
    pub n_tokens: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl PartialLayout {
    /// The layout of one decode token for `shape`.
    pub fn decode(shape: &AttnShape) -> Self {
        Self::append(shape, 1)
    }
    /// The layout of an append chunk of `n_tokens` queries for `shape`.
    pub fn append(shape: &AttnShape, n_tokens: usize) -> Self {
        Self {
            n_tokens,
            q_heads: shape.q_heads(),
            head_dim: shape.head_dim(),
        }
    }
    /// Rows (token, head pairs).
    #[inline]
    pub fn rows(&self) -> usize {
        self.n_tokens.saturating_mul(self.q_heads)
    }
    /// Elements of `out`.
    #[inline]
    pub fn out_len(&self) -> usize {
        self.rows().saturating_mul(self.head_dim)
    }
    fn check(&self, out: usize, lse: usize) -> Result<()> {
        check_len("partial out", self.out_len(), out)?;
        check_len("partial lse", self.rows(), lse)
    }
    pub(crate) fn check_same(&self, other: &Self) -> Result<()> {
        if self == other {
            Ok(())
        } else {
            Err(Error::ShapeMismatch {
                what: "partial layout",
                expected: format!("{self:?}"),
                found: format!("{other:?}"),
            })
        }
    }
}

/// An owned partial result. The empty partial (`out = 0`, `lse = -inf`) is
/// the identity of the merge.
///
/// ```
/// use hgca_kernels::{AttnShape, Partial, PartialLayout};
/// let shape = AttnShape::new(4, 2, 8)?;
/// let p = Partial::empty(PartialLayout::decode(&shape));
/// assert!(p.lse().iter().all(|&l| l == f32::NEG_INFINITY));
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    layout: PartialLayout,
    out: Vec<f32>,
    lse: Vec<f32>,
}

impl Partial {
    /// The empty partial: `out = 0`, `lse = -inf`.
    pub fn empty(layout: PartialLayout) -> Self {
        Self {
            layout,
            out: vec![0.0; layout.out_len()],
            lse: vec![f32::NEG_INFINITY; layout.rows()],
        }
    }
    /// A partial filled with NaN, to prove that a kernel writes every element.
    pub fn poisoned(layout: PartialLayout) -> Self {
        Self {
            layout,
            out: vec![f32::NAN; layout.out_len()],
            lse: vec![f32::NAN; layout.rows()],
        }
    }
    /// Wraps owned buffers.
    ///
    /// # Errors
    /// [`Error::Length`] when a buffer does not match `layout`.
    pub fn from_vecs(layout: PartialLayout, out: Vec<f32>, lse: Vec<f32>) -> Result<Self> {
        layout.check(out.len(), lse.len())?;
        Ok(Self { layout, out, lse })
    }
    /// The layout.
    pub fn layout(&self) -> PartialLayout {
        self.layout
    }
    /// `out`, `[n_tokens, q_heads, d]`.
    pub fn out(&self) -> &[f32] {
        &self.out
    }
    /// `lse` (natural log), `[n_tokens, q_heads]`.
    pub fn lse(&self) -> &[f32] {
        &self.lse
    }
    /// Borrowed view.
    pub fn as_ref(&self) -> PartialRef<'_> {
        PartialRef {
            layout: self.layout,
            out: &self.out,
            lse: &self.lse,
        }
    }
    /// Mutable view.
    pub fn as_mut(&mut self) -> PartialMut<'_> {
        PartialMut {
            layout: self.layout,
            out: &mut self.out,
            lse: &mut self.lse,
        }
    }
}

/// A borrowed partial result.
#[derive(Debug, Clone, Copy)]
pub struct PartialRef<'a> {
    layout: PartialLayout,
    out: &'a [f32],
    lse: &'a [f32],
}

impl<'a> PartialRef<'a> {
    /// Wraps slices.
    ///
    /// # Errors
    /// [`Error::Length`] when a slice does not match `layout`.
    pub fn new(layout: PartialLayout, out: &'a [f32], lse: &'a [f32]) -> Result<Self> {
        layout.check(out.len(), lse.len())?;
        Ok(Self { layout, out, lse })
    }
    /// The layout.
    pub fn layout(&self) -> PartialLayout {
        self.layout
    }
    /// `out`, `[n_tokens, q_heads, d]`.
    pub fn out(&self) -> &'a [f32] {
        self.out
    }
    /// `lse`, `[n_tokens, q_heads]`.
    pub fn lse(&self) -> &'a [f32] {
        self.lse
    }
    /// Output row `r` (`r = token * q_heads + head`) and its lse.
    #[inline]
    pub(crate) fn row(&self, r: usize) -> (&'a [f32], f32) {
        let d = self.layout.head_dim;
        (&self.out[r * d..(r + 1) * d], self.lse[r])
    }
}

/// A mutable borrowed partial result, the destination of every kernel.
#[derive(Debug)]
pub struct PartialMut<'a> {
    layout: PartialLayout,
    out: &'a mut [f32],
    lse: &'a mut [f32],
}

impl<'a> PartialMut<'a> {
    /// Wraps slices.
    ///
    /// # Errors
    /// [`Error::Length`] when a slice does not match `layout`.
    pub fn new(layout: PartialLayout, out: &'a mut [f32], lse: &'a mut [f32]) -> Result<Self> {
        layout.check(out.len(), lse.len())?;
        Ok(Self { layout, out, lse })
    }
    /// The layout.
    pub fn layout(&self) -> PartialLayout {
        self.layout
    }
    /// Splits into the raw `(out, lse)` slices.
    pub fn into_parts(self) -> (&'a mut [f32], &'a mut [f32]) {
        (self.out, self.lse)
    }
    /// Reborrows.
    pub fn reborrow(&mut self) -> PartialMut<'_> {
        PartialMut {
            layout: self.layout,
            out: self.out,
            lse: self.lse,
        }
    }
    /// Read-only view.
    pub fn as_ref(&self) -> PartialRef<'_> {
        PartialRef {
            layout: self.layout,
            out: self.out,
            lse: self.lse,
        }
    }
    /// Sets every row to the empty partial.
    pub fn set_empty(&mut self) {
        self.out.fill(0.0);
        self.lse.fill(f32::NEG_INFINITY);
    }
    /// `out` and `lse` as mutable slices.
    pub fn parts_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (self.out, self.lse)
    }
}
