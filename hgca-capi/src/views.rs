//! The C descriptors read as hgca's own types: shapes, LSE formats, dtypes,
//! paged caches, block tables and selections (and a selection written back).

use hgca_kernels::{
    AttnShape, BlockTable, KvElem, LseBase, LseFormat, LseLayout, PagedBatch, PagedLayout,
    PagedPool, Selection, SelectionRef,
};

use crate::ffi::{Fail, R, check_size, fail, slice, slice_mut};
use crate::types::hgca_status::*;
use crate::types::*;

pub(crate) fn shape_of(s: &hgca_shape) -> R<AttnShape> {
    check_size::<hgca_shape>(s.size, "hgca_shape")?;
    let shape = AttnShape::new(s.q_heads as usize, s.kv_heads as usize, s.head_dim as usize)?;
    Ok(if s.scale == 0.0 {
        shape
    } else {
        shape.with_scale(s.scale)?
    })
}

pub(crate) fn lse_format(base: u32, layout: u32) -> R<LseFormat> {
    let base = match base {
        HGCA_LSE_BASE_E => LseBase::E,
        HGCA_LSE_BASE_2 => LseBase::Two,
        x => {
            return fail(
                HGCA_PARAM,
                format!("lse_base = {x}: expected HGCA_LSE_BASE_E or HGCA_LSE_BASE_2"),
            );
        }
    };
    let layout = match layout {
        HGCA_LSE_TOKENS_HEADS => LseLayout::TokensHeads,
        HGCA_LSE_HEADS_TOKENS => LseLayout::HeadsTokens,
        x => {
            return fail(
                HGCA_PARAM,
                format!(
                    "lse_layout = {x}: expected HGCA_LSE_TOKENS_HEADS or HGCA_LSE_HEADS_TOKENS"
                ),
            );
        }
    };
    Ok(LseFormat { base, layout })
}

/// Runs `$body` with `$t` the Rust type of the dtype value `$d`.
macro_rules! with_dtype {
    ($d:expr, $t:ident => $body:expr) => {
        match $d {
            HGCA_DTYPE_F32 => {
                type $t = f32;
                $body
            }
            HGCA_DTYPE_F16 => {
                type $t = f16;
                $body
            }
            HGCA_DTYPE_BF16 => {
                type $t = bf16;
                $body
            }
            x => fail(
                HGCA_PARAM,
                format!("dtype = {x}: expected HGCA_DTYPE_F32, _F16 or _BF16"),
            ),
        }
    };
}
pub(crate) use with_dtype;

/// The cache as a pool of `T`.
///
/// # Safety
/// The cache's pointers are valid for their lengths for `'a`.
pub(crate) unsafe fn pool_of<'a, T: KvElem>(c: &hgca_paged_cache) -> R<PagedPool<'a, T>> {
    check_size::<hgca_paged_cache>(c.size, "hgca_paged_cache")?;
    // SAFETY: the caller's contract on the cache's pointers.
    let k: &[T] = unsafe { slice(c.k.cast::<T>(), c.k_len, "cache k") }?;
    // SAFETY: as above.
    let v: &[T] = unsafe { slice(c.v.cast::<T>(), c.v_len, "cache v") }?;
    if c.layout > HGCA_KV_STRIDED {
        return fail(
            HGCA_PARAM,
            format!("cache layout = {}: expected one of HGCA_KV_*", c.layout),
        );
    }
    let one = matches!(
        c.layout,
        HGCA_KV_VLLM_CPU
            | HGCA_KV_VLLM_FLASH
            | HGCA_KV_FLASHINFER_NHD_COMBINED
            | HGCA_KV_FLASHINFER_HND_COMBINED
    );
    if !one && c.layout != HGCA_KV_STRIDED && c.v.is_null() {
        return fail(
            HGCA_NULL_POINTER,
            "cache v is null (this layout keeps K and V apart)",
        );
    }
    let (nb, bs, hk, d) = (c.num_blocks, c.block_size, c.kv_heads, c.head_dim);
    let pool = match c.layout {
        HGCA_KV_VLLM_CPU => PagedPool::vllm_cpu(k, nb, hk, bs, d),
        HGCA_KV_VLLM_FLASH => PagedPool::vllm_flash(k, nb, bs, hk, d),
        HGCA_KV_FLASHINFER_NHD => PagedPool::flashinfer_nhd(k, v, nb, bs, hk, d),
        HGCA_KV_FLASHINFER_HND => PagedPool::flashinfer_hnd(k, v, nb, bs, hk, d),
        HGCA_KV_FLASHINFER_NHD_COMBINED => PagedPool::flashinfer_nhd_combined(k, nb, bs, hk, d),
        HGCA_KV_FLASHINFER_HND_COMBINED => PagedPool::flashinfer_hnd_combined(k, nb, bs, hk, d),
        HGCA_KV_TOKEN_MAJOR => PagedPool::token_major(k, v, bs, hk, d, c.token_stride),
        HGCA_KV_HEAD_MAJOR => PagedPool::head_major(k, v, hk, bs, d),
        HGCA_KV_STRIDED => {
            let layout = PagedLayout {
                num_blocks: nb,
                block_size: bs,
                kv_heads: hk,
                head_dim: d,
                block_stride: c.block_stride,
                token_stride: c.token_stride,
                head_stride: c.head_stride,
            };
            let v = if c.v.is_null() { k } else { v };
            PagedPool::strided(k, c.k_offset, v, c.v_offset, layout, 1)
        }
        x => {
            return fail(
                HGCA_PARAM,
                format!("cache layout = {x}: expected one of HGCA_KV_*"),
            );
        }
    }?;
    Ok(pool)
}

/// The table over `pool`, validated.
///
/// # Safety
/// The table's pointers are valid for their lengths for `'a`.
pub(crate) unsafe fn batch_of<'a, T: KvElem>(
    pool: PagedPool<'a, T>,
    t: &hgca_block_table,
) -> R<PagedBatch<'a, T>> {
    check_size::<hgca_block_table>(t.size, "hgca_block_table")?;
    let table = match t.kind {
        HGCA_TABLE_DENSE => {
            let cells = t
                .batch
                .checked_mul(t.max_blocks)
                .ok_or_else(|| Fail(HGCA_CAPACITY, "batch * max_blocks overflows".into()))?;
            // SAFETY: the caller's contract on the table's pointers.
            let table = unsafe { slice(t.table, cells, "block table") }?;
            // SAFETY: as above.
            let lens = unsafe { slice(t.seq_lens, t.batch, "seq_lens") }?;
            BlockTable::dense(table, t.max_blocks, lens)?
        }
        HGCA_TABLE_CSR => {
            let n = t
                .batch
                .checked_add(1)
                .ok_or_else(|| Fail(HGCA_CAPACITY, "batch + 1 overflows".into()))?;
            // SAFETY: the caller's contract on the table's pointers.
            let indptr = unsafe { slice(t.indptr, n, "indptr") }?;
            // SAFETY: as above.
            let indices = unsafe { slice(t.indices, t.indices_len, "indices") }?;
            // SAFETY: as above.
            let last = unsafe { slice(t.last_page_len, t.batch, "last_page_len") }?;
            BlockTable::csr(indptr, indices, last)?
        }
        x => {
            return fail(
                HGCA_PARAM,
                format!("table kind = {x}: expected HGCA_TABLE_DENSE or HGCA_TABLE_CSR"),
            );
        }
    };
    Ok(PagedBatch::new(pool, table)?)
}

/// Views of C selections (no copy).
///
/// # Safety
/// The views' pointers are valid for their lengths for `'a`.
pub(crate) unsafe fn selections<'a>(
    p: *const hgca_selection,
    n: usize,
) -> R<Vec<SelectionRef<'a>>> {
    // SAFETY: the caller's contract.
    let views = unsafe { slice(p, n, "selections") }?;
    views
        .iter()
        .map(|v| {
            // SAFETY: the caller's contract on each view.
            let idx = unsafe { slice(v.indices, v.indices_len, "selection indices") }?;
            // SAFETY: as above.
            let off = unsafe { slice(v.offsets, v.offsets_len, "selection offsets") }?;
            Ok(SelectionRef::new(off, idx)?)
        })
        .collect()
}

/// Writes `sel` into a C selection.
pub(crate) fn write_selection(sel: &Selection, out: &mut hgca_selection_out) -> R {
    out.written = sel.total();
    // SAFETY: the caller's contract on the output's pointers.
    let offs = unsafe { slice_mut(out.offsets, out.offsets_len, "selection offsets") }?;
    if offs.len() != sel.kv_heads() + 1 {
        return fail(
            HGCA_LENGTH,
            format!(
                "selection offsets: expected {} elements, found {}",
                sel.kv_heads() + 1,
                offs.len()
            ),
        );
    }
    if out.capacity < sel.total() {
        return fail(
            HGCA_CAPACITY,
            format!(
                "selection indices: {} needed, capacity {} (written holds the count)",
                sel.total(),
                out.capacity
            ),
        );
    }
    // SAFETY: as above.
    let idx = unsafe { slice_mut(out.indices, out.capacity, "selection indices") }?;
    for (g, o) in offs.iter_mut().enumerate().take(sel.kv_heads()) {
        let (a, h) = (sel.offset(g), sel.head(g));
        *o = a;
        idx[a..a + h.len()].copy_from_slice(h);
    }
    offs[sel.kv_heads()] = sel.total();
    Ok(())
}
