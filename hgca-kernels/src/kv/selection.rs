//! Per-KV-head selections of CPU entries: owned ([`Selection`]) and
//! borrowed ([`SelectionRef`]), in CSR form.

use crate::{Error, Result};

/// Selected token indices per KV head, in compressed-row form: head `h`'s
/// list is `indices[offsets[h]..offsets[h + 1]]`. Reusable: `clear` keeps
/// the allocations.
///
/// ```
/// use hgca_kernels::Selection;
/// let mut s = Selection::new();
/// s.push_head([0, 5, 9]);
/// s.push_head([]);
/// assert_eq!(s.kv_heads(), 2);
/// assert_eq!(s.head(0), &[0, 5, 9]);
/// assert!(s.validate(2, 10).is_ok());
/// assert!(s.validate(2, 9).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    offsets: Vec<usize>,
    indices: Vec<u32>,
}

impl Default for Selection {
    fn default() -> Self {
        Self::new()
    }
}

impl Selection {
    /// An empty selection of zero heads.
    pub fn new() -> Self {
        Self {
            offsets: vec![0],
            indices: Vec::new(),
        }
    }
    /// Every token of every head.
    pub fn all(kv_heads: usize, tokens: usize) -> Self {
        let mut s = Self::new();
        for _ in 0..kv_heads {
            s.push_head(0..tokens as u32);
        }
        s
    }
    /// From one list per head.
    pub fn from_heads<I: AsRef<[u32]>>(heads: &[I]) -> Self {
        let mut s = Self::new();
        for h in heads {
            s.push_head(h.as_ref().iter().copied());
        }
        s
    }
    /// Forgets all heads, keeping the allocations.
    pub fn clear(&mut self) {
        self.offsets.truncate(1);
        self.indices.clear();
    }
    /// Appends the list of the next KV head.
    pub fn push_head(&mut self, idx: impl IntoIterator<Item = u32>) {
        self.indices.extend(idx);
        self.offsets.push(self.indices.len());
    }
    /// Appends one index to the last head (call `begin_head` first).
    #[inline]
    pub fn push_index(&mut self, j: u32) {
        self.indices.push(j);
        *self.offsets.last_mut().expect("offsets is never empty") = self.indices.len();
    }
    /// Starts an empty list for the next head, to be filled by `push_index`.
    #[inline]
    pub fn begin_head(&mut self) {
        self.offsets.push(self.indices.len());
    }
    /// Heads.
    pub fn kv_heads(&self) -> usize {
        self.as_view().kv_heads()
    }
    /// Head `h`'s indices (empty for `h >= kv_heads()`).
    #[inline]
    pub fn head(&self, h: usize) -> &[u32] {
        self.as_view().head(h)
    }
    /// Where head `h`'s list starts in the flat index array (the total for
    /// `h >= kv_heads()`: past the last list).
    #[inline]
    pub fn offset(&self, h: usize) -> usize {
        self.as_view().offset(h)
    }
    /// Total selected entries over all heads.
    pub fn total(&self) -> usize {
        self.indices.len()
    }
    /// Checks `kv_heads` lists, every index `< tokens`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for the wrong number of heads, [`Error::Index`]
    /// for an index out of range.
    pub fn validate(&self, kv_heads: usize, tokens: usize) -> Result<()> {
        self.as_view().validate(kv_heads, tokens)
    }
    /// A borrowed view of this selection.
    #[inline]
    pub fn as_view(&self) -> SelectionRef<'_> {
        SelectionRef {
            offsets: &self.offsets,
            indices: &self.indices,
        }
    }
}

/// A borrowed [`Selection`]: per KV head `g`, the token indices
/// `indices[offsets[g]..offsets[g + 1]]`, in a caller's own buffers (an
/// engine's, a C or Python array) with no copy.
///
/// ```
/// use hgca_kernels::SelectionRef;
/// let (offsets, indices) = ([0usize, 2, 3], [4u32, 9, 1]);
/// let s = SelectionRef::new(&offsets, &indices)?;
/// assert_eq!((s.kv_heads(), s.head(0), s.head(1)), (2, &[4, 9][..], &[1][..]));
/// assert!(SelectionRef::new(&[0, 3, 2], &indices).is_err());
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelectionRef<'a> {
    offsets: &'a [usize],
    indices: &'a [u32],
}

impl<'a> SelectionRef<'a> {
    /// A view of `offsets` (`kv_heads + 1` entries, from 0, not decreasing,
    /// the last `indices.len()`) and `indices`.
    ///
    /// # Errors
    /// [`Error::Zero`] for empty `offsets`, [`Error::Param`] naming
    /// `selection offsets` when they do not start at 0, decrease, or do not
    /// end at `indices.len()`.
    pub fn new(offsets: &'a [usize], indices: &'a [u32]) -> Result<Self> {
        let Some((&first, &last)) = offsets.first().zip(offsets.last()) else {
            return Err(Error::Zero {
                what: "selection offsets (kv_heads + 1)",
            });
        };
        if first != 0 || last != indices.len() || offsets.windows(2).any(|w| w[1] < w[0]) {
            return Err(Error::Param {
                what: "selection offsets",
                value: last as f64,
                expected: "from 0, not decreasing, ending at the number of indices",
            });
        }
        Ok(Self { offsets, indices })
    }
    /// Heads.
    pub fn kv_heads(&self) -> usize {
        self.offsets.len() - 1
    }
    /// Head `h`'s indices (empty for `h >= kv_heads()`).
    #[inline]
    pub fn head(&self, h: usize) -> &'a [u32] {
        match (
            self.offsets.get(h),
            h.checked_add(1).and_then(|i| self.offsets.get(i)),
        ) {
            (Some(&a), Some(&b)) => &self.indices[a..b],
            _ => &[],
        }
    }
    /// Where head `h`'s list starts in the flat index array (the total for
    /// `h >= kv_heads()`).
    #[inline]
    pub fn offset(&self, h: usize) -> usize {
        self.offsets.get(h).copied().unwrap_or(self.indices.len())
    }
    /// Total selected entries over all heads.
    pub fn total(&self) -> usize {
        self.indices.len()
    }
    /// Checks `kv_heads` lists, every index `< tokens`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for the wrong number of heads, [`Error::Index`]
    /// for an index out of range.
    pub fn validate(&self, kv_heads: usize, tokens: usize) -> Result<()> {
        if self.kv_heads() != kv_heads {
            return Err(Error::ShapeMismatch {
                what: "selection heads",
                expected: kv_heads.to_string(),
                found: self.kv_heads().to_string(),
            });
        }
        if let Some(&bad) = self.indices.iter().find(|&&j| j as usize >= tokens) {
            return Err(Error::Index {
                what: "selected token",
                index: bad as usize,
                len: tokens,
            });
        }
        Ok(())
    }
}
