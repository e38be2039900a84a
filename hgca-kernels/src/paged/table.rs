//! Block tables in the two conventions engines use: vLLM's dense rows and
//! FlashInfer's / SGLang's CSR ([`BlockTable`]).

use super::pool::mul;
use crate::{Error, Result, error::check_len};

/// Block tables: which pages hold each sequence's tokens, in order, and how
/// many tokens each sequence has. Checked against a pool by
/// [`PagedBatch::new`](super::PagedBatch::new).
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
    pub(super) fn resolve(&self, b: usize, block_size: usize) -> Result<(&'a [u32], usize)> {
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
