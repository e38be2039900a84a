//! The CPU KV store (head-major, paged in blocks) and per-KV-head selections.

use crate::{AttnShape, Error, HostBuf, KvElem, Result, error::check_len};

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

/// A CPU-side store the hybrid layer moves evicted window rows into and
/// reads them from: hgca's own [`KvStore`], or an engine's own pages (an
/// engine that owns its cache implements this over it, and the whole
/// hybrid layer then runs on the engine's memory). Token `j` of the store
/// is sequence position `j`.
///
/// ```
/// use hgca_kernels::{CpuStore, KvSource, KvStore};
/// fn fill<S: CpuStore<f32>>(s: &mut S) -> hgca_kernels::Result<()> {
///     s.reserve(2)?;
///     s.push_head_major(2, &[1.0, 2.0, 3.0, 4.0], &[0.0; 4])
/// }
/// let mut store = KvStore::<f32>::new(2, 1, 4)?;
/// fill(&mut store)?;
/// assert_eq!(store.k_row(1, 0), &[3.0]);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
pub trait CpuStore<T: KvElem>: KvSource<T> + Send {
    /// Makes sure that pushing up to `n` more tokens next cannot fail for
    /// want of memory: the layer reserves before it takes rows out of its
    /// window, so no evicted row is ever lost.
    ///
    /// # Errors
    /// [`Error::Capacity`] or [`Error::OutOfMemory`]; nothing changes then.
    fn reserve(&mut self, n: usize) -> Result<()>;
    /// Appends `n` tokens given head-major, `[kv_heads, n, d]` each (the
    /// layout an evicted window block comes in).
    ///
    /// # Errors
    /// [`Error::Length`] when `k` or `v` does not hold `kv_heads * n * d`;
    /// the store's own errors.
    fn push_head_major(&mut self, n: usize, k: &[T], v: &[T]) -> Result<()>;
}

impl<T: KvElem> CpuStore<T> for KvStore<T> {
    fn reserve(&mut self, n: usize) -> Result<()> {
        KvStore::reserve(self, n)
    }
    fn push_head_major(&mut self, n: usize, k: &[T], v: &[T]) -> Result<()> {
        KvStore::push_head_major(self, n, k, v)
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

/// The CPU KV store: grows block by block as the GPU window evicts.
///
/// Block `b` holds tokens `b*B .. (b+1)*B` of every KV head, laid out
/// `[kv_heads][B][d]`, so every row stays contiguous and an appended token
/// is copied exactly once (the store never reallocates). `B` is a power of
/// two. Blocks live in chunks of 1, 2, 4, ... blocks, each a [`HostBuf`]:
/// once a chunk reaches 2 MiB it sits on transparent huge pages, so rows
/// gathered at random from a large store do not each cost a page walk.
///
/// ```
/// use hgca_kernels::{KvSource, KvStore};
/// let mut s = KvStore::<f32>::new(2, 4, 64)?;
/// // 3 tokens, head-major [kv_heads=2, n=3, d=4]
/// let k: Vec<f32> = (0..24).map(|x| x as f32).collect();
/// s.push_head_major(3, &k, &k)?;
/// assert_eq!(s.tokens(), 3);
/// assert_eq!(s.k_row(1, 2), &[20.0, 21.0, 22.0, 23.0]);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug)]
pub struct KvStore<T> {
    kv_heads: usize,
    head_dim: usize,
    shift: u32,
    tokens: usize,
    /// Chunk `c` holds blocks `2^c - 1 .. 2^(c+1) - 1`.
    k: Vec<HostBuf<T>>,
    v: Vec<HostBuf<T>>,
}

impl<T: KvElem> Clone for KvStore<T> {
    fn clone(&self) -> Self {
        Self {
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            shift: self.shift,
            tokens: self.tokens,
            k: self.k.clone(),
            v: self.v.clone(),
        }
    }
}

impl<T: KvElem> KvStore<T> {
    /// An empty store with blocks of `block_tokens` tokens (a power of two).
    ///
    /// # Errors
    /// [`Error::Zero`] for zero counts, [`Error::Param`] when `block_tokens`
    /// is not a power of two.
    pub fn new(kv_heads: usize, head_dim: usize, block_tokens: usize) -> Result<Self> {
        for (what, v) in [
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("block_tokens", block_tokens),
        ] {
            if v == 0 {
                return Err(Error::Zero { what });
            }
        }
        if !block_tokens.is_power_of_two() {
            return Err(Error::Param {
                what: "block_tokens",
                value: block_tokens as f64,
                expected: "a power of two",
            });
        }
        Ok(Self {
            kv_heads,
            head_dim,
            shift: block_tokens.trailing_zeros(),
            tokens: 0,
            k: Vec::new(),
            v: Vec::new(),
        })
    }
    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        1 << self.shift
    }
    fn block_len(&self) -> usize {
        self.kv_heads * self.block_tokens() * self.head_dim
    }
    /// Appends `n` tokens given head-major, `[kv_heads, n, d]` (the layout
    /// an evicted window block comes in).
    ///
    /// # Errors
    /// [`Error::Length`] when `k` or `v` does not hold `kv_heads * n * d`.
    pub fn push_head_major(&mut self, n: usize, k: &[T], v: &[T]) -> Result<()> {
        let d = self.head_dim;
        self.check_push(n, k, v)?;
        self.push_with(n, |h, i| (h * n + i) * d, k, v)
    }
    /// Appends `n` tokens given token-major, `[n, kv_heads, d]` (the layout
    /// a model produces).
    ///
    /// # Errors
    /// [`Error::Length`] when `k` or `v` does not hold `n * kv_heads * d`.
    pub fn push_token_major(&mut self, n: usize, k: &[T], v: &[T]) -> Result<()> {
        let (hk, d) = (self.kv_heads, self.head_dim);
        self.check_push(n, k, v)?;
        self.push_with(n, |h, i| (i * hk + h) * d, k, v)
    }
    /// `k` and `v` hold `kv_heads * n * d` elements (the count checked for overflow).
    fn check_push(&self, n: usize, k: &[T], v: &[T]) -> Result<()> {
        let count = (self.kv_heads * self.head_dim)
            .checked_mul(n)
            .ok_or(Error::Capacity {
                what: "kv store tokens to push",
                capacity: usize::MAX / (self.kv_heads * self.head_dim),
                requested: n,
            })?;
        check_len("k", count, k.len())?;
        check_len("v", count, v.len())
    }
    fn push_with(
        &mut self,
        n: usize,
        src_off: impl Fn(usize, usize) -> usize,
        k: &[T],
        v: &[T],
    ) -> Result<()> {
        let hk = self.kv_heads;
        let d = self.head_dim;
        // Map every chunk the new tokens need first, so a refused mapping
        // leaves the store as it was.
        self.reserve(n)?;
        for i in 0..n {
            for h in 0..hk {
                let (c, t) = self.locate(h, self.tokens);
                let s = src_off(h, i);
                self.k[c][t..t + d].copy_from_slice(&k[s..s + d]);
                self.v[c][t..t + d].copy_from_slice(&v[s..s + d]);
            }
            self.tokens += 1;
        }
        Ok(())
    }
    /// Maps the memory `n` more tokens need, so that pushing up to `n`
    /// tokens next cannot fail for want of it. A caller that must not lose
    /// rows it moves into the store (the hybrid engine evicting from its
    /// window) reserves before it takes them out.
    ///
    /// ```
    /// use hgca_kernels::{KvSource, KvStore};
    /// let mut store = KvStore::<f32>::new(2, 4, 8)?;
    /// store.reserve(20)?;
    /// store.push_token_major(20, &[0.5; 20 * 2 * 4], &[1.0; 20 * 2 * 4])?;
    /// assert_eq!(store.tokens(), 20);
    /// assert!(store.reserve(usize::MAX).is_err());
    /// assert_eq!(store.tokens(), 20);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Capacity`] when the count overflows the address space,
    /// [`Error::OutOfMemory`] when the host refuses the memory; nothing changes then.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        let too_many = || Error::Capacity {
            what: "kv store tokens",
            // Elements (K or V) must be addressable: a bound, not an offer.
            capacity: usize::MAX / (self.kv_heads * self.head_dim),
            requested: self.tokens.saturating_add(n),
        };
        let Some(last) = self
            .tokens
            .checked_add(n)
            .ok_or_else(too_many)?
            .checked_sub(1)
        else {
            return Ok(());
        };
        let need = self.locate(0, last).0 + 1;
        let mut k = Vec::new();
        let mut v = Vec::new();
        for c in self.k.len()..need {
            let len = u32::try_from(c)
                .ok()
                .and_then(|c| 1usize.checked_shl(c))
                .and_then(|blocks| self.block_len().checked_mul(blocks))
                .ok_or_else(too_many)?;
            k.push(HostBuf::zeroed(len)?);
            v.push(HostBuf::zeroed(len)?);
        }
        self.k.append(&mut k);
        self.v.append(&mut v);
        Ok(())
    }
    /// Chunk and element offset of row `(h, j)`.
    #[inline(always)]
    fn locate(&self, h: usize, j: usize) -> (usize, usize) {
        let bt = 1usize << self.shift;
        // Block b lives in chunk c = floor(log2(b + 1)), at index
        // b + 1 - 2^c inside it.
        let x = (j >> self.shift) + 1;
        let c = x.ilog2() as usize;
        let in_chunk = x ^ (1 << c);
        let o = (in_chunk * self.kv_heads + h) * bt + (j & (bt - 1));
        (c, o * self.head_dim)
    }
    /// Bytes of K and V held (the blocks in use; each chunk maps up to
    /// twice its used blocks in address space, touched only as it fills).
    pub fn bytes(&self) -> usize {
        2 * self.tokens.div_ceil(self.block_tokens()) * self.block_len() * core::mem::size_of::<T>()
    }
}

impl<T: KvElem> KvSource<T> for KvStore<T> {
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
        let (c, o) = self.locate(h, j);
        &self.k[c][o..o + self.head_dim]
    }
    #[inline(always)]
    fn v_row(&self, h: usize, j: usize) -> &[T] {
        debug_assert!(
            h < self.kv_heads && j < self.tokens,
            "row ({h}, {j}) out of range"
        );
        let (c, o) = self.locate(h, j);
        &self.v[c][o..o + self.head_dim]
    }
    #[inline(always)]
    fn kv_rows(&self, h: usize, j: usize) -> (&[T], &[T]) {
        debug_assert!(
            h < self.kv_heads && j < self.tokens,
            "row ({h}, {j}) out of range"
        );
        let (c, o) = self.locate(h, j);
        let d = self.head_dim;
        (&self.k[c][o..o + d], &self.v[c][o..o + d])
    }
}

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
