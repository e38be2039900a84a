//! Sparse selection: per-page key bounds (a handle), their score upper
//! bounds, the top-page and mass-targeted selectors, and the MAW update and
//! threshold rule.

use half::{bf16, f16};
use hgca_kernels::{MassTarget, PageBounds, Selection};

use crate::cpu::hgca_cpu;
use crate::ffi::{Fail, deref, deref_mut, fail, guard, sized, slice, slice_mut};
use crate::types::hgca_status::{self, *};
use crate::types::*;
use crate::views::{batch_of, pool_of, shape_of, with_dtype, write_selection};

/// The CPU kernels of the free functions below: the best ISA, on the
/// calling thread.
fn kernels() -> &'static ::hgca_cpu::CpuBackend {
    static CPU: std::sync::OnceLock<::hgca_cpu::CpuBackend> = std::sync::OnceLock::new();
    CPU.get_or_init(::hgca_cpu::CpuBackend::new)
}

/// Key bounds per page and KV head of one cache pool (see `PageBounds`).
#[derive(Debug)]
pub struct hgca_page_bounds {
    dtype: u32,
    inner: BoundsAny,
}

#[derive(Debug)]
enum BoundsAny {
    F32(PageBounds<f32>),
    F16(PageBounds<f16>),
    Bf16(PageBounds<bf16>),
}

/// Creates key bounds for every page of `cache`'s pool (all pages empty).
/// Free with [`hgca_page_bounds_free`].
///
/// # Safety
/// `cache` valid (its buffers are not retained), `out` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_page_bounds_new(
    cache: *const hgca_paged_cache,
    out: *mut *mut hgca_page_bounds,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let cache = unsafe { sized(cache, "cache") }?;
        if out.is_null() {
            return fail(HGCA_NULL_POINTER, "out is null");
        }
        let inner = with_dtype!(cache.dtype, T => {
            // SAFETY: as above.
            let pool = unsafe { pool_of::<T>(cache) }?;
            let b = PageBounds::<T>::new(pool.layout())?;
            Ok(bounds_any(b))
        })?;
        // SAFETY: non-null, valid for a write.
        unsafe {
            out.write(Box::into_raw(Box::new(hgca_page_bounds {
                dtype: cache.dtype,
                inner,
            })))
        };
        Ok(())
    })
}

trait IntoBounds {
    fn wrap(self) -> BoundsAny;
}
impl IntoBounds for PageBounds<f32> {
    fn wrap(self) -> BoundsAny {
        BoundsAny::F32(self)
    }
}
impl IntoBounds for PageBounds<f16> {
    fn wrap(self) -> BoundsAny {
        BoundsAny::F16(self)
    }
}
impl IntoBounds for PageBounds<bf16> {
    fn wrap(self) -> BoundsAny {
        BoundsAny::Bf16(self)
    }
}
fn bounds_any(b: impl IntoBounds) -> BoundsAny {
    b.wrap()
}

/// Runs `$body` with `$b` the typed bounds of `$any` and `$t` its element type.
macro_rules! with_bounds {
    ($any:expr, $b:ident, $t:ident => $body:expr) => {
        match $any {
            BoundsAny::F32($b) => {
                type $t = f32;
                $body
            }
            BoundsAny::F16($b) => {
                type $t = f16;
                $body
            }
            BoundsAny::Bf16($b) => {
                type $t = bf16;
                $body
            }
        }
    };
}

/// Frees page bounds (null is a no-op).
///
/// # Safety
/// `b` is null or came from [`hgca_page_bounds_new`] and is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_page_bounds_free(b: *mut hgca_page_bounds) {
    if !b.is_null() {
        // SAFETY: made by `Box::into_raw`, freed once.
        drop(unsafe { Box::from_raw(b) });
    }
}

/// Forgets the bounds of page `page` (an engine that frees a page and
/// hands it to another sequence calls it: equal fill counts cannot show
/// that the keys changed). A page past the last is a no-op. Needs the
/// bounds for itself.
///
/// # Safety
/// `bounds` null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_page_bounds_reset(
    bounds: *mut hgca_page_bounds,
    page: usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let b = unsafe { deref_mut(bounds, "bounds") }?;
        match &mut b.inner {
            BoundsAny::F32(pb) => pb.reset(page),
            BoundsAny::F16(pb) => pb.reset(page),
            BoundsAny::Bf16(pb) => pb.reset(page),
        }
        Ok(())
    })
}

/// Brings the bounds of every page of sequence `seq` up to the tokens it
/// holds (only new tokens are read; a page filled to fewer tokens than
/// before is rebuilt; a page given to another sequence must be reset with
/// [`hgca_page_bounds_reset`] first). Needs the bounds for itself (one
/// thread at a time).
///
/// # Safety
/// Pointers null or valid for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_page_bounds_update(
    bounds: *mut hgca_page_bounds,
    cache: *const hgca_paged_cache,
    table: *const hgca_block_table,
    seq: usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract, for each pointer below.
        let b = unsafe { deref_mut(bounds, "bounds") }?;
        // SAFETY: as above.
        let cache = unsafe { sized(cache, "cache") }?;
        // SAFETY: as above.
        let table = unsafe { sized(table, "table") }?;
        if cache.dtype != b.dtype {
            return fail(
                HGCA_UNSUPPORTED,
                format!("cache dtype {} is not the bounds' {}", cache.dtype, b.dtype),
            );
        }
        with_bounds!(&mut b.inner, pb, T => {
            // SAFETY: as above.
            let batch = unsafe { batch_of(pool_of::<T>(cache)?, table) }?;
            let s = batch.seq(seq).ok_or_else(|| Fail(HGCA_INDEX, format!("seq {seq}: the batch has {}", batch.batch())))?;
            pb.update_seq(&s)?;
            Ok(())
        })
    })
}

/// Upper bounds of the scores of each of sequence `seq`'s pages per KV
/// head: `ub [kv_heads, pages]` (pages in the sequence's order), from `q
/// [q_heads, head_dim]`. Thread-safe (reads `bounds`).
///
/// # Safety
/// Pointers null or valid for their lengths.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_page_upper_bounds(
    cpu: *const hgca_cpu,
    shape: *const hgca_shape,
    q: *const f32,
    q_len: usize,
    cache: *const hgca_paged_cache,
    table: *const hgca_block_table,
    seq: usize,
    bounds: *const hgca_page_bounds,
    ub: *mut f32,
    ub_len: usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract, for each pointer below.
        let cpu = &unsafe { deref(cpu, "cpu") }?.cpu;
        // SAFETY: as above.
        let shape = shape_of(unsafe { sized(shape, "shape") }?)?;
        // SAFETY: as above.
        let q = unsafe { slice(q, q_len, "q") }?;
        // SAFETY: as above.
        let cache = unsafe { sized(cache, "cache") }?;
        // SAFETY: as above.
        let table = unsafe { sized(table, "table") }?;
        // SAFETY: as above.
        let b = unsafe { deref(bounds, "bounds") }?;
        // SAFETY: as above.
        let ub = unsafe { slice_mut(ub, ub_len, "ub") }?;
        if cache.dtype != b.dtype {
            return fail(
                HGCA_UNSUPPORTED,
                format!("cache dtype {} is not the bounds' {}", cache.dtype, b.dtype),
            );
        }
        with_bounds!(&b.inner, pb, T => {
            // SAFETY: as above.
            let batch = unsafe { batch_of(pool_of::<T>(cache)?, table) }?;
            let s = batch.seq(seq).ok_or_else(|| Fail(HGCA_INDEX, format!("seq {seq}: the batch has {}", batch.batch())))?;
            cpu.page_upper_bounds(&shape, q, &s, pb, ub)?;
            Ok(())
        })
    })
}

/// Top-`k` pages per KV head from `ub [kv_heads, pages]`: every token of
/// each head's `k` pages of highest bound, in token order, into `out`.
/// Thread-safe.
///
/// # Safety
/// Pointers null or valid for their lengths.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_select_top_pages(
    ub: *const f32,
    ub_len: usize,
    kv_heads: usize,
    pages: usize,
    block_size: usize,
    tokens: usize,
    k: usize,
    out: *mut hgca_selection_out,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let ub = unsafe { slice(ub, ub_len, "ub") }?;
        // SAFETY: as above.
        let out = unsafe { deref_mut(out, "out") }?;
        let mut sel = Selection::new();
        hgca_kernels::select_top_pages(ub, kv_heads, pages, block_size, tokens, k, &mut sel)?;
        write_selection(&sel, out)
    })
}

/// Pages by estimated attention mass per KV head until `target` (in (0,
/// 1]) is met; a head that needs more than `max_share` of its pages takes
/// all of them (`reports[g].dense = 1`). `reports` gets `kv_heads` entries.
/// Thread-safe.
///
/// # Safety
/// Pointers null or valid for their lengths.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_select_by_mass(
    ub: *const f32,
    ub_len: usize,
    kv_heads: usize,
    pages: usize,
    block_size: usize,
    tokens: usize,
    target: f32,
    max_share: f32,
    out: *mut hgca_selection_out,
    reports: *mut hgca_head_mass,
    reports_len: usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let ub = unsafe { slice(ub, ub_len, "ub") }?;
        // SAFETY: as above.
        let out = unsafe { deref_mut(out, "out") }?;
        // SAFETY: as above.
        let rep = unsafe { slice_mut(reports, reports_len, "reports") }?;
        hgca_kernels::check_len("reports", kv_heads, rep.len())?;
        let mut sel = Selection::new();
        let mut r = Vec::new();
        let t = MassTarget::new(target, max_share)?;
        hgca_kernels::select_by_mass(ub, kv_heads, pages, block_size, tokens, t, &mut sel, &mut r)?;
        for (d, s) in rep.iter_mut().zip(&r) {
            *d = hgca_head_mass {
                pages: s.pages,
                estimated: s.estimated,
                dense: u32::from(s.dense),
            };
        }
        write_selection(&sel, out)
    })
}

/// The MAW update of attended entries:
/// `maw[idx[i]] = alpha * maw[idx[i]] + (1 - alpha) * weights[i]`, by the
/// vectorised kernel the hybrid layer's own update runs
/// (`CpuBackend::decay_accumulate`). Thread-safe (on distinct `maw`).
///
/// # Safety
/// Pointers null or valid for their lengths.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_maw_update_gather(
    maw: *mut f32,
    maw_len: usize,
    idx: *const u32,
    weights: *const f32,
    n: usize,
    alpha: f32,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { slice_mut(maw, maw_len, "maw") }?;
        // SAFETY: as above.
        let i = unsafe { slice(idx, n, "idx") }?;
        // SAFETY: as above.
        let w = unsafe { slice(weights, n, "weights") }?;
        let a = hgca_kernels::Alpha::new(alpha)?.get();
        // The kernel checks every index before it writes; the caller's
        // argument is `idx`.
        kernels()
            .decay_accumulate(m, Some(i), a, w, n, &[1.0 - a])
            .map_err(|e| match e {
                hgca_kernels::Error::Index { index, len, .. } => hgca_kernels::Error::Index {
                    what: "idx",
                    index,
                    len,
                },
                e => e,
            })?;
        Ok(())
    })
}

/// The paper's threshold rule over `maw [kv_heads, tokens]`: head `g`
/// selects every `j` with `maw[g][j] > betas[g] / n_gpu` (`betas` has
/// `kv_heads` entries, none NaN or negative; a NaN entry never passes), by
/// the scan the hybrid layer runs (`CpuBackend::indices_above`).
/// Thread-safe.
///
/// # Safety
/// Pointers null or valid for their lengths.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_select_threshold(
    maw: *const f32,
    maw_len: usize,
    kv_heads: usize,
    tokens: usize,
    betas: *const f32,
    n_gpu: usize,
    out: *mut hgca_selection_out,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { slice(maw, maw_len, "maw") }?;
        // SAFETY: as above.
        let b = unsafe { slice(betas, kv_heads, "betas") }?;
        // SAFETY: as above.
        let out = unsafe { deref_mut(out, "out") }?;
        let beta = hgca_kernels::Beta::new(b.to_vec())?;
        hgca_kernels::check_len_of("maw", &[kv_heads, tokens], m.len())?;
        let (cpu, mut sel, mut idx) = (kernels(), Selection::new(), Vec::new());
        for h in 0..kv_heads {
            idx.clear();
            let row = &m[h * tokens..(h + 1) * tokens];
            cpu.indices_above(row, beta.threshold(h, n_gpu), 0, &mut idx);
            sel.push_head(idx.iter().copied());
        }
        write_selection(&sel, out)
    })
}
