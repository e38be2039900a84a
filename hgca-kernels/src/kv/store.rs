//! The CPU KV store: head-major, grown in blocks ([`KvStore`]), and the
//! trait an engine's own store implements to serve the hybrid layer
//! ([`CpuStore`]).

use super::KvSource;
use crate::{Error, HostBuf, KvElem, Result, error::check_len};

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
