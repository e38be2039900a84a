//! Selection over engine caches: Quest-style key bounds per page and KV
//! head ([`PageBounds`]), and selectors that turn per-page score bounds
//! into a [`Selection`] of token indices: the top `k` pages
//! ([`select_top_pages`]) or as many pages as an estimated attention-mass
//! target needs ([`select_by_mass`]).
//!
//! The bounds of page `p`, KV head `g` are the elementwise minimum and
//! maximum of the keys it holds; for a query `q`, `Σ_i max(q_i lo_i, q_i
//! hi_i)` bounds `q·k` for every key of the page from above (the CPU
//! backend computes it: `hgca_cpu::CpuBackend::page_upper_bounds`).
//!
//! ```
//! use hgca_kernels::{KvSource, PageBounds, PagedPool, PagedSeq, Selection, select_top_pages};
//! // one KV head, d = 1, pages of 2 tokens: keys 0, 1 | 5, 6 | -3
//! let k = [0.0f32, 1.0, 5.0, 6.0, -3.0, 0.0];
//! let pool = PagedPool::flashinfer_nhd(&k, &k, 3, 2, 1, 1)?;
//! let seq = PagedSeq::new(pool, &[0, 1, 2], 5)?;
//! let mut bounds = PageBounds::new(pool.layout())?;
//! bounds.update_seq(&seq)?;
//! assert_eq!(bounds.page(1, 0), Some(&[5.0f32, 6.0][..]));
//! assert_eq!(bounds.filled(2), 1);
//! // upper bounds of q = 1 per page, then the best page
//! let ub = [1.0f32, 6.0, -3.0];
//! let mut sel = Selection::new();
//! select_top_pages(&ub, 1, seq.pages().len(), 2, seq.tokens(), 1, &mut sel)?;
//! assert_eq!(sel.head(0), &[2, 3]);
//! # Ok::<(), hgca_kernels::Error>(())
//! ```

use crate::{Error, KvElem, KvSource, PagedLayout, PagedSeq, Result, Selection, check_len};

/// Per page and KV head, the elementwise minimum and maximum of the keys
/// the page holds, in the KV dtype (the min and max of `T` values are `T`
/// values: nothing rounds). Laid out `[num_blocks, kv_heads, 2, d]`.
/// Updated as pages fill ([`PageBounds::update`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PageBounds<T> {
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    data: Vec<T>,
    filled: Vec<u32>,
}

impl<T: KvElem> PageBounds<T> {
    /// Bounds for every page of a pool of `layout`, all pages empty.
    ///
    /// # Errors
    /// [`Error::Capacity`] when the size overflows.
    pub fn new(layout: &PagedLayout) -> Result<Self> {
        let n = layout
            .num_blocks
            .checked_mul(layout.kv_heads)
            .and_then(|x| x.checked_mul(2 * layout.head_dim))
            .ok_or(Error::Capacity {
                what: "page bounds elements",
                capacity: usize::MAX,
                requested: layout.num_blocks,
            })?;
        Ok(Self {
            kv_heads: layout.kv_heads,
            head_dim: layout.head_dim,
            block_size: layout.block_size,
            data: vec![T::from_f32(0.0); n],
            filled: vec![0; layout.num_blocks],
        })
    }

    /// Pages tracked.
    pub fn num_blocks(&self) -> usize {
        self.filled.len()
    }

    /// Tokens of page `p` the bounds cover (0 past the last page).
    pub fn filled(&self, p: usize) -> usize {
        self.filled.get(p).map_or(0, |&f| f as usize)
    }

    /// Bounds of page `p`, KV head `g`: `[lo; d]` then `[hi; d]`; `None`
    /// for an empty page or indices past the end.
    pub fn page(&self, p: usize, g: usize) -> Option<&[T]> {
        if g >= self.kv_heads || self.filled(p) == 0 {
            return None;
        }
        let w = 2 * self.head_dim;
        self.data.get((p * self.kv_heads + g) * w..)?.get(..w)
    }

    /// Brings page `page` up to its first `filled` tokens, read from `seq`
    /// (the sequence holding it: `seq.pages()[slot] == page`): tokens the
    /// bounds already cover are not read again; `filled` below the covered
    /// count rebuilds them from the page's start. A page given to another
    /// sequence must be [`PageBounds::reset`] first.
    ///
    /// # Errors
    /// [`Error::Index`] when `slot` is not one of `seq`'s pages,
    /// [`Error::Capacity`] when `filled` is more than the page holds in
    /// `seq`, [`Error::ShapeMismatch`] when `seq`'s pool differs in
    /// geometry from these bounds.
    pub fn update(&mut self, seq: &PagedSeq<'_, T>, slot: usize, filled: usize) -> Result<()> {
        self.check_pool(seq.pool().layout())?;
        let pages = seq.pages();
        let Some(&page) = pages.get(slot) else {
            return Err(Error::Index {
                what: "page slot of the sequence",
                index: slot,
                len: pages.len(),
            });
        };
        let first = slot * self.block_size;
        let holds = seq.page_tokens(slot);
        if filled > holds {
            return Err(Error::Capacity {
                what: "tokens of the page filled",
                capacity: holds,
                requested: filled,
            });
        }
        let page = page as usize;
        let from = match self.filled[page] as usize {
            f if f > filled => 0,
            f => f,
        };
        let d = self.head_dim;
        for g in 0..self.kv_heads {
            let b = &mut self.data[(page * self.kv_heads + g) * 2 * d..][..2 * d];
            let (lo, hi) = b.split_at_mut(d);
            for i in from..filled {
                let k = seq.k_row(g, first + i);
                for c in 0..d {
                    let x = k[c].to_f32();
                    if i == 0 || x < lo[c].to_f32() {
                        lo[c] = k[c];
                    }
                    if i == 0 || x > hi[c].to_f32() {
                        hi[c] = k[c];
                    }
                }
            }
        }
        self.filled[page] = filled as u32;
        Ok(())
    }

    /// [`PageBounds::update`] of every page of `seq`, each to the tokens
    /// it holds: after an engine appended tokens, only the new ones are read.
    ///
    /// # Errors
    /// As [`PageBounds::update`].
    pub fn update_seq(&mut self, seq: &PagedSeq<'_, T>) -> Result<()> {
        for slot in 0..seq.pages().len() {
            self.update(seq, slot, seq.page_tokens(slot))?;
        }
        Ok(())
    }

    /// Forgets page `page`'s bounds (0 tokens covered). An engine that
    /// frees a page and hands it to another sequence resets it: the bounds
    /// cannot see that the keys changed when the new owner fills the page
    /// to as many tokens as before (past the last page: nothing).
    pub fn reset(&mut self, page: usize) {
        if let Some(f) = self.filled.get_mut(page) {
            *f = 0;
        }
    }

    /// Checks that a pool of `layout` is the one these bounds are for
    /// (heads, head dim, block size, pages).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming the four counts.
    pub fn check_pool(&self, l: &PagedLayout) -> Result<()> {
        if (l.kv_heads, l.head_dim, l.block_size, l.num_blocks)
            == (
                self.kv_heads,
                self.head_dim,
                self.block_size,
                self.num_blocks(),
            )
        {
            return Ok(());
        }
        Err(Error::ShapeMismatch {
            what: "page bounds (kv_heads, head_dim, block_size, num_blocks)",
            expected: format!(
                "({}, {}, {}, {})",
                self.kv_heads,
                self.head_dim,
                self.block_size,
                self.num_blocks()
            ),
            found: format!(
                "({}, {}, {}, {})",
                l.kv_heads, l.head_dim, l.block_size, l.num_blocks
            ),
        })
    }
}

/// Checks `ub [kv_heads, pages]` against the sequence's pages.
fn check_ub(
    ub: &[f32],
    kv_heads: usize,
    pages: usize,
    block_size: usize,
    tokens: usize,
) -> Result<()> {
    if block_size == 0 {
        return Err(Error::Zero { what: "block_size" });
    }
    check_len(
        "page upper bounds (kv_heads * pages)",
        kv_heads.saturating_mul(pages),
        ub.len(),
    )?;
    if tokens.div_ceil(block_size) != pages {
        return Err(Error::ShapeMismatch {
            what: "pages of the sequence",
            expected: tokens.div_ceil(block_size).to_string(),
            found: pages.to_string(),
        });
    }
    if tokens > u32::MAX as usize {
        return Err(Error::Capacity {
            what: "sequence tokens (indices are u32)",
            capacity: u32::MAX as usize,
            requested: tokens,
        });
    }
    Ok(())
}

/// Tokens of page slot `slot` of a sequence of `tokens` in pages of `block_size`.
pub(crate) fn page_tokens(tokens: usize, block_size: usize, slot: usize) -> usize {
    tokens
        .saturating_sub(slot.saturating_mul(block_size))
        .min(block_size)
}

/// Appends the token indices of the sequence's page slots `slots` (sorted
/// here, so the list is in token order) as the next head of `sel`.
fn push_pages(sel: &mut Selection, slots: &mut [usize], block_size: usize, tokens: usize) {
    slots.sort_unstable();
    sel.begin_head();
    for &s in slots.iter() {
        let a = s * block_size;
        for j in a..(a + block_size).min(tokens) {
            sel.push_index(j as u32);
        }
    }
}

/// Page slots of one head in decreasing bound (NaN last, ties by slot).
fn ranked(ub: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..ub.len()).collect();
    order.sort_by(|&a, &b| ub[b].total_cmp(&ub[a]).then(a.cmp(&b)));
    order.sort_by_key(|&i| ub[i].is_nan());
    order
}

/// Top-`k` pages per KV head: from `ub [kv_heads, pages]` (an upper bound
/// of the scores of each of the sequence's pages, in page order), `sel`
/// gets, per head, every token of its `k` pages of highest bound (all
/// pages when `k >= pages`), in token order. `tokens` is the sequence's
/// length, `pages == tokens.div_ceil(block_size)`.
///
/// # Errors
/// [`Error::Length`] when `ub` is not `kv_heads * pages`,
/// [`Error::ShapeMismatch`] when `pages` does not fit `tokens`,
/// [`Error::Zero`] for a zero `block_size`.
pub fn select_top_pages(
    ub: &[f32],
    kv_heads: usize,
    pages: usize,
    block_size: usize,
    tokens: usize,
    k: usize,
    sel: &mut Selection,
) -> Result<()> {
    check_ub(ub, kv_heads, pages, block_size, tokens)?;
    sel.clear();
    for g in 0..kv_heads {
        let mut top = ranked(&ub[g * pages..(g + 1) * pages]);
        top.truncate(k);
        push_pages(sel, &mut top, block_size, tokens);
    }
    Ok(())
}

/// A mass target for [`select_by_mass`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MassTarget {
    /// Estimated share of the attention mass to capture, in `(0, 1]`.
    pub target: f32,
    /// Most pages a head may take, as a share of its pages, in `(0, 1]`;
    /// a head that needs more falls back to all of them (dense), and says
    /// so in its [`HeadMass`].
    pub max_share: f32,
}

impl MassTarget {
    /// The hybrid layer's default: 93% of the estimated mass, at most half
    /// of a head's entries. Chosen on decoded perplexity (*Persuasion*,
    /// window a quarter of the context, f16 KV, int4 key copy; AMD EPYC,
    /// 2026-12-03): 0.9 was 1.09% over full attention on SmolLM2-135M at
    /// 2048 tokens and 1.18% on Qwen2.5-Coder-0.5B at 16384, 0.93 0.59% and
    /// 0.63%, reading 27.1% and 26.0% of full attention's CPU-side bytes
    /// (23.7% and 22.2% at 0.9); on Qwen2.5's 4096-token task suite (52
    /// questions) 49 answers the same as full attention's against 47.
    pub const DEFAULT: MassTarget = MassTarget {
        target: 0.93,
        max_share: 0.5,
    };

    /// Checks the fields.
    ///
    /// # Errors
    /// [`Error::Param`] naming the field outside `(0, 1]`.
    pub fn new(target: f32, max_share: f32) -> Result<Self> {
        for (what, v) in [("mass target", target), ("max page share", max_share)] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(Error::Param {
                    what,
                    value: v as f64,
                    expected: "in (0, 1]",
                });
            }
        }
        Ok(Self { target, max_share })
    }
}

/// What [`select_by_mass`] did for one KV head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadMass {
    /// Pages selected.
    pub pages: usize,
    /// The estimated share of the head's attention mass they hold.
    pub estimated: f32,
    /// True when the target needed more than `max_share` of the pages and
    /// the head took all of them instead.
    pub dense: bool,
}

/// Pages by estimated attention mass, per KV head: page `p` is given the
/// estimated mass `n_p * exp(ub_p)` (its token count times the exponential
/// of its score bound, `ub` already scaled like scores), normalised over
/// the head's pages; pages are admitted in decreasing bound until the
/// admitted estimate reaches `target.target`. A head whose target needs
/// more than `target.max_share` of its pages takes all of them
/// (`dense: true`). `sel` gets the tokens of the admitted pages in token
/// order; `report` one [`HeadMass`] per head. Heads with sparse attention
/// take few pages and flat ones many: one target serves both.
///
/// The estimate uses upper bounds, so it favours pages with one strong key
/// over pages of many middling ones; it is an estimate, and the recall it
/// reaches is measured, not assumed (the hybrid crate's harness).
///
/// # Errors
/// As [`select_top_pages`].
#[allow(clippy::too_many_arguments)]
pub fn select_by_mass(
    ub: &[f32],
    kv_heads: usize,
    pages: usize,
    block_size: usize,
    tokens: usize,
    target: MassTarget,
    sel: &mut Selection,
    report: &mut Vec<HeadMass>,
) -> Result<()> {
    check_ub(ub, kv_heads, pages, block_size, tokens)?;
    sel.clear();
    report.clear();
    let count = |p: usize| page_tokens(tokens, block_size, p);
    for g in 0..kv_heads {
        let row = &ub[g * pages..(g + 1) * pages];
        let order = ranked(row);
        let m = order.first().map_or(f32::NEG_INFINITY, |&p| row[p]);
        let mass: Vec<f64> = (0..pages)
            .map(|p| {
                let w = count(p) as f64 * ((row[p] - m) as f64).exp();
                if w.is_nan() { 0.0 } else { w }
            })
            .collect();
        let total: f64 = mass.iter().sum();
        let limit = ((target.max_share as f64 * pages as f64).ceil() as usize).min(pages);
        let mut acc = 0.0f64;
        let mut taken = 0;
        for &p in &order {
            if total > 0.0 && acc / total >= target.target as f64 {
                break;
            }
            acc += mass[p];
            taken += 1;
        }
        let dense = taken > limit;
        let mut chosen: Vec<usize> = if dense {
            (0..pages).collect()
        } else {
            order[..taken].to_vec()
        };
        let est = if dense || total <= 0.0 {
            1.0
        } else {
            (acc / total) as f32
        };
        report.push(HeadMass {
            pages: chosen.len(),
            estimated: est,
            dense,
        });
        push_pages(sel, &mut chosen, block_size, tokens);
    }
    Ok(())
}
