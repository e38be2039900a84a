//! The CPU backend handle and the attention it runs over an engine's paged
//! cache: batched decode (whole or by shard on the caller's threads) and
//! causal append.

use std::ffi::c_char;

use ::hgca_cpu::{BatchTokens, CpuBackend, Par, Shard};
use half::{bf16, f16};
use hgca_kernels::{PartialLayout, SelectionRef};

use crate::ffi::{Fail, R, check_size, deref, deref_mut, fail, guard, sized, slice, slice_mut};
use crate::types::hgca_status::{self, *};
use crate::types::*;
use crate::views::{batch_of, lse_format, pool_of, selections, shape_of, with_dtype};

/// A CPU backend: SIMD kernels on the best ISA, its threads. Shared by any
/// number of threads.
#[derive(Debug)]
pub struct hgca_cpu {
    pub(crate) cpu: CpuBackend,
}

impl hgca_cpu {
    /// The Rust backend behind the handle (for Rust code that shares it
    /// with C callers).
    pub fn backend(&self) -> &CpuBackend {
        &self.cpu
    }
}

/// Creates a CPU backend: the best ISA of this machine; `threads` 1 runs
/// every call on the calling thread, 0 on rayon's pool of all cores, `n`
/// on a pool of `n` threads. Free it with [`hgca_cpu_free`].
///
/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_cpu_new(threads: u32, out: *mut *mut hgca_cpu) -> hgca_status {
    guard(|| {
        if out.is_null() {
            return fail(HGCA_NULL_POINTER, "out is null");
        }
        let cpu = CpuBackend::new().with_par(Par::from_threads(threads as usize))?;
        // SAFETY: `out` is non-null and valid for a write by the contract.
        unsafe { out.write(Box::into_raw(Box::new(hgca_cpu { cpu }))) };
        Ok(())
    })
}

/// Frees a CPU backend (null is a no-op). No call may be using it.
///
/// # Safety
/// `cpu` is null or came from [`hgca_cpu_new`] and is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_cpu_free(cpu: *mut hgca_cpu) {
    if !cpu.is_null() {
        // SAFETY: made by `Box::into_raw` in `hgca_cpu_new`, freed once.
        drop(unsafe { Box::from_raw(cpu) });
    }
}

/// The ISA a CPU backend runs (`"avx512"`, `"avx2"`, `"neon"`, `"scalar"`), static.
///
/// # Safety
/// `cpu` is null or a live backend.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_cpu_isa(cpu: *const hgca_cpu) -> *const c_char {
    // SAFETY: the caller's contract.
    match unsafe { cpu.as_ref() }.map(|c| c.cpu.isa().kind()) {
        Some(::hgca_cpu::IsaKind::V4) => c"avx512".as_ptr(),
        Some(::hgca_cpu::IsaKind::V3) => c"avx2".as_ptr(),
        Some(::hgca_cpu::IsaKind::Neon) => c"neon".as_ptr(),
        _ => c"scalar".as_ptr(),
    }
}

/// Which tokens, from a C selection array.
fn tokens_of<'a>(sels: &'a [SelectionRef<'a>], dense: bool) -> BatchTokens<'a> {
    if dense {
        BatchTokens::Dense
    } else {
        BatchTokens::SparseRef(sels)
    }
}

/// The common body of the batched decodes.
///
/// # Safety
/// The caller's contract of [`hgca_decode_batch`].
#[allow(clippy::too_many_arguments)]
unsafe fn decode_common(
    cpu: *const hgca_cpu,
    shard: Option<(usize, usize)>,
    shape: *const hgca_shape,
    q: *const f32,
    q_len: usize,
    cache: *const hgca_paged_cache,
    table: *const hgca_block_table,
    sels: *const hgca_selection,
    n_sels: usize,
    outputs: *const hgca_outputs,
) -> R {
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
    let o = unsafe { sized(outputs, "outputs") }?;
    check_size::<hgca_outputs>(o.size, "hgca_outputs")?;
    let fmt = lse_format(o.lse_base, o.lse_layout)?;
    let dense = sels.is_null();
    let sels = if dense {
        Vec::new()
    } else {
        // SAFETY: the caller's contract on the selections.
        unsafe { selections(sels, n_sels) }?
    };
    // SAFETY: as above.
    let out = unsafe { slice_mut(o.out, o.out_len, "out") }?;
    // SAFETY: as above.
    let lse = unsafe { slice_mut(o.lse, o.lse_len, "lse") }?;
    let w = if o.weights.is_null() {
        None
    } else {
        // SAFETY: the caller's contract on the weights.
        Some(unsafe { slice_mut(o.weights, o.weights_len, "weights") }?)
    };
    with_dtype!(cache.dtype, T => {
        // SAFETY: as above.
        let pool = unsafe { pool_of::<T>(cache) }?;
        // SAFETY: as above.
        let batch = unsafe { batch_of(pool, table) }?;
        let tokens = tokens_of(&sels, dense);
        match shard {
            None => cpu.decode_batch(&shape, q, &batch, tokens, out, lse, fmt, w)?,
            Some((ith, nth)) => cpu.decode_batch_shard(Shard::new(ith, nth)?, &shape, q, &batch, tokens, out, lse, fmt, w)?,
        }
        Ok(())
    })
}

/// Batched varlen decode over an engine's paged cache: `q [batch, q_heads,
/// head_dim]`, each sequence attending all its tokens (`sels` null) or its
/// selection (`sels[b]`, `n_sels == batch`); `outputs->out [batch,
/// q_heads, head_dim]`, `outputs->lse [batch * q_heads]` in its base and
/// layout; `outputs->weights` (optional) the softmax weights of the
/// attended entries, sequence after sequence (dense: `[q_heads, seq_len]`;
/// sparse: per KV head `g` a `[group, len_g]` block at `group *
/// offsets[g]`). Thread-safe on a shared `cpu`.
///
/// # Safety
/// Every pointer is null or valid for its stated length for the call;
/// outputs do not alias inputs.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_decode_batch(
    cpu: *const hgca_cpu,
    shape: *const hgca_shape,
    q: *const f32,
    q_len: usize,
    cache: *const hgca_paged_cache,
    table: *const hgca_block_table,
    sels: *const hgca_selection,
    n_sels: usize,
    outputs: *const hgca_outputs,
) -> hgca_status {
    // SAFETY: forwarded contract.
    guard(|| unsafe {
        decode_common(
            cpu, None, shape, q, q_len, cache, table, sels, n_sels, outputs,
        )
    })
}

/// Shard `ith` of `nth` of [`hgca_decode_batch`], on the calling thread
/// (no threads of hgca's): `outputs` hold only this shard's rows
/// ([`hgca_shard_rows`]) and, for weights, its part of them
/// ([`hgca_shard_weights`]); the lse layout must be
/// `HGCA_LSE_TOKENS_HEADS`. Thread-safe: run the shards on the caller's
/// pool, each writing its own rows.
///
/// # Safety
/// As [`hgca_decode_batch`].
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_decode_batch_shard(
    cpu: *const hgca_cpu,
    ith: usize,
    nth: usize,
    shape: *const hgca_shape,
    q: *const f32,
    q_len: usize,
    cache: *const hgca_paged_cache,
    table: *const hgca_block_table,
    sels: *const hgca_selection,
    n_sels: usize,
    outputs: *const hgca_outputs,
) -> hgca_status {
    // SAFETY: forwarded contract.
    guard(|| unsafe {
        decode_common(
            cpu,
            Some((ith, nth)),
            shape,
            q,
            q_len,
            cache,
            table,
            sels,
            n_sels,
            outputs,
        )
    })
}

/// The query rows (`b * q_heads + h`) shard `ith` of `nth` of a batched
/// decode of `batch` sequences computes: `*first`, `*count`.
///
/// # Safety
/// Pointers null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_shard_rows(
    shape: *const hgca_shape,
    batch: usize,
    ith: usize,
    nth: usize,
    first: *mut usize,
    count: *mut usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let shape = shape_of(unsafe { sized(shape, "shape") }?)?;
        let r = CpuBackend::shard_rows(&shape, batch, Shard::new(ith, nth)?);
        // SAFETY: the caller's contract on `first` and `count`.
        unsafe { write_range(r, first, count) }
    })
}

/// Writes `r` as `*first` and `*count`.
///
/// # Safety
/// `first` and `count` are null or valid for writes.
unsafe fn write_range(r: std::ops::Range<usize>, first: *mut usize, count: *mut usize) -> R {
    // SAFETY: the caller's contract (null and alignment checked there).
    let (f, c) = unsafe { (deref_mut(first, "first")?, deref_mut(count, "count")?) };
    (*f, *c) = (r.start, r.len());
    Ok(())
}

/// The part of a batched decode's weights that shard `ith` of `nth`
/// writes: `*first`, `*count` (`sels` null for dense).
///
/// # Safety
/// As [`hgca_decode_batch`].
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_shard_weights(
    shape: *const hgca_shape,
    cache: *const hgca_paged_cache,
    table: *const hgca_block_table,
    sels: *const hgca_selection,
    n_sels: usize,
    ith: usize,
    nth: usize,
    first: *mut usize,
    count: *mut usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract, for each pointer below.
        let shape = shape_of(unsafe { sized(shape, "shape") }?)?;
        // SAFETY: as above.
        let cache = unsafe { sized(cache, "cache") }?;
        // SAFETY: as above.
        let table = unsafe { sized(table, "table") }?;
        let dense = sels.is_null();
        let sels = if dense {
            Vec::new()
        } else {
            // SAFETY: the caller's contract on the selections.
            unsafe { selections(sels, n_sels) }?
        };
        with_dtype!(cache.dtype, T => {
            // SAFETY: as above.
            let batch = unsafe { batch_of(pool_of::<T>(cache)?, table) }?;
            let r = CpuBackend::shard_weights(&shape, &batch, tokens_of(&sels, dense), Shard::new(ith, nth)?)?;
            // SAFETY: the caller's contract on `first` and `count`.
            unsafe { write_range(r, first, count) }
        })
    })
}

/// Causal append (prefill) attention over sequence `seq` of a paged
/// cache: `n_q` queries `q [n_q, q_heads, head_dim]`, query `i` seeing the
/// sequence's tokens `0 .. min(visible0 + i, seq_len)` (for a chunk whose
/// own K/V are the sequence's last `n_q` tokens, `visible0 = seq_len - n_q
/// + 1`); `outputs->out [n_q, q_heads, head_dim]`, `lse [n_q * q_heads]`.
/// Weights are not offered (null). Thread-safe on a shared `cpu`.
///
/// # Safety
/// As [`hgca_decode_batch`].
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_append_attention(
    cpu: *const hgca_cpu,
    shape: *const hgca_shape,
    q: *const f32,
    n_q: usize,
    visible0: usize,
    cache: *const hgca_paged_cache,
    table: *const hgca_block_table,
    seq: usize,
    outputs: *const hgca_outputs,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract, for each pointer below.
        let cpu = &unsafe { deref(cpu, "cpu") }?.cpu;
        // SAFETY: as above.
        let shape = shape_of(unsafe { sized(shape, "shape") }?)?;
        let q_len = n_q
            .checked_mul(shape.q_len())
            .ok_or_else(|| Fail(HGCA_CAPACITY, "n_q overflows".into()))?;
        // SAFETY: as above.
        let q = unsafe { slice(q, q_len, "q") }?;
        // SAFETY: as above.
        let cache = unsafe { sized(cache, "cache") }?;
        // SAFETY: as above.
        let table = unsafe { sized(table, "table") }?;
        // SAFETY: as above.
        let o = unsafe { sized(outputs, "outputs") }?;
        check_size::<hgca_outputs>(o.size, "hgca_outputs")?;
        if !o.weights.is_null() {
            return fail(
                HGCA_PARAM,
                "append attention writes no weights: pass weights = NULL",
            );
        }
        let fmt = lse_format(o.lse_base, o.lse_layout)?;
        // SAFETY: as above.
        let out = unsafe { slice_mut(o.out, o.out_len, "out") }?;
        // SAFETY: as above.
        let lse = unsafe { slice_mut(o.lse, o.lse_len, "lse") }?;
        with_dtype!(cache.dtype, T => {
            // SAFETY: as above.
            let batch = unsafe { batch_of(pool_of::<T>(cache)?, table) }?;
            let s = batch.seq(seq).ok_or_else(|| Fail(HGCA_INDEX, format!("seq {seq}: the batch has {}", batch.batch())))?;
            let layout = PartialLayout::append(&shape, n_q);
            hgca_kernels::check_len("lse", layout.rows(), lse.len())?;
            let mut natural = vec![0.0f32; layout.rows()];
            cpu.dense_append(&shape, q, n_q, visible0, &s, hgca_kernels::PartialMut::new(layout, out, &mut natural)?)?;
            fmt.write(&natural, n_q, shape.q_heads(), lse)?;
            Ok(())
        })
    })
}
