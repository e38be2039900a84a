//! Where attention reads KV rows: the [`KvSource`] trait, borrowed
//! head-major slices ([`KvSlices`]), and (in `store.rs`) the CPU store and
//! (in `selection.rs`) per-KV-head selections.

mod selection;
mod store;

pub use selection::{Selection, SelectionRef};
pub use store::{CpuStore, KvStore};

use crate::{AttnShape, Error, KvElem, Result, error::check_len};

/// Read access to head-major KV rows: `k_row(h, j)` is the `d` contiguous
/// elements of token `j` of KV head `h`. Kernels are generic over it.
pub trait KvSource<T: KvElem>: Sync {
    /// KV heads.
    fn kv_heads(&self) -> usize;
    /// Head dimension.
    fn head_dim(&self) -> usize;
    /// Tokens held.
    fn tokens(&self) -> usize;
    /// Key row of token `j` of KV head `h`.
    ///
    /// This is the kernels' hot path, called after their boundary checks:
    /// `h < kv_heads` and `j < tokens` are the caller's to keep. Past them
    /// an implementation may panic or return another row (a debug build
    /// asserts them).
    fn k_row(&self, h: usize, j: usize) -> &[T];
    /// Value row of token `j` of KV head `h`, under the same terms as
    /// [`KvSource::k_row`].
    fn v_row(&self, h: usize, j: usize) -> &[T];
    /// Both rows of token `j` of KV head `h` (what the kernels ask for),
    /// under the same terms: a source that locates a row with some work
    /// (a page table) overrides it to do that work once for both.
    #[inline(always)]
    fn kv_rows(&self, h: usize, j: usize) -> (&[T], &[T]) {
        (self.k_row(h, j), self.v_row(h, j))
    }
    /// Checks that this source matches `shape`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when heads or head_dim differ.
    fn check_shape(&self, shape: &AttnShape) -> Result<()> {
        if self.kv_heads() == shape.kv_heads() && self.head_dim() == shape.head_dim() {
            Ok(())
        } else {
            Err(Error::ShapeMismatch {
                what: "kv source (kv_heads, head_dim)",
                expected: format!("({}, {})", shape.kv_heads(), shape.head_dim()),
                found: format!("({}, {})", self.kv_heads(), self.head_dim()),
            })
        }
    }
}

impl<T: KvElem, S: KvSource<T> + ?Sized> KvSource<T> for &S {
    fn kv_heads(&self) -> usize {
        (**self).kv_heads()
    }
    fn head_dim(&self) -> usize {
        (**self).head_dim()
    }
    fn tokens(&self) -> usize {
        (**self).tokens()
    }
    #[inline(always)]
    fn k_row(&self, h: usize, j: usize) -> &[T] {
        (**self).k_row(h, j)
    }
    #[inline(always)]
    fn v_row(&self, h: usize, j: usize) -> &[T] {
        (**self).v_row(h, j)
    }
    #[inline(always)]
    fn kv_rows(&self, h: usize, j: usize) -> (&[T], &[T]) {
        (**self).kv_rows(h, j)
    }
}

/// Contiguous head-major K and V slices, `[kv_heads, tokens, d]` each.
#[derive(Debug, Clone, Copy)]
pub struct KvSlices<'a, T> {
    kv_heads: usize,
    head_dim: usize,
    tokens: usize,
    k: &'a [T],
    v: &'a [T],
}

impl<'a, T: KvElem> KvSlices<'a, T> {
    /// Wraps `[kv_heads, tokens, d]` slices.
    ///
    /// # Errors
    /// [`Error::Zero`] for zero heads or head_dim, [`Error::Length`] when a
    /// slice does not hold `kv_heads * tokens * d` elements.
    pub fn new(
        kv_heads: usize,
        head_dim: usize,
        tokens: usize,
        k: &'a [T],
        v: &'a [T],
    ) -> Result<Self> {
        if kv_heads == 0 {
            return Err(Error::Zero { what: "kv_heads" });
        }
        if head_dim == 0 {
            return Err(Error::Zero { what: "head_dim" });
        }
        let n = kv_heads
            .checked_mul(tokens)
            .and_then(|x| x.checked_mul(head_dim))
            .ok_or(Error::Capacity {
                what: "kv slices elements",
                capacity: usize::MAX,
                requested: tokens,
            })?;
        check_len("k", n, k.len())?;
        check_len("v", n, v.len())?;
        Ok(Self {
            kv_heads,
            head_dim,
            tokens,
            k,
            v,
        })
    }
    /// Keys of head `h`, `[tokens, d]` (empty for `h >= kv_heads`).
    pub fn k_head(&self, h: usize) -> &'a [T] {
        head_of(self.k, h, self.tokens * self.head_dim)
    }
    /// Values of head `h`, `[tokens, d]` (empty for `h >= kv_heads`).
    pub fn v_head(&self, h: usize) -> &'a [T] {
        head_of(self.v, h, self.tokens * self.head_dim)
    }
}

/// Head `h` of a head-major buffer of `n` elements per head; empty past the end.
fn head_of<T>(buf: &[T], h: usize, n: usize) -> &[T] {
    h.checked_mul(n)
        .and_then(|a| buf.get(a..a.checked_add(n)?))
        .unwrap_or(&[])
}

impl<T: KvElem> KvSource<T> for KvSlices<'_, T> {
    fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn tokens(&self) -> usize {
        self.tokens
    }
    #[inline(always)]
    fn k_row(&self, h: usize, j: usize) -> &[T] {
        debug_assert!(
            h < self.kv_heads && j < self.tokens,
            "row ({h}, {j}) out of range"
        );
        let o = (h * self.tokens + j) * self.head_dim;
        &self.k[o..o + self.head_dim]
    }
    #[inline(always)]
    fn v_row(&self, h: usize, j: usize) -> &[T] {
        debug_assert!(
            h < self.kv_heads && j < self.tokens,
            "row ({h}, {j}) out of range"
        );
        let o = (h * self.tokens + j) * self.head_dim;
        &self.v[o..o + self.head_dim]
    }
}
