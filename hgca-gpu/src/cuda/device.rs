//! One device: its context and stream, the kernels loaded from PTX, the
//! pinned host-buffer pool, and launch-geometry helpers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DeviceRepr, HostSlice, LaunchConfig, PinnedHostSlice,
};
use cudarc::nvrtc::Ptx;
use hgca_kernels::{Error, Result};

use super::spec::KernelSpec;

#[cfg(feature = "bench-timers")]
use super::launch::CopyKernel;
use super::launch::{
    Append, DecodeCombine, DecodeSplit, DecodeWeights, EvictGather, FfnDown, FfnDownSum,
    FfnDownTiled, FfnGateUp, FfnGateUpTiled, Merge, RingWrite,
};
use super::{backend::*, nvrtc::*};

pub(super) fn poisoned() -> Error {
    Error::backend(BACKEND, "a lock was poisoned by a panic in another thread")
}

/// The functions of one loaded attention module.
#[derive(Debug)]
pub(super) struct AttnFns {
    pub(super) spec: KernelSpec,
    pub(super) decode: DecodeSplit,
    pub(super) combine: DecodeCombine,
    pub(super) weights: DecodeWeights,
    pub(super) append: Append,
    pub(super) ring_write: RingWrite,
    pub(super) evict: EvictGather,
}

/// The functions of the loaded FFN module.
#[derive(Debug)]
pub(super) struct FfnFns {
    pub(super) gate_up: FfnGateUp,
    pub(super) down: FfnDown,
    pub(super) gate_up_tiled: FfnGateUpTiled,
    pub(super) down_tiled: FfnDownTiled,
    pub(super) down_sum: FfnDownSum,
}

#[derive(Debug)]
pub(super) struct Device {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) compute: Arc<CudaStream>,
    pub(super) copy: Arc<CudaStream>,
    pub(super) name: String,
    pub(super) cc: (u32, u32),
    pub(super) sms: usize,
    pub(super) merge: Merge,
    /// The copy yardstick of the benchmark timers.
    #[cfg(feature = "bench-timers")]
    pub(super) copy_fn: CopyKernel,
    pub(super) attn: Mutex<HashMap<KernelSpec, Arc<AttnFns>>>,
    /// The FFN module, compiled and loaded on first use.
    pub(super) ffn: Mutex<Option<Arc<FfnFns>>>,
    pub(super) pinned: Mutex<Vec<PinnedHostSlice<f32>>>,
}

impl Device {
    pub(super) fn attn(&self, spec: KernelSpec) -> Result<Arc<AttnFns>> {
        if let Some(f) = self.attn.lock().map_err(|_| poisoned())?.get(&spec) {
            return Ok(f.clone());
        }
        let ptx = cached_ptx(&spec.source(), self.cc)?;
        let module = self.ctx.load_module(Ptx::from_src(ptx)).map_err(drv)?;
        let append = Append::load(&module)?;
        let smem = spec.append_smem_bytes();
        if smem > 48 * 1024 {
            append
                .0
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(drv)?;
        }
        let fns = Arc::new(AttnFns {
            spec,
            decode: DecodeSplit::load(&module)?,
            combine: DecodeCombine::load(&module)?,
            weights: DecodeWeights::load(&module)?,
            append,
            ring_write: RingWrite::load(&module)?,
            evict: EvictGather::load(&module)?,
        });
        self.attn
            .lock()
            .map_err(|_| poisoned())?
            .insert(spec, fns.clone());
        Ok(fns)
    }

    /// The FFN kernels, compiled and loaded on the first call.
    pub(super) fn ffn(&self) -> Result<Arc<FfnFns>> {
        let mut slot = self.ffn.lock().map_err(|_| poisoned())?;
        if let Some(f) = slot.as_ref() {
            return Ok(f.clone());
        }
        let ptx = cached_ptx(super::spec::FFN_CU, self.cc)?;
        let module = self.ctx.load_module(Ptx::from_src(ptx)).map_err(drv)?;
        let fns = Arc::new(FfnFns {
            gate_up: FfnGateUp::load(&module)?,
            down: FfnDown::load(&module)?,
            gate_up_tiled: FfnGateUpTiled::load(&module)?,
            down_tiled: FfnDownTiled::load(&module)?,
            down_sum: FfnDownSum::load(&module)?,
        });
        *slot = Some(fns.clone());
        Ok(fns)
    }

    /// A pinned host buffer of at least `len` floats, from the pool.
    pub(super) fn take_pinned(&self, len: usize) -> Result<PinnedHostSlice<f32>> {
        {
            let mut pool = self.pinned.lock().map_err(|_| poisoned())?;
            if let Some(i) = pool.iter().position(|p| p.len() >= len) {
                return Ok(pool.swap_remove(i));
            }
        }
        alloc_pinned::<f32>(&self.ctx, len.max(1024))
    }

    pub(super) fn give_pinned(&self, p: PinnedHostSlice<f32>) {
        if let Ok(mut pool) = self.pinned.lock()
            && pool.len() < 16
        {
            pool.push(p);
        }
    }

    #[cfg(feature = "bench-timers")]
    pub(super) fn event(&self) -> Result<cudarc::driver::CudaEvent> {
        self.ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)
    }
}

pub(super) fn alloc_pinned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    len: usize,
) -> Result<PinnedHostSlice<T>> {
    if len
        .checked_mul(std::mem::size_of::<T>())
        .is_none_or(|b| b >= isize::MAX as usize)
    {
        return Err(too_big("pinned host buffer", len));
    }
    // SAFETY: the size was checked above; the memory is zeroed below before any read.
    let mut p = unsafe { ctx.alloc_pinned_with_flags::<T>(len, 0) }.map_err(drv)?;
    let ptr = p.as_mut_ptr().map_err(drv)?;
    // SAFETY: `ptr` points to `len` elements of page-locked memory that we own;
    // all-zero bits are a valid `T` (`ValidAsZeroBits`).
    unsafe { std::ptr::write_bytes(ptr, 0, len) };
    Ok(p)
}

/// Queues a copy of all of `src` into the first `src.len()` elements of the
/// pinned `dst` on `stream`; reading `dst` (`as_slice`) waits for it.
///
/// cudarc's `memcpy_dtoh` copies `dst.len()` elements, so with a larger
/// pooled host buffer it reads past the end of `src` (the driver answers
/// `CUDA_ERROR_INVALID_VALUE`, seen on an H200): this copies exactly `src`.
pub(super) fn dtoh_prefix<T: DeviceRepr, S: DevicePtr<T>>(
    stream: &Arc<CudaStream>,
    src: &S,
    dst: &mut PinnedHostSlice<T>,
) -> Result<()> {
    let n = src.len();
    if dst.len() < n {
        return Err(Error::Capacity {
            what: "pinned host buffer",
            capacity: dst.len(),
            requested: n,
        });
    }
    stream.context().bind_to_thread().map_err(drv)?;
    let (sp, _read) = src.device_ptr(stream);
    // SAFETY: the host slice is used with `stream` only; dropping `_written`
    // records the pinned buffer's event after the copy, so a later
    // `as_slice` waits for it. `n <= dst.len()` was checked above and `src`
    // holds `n` elements, so the copy stays inside both allocations.
    unsafe {
        let (host, _written) = dst.stream_synced_mut_slice(stream);
        cudarc::driver::result::memcpy_dtoh_async(&mut host[..n], sp, stream.cu_stream())
            .map_err(drv)?;
    }
    Ok(())
}

pub(super) fn launch_cfg(grid: (u32, u32, u32), block: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

pub(super) fn elementwise_grid(total: usize, block: usize) -> u32 {
    total.div_ceil(block).clamp(1, 65_536) as u32
}
