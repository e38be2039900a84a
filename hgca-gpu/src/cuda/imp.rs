//! The CUDA backend proper (cargo feature `cuda`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    DriverError, HostSlice, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use half::slice::HalfFloatSliceExt;
use hgca_kernels::{
    DType, DenseAttention, Error, KvElem, KvWindow, MergeBackend, PartialLayout, PartialMut,
    PartialRef, Result, WindowBackend, WindowSpec, bf16, check_len, check_len_of, f16,
};

use super::spec::{APPEND_ROWS, BLOCK_THREADS, KernelSpec, MERGE_CU};

const BACKEND: &str = "cuda";
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// Weights (f32 elements) from which `wait` copies them out on several threads.
const PAR_COPY_MIN: usize = 1 << 18;
/// Largest window: ring indices stay below 2^31 in the kernels' `int`s.
const MAX_CAPACITY: usize = 1 << 30;

fn drv(e: DriverError) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: e.to_string(),
    }
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        reason: reason.into(),
    }
}

fn too_big(what: &'static str, requested: usize) -> Error {
    Error::Capacity {
        what,
        capacity: i32::MAX as usize,
        requested,
    }
}

fn to_i32(what: &'static str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| too_big(what, x))
}

fn mul(what: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or(Error::Capacity {
        what,
        capacity: usize::MAX,
        requested: a.max(b),
    })
}

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
    cudarc::driver::result::init().map_err(|e| unavailable(format!("cuInit failed: {e}")))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| unavailable(format!("cuDeviceGetCount failed: {e}")))?;
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
        return Err(Error::Backend {
            backend: BACKEND,
            message: "kernel source contains a NUL byte".into(),
        });
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
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => Error::Backend {
            backend: BACKEND,
            message: format!("NVRTC: {nvrtc}: {}", log.to_string_lossy()),
        },
        other => Error::Backend {
            backend: BACKEND,
            message: format!("NVRTC: {other}"),
        },
    })?;
    Ok(ptx.to_src())
}

/// PTX compiled once per (compute capability, source) for the whole process.
fn cached_ptx(source: &str, cc: (u32, u32)) -> Result<String> {
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

fn poisoned() -> Error {
    Error::Backend {
        backend: BACKEND,
        message: "a lock was poisoned by a panic in another thread".into(),
    }
}

/// The functions of one loaded attention module.
#[derive(Debug)]
struct AttnFns {
    spec: KernelSpec,
    decode: CudaFunction,
    combine: CudaFunction,
    weights: CudaFunction,
    append: CudaFunction,
    ring_write: CudaFunction,
    evict: CudaFunction,
}

#[derive(Debug)]
struct Device {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    name: String,
    cc: (u32, u32),
    sms: usize,
    merge: CudaFunction,
    copy_fn: CudaFunction,
    attn: Mutex<HashMap<KernelSpec, Arc<AttnFns>>>,
    pinned: Mutex<Vec<PinnedHostSlice<f32>>>,
}

impl Device {
    fn load(&self, source: &str, names: &[&str]) -> Result<Vec<CudaFunction>> {
        let ptx = cached_ptx(source, self.cc)?;
        let module = self.ctx.load_module(Ptx::from_src(ptx)).map_err(drv)?;
        names
            .iter()
            .map(|n| module.load_function(n).map_err(drv))
            .collect()
    }

    fn attn(&self, spec: KernelSpec) -> Result<Arc<AttnFns>> {
        if let Some(f) = self.attn.lock().map_err(|_| poisoned())?.get(&spec) {
            return Ok(f.clone());
        }
        let f = self.load(&spec.source(), &super::spec::ATTENTION_KERNELS)?;
        let smem = spec.append_smem_bytes();
        if smem > 48 * 1024 {
            f[3].set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(drv)?;
        }
        let mut it = f.into_iter();
        let mut next = || {
            it.next().ok_or(Error::Backend {
                backend: BACKEND,
                message: "kernel missing from module".into(),
            })
        };
        let fns = Arc::new(AttnFns {
            spec,
            decode: next()?,
            combine: next()?,
            weights: next()?,
            append: next()?,
            ring_write: next()?,
            evict: next()?,
        });
        self.attn
            .lock()
            .map_err(|_| poisoned())?
            .insert(spec, fns.clone());
        Ok(fns)
    }

    /// A pinned host buffer of at least `len` floats, from the pool.
    fn take_pinned(&self, len: usize) -> Result<PinnedHostSlice<f32>> {
        {
            let mut pool = self.pinned.lock().map_err(|_| poisoned())?;
            if let Some(i) = pool.iter().position(|p| p.len() >= len) {
                return Ok(pool.swap_remove(i));
            }
        }
        alloc_pinned::<f32>(&self.ctx, len.max(1024))
    }

    fn give_pinned(&self, p: PinnedHostSlice<f32>) {
        if let Ok(mut pool) = self.pinned.lock()
            && pool.len() < 16
        {
            pool.push(p);
        }
    }

    fn event(&self) -> Result<cudarc::driver::CudaEvent> {
        self.ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)
    }
}

fn alloc_pinned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
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
fn dtoh_prefix<T: DeviceRepr, S: DevicePtr<T>>(
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

fn launch_cfg(grid: (u32, u32, u32), block: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

fn elementwise_grid(total: usize, block: usize) -> u32 {
    total.div_ceil(block).clamp(1, 65_536) as u32
}

/// Dense attention, KV window and merge on an NVIDIA GPU, with kernels
/// compiled at run time by NVRTC (cached per device and specialisation).
///
/// Work is queued on a compute stream; evictions gather and copy out on a
/// second stream into pinned host memory, so they overlap decode work that
/// is still in flight. `submit_*` return at once; `wait` blocks on an event.
#[derive(Debug, Clone)]
pub struct CudaBackend {
    dev: Arc<Device>,
    /// Windows created from now on use the shared-memory staged decode
    /// loop ([`CudaBackend::with_staged_decode`]).
    staged: bool,
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
    /// Off by default: it compiles without spills (NVRTC, ptxas, in CI) but
    /// has not yet passed the conformance suite on a GPU;
    /// `scripts/gpu-check.sh` runs it (`HGCA_CUDA_STAGED=1` in its tests and
    /// bench, not in the library).
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
        let merge = module.load_function("hgca_merge").map_err(drv)?;
        let copy_fn = module.load_function("hgca_copy").map_err(drv)?;
        Ok(Self {
            dev: Arc::new(Device {
                ctx,
                compute,
                copy,
                name,
                cc,
                sms,
                merge,
                copy_fn,
                attn: Mutex::new(HashMap::new()),
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

    fn check_window(&self, w: &CudaWindow) -> Result<()> {
        if Arc::ptr_eq(&self.dev, &w.dev) {
            Ok(())
        } else {
            Err(Error::Backend {
                backend: BACKEND,
                message: "the window belongs to another CudaBackend".into(),
            })
        }
    }

    fn decode_plan(&self, w: &CudaWindow) -> DecodePlan {
        let spec = w.fns.spec;
        let shape = w.spec.shape;
        let nz = shape.group().div_ceil(spec.heads_per_block());
        let per_split = shape.kv_heads() * nz;
        let target = 4 * self.dev.sms;
        let splits = target.div_ceil(per_split).max(1);
        let step = spec.unroll() * spec.decode_slots();
        let chunk = w.len.div_ceil(splits).next_multiple_of(step).max(2 * step);
        let splits = w.len.div_ceil(chunk).max(1);
        DecodePlan { splits, chunk, nz }
    }

    fn alloc_decode(&self, w: &CudaWindow, want_weights: bool) -> Result<DecodeBufs> {
        let shape = w.spec.shape;
        let plan = self.decode_plan(w);
        let (qh, d) = (shape.q_heads(), shape.head_dim());
        let s = &self.dev.compute;
        let res_len = qh * d
            + qh
            + if want_weights {
                mul("weights", qh, w.len)?
            } else {
                0
            };
        // SAFETY: every element is written by the kernels before it is read.
        let bufs = unsafe {
            DecodeBufs {
                part_o: s
                    .alloc::<f32>(mul("decode partials", plan.splits, qh * d)?)
                    .map_err(drv)?,
                part_lse: s.alloc::<f32>(plan.splits * qh).map_err(drv)?,
                lse2: s.alloc::<f32>(qh).map_err(drv)?,
                res: s.alloc::<f32>(res_len).map_err(drv)?,
                plan,
                want_weights,
            }
        };
        Ok(bufs)
    }

    /// Queues decode attention of `q_dev` over `w` into `b`.
    fn launch_decode(
        &self,
        w: &CudaWindow,
        q_dev: &CudaSlice<f32>,
        b: &mut DecodeBufs,
    ) -> Result<()> {
        let fns = &w.fns;
        let spec = fns.spec;
        let shape = w.spec.shape;
        let (qh, d) = (shape.q_heads(), shape.head_dim());
        let s = &self.dev.compute;
        let plan = b.plan;
        let cap = to_i32("window capacity", w.spec.capacity)?;
        let start = to_i32("window start", w.start_slot)?;
        let len = to_i32("window length", w.len)?;
        let chunk = to_i32("decode chunk", plan.chunk)?;
        let group = to_i32("group", shape.group())?;
        let qhi = to_i32("q_heads", qh)?;
        let splits = to_i32("decode splits", plan.splits)?;
        let qscale = shape.scale() * LOG2_E;
        let (kp, _kg) = w.k.device_ptr(s);
        let (vp, _vg) = w.v.device_ptr(s);
        let (qp, _qg) = q_dev.device_ptr(s);
        let (po, _pog) = b.part_o.device_ptr_mut(s);
        let (pl, _plg) = b.part_lse.device_ptr_mut(s);
        let (l2, _l2g) = b.lse2.device_ptr_mut(s);
        let (res, _rg) = b.res.device_ptr_mut(s);
        let out_p = res;
        let lse_p = res + (qh * d * 4) as u64;
        let w_p = if b.want_weights {
            res + ((qh * d + qh) * 4) as u64
        } else {
            0u64
        };
        let grid = (
            u32::try_from(plan.splits).map_err(|_| too_big("decode splits", plan.splits))?,
            shape.kv_heads() as u32,
            plan.nz as u32,
        );
        // SAFETY: the argument list matches hgca_decode_split's signature; every
        // pointer addresses a live allocation of the size the kernel indexes
        // (K/V: kv_heads * cap * d, q: q_heads * d, partials: splits * q_heads
        // * (d + 1), scores: q_heads * len), all validated at the boundary.
        unsafe {
            s.launch_builder(&fns.decode)
                .arg(&kp)
                .arg(&vp)
                .arg(&qp)
                .arg(&po)
                .arg(&pl)
                .arg(&w_p)
                .arg(&cap)
                .arg(&start)
                .arg(&len)
                .arg(&chunk)
                .arg(&group)
                .arg(&qhi)
                .arg(&qscale)
                .launch(launch_cfg(grid, BLOCK_THREADS, spec.decode_smem_bytes()))
                .map_err(drv)?;
        }
        // SAFETY: matches hgca_decode_combine; partials as above, out/lse inside `res`.
        unsafe {
            s.launch_builder(&fns.combine)
                .arg(&po)
                .arg(&pl)
                .arg(&out_p)
                .arg(&lse_p)
                .arg(&l2)
                .arg(&splits)
                .arg(&qhi)
                .launch(launch_cfg((qh as u32, 1, 1), BLOCK_THREADS, 0))
                .map_err(drv)?;
        }
        if b.want_weights {
            let total = qh * w.len;
            // SAFETY: matches hgca_decode_weights; `w_p` holds q_heads * len floats.
            unsafe {
                s.launch_builder(&fns.weights)
                    .arg(&w_p)
                    .arg(&l2)
                    .arg(&len)
                    .arg(&qhi)
                    .launch(launch_cfg((elementwise_grid(total, 256), 1, 1), 256, 0))
                    .map_err(drv)?;
            }
        }
        Ok(())
    }

    /// Seconds per decode (split + combine kernels, no transfers) of
    /// `q [q_heads, d]` over `window`, averaged over `iters` launches after
    /// one warm-up. For benchmarks.
    ///
    /// # Errors
    /// [`Error::Length`] for a wrong `q`, [`Error::Zero`] for an empty window
    /// or zero `iters`, backend errors.
    pub fn time_decode(&self, window: &CudaWindow, q: &[f32], iters: usize) -> Result<f64> {
        self.check_window(window)?;
        check_len("q", window.spec.shape.q_len(), q.len())?;
        if window.len == 0 {
            return Err(Error::Zero {
                what: "window length",
            });
        }
        if iters == 0 {
            return Err(Error::Zero { what: "iters" });
        }
        let s = &self.dev.compute;
        let q_dev = s.clone_htod(q).map_err(drv)?;
        let mut b = self.alloc_decode(window, false)?;
        self.launch_decode(window, &q_dev, &mut b)?;
        let (e0, e1) = (self.dev.event()?, self.dev.event()?);
        e0.record(s).map_err(drv)?;
        for _ in 0..iters {
            self.launch_decode(window, &q_dev, &mut b)?;
        }
        e1.record(s).map_err(drv)?;
        let ms = e0.elapsed_ms(&e1).map_err(drv)?;
        Ok(ms as f64 * 1e-3 / iters as f64)
    }

    /// Seconds per merge kernel of `n_parts` device-resident partials of
    /// `rows` rows of `d` floats, averaged over `iters` launches. For benchmarks.
    ///
    /// # Errors
    /// [`Error::Zero`] for a zero count, backend errors.
    pub fn time_merge(&self, n_parts: usize, rows: usize, d: usize, iters: usize) -> Result<f64> {
        for (what, v) in [
            ("n_parts", n_parts),
            ("rows", rows),
            ("d", d),
            ("iters", iters),
        ] {
            if v == 0 {
                return Err(Error::Zero { what });
            }
        }
        let s = &self.dev.compute;
        let n_o = mul("merge input", mul("merge input", n_parts, rows)?, d)?;
        let mut host_o = vec![0f32; n_o];
        let mut x = 0x9E37_79B9u32;
        for v in &mut host_o {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *v = (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
        }
        let host_l: Vec<f32> = (0..n_parts * rows).map(|i| (i % 7) as f32 - 3.0).collect();
        let po = s.clone_htod(&host_o).map_err(drv)?;
        let pl = s.clone_htod(&host_l).map_err(drv)?;
        // SAFETY: written by the kernel before any read.
        let mut out = unsafe { s.alloc::<f32>(rows * d) }.map_err(drv)?;
        // SAFETY: as above.
        let mut lse = unsafe { s.alloc::<f32>(rows) }.map_err(drv)?;
        let run = |out: &mut CudaSlice<f32>, lse: &mut CudaSlice<f32>| -> Result<()> {
            self.launch_merge(&po, &pl, out, lse, n_parts, rows, d)
        };
        run(&mut out, &mut lse)?;
        let (e0, e1) = (self.dev.event()?, self.dev.event()?);
        e0.record(s).map_err(drv)?;
        for _ in 0..iters {
            run(&mut out, &mut lse)?;
        }
        e1.record(s).map_err(drv)?;
        let ms = e0.elapsed_ms(&e1).map_err(drv)?;
        Ok(ms as f64 * 1e-3 / iters as f64)
    }

    /// Seconds per device-to-device copy of `bytes` bytes (rounded down to
    /// 16), as `(driver memcpy, copy kernel)`: the bandwidth yardstick.
    ///
    /// # Errors
    /// [`Error::Zero`] for fewer than 16 bytes or zero `iters`, backend errors.
    pub fn time_copy(&self, bytes: usize, iters: usize) -> Result<(f64, f64)> {
        let n4 = bytes / 16;
        if n4 == 0 {
            return Err(Error::Zero {
                what: "copy bytes / 16",
            });
        }
        if iters == 0 {
            return Err(Error::Zero { what: "iters" });
        }
        let s = &self.dev.compute;
        let src = s.alloc_zeros::<f32>(n4 * 4).map_err(drv)?;
        let mut dst = s.alloc_zeros::<f32>(n4 * 4).map_err(drv)?;
        let (e0, e1) = (self.dev.event()?, self.dev.event()?);
        s.memcpy_dtod(&src, &mut dst).map_err(drv)?;
        e0.record(s).map_err(drv)?;
        for _ in 0..iters {
            s.memcpy_dtod(&src, &mut dst).map_err(drv)?;
        }
        e1.record(s).map_err(drv)?;
        let memcpy = e0.elapsed_ms(&e1).map_err(drv)? as f64 * 1e-3 / iters as f64;
        let grid = (4 * self.dev.sms as u32, 1, 1);
        let n4u = n4 as u64;
        let launch = |dst: &mut CudaSlice<f32>| -> Result<()> {
            let (sp, _sg) = src.device_ptr(s);
            let (dp, _dg) = dst.device_ptr_mut(s);
            // SAFETY: matches hgca_copy; both buffers hold n4 float4s.
            unsafe {
                s.launch_builder(&self.dev.copy_fn)
                    .arg(&sp)
                    .arg(&dp)
                    .arg(&n4u)
                    .launch(launch_cfg(grid, 256, 0))
                    .map_err(drv)?;
            }
            Ok(())
        };
        launch(&mut dst)?;
        e0.record(s).map_err(drv)?;
        for _ in 0..iters {
            launch(&mut dst)?;
        }
        e1.record(s).map_err(drv)?;
        let kernel = e0.elapsed_ms(&e1).map_err(drv)? as f64 * 1e-3 / iters as f64;
        Ok((memcpy, kernel))
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_merge(
        &self,
        po: &CudaSlice<f32>,
        pl: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
        n_parts: usize,
        rows: usize,
        d: usize,
    ) -> Result<()> {
        let s = &self.dev.compute;
        let (np, r, dd) = (
            to_i32("merge parts", n_parts)?,
            to_i32("merge rows", rows)?,
            to_i32("head_dim", d)?,
        );
        let (pop, _g1) = po.device_ptr(s);
        let (plp, _g2) = pl.device_ptr(s);
        let (op, _g3) = out.device_ptr_mut(s);
        let (lp, _g4) = lse.device_ptr_mut(s);
        let grid = u32::try_from(rows.div_ceil(8)).map_err(|_| too_big("merge rows", rows))?;
        // SAFETY: matches hgca_merge; parts hold n_parts * rows * (d + 1)
        // floats, out rows * d, lse rows.
        unsafe {
            s.launch_builder(&self.dev.merge)
                .arg(&pop)
                .arg(&plp)
                .arg(&op)
                .arg(&lp)
                .arg(&np)
                .arg(&r)
                .arg(&dd)
                .launch(launch_cfg((grid, 1, 1), 256, 0))
                .map_err(drv)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct DecodePlan {
    splits: usize,
    chunk: usize,
    nz: usize,
}

#[derive(Debug)]
struct DecodeBufs {
    part_o: CudaSlice<f32>,
    part_lse: CudaSlice<f32>,
    lse2: CudaSlice<f32>,
    /// `out [q_heads, d] | lse [q_heads] | weights [q_heads, len]`.
    res: CudaSlice<f32>,
    plan: DecodePlan,
    want_weights: bool,
}

/// A KV window in device memory: K and V `[kv_heads, capacity, d]` in the
/// window's dtype, used as a ring.
#[derive(Debug)]
pub struct CudaWindow {
    spec: WindowSpec,
    dev: Arc<Device>,
    fns: Arc<AttnFns>,
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    start_slot: usize,
    len: usize,
    start_pos: u64,
    /// Host conversion buffer of appends (K then V, window dtype), 4-byte aligned.
    stage: Vec<u32>,
    stage_dev: Option<CudaSlice<u8>>,
    evict_dev: Option<CudaSlice<u8>>,
    evict_host: Option<PinnedHostSlice<u8>>,
}

impl KvWindow for CudaWindow {
    fn spec(&self) -> &WindowSpec {
        &self.spec
    }
    fn len(&self) -> usize {
        self.len
    }
    fn start_pos(&self) -> u64 {
        self.start_pos
    }
}

/// Converts f32 rows into the window dtype's bytes in `dst`.
fn convert_into(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let bad = |_| Error::Backend {
        backend: BACKEND,
        message: "misaligned staging buffer".into(),
    };
    match dtype {
        DType::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        DType::F16 => bytemuck::try_cast_slice_mut::<u8, f16>(dst)
            .map_err(bad)?
            .convert_from_f32_slice(src),
        DType::BF16 => bytemuck::try_cast_slice_mut::<u8, bf16>(dst)
            .map_err(bad)?
            .convert_from_f32_slice(src),
    }
    Ok(())
}

impl WindowBackend for CudaBackend {
    type Window = CudaWindow;

    fn new_window(&self, spec: WindowSpec) -> Result<CudaWindow> {
        let shape = spec.shape;
        if spec.capacity > MAX_CAPACITY {
            return Err(Error::Capacity {
                what: "cuda window capacity",
                capacity: MAX_CAPACITY,
                requested: spec.capacity,
            });
        }
        to_i32("q_heads", shape.q_heads())?;
        let kspec =
            KernelSpec::new(spec.dtype, shape.head_dim(), shape.group())?.with_staged(self.staged);
        let bytes = mul(
            "cuda window bytes",
            mul("cuda window bytes", spec.capacity, shape.kv_token_len())?,
            spec.dtype.size(),
        )?;
        let fns = self.dev.attn(kspec)?;
        let s = &self.dev.compute;
        let k = s.alloc_zeros::<u8>(bytes).map_err(drv)?;
        let v = s.alloc_zeros::<u8>(bytes).map_err(drv)?;
        Ok(CudaWindow {
            spec,
            dev: self.dev.clone(),
            fns,
            k,
            v,
            start_slot: 0,
            len: 0,
            start_pos: 0,
            stage: Vec::new(),
            stage_dev: None,
            evict_dev: None,
            evict_host: None,
        })
    }

    fn append(&self, window: &mut CudaWindow, n: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.check_window(window)?;
        let shape = window.spec.shape;
        window.spec.check_append(window.free(), n, k, v)?;
        let count = n * shape.kv_token_len();
        if n == 0 {
            return Ok(());
        }
        let dtype = window.spec.dtype;
        let half = count * dtype.size();
        let total = 2 * half;
        let w = window;
        w.stage.resize(total.div_ceil(4), 0);
        {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut w.stage);
            let (kb, vb) = bytes[..total].split_at_mut(half);
            convert_into(dtype, k, kb)?;
            convert_into(dtype, v, vb)?;
        }
        let s = &self.dev.compute;
        if w.stage_dev.as_ref().is_none_or(|b| b.len() < total) {
            w.stage_dev = Some(
                s.alloc_zeros::<u8>(total.next_power_of_two())
                    .map_err(drv)?,
            );
        }
        let Some(stage_dev) = w.stage_dev.as_mut() else {
            return Err(poisoned());
        };
        {
            let bytes: &[u8] = bytemuck::cast_slice(&w.stage);
            let mut dst = stage_dev.slice_mut(0..total);
            s.memcpy_htod(&bytes[..total], &mut dst).map_err(drv)?;
        }
        let cap = to_i32("window capacity", w.spec.capacity)?;
        let write_slot = to_i32("write slot", (w.start_slot + w.len) % w.spec.capacity)?;
        let ni = to_i32("append tokens", n)?;
        let kvh = to_i32("kv_heads", shape.kv_heads())?;
        {
            let (kp, _kg) = w.k.device_ptr_mut(s);
            let (vp, _vg) = w.v.device_ptr_mut(s);
            let (sp, _sg) = stage_dev.device_ptr(s);
            let vs = sp + half as u64;
            // SAFETY: matches hgca_ring_write; the staging buffer holds 2 * n *
            // kv_heads * d elements, the ring kv_heads * cap * d, and n <= free.
            unsafe {
                s.launch_builder(&w.fns.ring_write)
                    .arg(&kp)
                    .arg(&vp)
                    .arg(&sp)
                    .arg(&vs)
                    .arg(&cap)
                    .arg(&write_slot)
                    .arg(&ni)
                    .arg(&kvh)
                    .launch(launch_cfg((elementwise_grid(count, 256), 1, 1), 256, 0))
                    .map_err(drv)?;
            }
        }
        w.len += n;
        Ok(())
    }

    fn evict_oldest<T: KvElem>(
        &self,
        window: &mut CudaWindow,
        n: usize,
        k_out: &mut [T],
        v_out: &mut [T],
    ) -> Result<()> {
        self.check_window(window)?;
        let w = window;
        w.spec.check_evict(BACKEND, w.len, n, k_out, v_out)?;
        let shape = w.spec.shape;
        let count = n * shape.kv_token_len();
        if n == 0 {
            return Ok(());
        }
        let half = count * T::DTYPE.size();
        let total = 2 * half;
        let s = &self.dev.copy;
        if w.evict_dev.as_ref().is_none_or(|b| b.len() < total) {
            w.evict_dev = Some(
                s.alloc_zeros::<u8>(total.next_power_of_two())
                    .map_err(drv)?,
            );
        }
        if w.evict_host.as_ref().is_none_or(|b| b.len() < total) {
            w.evict_host = Some(alloc_pinned::<u8>(
                &self.dev.ctx,
                total.next_power_of_two(),
            )?);
        }
        let (Some(ed), Some(eh)) = (w.evict_dev.as_mut(), w.evict_host.as_mut()) else {
            return Err(poisoned());
        };
        let cap = to_i32("window capacity", w.spec.capacity)?;
        let start = to_i32("window start", w.start_slot)?;
        let ni = to_i32("evict tokens", n)?;
        let kvh = to_i32("kv_heads", shape.kv_heads())?;
        {
            // Reading K/V on the copy stream waits for the appends that wrote
            // them (cudarc's per-buffer events); later appends wait for this read.
            let (kp, _kg) = w.k.device_ptr(s);
            let (vp, _vg) = w.v.device_ptr(s);
            let (op, _og) = ed.device_ptr_mut(s);
            let vo = op + half as u64;
            // SAFETY: matches hgca_evict_gather; the staging buffer holds 2 * n *
            // kv_heads * d elements, the ring kv_heads * cap * d, and n <= len.
            unsafe {
                s.launch_builder(&w.fns.evict)
                    .arg(&kp)
                    .arg(&vp)
                    .arg(&op)
                    .arg(&vo)
                    .arg(&cap)
                    .arg(&start)
                    .arg(&ni)
                    .arg(&kvh)
                    .launch(launch_cfg((elementwise_grid(count, 256), 1, 1), 256, 0))
                    .map_err(drv)?;
            }
        }
        dtoh_prefix(s, &ed.slice(0..total), eh)?;
        let host = eh.as_slice().map_err(drv)?;
        bytemuck::cast_slice_mut::<T, u8>(k_out).copy_from_slice(&host[..half]);
        bytemuck::cast_slice_mut::<T, u8>(v_out).copy_from_slice(&host[half..total]);
        w.start_slot = (w.start_slot + n) % w.spec.capacity;
        w.len -= n;
        w.start_pos += n as u64;
        Ok(())
    }
}

#[derive(Debug)]
enum Work {
    /// Nothing to compute: the empty partial.
    Empty,
    Decode {
        _bufs: DecodeBufs,
        _q: CudaSlice<f32>,
    },
    Append {
        _res: CudaSlice<f32>,
        _q: CudaSlice<f32>,
    },
}

/// Work queued by [`CudaBackend`]'s `submit_*`, not yet waited for.
#[derive(Debug)]
pub struct CudaPending {
    layout: PartialLayout,
    /// Window tokens whose weights come back (decode with `want_weights`).
    weights: Option<usize>,
    work: Work,
    host: Option<PinnedHostSlice<f32>>,
}

impl CudaBackend {
    fn finish_submit(
        &self,
        res: &CudaSlice<f32>,
        layout: PartialLayout,
        weights: Option<usize>,
        work: Work,
    ) -> Result<CudaPending> {
        let mut host = self.dev.take_pinned(res.len())?;
        dtoh_prefix(&self.dev.compute, res, &mut host)?;
        Ok(CudaPending {
            layout,
            weights,
            work,
            host: Some(host),
        })
    }
}

impl DenseAttention for CudaBackend {
    type Pending = CudaPending;

    fn name(&self) -> String {
        format!("cuda {}", self.dev.name)
    }

    fn submit_decode(
        &self,
        window: &CudaWindow,
        q: &[f32],
        want_weights: bool,
    ) -> Result<CudaPending> {
        self.check_window(window)?;
        let shape = window.spec.shape;
        check_len("q", shape.q_len(), q.len())?;
        let layout = PartialLayout::decode(&shape);
        let weights = want_weights.then_some(window.len);
        if window.len == 0 {
            return Ok(CudaPending {
                layout,
                weights,
                work: Work::Empty,
                host: None,
            });
        }
        let q_dev = self.dev.compute.clone_htod(q).map_err(drv)?;
        let mut bufs = self.alloc_decode(window, want_weights)?;
        self.launch_decode(window, &q_dev, &mut bufs)?;
        let mut p = self.finish_submit(&bufs.res, layout, weights, Work::Empty)?;
        p.work = Work::Decode {
            _bufs: bufs,
            _q: q_dev,
        };
        Ok(p)
    }

    fn submit_append(
        &self,
        window: &CudaWindow,
        q: &[f32],
        n_q: usize,
        p0: u64,
    ) -> Result<CudaPending> {
        self.check_window(window)?;
        let shape = window.spec.shape;
        check_len("q", mul("q elements", n_q, shape.q_len())?, q.len())?;
        let layout = PartialLayout::append(&shape, n_q);
        if window.len == 0 || n_q == 0 {
            return Ok(CudaPending {
                layout,
                weights: None,
                work: Work::Empty,
                host: None,
            });
        }
        let (qh, d) = (shape.q_heads(), shape.head_dim());
        let rows_total = mul("append rows", n_q, shape.group())?;
        to_i32("append rows", mul("append rows", n_q, qh)?)?;
        let s = &self.dev.compute;
        let q_dev = s.clone_htod(q).map_err(drv)?;
        let rows = n_q * qh;
        // SAFETY: every element is written by hgca_append before it is read.
        let mut res = unsafe { s.alloc::<f32>(rows * (d + 1)) }.map_err(drv)?;
        let w = window;
        let cap = to_i32("window capacity", w.spec.capacity)?;
        let start = to_i32("window start", w.start_slot)?;
        let len = to_i32("window length", w.len)?;
        let rel =
            (p0 as i128 - w.start_pos as i128).clamp(i64::MIN as i128, i64::MAX as i128) as i64;
        let nq = to_i32("n_q", n_q)?;
        let group = to_i32("group", shape.group())?;
        let qhi = to_i32("q_heads", qh)?;
        let qscale = shape.scale() * LOG2_E;
        let grid_x = u32::try_from(rows_total.div_ceil(APPEND_ROWS))
            .map_err(|_| too_big("append blocks", rows_total))?;
        {
            let (kp, _kg) = w.k.device_ptr(s);
            let (vp, _vg) = w.v.device_ptr(s);
            let (qp, _qg) = q_dev.device_ptr(s);
            let (rp, _rg) = res.device_ptr_mut(s);
            let lp = rp + (rows * d * 4) as u64;
            // SAFETY: matches hgca_append; q holds n_q * q_heads * d floats, res
            // n_q * q_heads * (d + 1), the ring kv_heads * cap * d elements.
            unsafe {
                s.launch_builder(&w.fns.append)
                    .arg(&kp)
                    .arg(&vp)
                    .arg(&qp)
                    .arg(&rp)
                    .arg(&lp)
                    .arg(&cap)
                    .arg(&start)
                    .arg(&len)
                    .arg(&rel)
                    .arg(&nq)
                    .arg(&group)
                    .arg(&qhi)
                    .arg(&qscale)
                    .launch(launch_cfg(
                        (grid_x, shape.kv_heads() as u32, 1),
                        BLOCK_THREADS,
                        w.fns.spec.append_smem_bytes(),
                    ))
                    .map_err(drv)?;
            }
        }
        let mut p = self.finish_submit(&res, layout, None, Work::Empty)?;
        p.work = Work::Append {
            _res: res,
            _q: q_dev,
        };
        Ok(p)
    }

    fn wait(
        &self,
        pending: CudaPending,
        mut out: PartialMut<'_>,
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        let layout = pending.layout;
        if out.layout() != layout {
            return Err(Error::ShapeMismatch {
                what: "partial layout",
                expected: format!("{layout:?}"),
                found: format!("{:?}", out.layout()),
            });
        }
        let n_w = match (pending.weights, weights.as_ref()) {
            (Some(len), Some(w)) => {
                check_len_of("weights", &[layout.q_heads, len], w.len())?;
                layout.q_heads * len
            }
            (None, Some(_)) => return Err(hgca_kernels::weights_not_requested()),
            _ => 0,
        };
        let (o, l) = out.parts_mut();
        let Some(host) = pending.host else {
            o.fill(0.0);
            l.fill(f32::NEG_INFINITY);
            return Ok(());
        };
        let data = host.as_slice().map_err(drv)?;
        let (no, nl) = (o.len(), l.len());
        o.copy_from_slice(&data[..no]);
        l.copy_from_slice(&data[no..no + nl]);
        if let Some(w) = weights {
            let src = &data[no + nl..no + nl + n_w];
            if n_w >= PAR_COPY_MIN {
                // Window weights run to megabytes at long windows; one core
                // copying them out was most of a hybrid step's dense wait.
                use rayon::prelude::*;
                w.par_chunks_mut(PAR_COPY_MIN / 4)
                    .zip(src.par_chunks(PAR_COPY_MIN / 4))
                    .for_each(|(d, s)| d.copy_from_slice(s));
            } else {
                w.copy_from_slice(src);
            }
        }
        drop(pending.work);
        self.dev.give_pinned(host);
        Ok(())
    }
}

impl MergeBackend for CudaBackend {
    fn merge(&self, parts: &[PartialRef<'_>], mut dst: PartialMut<'_>) -> Result<()> {
        let layout = dst.layout();
        for p in parts {
            if p.layout() != layout {
                return Err(Error::ShapeMismatch {
                    what: "partial layout",
                    expected: format!("{layout:?}"),
                    found: format!("{:?}", p.layout()),
                });
            }
        }
        if parts.is_empty() {
            dst.set_empty();
            return Ok(());
        }
        let (rows, d) = (layout.rows(), layout.head_dim);
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let n = parts.len();
        let mut host_o = Vec::with_capacity(mul("merge input", n, layout.out_len())?);
        let mut host_l = Vec::with_capacity(n * rows);
        for p in parts {
            host_o.extend_from_slice(p.out());
            host_l.extend_from_slice(p.lse());
        }
        let s = &self.dev.compute;
        let po = s.clone_htod(&host_o).map_err(drv)?;
        let pl = s.clone_htod(&host_l).map_err(drv)?;
        // SAFETY: written by hgca_merge before any read.
        let mut out = unsafe { s.alloc::<f32>(rows * d) }.map_err(drv)?;
        // SAFETY: as above.
        let mut lse = unsafe { s.alloc::<f32>(rows) }.map_err(drv)?;
        self.launch_merge(&po, &pl, &mut out, &mut lse, n, rows, d)?;
        let (o, l) = dst.parts_mut();
        s.memcpy_dtoh(&out, o).map_err(drv)?;
        s.memcpy_dtoh(&lse, l).map_err(drv)?;
        s.synchronize().map_err(drv)?;
        Ok(())
    }

    fn merge_into(&self, mut acc: PartialMut<'_>, src: PartialRef<'_>) -> Result<()> {
        let a = acc.as_ref();
        let (ao, al) = (a.out().to_vec(), a.lse().to_vec());
        let copy = PartialRef::new(a.layout(), &ao, &al)?;
        self.merge(&[copy, src], acc.reborrow())
    }
}
