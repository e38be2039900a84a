//! Engine-owned KV caches read where they lie: a pool of pages described by
//! strides ([`PagedPool`]), block tables in the two conventions engines use
//! ([`BlockTable`]), and the validated per-sequence view ([`PagedSeq`]) that
//! implements [`KvSource`] with no copy.
//!
//! A pool holds `num_blocks` pages of `block_size` tokens. Element
//! `(page p, token-in-page i, KV head h, dim c)` of K lies at
//! `k_offset + p * block_stride + i * token_stride + h * head_stride + c`
//! of the K slice (V alike, with `v_offset`); `head_dim` is contiguous. The
//! named constructors give these strides for the layouts engines keep:
//!
//! | constructor | engine | shape |
//! |---|---|---|
//! | [`PagedPool::vllm_cpu`] | vLLM's CPU attention backend | `(2, num_blocks, kv_heads, block_size, d)` |
//! | [`PagedPool::vllm_flash`] | vLLM / FlashAttention's GPU cache held on the host | `(2, num_blocks, block_size, kv_heads, d)` |
//! | [`PagedPool::flashinfer_nhd`] | FlashInfer NHD, K and V separate | `[pages, page_size, kv_heads, d]` each |
//! | [`PagedPool::flashinfer_hnd`] | FlashInfer HND, K and V separate | `[pages, kv_heads, page_size, d]` each |
//! | [`PagedPool::flashinfer_nhd_combined`] | FlashInfer NHD, one tensor | `[pages, 2, page_size, kv_heads, d]` |
//! | [`PagedPool::flashinfer_hnd_combined`] | FlashInfer HND, one tensor | `[pages, 2, kv_heads, page_size, d]` |
//! | [`PagedPool::token_major`] | llama.cpp / ggml's cache | one row of `row_stride` elements per token, heads `[kv_heads, d]` inside |
//! | [`PagedPool::head_major`] | hgca's own `[kv_heads, tokens, d]` ([`crate::KvSlices`]) | one page |
//!
//! Everything is validated once, when a view is built: every block index
//! `< num_blocks`, every length within its table row, and every row the
//! strides can reach inside the slices. The rows a kernel then reads cannot
//! be out of bounds.
//!
//! ```
//! use hgca_kernels::{BlockTable, KvSource, PagedBatch, PagedPool};
//! // vLLM's CPU cache: (2, num_blocks=4, kv_heads=2, block_size=3, d=2)
//! let cache: Vec<f32> = (0..2 * 4 * 2 * 3 * 2).map(|x| x as f32).collect();
//! let pool = PagedPool::vllm_cpu(&cache, 4, 2, 3, 2)?;
//! // two sequences: 5 tokens in blocks [2, 0], 1 token in block [3]
//! let table = [2, 0, 3, 0];
//! let lens = [5, 1];
//! let batch = PagedBatch::new(pool, BlockTable::dense(&table, 2, &lens)?)?;
//! let s0 = batch.seq(0).unwrap();
//! assert_eq!(s0.tokens(), 5);
//! // token 4 is token 1 of block 0; KV head 1 of it starts at 0*12 + 1*6 + 1*2
//! assert_eq!(s0.k_row(1, 4), &[8.0, 9.0]);
//! // V is the second half of the tensor
//! assert_eq!(s0.v_row(0, 0)[0], 48.0 + 2.0 * 12.0);
//! # Ok::<(), hgca_kernels::Error>(())
//! ```

use crate::{AttnShape, Error, KvElem, KvSource, Result, error::check_len};

/// `a * b`, or [`Error::Capacity`] naming `what` on overflow.
fn mul(what: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or(Error::Capacity {
        what,
        capacity: usize::MAX,
        requested: a.max(b),
    })
}

/// The geometry of a page pool: counts and strides in elements (see the
/// module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedLayout {
    /// Pages in the pool.
    pub num_blocks: usize,
    /// Tokens per page (any positive count).
    pub block_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension (contiguous).
    pub head_dim: usize,
    /// Elements from one page to the next.
    pub block_stride: usize,
    /// Elements from one token of a page to the next.
    pub token_stride: usize,
    /// Elements from one KV head to the next.
    pub head_stride: usize,
}

impl PagedLayout {
    /// Elements past a base offset that the layout can reach: one past the
    /// last element of the last row.
    fn extent(&self) -> Result<usize> {
        let what = "paged layout extent";
        let reach = mul(what, self.num_blocks - 1, self.block_stride)?
            .checked_add(mul(what, self.block_size - 1, self.token_stride)?)
            .and_then(|x| x.checked_add((self.kv_heads - 1).checked_mul(self.head_stride)?))
            .and_then(|x| x.checked_add(self.head_dim))
            .ok_or(Error::Capacity {
                what,
                capacity: usize::MAX,
                requested: self.num_blocks,
            })?;
        Ok(reach)
    }
}

/// Fast `j / b` and `j % b` for the page size `b`, `j < 2^32` (token
/// indices are `u32`): a shift for powers of two, else a multiply by a
/// 64-bit reciprocal (exact for all 32-bit `j` and `b`, Lemire et al. 2019).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageDiv {
    Shift(u32),
    Magic { m: u64, b: u64 },
}

impl PageDiv {
    fn new(b: usize) -> Self {
        if b.is_power_of_two() {
            PageDiv::Shift(b.trailing_zeros())
        } else {
            let b = b as u64;
            PageDiv::Magic {
                m: u64::MAX / b + 1,
                b,
            }
        }
    }
    #[inline(always)]
    fn divmod(self, j: usize) -> (usize, usize) {
        match self {
            PageDiv::Shift(s) => (j >> s, j & ((1 << s) - 1)),
            PageDiv::Magic { m, b } => {
                let q = ((m as u128 * j as u128) >> 64) as u64;
                (q as usize, (j as u64 - q * b) as usize)
            }
        }
    }
}

/// The order of a named layout's pages.
#[derive(Debug, Clone, Copy)]
enum Order {
    /// `[tokens, heads, d]`.
    Nhd,
    /// `[heads, tokens, d]`.
    Hnd,
}

/// Where a named layout keeps V beside K.
#[derive(Debug, Clone, Copy)]
enum Halves {
    /// In its own slice.
    Separate,
    /// The second half of one tensor `(2, pages, ...)`.
    Outer,
    /// Beside K in every page, `[pages, 2, ...]`.
    PerPage,
}

/// A borrowed pool of KV pages, validated: every row its layout can reach
/// lies inside its slices.
#[derive(Debug, Clone, Copy)]
pub struct PagedPool<'a, T> {
    layout: PagedLayout,
    k: &'a [T],
    v: &'a [T],
    k_offset: usize,
    v_offset: usize,
    div: PageDiv,
}

impl<'a, T: KvElem> PagedPool<'a, T> {
    /// The general form: K and V slices with base offsets, the layout's
    /// strides, and `dim_stride`, the stride between the elements of a row,
    /// which must be 1 (hgca reads rows as contiguous slices). K and V may be
    /// the same slice (one tensor, two offsets).
    ///
    /// # Errors
    /// [`Error::Zero`] for a zero count, [`Error::Param`] naming
    /// `dim_stride` when it is not 1, [`Error::Capacity`] when the size
    /// arithmetic overflows, [`Error::Length`] naming `k` or `v` when a
    /// reachable row lies past the end of its slice.
    pub fn strided(
        k: &'a [T],
        k_offset: usize,
        v: &'a [T],
        v_offset: usize,
        layout: PagedLayout,
        dim_stride: usize,
    ) -> Result<Self> {
        for (what, x) in [
            ("num_blocks", layout.num_blocks),
            ("block_size", layout.block_size),
            ("kv_heads", layout.kv_heads),
            ("head_dim", layout.head_dim),
        ] {
            if x == 0 {
                return Err(Error::Zero { what });
            }
        }
        if dim_stride != 1 {
            return Err(Error::Param {
                what: "dim_stride",
                value: dim_stride as f64,
                expected: "1: head_dim must be contiguous",
            });
        }
        if layout.block_size > u32::MAX as usize {
            return Err(Error::Capacity {
                what: "block_size (token indices are u32)",
                capacity: u32::MAX as usize,
                requested: layout.block_size,
            });
        }
        let extent = layout.extent()?;
        for (what, off, len) in [("k", k_offset, k.len()), ("v", v_offset, v.len())] {
            let need = off.checked_add(extent).ok_or(Error::Capacity {
                what: "paged pool offset",
                capacity: usize::MAX,
                requested: off,
            })?;
            if need > len {
                return Err(Error::Length {
                    what,
                    expected: need,
                    found: len,
                });
            }
        }
        Ok(Self {
            layout,
            k,
            v,
            k_offset,
            v_offset,
            div: PageDiv::new(layout.block_size),
        })
    }

    /// The named layouts: pages `[tokens, heads, d]` (`Nhd`) or `[heads,
    /// tokens, d]` (`Hnd`) inside, K and V in separate slices, in the two
    /// halves of one tensor `(2, pages, ...)`, or side by side in each page
    /// `[pages, 2, ...]`; the slices must hold exactly the shape.
    #[allow(clippy::too_many_arguments)]
    fn named(
        k: &'a [T],
        v: Option<&'a [T]>,
        order: Order,
        halves: Halves,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let what = "cache elements";
        let page = mul(what, mul(what, kv_heads, block_size)?, head_dim)?;
        let (token_stride, head_stride) = match order {
            Order::Nhd => (mul(what, kv_heads, head_dim)?, head_dim),
            Order::Hnd => (head_dim, mul(what, block_size, head_dim)?),
        };
        let (block_stride, v_offset) = match halves {
            Halves::Separate => (page, 0),
            Halves::Outer => (page, mul(what, num_blocks, page)?),
            Halves::PerPage => (mul(what, page, 2)?, page),
        };
        let all = mul(what, num_blocks, block_stride)?;
        let v = match v {
            Some(v) => {
                check_len("k_cache", all, k.len())?;
                check_len("v_cache", all, v.len())?;
                v
            }
            None => {
                let n = if matches!(halves, Halves::Outer) {
                    mul(what, all, 2)?
                } else {
                    all
                };
                check_len("kv_cache", n, k.len())?;
                k
            }
        };
        let layout = PagedLayout {
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            block_stride,
            token_stride,
            head_stride,
        };
        Self::strided(k, 0, v, v_offset, layout, 1)
    }

    /// vLLM's CPU attention cache, one tensor `(2, num_blocks, kv_heads,
    /// block_size, head_size)` (K then V; each page head-major inside).
    ///
    /// # Errors
    /// As [`PagedPool::strided`]; [`Error::Length`] when `kv_cache` does not
    /// hold exactly the shape.
    pub fn vllm_cpu(
        kv_cache: &'a [T],
        num_blocks: usize,
        kv_heads: usize,
        block_size: usize,
        head_size: usize,
    ) -> Result<Self> {
        Self::named(
            kv_cache,
            None,
            Order::Hnd,
            Halves::Outer,
            num_blocks,
            block_size,
            kv_heads,
            head_size,
        )
    }

    /// vLLM's (FlashAttention's) GPU cache layout held in host memory, one
    /// tensor `(2, num_blocks, block_size, kv_heads, head_size)` (K then V;
    /// each page token-major inside).
    ///
    /// # Errors
    /// As [`PagedPool::vllm_cpu`].
    pub fn vllm_flash(
        kv_cache: &'a [T],
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_size: usize,
    ) -> Result<Self> {
        Self::named(
            kv_cache,
            None,
            Order::Nhd,
            Halves::Outer,
            num_blocks,
            block_size,
            kv_heads,
            head_size,
        )
    }

    /// FlashInfer's NHD layout, K and V separate: `[pages, page_size,
    /// kv_heads, d]` each.
    ///
    /// # Errors
    /// As [`PagedPool::strided`]; [`Error::Length`] when a slice does not
    /// hold exactly the shape.
    pub fn flashinfer_nhd(
        k_cache: &'a [T],
        v_cache: &'a [T],
        pages: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Self::named(
            k_cache,
            Some(v_cache),
            Order::Nhd,
            Halves::Separate,
            pages,
            page_size,
            kv_heads,
            head_dim,
        )
    }

    /// FlashInfer's HND layout, K and V separate: `[pages, kv_heads,
    /// page_size, d]` each.
    ///
    /// # Errors
    /// As [`PagedPool::flashinfer_nhd`].
    pub fn flashinfer_hnd(
        k_cache: &'a [T],
        v_cache: &'a [T],
        pages: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Self::named(
            k_cache,
            Some(v_cache),
            Order::Hnd,
            Halves::Separate,
            pages,
            page_size,
            kv_heads,
            head_dim,
        )
    }

    /// FlashInfer's NHD layout as one tensor `[pages, 2, page_size,
    /// kv_heads, d]` (each page's K, then its V).
    ///
    /// # Errors
    /// As [`PagedPool::strided`]; [`Error::Length`] when `kv_cache` does not
    /// hold exactly the shape.
    pub fn flashinfer_nhd_combined(
        kv_cache: &'a [T],
        pages: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Self::named(
            kv_cache,
            None,
            Order::Nhd,
            Halves::PerPage,
            pages,
            page_size,
            kv_heads,
            head_dim,
        )
    }

    /// FlashInfer's HND layout as one tensor `[pages, 2, kv_heads,
    /// page_size, d]`.
    ///
    /// # Errors
    /// As [`PagedPool::flashinfer_nhd_combined`].
    pub fn flashinfer_hnd_combined(
        kv_cache: &'a [T],
        pages: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Self::named(
            kv_cache,
            None,
            Order::Hnd,
            Halves::PerPage,
            pages,
            page_size,
            kv_heads,
            head_dim,
        )
    }

    /// A token-major cache as llama.cpp/ggml keeps it: token `j`'s K (or
    /// V) is one row of `row_stride >= kv_heads * head_dim` elements
    /// starting at `j * row_stride`, holding `[kv_heads, head_dim]`. One page
    /// of `tokens` tokens: view it with [`PagedSeq::contiguous`].
    ///
    /// # Errors
    /// As [`PagedPool::strided`]; [`Error::Param`] naming `row_stride` when
    /// it is shorter than a token's heads.
    pub fn token_major(
        k: &'a [T],
        v: &'a [T],
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
        row_stride: usize,
    ) -> Result<Self> {
        if row_stride < kv_heads.saturating_mul(head_dim) {
            return Err(Error::Param {
                what: "row_stride",
                value: row_stride as f64,
                expected: "at least kv_heads * head_dim (rows must not overlap)",
            });
        }
        Self::strided(
            k,
            0,
            v,
            0,
            PagedLayout {
                num_blocks: 1,
                block_size: tokens,
                kv_heads,
                head_dim,
                block_stride: 0,
                token_stride: row_stride,
                head_stride: head_dim,
            },
            1,
        )
    }

    /// hgca's head-major `[kv_heads, tokens, d]` K and V (the layout of
    /// [`crate::KvSlices`]), as one page of `tokens` (at least 1) tokens.
    ///
    /// # Errors
    /// As [`PagedPool::strided`]; [`Error::Length`] when a slice does not
    /// hold exactly the shape.
    pub fn head_major(
        k: &'a [T],
        v: &'a [T],
        kv_heads: usize,
        tokens: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Self::named(
            k,
            Some(v),
            Order::Hnd,
            Halves::Separate,
            1,
            tokens,
            kv_heads,
            head_dim,
        )
    }

    /// The pool's geometry.
    pub fn layout(&self) -> &PagedLayout {
        &self.layout
    }

    /// Element offset of row `(page, i, h)` past a base offset.
    #[inline(always)]
    fn row_at(&self, page: usize, i: usize, h: usize) -> usize {
        let l = &self.layout;
        page * l.block_stride + i * l.token_stride + h * l.head_stride
    }

    /// Key row of token `i` of page `page`, KV head `h`; `None` past the
    /// layout's counts.
    pub fn page_k_row(&self, page: usize, i: usize, h: usize) -> Option<&'a [T]> {
        let l = &self.layout;
        (page < l.num_blocks && i < l.block_size && h < l.kv_heads).then(|| {
            let o = self.k_offset + self.row_at(page, i, h);
            &self.k[o..o + l.head_dim]
        })
    }

    /// Value row, as [`PagedPool::page_k_row`].
    pub fn page_v_row(&self, page: usize, i: usize, h: usize) -> Option<&'a [T]> {
        let l = &self.layout;
        (page < l.num_blocks && i < l.block_size && h < l.kv_heads).then(|| {
            let o = self.v_offset + self.row_at(page, i, h);
            &self.v[o..o + l.head_dim]
        })
    }
}

/// Block tables: which pages hold each sequence's tokens, in order, and how
/// many tokens each sequence has. Checked against a pool by
/// [`PagedBatch::new`].
#[derive(Debug, Clone, Copy)]
pub enum BlockTable<'a> {
    /// vLLM's convention: `table [batch, max_blocks]` row-major (entries
    /// past a sequence's last page are not read) and `seq_lens [batch]`.
    Dense {
        /// Page indices, `batch * max_blocks`.
        table: &'a [u32],
        /// Columns of `table`.
        max_blocks: usize,
        /// Tokens per sequence.
        seq_lens: &'a [u32],
    },
    /// FlashInfer's / SGLang's CSR convention: sequence `b`'s pages are
    /// `indices[indptr[b]..indptr[b + 1]]`, its last page holding
    /// `last_page_len[b]` tokens (`1..=page_size`; 0 for no pages).
    Csr {
        /// `batch + 1` non-decreasing offsets into `indices`.
        indptr: &'a [u32],
        /// Page indices.
        indices: &'a [u32],
        /// Tokens in each sequence's last page.
        last_page_len: &'a [u32],
    },
}

impl<'a> BlockTable<'a> {
    /// A dense table, its lengths checked (`table.len() == seq_lens.len() *
    /// max_blocks`); the entries are checked against a pool later.
    ///
    /// Engines whose tables are `int32` can pass them cast to `u32`: a
    /// negative entry becomes `>= 2^31` and is refused as out of range.
    ///
    /// # Errors
    /// [`Error::Length`] naming `block_table`.
    pub fn dense(table: &'a [u32], max_blocks: usize, seq_lens: &'a [u32]) -> Result<Self> {
        check_len(
            "block_table (batch * max_blocks)",
            mul("block_table elements", seq_lens.len(), max_blocks)?,
            table.len(),
        )?;
        Ok(BlockTable::Dense {
            table,
            max_blocks,
            seq_lens,
        })
    }

    /// A CSR table.
    ///
    /// # Errors
    /// [`Error::Zero`] for an empty `indptr`, [`Error::Length`] naming
    /// `last_page_len` when it does not hold one entry per sequence.
    pub fn csr(indptr: &'a [u32], indices: &'a [u32], last_page_len: &'a [u32]) -> Result<Self> {
        if indptr.is_empty() {
            return Err(Error::Zero {
                what: "indptr length (batch + 1)",
            });
        }
        check_len(
            "last_page_len (batch)",
            indptr.len() - 1,
            last_page_len.len(),
        )?;
        Ok(BlockTable::Csr {
            indptr,
            indices,
            last_page_len,
        })
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        match self {
            BlockTable::Dense { seq_lens, .. } => seq_lens.len(),
            BlockTable::Csr { last_page_len, .. } => last_page_len.len(),
        }
    }

    /// Sequence `b`'s pages (all the table gives it) and its token count,
    /// checked against `block_size`.
    fn resolve(&self, b: usize, block_size: usize) -> Result<(&'a [u32], usize)> {
        match *self {
            BlockTable::Dense {
                table,
                max_blocks,
                seq_lens,
            } => {
                let len = seq_lens[b] as usize;
                let pages = len.div_ceil(block_size);
                if pages > max_blocks {
                    return Err(Error::Capacity {
                        what: "seq_lens: pages a sequence needs beyond max_blocks",
                        capacity: max_blocks * block_size,
                        requested: len,
                    });
                }
                Ok((&table[b * max_blocks..][..pages], len))
            }
            BlockTable::Csr {
                indptr,
                indices,
                last_page_len,
            } => {
                let (a, e) = (indptr[b] as usize, indptr[b + 1] as usize);
                if e < a {
                    return Err(Error::Param {
                        what: "indptr (must not decrease)",
                        value: e as f64,
                        expected: "indptr[b + 1] >= indptr[b]",
                    });
                }
                if e > indices.len() {
                    return Err(Error::Index {
                        what: "indptr (past the end of indices)",
                        index: e,
                        len: indices.len(),
                    });
                }
                let last = last_page_len[b] as usize;
                let pages = e - a;
                let ok = if pages == 0 {
                    last == 0
                } else {
                    (1..=block_size).contains(&last)
                };
                if !ok {
                    return Err(Error::Param {
                        what: "last_page_len",
                        value: last as f64,
                        expected: "1..=page_size for a sequence with pages, 0 for one without",
                    });
                }
                let len = pages.saturating_sub(1) * block_size + last;
                Ok((&indices[a..e], len))
            }
        }
    }
}

/// A validated batch: a pool and its block tables. Sequence `b`'s view is
/// [`PagedBatch::seq`].
#[derive(Debug, Clone)]
pub struct PagedBatch<'a, T> {
    pool: PagedPool<'a, T>,
    /// Per sequence: its pages and tokens.
    seqs: Vec<(&'a [u32], usize)>,
}

impl<'a, T: KvElem> PagedBatch<'a, T> {
    /// Validates `table` against `pool`: every page a sequence's tokens
    /// use is `< num_blocks`, every length fits its table row, and every
    /// length is below `2^32` (token indices are `u32`).
    ///
    /// # Errors
    /// [`Error::Index`] naming `block_table` for a page out of range,
    /// [`Error::Capacity`] for a `seq_len` beyond its row, [`Error::Param`]
    /// for a bad CSR `indptr` or `last_page_len`.
    pub fn new(pool: PagedPool<'a, T>, table: BlockTable<'a>) -> Result<Self> {
        let bs = pool.layout.block_size;
        let seqs = (0..table.batch())
            .map(|b| {
                let (pages, len) = table.resolve(b, bs)?;
                check_pages(&pool, pages, len)?;
                Ok((pages, len))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { pool, seqs })
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.seqs.len()
    }

    /// The pool.
    pub fn pool(&self) -> &PagedPool<'a, T> {
        &self.pool
    }

    /// Tokens of sequence `b` (0 past the last).
    pub fn seq_len(&self, b: usize) -> usize {
        self.seqs.get(b).map_or(0, |s| s.1)
    }

    /// Sequence `b`'s view, `None` past the last.
    pub fn seq(&self, b: usize) -> Option<PagedSeq<'a, T>> {
        self.seqs.get(b).map(|&(pages, len)| PagedSeq {
            pool: self.pool,
            pages,
            len,
        })
    }

    /// Checks the batch against `shape` (KV heads and head dim).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`].
    pub fn check_shape(&self, shape: &AttnShape) -> Result<()> {
        check_pool_shape(&self.pool.layout, shape)
    }
}

fn check_pool_shape(l: &PagedLayout, shape: &AttnShape) -> Result<()> {
    if l.kv_heads == shape.kv_heads() && l.head_dim == shape.head_dim() {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            what: "paged pool (kv_heads, head_dim)",
            expected: format!("({}, {})", shape.kv_heads(), shape.head_dim()),
            found: format!("({}, {})", l.kv_heads, l.head_dim),
        })
    }
}

fn check_pages<T: KvElem>(pool: &PagedPool<'_, T>, pages: &[u32], len: usize) -> Result<()> {
    if len > u32::MAX as usize {
        return Err(Error::Capacity {
            what: "sequence tokens (indices are u32)",
            capacity: u32::MAX as usize,
            requested: len,
        });
    }
    let bs = pool.layout.block_size;
    if len.div_ceil(bs) > pages.len() {
        return Err(Error::Capacity {
            what: "sequence tokens beyond its pages",
            capacity: pages.len().saturating_mul(bs),
            requested: len,
        });
    }
    let nb = pool.layout.num_blocks;
    if let Some(&p) = pages[..len.div_ceil(bs)]
        .iter()
        .find(|&&p| p as usize >= nb)
    {
        return Err(Error::Index {
            what: "block_table page",
            index: p as usize,
            len: nb,
        });
    }
    Ok(())
}

/// One sequence of a paged cache: its pages in order and its length,
/// validated. Implements [`KvSource`]: token `j` is token `j % block_size`
/// of page `pages[j / block_size]`.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a, T> {
    pool: PagedPool<'a, T>,
    pages: &'a [u32],
    len: usize,
}

impl<'a, T: KvElem> PagedSeq<'a, T> {
    /// One sequence of `len` tokens in `pages`.
    ///
    /// # Errors
    /// As [`PagedBatch::new`].
    pub fn new(pool: PagedPool<'a, T>, pages: &'a [u32], len: usize) -> Result<Self> {
        check_pages(&pool, pages, len)?;
        Ok(Self { pool, pages, len })
    }

    /// The first `len` tokens of a one-page pool ([`PagedPool::token_major`],
    /// [`PagedPool::head_major`]).
    ///
    /// # Errors
    /// [`Error::Capacity`] when `len` exceeds the page.
    pub fn contiguous(pool: PagedPool<'a, T>, len: usize) -> Result<Self> {
        const FIRST: &[u32] = &[0];
        Self::new(pool, FIRST, len)
    }

    /// The pages this sequence's tokens use, in order.
    pub fn pages(&self) -> &'a [u32] {
        &self.pages[..self.len.div_ceil(self.pool.layout.block_size)]
    }

    /// The pool.
    pub fn pool(&self) -> &PagedPool<'a, T> {
        &self.pool
    }

    /// Tokens of this sequence in its page slot `slot` (0 past the last).
    pub fn page_tokens(&self, slot: usize) -> usize {
        crate::pages::page_tokens(self.len, self.pool.layout.block_size, slot)
    }

    #[inline(always)]
    fn locate(&self, h: usize, j: usize) -> usize {
        debug_assert!(
            h < self.pool.layout.kv_heads && j < self.len,
            "row ({h}, {j}) out of range"
        );
        let (b, i) = self.pool.div.divmod(j);
        self.pool.row_at(self.pages[b] as usize, i, h)
    }
}

impl<T: KvElem> KvSource<T> for PagedSeq<'_, T> {
    fn kv_heads(&self) -> usize {
        self.pool.layout.kv_heads
    }
    fn head_dim(&self) -> usize {
        self.pool.layout.head_dim
    }
    fn tokens(&self) -> usize {
        self.len
    }
    #[inline(always)]
    fn k_row(&self, h: usize, j: usize) -> &[T] {
        self.kv_rows(h, j).0
    }
    #[inline(always)]
    fn v_row(&self, h: usize, j: usize) -> &[T] {
        self.kv_rows(h, j).1
    }
    #[inline(always)]
    fn kv_rows(&self, h: usize, j: usize) -> (&[T], &[T]) {
        let (o, d) = (self.locate(h, j), self.pool.layout.head_dim);
        let (k, v) = (self.pool.k_offset + o, self.pool.v_offset + o);
        (&self.pool.k[k..k + d], &self.pool.v[v..v + d])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_div_is_exact() {
        for b in [
            1usize,
            2,
            3,
            5,
            7,
            16,
            17,
            100,
            255,
            256,
            1000,
            65537,
            u32::MAX as usize,
        ] {
            let dv = PageDiv::new(b);
            let mut js: Vec<usize> = (0..2000).collect();
            js.extend([
                u32::MAX as usize,
                u32::MAX as usize - 1,
                b * 1000 - 1,
                b * 1000,
            ]);
            js.extend((0..64).map(|i| (0x9E37_79B9u64.wrapping_mul(i + 1) & 0xFFFF_FFFF) as usize));
            for j in js.into_iter().filter(|&j| j <= u32::MAX as usize) {
                assert_eq!(dv.divmod(j), (j / b, j % b), "j {j} b {b}");
            }
        }
    }
}
