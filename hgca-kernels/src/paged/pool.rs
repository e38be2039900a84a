//! A pool of KV pages: its geometry ([`PagedLayout`]), the named layouts of
//! the engines, and the validated borrow ([`PagedPool`]).

use crate::{Error, KvElem, Result, error::check_len};

/// `a * b`, or [`Error::Capacity`] naming `what` on overflow.
pub(super) fn mul(what: &'static str, a: usize, b: usize) -> Result<usize> {
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
pub(super) enum PageDiv {
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
    pub(super) fn divmod(self, j: usize) -> (usize, usize) {
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
    pub(super) layout: PagedLayout,
    pub(super) k: &'a [T],
    pub(super) v: &'a [T],
    pub(super) k_offset: usize,
    pub(super) v_offset: usize,
    pub(super) div: PageDiv,
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
    /// of `tokens` tokens: view it with [`PagedSeq::contiguous`](super::PagedSeq::contiguous).
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
    pub(super) fn row_at(&self, page: usize, i: usize, h: usize) -> usize {
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
