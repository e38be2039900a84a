//! The hybrid attention layer handle (CPU in both roles, one sequence): its
//! configuration, forward, append, attend and step stats.

use ::hgca_cpu::{CpuBackend, Par};
use ::hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
use half::{bf16, f16};
use hgca_kernels::{AttnShape, MassTarget};

use crate::ffi::{R, check_size, deref, deref_mut, fail, guard, sized, slice, slice_mut};
use crate::types::hgca_status::{self, *};
use crate::types::*;
use crate::views::shape_of;

/// A hybrid attention layer (CPU in both roles), one sequence.
#[derive(Debug)]
pub struct hgca_hybrid {
    inner: HybridAny,
    shape: AttnShape,
}

#[derive(Debug)]
enum HybridAny {
    F32(HybridAttention<CpuBackend, CpuBackend, f32>),
    F16(HybridAttention<CpuBackend, CpuBackend, f16>),
    Bf16(HybridAttention<CpuBackend, CpuBackend, bf16>),
}

/// Fills `cfg` with the defaults (f16 KV, window 1024, block 64, 4 sinks,
/// beta 1, alpha 0.9, the mass-targeted selector (target 0.93, max share 0.5), all cores).
///
/// # Safety
/// `cfg` null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_hybrid_config_default(cfg: *mut hgca_hybrid_config) -> hgca_status {
    guard(|| {
        if cfg.is_null() {
            return fail(HGCA_NULL_POINTER, "cfg is null");
        }
        let d = HybridConfig::default();
        // The mass fields hold the selector's defaults whatever the rule,
        // so that switching `recovery` to HGCA_RECOVERY_MASS needs nothing else.
        let mut mass = MassTarget::DEFAULT;
        let (recovery, param) = match d.recovery {
            Recovery::Frozen => (HGCA_RECOVERY_FROZEN, 0),
            Recovery::Rescore { every } => (HGCA_RECOVERY_RESCORE, every),
            Recovery::BlockBounds { top } => (HGCA_RECOVERY_BLOCK_BOUNDS, top),
            Recovery::Mass(m) => {
                mass = m;
                (HGCA_RECOVERY_MASS, 0)
            }
        };
        let c = hgca_hybrid_config {
            size: core::mem::size_of::<hgca_hybrid_config>() as u32,
            dtype: HGCA_DTYPE_F16,
            window: d.window,
            block: d.block,
            sinks: d.sinks,
            beta: d.beta,
            alpha: d.alpha,
            recovery,
            recovery_param: param,
            refresh_queries: d.refresh_queries,
            threads: 0,
            mass_target: mass.target,
            mass_max_share: mass.max_share,
        };
        // SAFETY: non-null, valid for a write.
        unsafe { cfg.write(c) };
        Ok(())
    })
}

/// Creates a hybrid layer for one sequence, the CPU in both roles (dense
/// window and sparse store). Free with [`hgca_hybrid_free`].
///
/// # Safety
/// Pointers null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_hybrid_new(
    shape: *const hgca_shape,
    cfg: *const hgca_hybrid_config,
    out: *mut *mut hgca_hybrid,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let shape = shape_of(unsafe { sized(shape, "shape") }?)?;
        // SAFETY: as above.
        let c = unsafe { sized(cfg, "cfg") }?;
        check_size::<hgca_hybrid_config>(c.size, "hgca_hybrid_config")?;
        if out.is_null() {
            return fail(HGCA_NULL_POINTER, "out is null");
        }
        let recovery = match c.recovery {
            HGCA_RECOVERY_FROZEN => Recovery::Frozen,
            HGCA_RECOVERY_RESCORE => Recovery::Rescore {
                every: c.recovery_param,
            },
            HGCA_RECOVERY_BLOCK_BOUNDS => Recovery::BlockBounds {
                top: c.recovery_param,
            },
            HGCA_RECOVERY_MASS => Recovery::Mass(MassTarget::new(c.mass_target, c.mass_max_share)?),
            x => {
                return fail(
                    HGCA_PARAM,
                    format!("recovery = {x}: expected one of HGCA_RECOVERY_*"),
                );
            }
        };
        let cfg = HybridConfig {
            window: c.window,
            block: c.block,
            sinks: c.sinks,
            beta: c.beta,
            beta_per_head: None,
            alpha: c.alpha,
            recovery,
            refresh_queries: c.refresh_queries,
            // The mass selector's key copy: the library's default.
            ..HybridConfig::default()
        };
        let cpu = CpuBackend::new().with_par(Par::from_threads(c.threads as usize))?;
        let inner = match c.dtype {
            HGCA_DTYPE_F32 => HybridAny::F32(HybridAttention::cpu_on(shape, cfg, cpu)?),
            HGCA_DTYPE_F16 => HybridAny::F16(HybridAttention::cpu_on(shape, cfg, cpu)?),
            HGCA_DTYPE_BF16 => HybridAny::Bf16(HybridAttention::cpu_on(shape, cfg, cpu)?),
            x => {
                return fail(
                    HGCA_PARAM,
                    format!("dtype = {x}: expected HGCA_DTYPE_F32, _F16 or _BF16"),
                );
            }
        };
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(Box::into_raw(Box::new(hgca_hybrid { inner, shape }))) };
        Ok(())
    })
}

/// Frees a hybrid layer (null is a no-op).
///
/// # Safety
/// `h` null or from [`hgca_hybrid_new`], not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_hybrid_free(h: *mut hgca_hybrid) {
    if !h.is_null() {
        // SAFETY: made by `Box::into_raw`, freed once.
        drop(unsafe { Box::from_raw(h) });
    }
}

macro_rules! with_layer {
    ($h:expr, $l:ident => $body:expr) => {
        match $h {
            HybridAny::F32($l) => $body,
            HybridAny::F16($l) => $body,
            HybridAny::Bf16($l) => $body,
        }
    };
}

/// The layer behind a handle, for itself.
///
/// # Safety
/// `h` null or a live layer not used by another thread for the call.
unsafe fn layer<'a>(h: *mut hgca_hybrid) -> R<&'a mut hgca_hybrid> {
    // SAFETY: the caller's contract.
    unsafe { deref_mut(h, "layer") }
}

/// Runs `n` tokens through the layer: `q [n, q_heads, d]`, `k`, `v` `[n,
/// kv_heads, d]` token-major, `out [n, q_heads, d]` (n = 1 is a decode
/// step, more a causal prompt chunk). One thread at a time per layer.
///
/// # Safety
/// Pointers null or valid for their lengths.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_hybrid_forward(
    h: *mut hgca_hybrid,
    q: *const f32,
    q_len: usize,
    k: *const f32,
    k_len: usize,
    v: *const f32,
    v_len: usize,
    n: usize,
    out: *mut f32,
    out_len: usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract, for each pointer below.
        let h = unsafe { layer(h) }?;
        // SAFETY: as above.
        let (q, k, v) = unsafe {
            (
                slice(q, q_len, "q")?,
                slice(k, k_len, "k")?,
                slice(v, v_len, "v")?,
            )
        };
        // SAFETY: as above.
        let out = unsafe { slice_mut(out, out_len, "out") }?;
        Ok(with_layer!(&mut h.inner, l => l.forward(q, k, v, n, out))?)
    })
}

/// Appends `n` tokens (token-major K and V) without attending.
///
/// # Safety
/// As [`hgca_hybrid_forward`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_hybrid_append(
    h: *mut hgca_hybrid,
    k: *const f32,
    k_len: usize,
    v: *const f32,
    v_len: usize,
    n: usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { layer(h) }?;
        // SAFETY: as above.
        let (k, v) = unsafe { (slice(k, k_len, "k")?, slice(v, v_len, "v")?) };
        Ok(with_layer!(&mut h.inner, l => l.append(k, v, n))?)
    })
}

/// One decode query `q [q_heads, d]` attending every token held; `out [q_heads, d]`.
///
/// # Safety
/// As [`hgca_hybrid_forward`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_hybrid_attend(
    h: *mut hgca_hybrid,
    q: *const f32,
    q_len: usize,
    out: *mut f32,
    out_len: usize,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { layer(h) }?;
        // SAFETY: as above.
        let q = unsafe { slice(q, q_len, "q") }?;
        // SAFETY: as above.
        let out = unsafe { slice_mut(out, out_len, "out") }?;
        Ok(with_layer!(&mut h.inner, l => l.attend(q, out))?)
    })
}

/// Tokens the layer holds (window and CPU store), into `*len`.
///
/// # Safety
/// Pointers null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_hybrid_len(h: *const hgca_hybrid, len: *mut usize) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { deref(h, "layer") }?;
        if len.is_null() {
            return fail(HGCA_NULL_POINTER, "len is null");
        }
        let n = with_layer!(&h.inner, l => l.len());
        // SAFETY: non-null, valid for a write.
        unsafe { len.write(n) };
        Ok(())
    })
}

/// Stats of the last step; set `out->size = sizeof(hgca_step_stats)` first.
///
/// # Safety
/// Pointers null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hgca_hybrid_stats(
    h: *const hgca_hybrid,
    out: *mut hgca_step_stats,
) -> hgca_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { deref(h, "layer") }?;
        // SAFETY: as above.
        unsafe { sized(out.cast_const(), "out") }?;
        // SAFETY: as above (checked non-null, aligned, of this library's size).
        let o = unsafe { deref_mut(out, "out") }?;
        let s = with_layer!(&h.inner, l => l.stats().clone());
        let _ = h.shape;
        *o = hgca_step_stats {
            size: o.size,
            window_tokens: s.window_tokens,
            cpu_tokens: s.cpu_tokens,
            selected: s.selected,
            full_cpu: u32::from(s.full_cpu),
            dense_ns: s.dense.as_nanos() as u64,
            sparse_ns: s.sparse.as_nanos() as u64,
            merge_ns: s.merge.as_nanos() as u64,
            total_ns: s.total.as_nanos() as u64,
            mass_estimated: s.mass_estimated.unwrap_or(f32::NAN),
            dense_heads: s.dense_heads,
        };
        Ok(())
    })
}
