//! Driver and NVRTC presence checks, and kernel compilation to PTX (cached
//! per source and compute capability).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::nvrtc::CompileOptions;
use hgca_kernels::{Error, Result};

use super::{backend::*, device::*};

/// Checks that the NVIDIA driver library can be loaded, that it initialises,
/// and that it sees at least one device. Never panics.
///
/// # Errors
/// [`Error::Unavailable`] with the reason.
pub fn driver_available() -> Result<usize> {
    // SAFETY: only tries to dlopen libcuda under its usual names; no symbol is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable(
            "the NVIDIA driver library (libcuda.so) was not found",
        ));
    }
    cudarc::driver::result::init().map_err(|e| Error::unavailable_from(BACKEND, "cuInit", e))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| Error::unavailable_from(BACKEND, "cuDeviceGetCount", e))?;
    if n <= 0 {
        return Err(unavailable("no CUDA device"));
    }
    Ok(n as usize)
}

/// Checks that NVRTC (`libnvrtc.so`, e.g. from the `nvidia-cuda-nvrtc-cu12`
/// wheel on `LD_LIBRARY_PATH`) can be loaded. Never panics.
///
/// # Errors
/// [`Error::Unavailable`] with the reason.
pub fn nvrtc_available() -> Result<()> {
    // SAFETY: only tries to dlopen libnvrtc under its usual names; no symbol is called.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(unavailable(
            "NVRTC (libnvrtc.so.12) was not found: run scripts/setup-cuda.sh and export its LD_LIBRARY_PATH",
        ))
    }
}

/// Compiles CUDA C `source` to PTX for compute capability `cc` (e.g. `(9, 0)`)
/// with NVRTC. Needs no GPU. The include dir in `HGCA_CUDA_INCLUDE`, when
/// set, is passed on (hgca's kernels themselves need no header).
///
/// # Errors
/// [`Error::Unavailable`] without NVRTC, [`Error::Backend`] with NVRTC's log
/// when compilation fails.
pub fn compile_ptx(source: &str, cc: (u32, u32)) -> Result<String> {
    nvrtc_available()?;
    if source.contains('\0') {
        return Err(Error::backend(BACKEND, "kernel source contains a NUL byte"));
    }
    let mut options = vec![
        format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
        "--std=c++17".to_string(),
    ];
    if let Ok(inc) = std::env::var("HGCA_CUDA_INCLUDE")
        && !inc.is_empty()
        && !inc.contains('\0')
    {
        options.push(format!("--include-path={inc}"));
    }
    let opts = CompileOptions {
        options,
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| match e {
        // The log is the compiler's output: hgca's message, not a source.
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => Error::backend_from(
            BACKEND,
            format!("NVRTC compile failed: {}", log.to_string_lossy()),
            nvrtc,
        ),
        other => Error::backend_from(BACKEND, "NVRTC", other),
    })?;
    Ok(ptx.to_src())
}

/// PTX compiled once per (compute capability, source) for the whole process.
pub(super) fn cached_ptx(source: &str, cc: (u32, u32)) -> Result<String> {
    type Cache = Mutex<HashMap<(u32, u32, String), String>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (cc.0, cc.1, source.to_string());
    if let Some(p) = cache.lock().map_err(|_| poisoned())?.get(&key) {
        return Ok(p.clone());
    }
    let ptx = compile_ptx(source, cc)?;
    cache
        .lock()
        .map_err(|_| poisoned())?
        .insert(key, ptx.clone());
    Ok(ptx)
}
