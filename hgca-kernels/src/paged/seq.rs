//! The validated views: a batch of sequences over one pool
//! ([`PagedBatch`]) and one sequence ([`PagedSeq`], a [`KvSource`] with no
//! copy).

use super::pool::{PagedLayout, PagedPool};
use super::table::BlockTable;
use crate::{AttnShape, Error, KvElem, KvSource, Result};

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
