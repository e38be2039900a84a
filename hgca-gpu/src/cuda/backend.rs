//! The CUDA backend's context ([`CudaBackend`]: device, stream, compiled
//! kernels, options) and the error helpers the other modules share.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, DriverError};
use cudarc::nvrtc::Ptx;
use hgca_kernels::{Error, Result};

use super::spec::MERGE_CU;

use super::{device::*, nvrtc::*, window::*};

pub(super) const BACKEND: &str = "cuda";

/// A CUDA driver API error, kept as the source.
pub(super) fn drv(e: DriverError) -> Error {
    Error::backend_from(BACKEND, "a CUDA driver call", e)
}

pub(super) fn unavailable(reason: impl Into<String>) -> Error {
    Error::unavailable(BACKEND, reason)
}

pub(super) fn too_big(what: &'static str, requested: usize) -> Error {
    Error::Capacity {
        what,
        capacity: i32::MAX as usize,
        requested,
    }
}

pub(super) fn to_i32(what: &'static str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| too_big(what, x))
}

pub(super) fn mul(what: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or(Error::Capacity {
        what,
        capacity: usize::MAX,
        requested: a.max(b),
    })
}

/// Dense attention, KV window and merge on an NVIDIA GPU, with kernels
/// compiled at run time by NVRTC (cached per device and specialisation).
///
/// Work is queued on a compute stream; evictions gather and copy out on a
/// second stream into pinned host memory, so they overlap decode work that
/// is still in flight. `submit_*` return at once; `wait` blocks on an event.
#[derive(Debug, Clone)]
pub struct CudaBackend {
    pub(super) dev: Arc<Device>,
    /// Windows created from now on use the shared-memory staged decode
    /// loop ([`CudaBackend::with_staged_decode`]).
    pub(super) staged: bool,
}

impl CudaBackend {
    /// The backend on device 0.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without driver, device or NVRTC;
    /// [`Error::Backend`] when the driver or NVRTC fails.
    pub fn new() -> Result<Self> {
        Self::with_device(0)
    }

    /// The same backend whose windows created from now on use the
    /// shared-memory staged decode loop (for the 4-token specialisations).
    /// Off by default: it passes the conformance suite on an H200
    /// (2026-12-04) but is slower there than the default loop (63-64%
    /// of the copy rate at 256k tokens against 78-79%, 47-48% against 54-55%
    /// at 32k); `scripts/gpu-check.sh` runs both (`HGCA_CUDA_STAGED=1` in
    /// its tests and bench, not in the library).
    pub fn with_staged_decode(mut self, on: bool) -> Self {
        self.staged = on;
        self
    }

    /// The backend on device `ordinal`.
    ///
    /// # Errors
    /// As [`CudaBackend::new`]; [`Error::Index`] for a device that does not exist.
    pub fn with_device(ordinal: usize) -> Result<Self> {
        let n = driver_available()?;
        if ordinal >= n {
            return Err(Error::Index {
                what: "cuda device",
                index: ordinal,
                len: n,
            });
        }
        nvrtc_available()?;
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        let cc = (major.max(0) as u32, minor.max(0) as u32);
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv)?
            .max(1) as usize;
        let name = ctx.name().map_err(drv)?;
        let compute = ctx.new_stream().map_err(drv)?;
        let copy = ctx.new_stream().map_err(drv)?;
        let ptx = cached_ptx(MERGE_CU, cc)?;
        let module = ctx.load_module(Ptx::from_src(ptx)).map_err(drv)?;
        let merge = super::launch::Merge::load(&module)?;
        #[cfg(feature = "bench-timers")]
        let copy_fn = super::launch::CopyKernel::load(&module)?;
        Ok(Self {
            dev: Arc::new(Device {
                ctx,
                compute,
                copy,
                name,
                cc,
                sms,
                merge,
                #[cfg(feature = "bench-timers")]
                copy_fn,
                attn: Mutex::new(HashMap::new()),
                ffn: Mutex::new(None),
                pinned: Mutex::new(Vec::new()),
            }),
            staged: false,
        })
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    /// The device's compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.dev.cc
    }

    pub(super) fn check_window(&self, w: &CudaWindow) -> Result<()> {
        self.check_device("cuda window", &w.dev)
    }

    /// [`Error::ForeignObject`] (naming `what`) unless `dev` is this
    /// backend's device (an object another instance made).
    pub(super) fn check_device(&self, what: &'static str, dev: &Arc<Device>) -> Result<()> {
        if Arc::ptr_eq(&self.dev, dev) {
            Ok(())
        } else {
            Err(Error::ForeignObject {
                what,
                backend: BACKEND,
            })
        }
    }
}
