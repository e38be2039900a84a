//! The wgpu context, the GPU KV window and the submit/wait machinery.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use hgca_kernels::{
    DType, DenseAttention, Error, KvElem, KvWindow, MergeBackend, PartialLayout, PartialMut,
    PartialRef, Result, WindowBackend, WindowSpec, bf16, check_len, check_len_of, f16,
};

use super::{MAX_HEAD_DIM, WgpuAdapterInfo, WgpuOptions};

/// How long a read-back waits for its map callbacks once the GPU work it
/// reads has completed (they need only another poll; this bounds a bug).
const MAP_DEADLINE: Duration = Duration::from_secs(60);

const BACKEND: &str = "wgpu";
/// Invocations per workgroup of every kernel (the `64u` in the shaders).
const WG: usize = 64;
/// Most splits of one split-K decode.
const MAX_SPLITS: usize = 4096;
/// Most idle buffers the pool keeps.
const POOL_MAX: usize = 64;

const ATTN_SRC: &str = concat!(
    include_str!("shaders/common.wgsl"),
    include_str!("shaders/attn.wgsl")
);
const WEIGHTS_SRC: &str = concat!(
    include_str!("shaders/common.wgsl"),
    include_str!("shaders/weights.wgsl")
);
const MERGE_SRC: &str = concat!(
    include_str!("shaders/common.wgsl"),
    include_str!("shaders/merge.wgsl")
);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn backend_err(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: message.into(),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The uniform parameter block, `Params` in `shaders/common.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    q_heads: u32,
    group: u32,
    d: u32,
    rw: u32,
    cap: u32,
    start: u32,
    len: u32,
    n_splits: u32,
    split_len: u32,
    vis0: i32,
    want_scores: u32,
    scale: f32,
    n_parts: u32,
    nblk: u32,
    pad: u32,
}

#[derive(Debug)]
struct Pipelines {
    /// `attn_split` specialised for f32, f16 and bf16 storage.
    attn: [wgpu::ComputePipeline; 3],
    weights: wgpu::ComputePipeline,
    merge: wgpu::ComputePipeline,
}

/// Idle device buffers, reused by size class (powers of two) and usage.
#[derive(Debug)]
struct Pool {
    free: Mutex<Vec<wgpu::Buffer>>,
    /// Largest buffer the pool hands out (bytes).
    max: u64,
}

impl Pool {
    fn take(&self, device: &wgpu::Device, usage: wgpu::BufferUsages, size: u64) -> wgpu::Buffer {
        let need = size.max(16).next_multiple_of(16);
        let class = need
            .checked_next_power_of_two()
            .filter(|&c| c <= self.max)
            .unwrap_or(need);
        let mut free = lock(&self.free);
        if let Some(i) = free
            .iter()
            .position(|b| b.usage() == usage && b.size() == class)
        {
            return free.swap_remove(i);
        }
        drop(free);
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("hgca pool"),
            size: class,
            usage,
            mapped_at_creation: false,
        })
    }

    fn give(&self, bufs: impl IntoIterator<Item = wgpu::Buffer>) {
        let mut free = lock(&self.free);
        for b in bufs {
            if free.len() < POOL_MAX {
                free.push(b);
            }
        }
    }
}

/// The wgpu context: adapter, device and queue, the compute pipelines (built
/// once) and a pool of reusable device and staging buffers.
///
/// Implements [`WindowBackend`], [`DenseAttention`] and [`MergeBackend`].
/// `Send + Sync`: one backend may serve several threads.
pub struct WgpuBackend {
    id: u64,
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: WgpuAdapterInfo,
    max_dim: u32,
    max_binding: u64,
    opts: WgpuOptions,
    pipes: Pipelines,
    pool: Pool,
    errors: Arc<Mutex<Option<String>>>,
}

impl fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuBackend")
            .field("id", &self.id)
            .field("info", &self.info)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl WgpuBackend {
    /// The first high-performance adapter, default options.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when no adapter is found, [`Error::Backend`]
    /// when the device cannot be created or a shader does not compile.
    pub fn new() -> Result<Self> {
        Self::with_options(WgpuOptions::default())
    }

    /// A backend with `opts`. Uses the Vulkan, Metal and DX12 backends of
    /// wgpu, or those named by the `WGPU_BACKEND` environment variable.
    ///
    /// # Errors
    /// [`Error::Zero`] for invalid options, [`Error::Unavailable`] when no
    /// adapter is found, [`Error::Backend`] when the device cannot be
    /// created or a shader does not compile.
    pub fn with_options(opts: WgpuOptions) -> Result<Self> {
        opts.validate()?;
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
        let instance = wgpu::Instance::new(desc);
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: if opts.low_power {
                wgpu::PowerPreference::LowPower
            } else {
                wgpu::PowerPreference::HighPerformance
            },
            force_fallback_adapter: opts.force_fallback_adapter,
            ..Default::default()
        }))
        .map_err(|e| Error::Unavailable {
            backend: BACKEND,
            reason: format!("no wgpu adapter: {e}"),
        })?;
        let features = adapter.features() & wgpu::Features::SHADER_F16;
        // The adapter's real limits: WebGPU's defaults cap storage bindings at 128 MiB.
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("hgca"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| backend_err(format!("request_device: {e}")))?;
        let ai = adapter.get_info();
        // Word indices in the shaders are u32: keep every binding below 4 GiB.
        let max_binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size)
            .min((1u64 << 32) - 256);
        let info = WgpuAdapterInfo {
            name: ai.name.clone(),
            backend: format!("{:?}", ai.backend),
            device_type: format!("{:?}", ai.device_type),
            driver: format!("{} {}", ai.driver, ai.driver_info),
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            max_storage_binding: max_binding,
            max_workgroups_per_dim: limits.max_compute_workgroups_per_dimension,
        };

        let errors = Arc::new(Mutex::new(None::<String>));
        let slot = Arc::clone(&errors);
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            lock(&slot).get_or_insert_with(|| e.to_string());
        }));
        let slot = Arc::clone(&errors);
        device.set_device_lost_callback(move |reason, msg| {
            lock(&slot).get_or_insert_with(|| format!("device lost ({reason:?}): {msg}"));
        });

        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = |label: &str, src: &'static str| {
            device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            })
        };
        let attn = module("hgca attn", ATTN_SRC);
        let weights = module("hgca weights", WEIGHTS_SRC);
        let merge = module("hgca merge", MERGE_SRC);
        let pipeline = |m: &wgpu::ShaderModule, entry: &str, constants: &[(&str, f64)]| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: m,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants,
                    ..Default::default()
                },
                cache: None,
            })
        };
        let pipes = Pipelines {
            attn: [
                pipeline(&attn, "attn_split", &[("DTYPE", 0.0)]),
                pipeline(&attn, "attn_split", &[("DTYPE", 1.0)]),
                pipeline(&attn, "attn_split", &[("DTYPE", 2.0)]),
            ],
            weights: pipeline(&weights, "attn_weights", &[]),
            merge: pipeline(&merge, "merge_rows", &[]),
        };
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(backend_err(format!("building the pipelines: {e}")));
        }
        let me = Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            device,
            queue,
            info,
            max_dim: limits.max_compute_workgroups_per_dimension.max(1),
            max_binding,
            opts,
            pipes,
            pool: Pool {
                free: Mutex::new(Vec::new()),
                max: max_binding,
            },
            errors,
        };
        me.take_error()?;
        Ok(me)
    }

    /// The adapter this backend runs on.
    pub fn adapter_info(&self) -> &WgpuAdapterInfo {
        &self.info
    }

    /// The options this backend was built with.
    pub fn options(&self) -> &WgpuOptions {
        &self.opts
    }

    fn take_error(&self) -> Result<()> {
        match lock(&self.errors).take() {
            Some(e) => Err(backend_err(e)),
            None => Ok(()),
        }
    }

    /// Runs `f` inside validation and out-of-memory error scopes.
    fn scoped<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let e1 = pollster::block_on(val.pop());
        let e2 = pollster::block_on(oom.pop());
        if let Some(e) = e1.or(e2) {
            return Err(backend_err(e.to_string()));
        }
        self.take_error()?;
        Ok(out)
    }

    fn own(&self, what: &'static str, owner: u64) -> Result<()> {
        if owner == self.id {
            Ok(())
        } else {
            Err(Error::ShapeMismatch {
                what,
                expected: format!("created by wgpu backend #{}", self.id),
                found: format!("created by wgpu backend #{owner}"),
            })
        }
    }

    fn check_bytes(&self, what: &'static str, bytes: u128) -> Result<u64> {
        if bytes <= self.max_binding as u128 {
            Ok(bytes as u64)
        } else {
            Err(Error::Capacity {
                what,
                capacity: self.max_binding as usize,
                requested: usize::try_from(bytes).unwrap_or(usize::MAX),
            })
        }
    }

    fn take(&self, usage: wgpu::BufferUsages, size: u64) -> wgpu::Buffer {
        self.pool.take(&self.device, usage, size)
    }

    /// `n` workgroups folded into `(y, z)` under the per-dimension limit.
    fn fold(&self, n: usize) -> Result<(u32, u32)> {
        let max = self.max_dim as usize;
        let y = n.clamp(1, max);
        let z = n.div_ceil(y);
        if z > max {
            return Err(Error::Capacity {
                what: "wgpu workgroups",
                capacity: max * max,
                requested: n,
            });
        }
        Ok((y as u32, z as u32))
    }

    fn bind(&self, pipe: &wgpu::ComputePipeline, bufs: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        let layout = pipe.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry<'_>> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        })
    }

    fn params_buffer(&self, p: &Params) -> wgpu::Buffer {
        let b = self.take(
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            size_of::<Params>() as u64,
        );
        self.queue.write_buffer(&b, 0, bytemuck::bytes_of(p));
        b
    }

    /// Submits the copy of the `n` oldest rows of `w` (K, then V, head-major
    /// `[kv_heads, n]` rows) into two staging buffers, and starts mapping them.
    fn copy_oldest(&self, w: &WgpuWindow, n: usize) -> Result<Staged> {
        let (hk, cap) = (w.spec.shape.kv_heads(), w.spec.capacity);
        let row_bytes = w.rw * 4;
        let bytes = (hk * n * row_bytes) as u64;
        let runs = w.runs(w.head, n);
        let usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        self.scoped(|| {
            let ks = self.take(usage, bytes);
            let vs = self.take(usage, bytes);
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("hgca evict"),
                });
            for (src, dst) in [(&w.k, &ks), (&w.v, &vs)] {
                for h in 0..hk {
                    for &(slot, i0, cnt) in &runs {
                        if cnt > 0 {
                            enc.copy_buffer_to_buffer(
                                src,
                                ((h * cap + slot) * row_bytes) as u64,
                                dst,
                                ((h * n + i0) * row_bytes) as u64,
                                (cnt * row_bytes) as u64,
                            );
                        }
                    }
                }
            }
            let index = self.queue.submit([enc.finish()]);
            let rx = start_map(&[(&ks, bytes), (&vs, bytes)]);
            Staged {
                head: w.head,
                n,
                bytes,
                ks,
                vs,
                index,
                rx,
            }
        })
    }

    /// Waits for submission `index`, then for `count` map callbacks on `rx`.
    ///
    /// With several threads on one device, the callbacks run in whichever
    /// thread's poll finds them ready: ours may return with nothing to do
    /// while another thread is still about to call them. So this waits on
    /// the channel itself (polling in between), up to [`MAP_DEADLINE`],
    /// instead of counting polls (64 quick polls lost that race in the
    /// test suite's parallel threads).
    fn await_map(
        &self,
        index: wgpu::SubmissionIndex,
        rx: &mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>,
        count: usize,
    ) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(|e| backend_err(format!("poll: {e}")))?;
        let deadline = Instant::now() + MAP_DEADLINE;
        let mut got = 0;
        loop {
            while let Ok(r) = rx.try_recv() {
                self.mapped(r)?;
                got += 1;
            }
            if got >= count {
                return self.take_error();
            }
            self.take_error()?;
            if Instant::now() >= deadline {
                return Err(backend_err(format!(
                    "the staging buffer was not mapped within {MAP_DEADLINE:?} of its submission completing"
                )));
            }
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(r) => {
                    self.mapped(r)?;
                    got += 1;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(backend_err(
                        "a map callback was dropped without being called",
                    ));
                }
            }
            self.device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| backend_err(format!("poll: {e}")))?;
        }
    }

    /// One map callback's result; a failed mapping reports the device's own
    /// error first when it has one (a lost device or out of memory is the
    /// cause, the mapping only its symptom).
    fn mapped(&self, r: std::result::Result<(), wgpu::BufferAsyncError>) -> Result<()> {
        r.or_else(|e| {
            self.take_error()?;
            Err(backend_err(format!("mapping the staging buffer: {e}")))
        })
    }

    /// Tokens per split and the number of splits for `len` tokens and `rows` query rows.
    fn split_plan(&self, len: usize, rows: usize) -> (usize, usize) {
        if len == 0 {
            return (1, 1);
        }
        let min = self.opts.min_split_tokens as usize;
        let want = (self.opts.target_workgroups as usize).div_ceil(rows).max(1);
        let most = len
            .div_ceil(min)
            .clamp(1, MAX_SPLITS.min(self.max_dim as usize));
        let split_len = len.div_ceil(want.min(most));
        (len.div_ceil(split_len), split_len)
    }

    /// Submits split-K attention of `n_q` query tokens over `w`; row token
    /// `i` sees the `clamp(vis0 + i, 0, len)` oldest tokens.
    fn submit_rows(
        &self,
        w: &WgpuWindow,
        q: &[f32],
        n_q: usize,
        vis0: i32,
        want_weights: bool,
    ) -> Result<WgpuPending> {
        let shape = w.spec.shape;
        let (qh, d) = (shape.q_heads(), shape.head_dim());
        let layout = PartialLayout::append(&shape, n_q);
        let rows = layout.rows();
        let len = w.len;
        let weights_len = want_weights.then_some(qh * len);
        if rows == 0 {
            return Ok(WgpuPending {
                owner: self.id,
                layout,
                weights_len,
                gpu: None,
            });
        }
        let (splits, split_len) = self.split_plan(len, rows);
        let (r128, d128, s128) = (rows as u128, d as u128, splits as u128);
        let q_bytes = self.check_bytes("wgpu query bytes", r128 * d128 * 4)?;
        let po_bytes = self.check_bytes("wgpu split partial bytes", s128 * r128 * d128 * 4)?;
        let pl_bytes = self.check_bytes("wgpu split lse bytes", s128 * r128 * 4)?;
        let res_bytes = self.check_bytes("wgpu result bytes", (r128 * d128 + r128) * 4)?;
        let w_bytes = match weights_len {
            Some(n) => self.check_bytes("wgpu weights bytes", n as u128 * 4)?,
            None => 0,
        };
        let with_w = w_bytes > 0;
        let nblk = len.div_ceil(WG);
        let params = Params {
            rows: rows as u32,
            q_heads: qh as u32,
            group: shape.group() as u32,
            d: d as u32,
            rw: w.rw as u32,
            cap: w.spec.capacity as u32,
            start: w.head as u32,
            len: len as u32,
            n_splits: splits as u32,
            split_len: split_len as u32,
            vis0,
            want_scores: u32::from(with_w),
            scale: shape.scale(),
            n_parts: splits as u32,
            nblk: nblk as u32,
            pad: 0,
        };
        let (ry, rz) = self.fold(rows)?;
        let (wy, wz) = self.fold(qh * nblk)?;
        let st = wgpu::BufferUsages::STORAGE;
        let cd = wgpu::BufferUsages::COPY_DST;
        let cs = wgpu::BufferUsages::COPY_SRC;
        self.scoped(|| {
            let pbuf = self.params_buffer(&params);
            let qbuf = self.take(st | cd, q_bytes);
            self.queue.write_buffer(&qbuf, 0, bytemuck::cast_slice(q));
            let po = self.take(st, po_bytes);
            let pl = self.take(st, pl_bytes);
            let scores = self.take(st, w_bytes);
            let res = self.take(st | cs, res_bytes);
            let wbuf = self.take(st | cs, w_bytes);
            let staging = self.take(wgpu::BufferUsages::MAP_READ | cd, res_bytes + w_bytes);
            let attn_pipe = &self.pipes.attn[dtype_index(w.spec.dtype)];
            let bg_attn = self.bind(attn_pipe, &[&pbuf, &qbuf, &w.k, &w.v, &po, &pl, &scores]);
            let bg_merge = self.bind(&self.pipes.merge, &[&pbuf, &po, &pl, &res]);
            let bg_w =
                with_w.then(|| self.bind(&self.pipes.weights, &[&pbuf, &scores, &res, &wbuf]));
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("hgca attention"),
                });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("hgca attention"),
                    timestamp_writes: None,
                });
                pass.set_pipeline(attn_pipe);
                pass.set_bind_group(0, &bg_attn, &[]);
                pass.dispatch_workgroups(splits as u32, ry, rz);
                pass.set_pipeline(&self.pipes.merge);
                pass.set_bind_group(0, &bg_merge, &[]);
                pass.dispatch_workgroups(1, ry, rz);
                if let Some(bg) = &bg_w {
                    pass.set_pipeline(&self.pipes.weights);
                    pass.set_bind_group(0, bg, &[]);
                    pass.dispatch_workgroups(1, wy, wz);
                }
            }
            enc.copy_buffer_to_buffer(&res, 0, &staging, 0, res_bytes);
            if with_w {
                enc.copy_buffer_to_buffer(&wbuf, 0, &staging, res_bytes, w_bytes);
            }
            let index = self.queue.submit([enc.finish()]);
            let rx = start_map(&[(&staging, res_bytes + w_bytes)]);
            InFlight {
                index,
                staging,
                res_bytes,
                w_bytes,
                rx,
                keep: vec![pbuf, qbuf, po, pl, scores, res, wbuf],
            }
        })
        .map(|f| WgpuPending {
            owner: self.id,
            layout,
            weights_len,
            gpu: Some(f),
        })
    }

    /// Uploads `parts` and submits their merge; `layout` is checked by the caller.
    fn submit_merge(&self, parts: &[PartialRef<'_>], layout: PartialLayout) -> Result<InFlight> {
        let (rows, d) = (layout.rows(), layout.head_dim);
        let (n, r128, d128) = (parts.len() as u128, rows as u128, d as u128);
        let po_bytes = self.check_bytes("wgpu merge input bytes", n * r128 * d128 * 4)?;
        let pl_bytes = self.check_bytes("wgpu merge lse bytes", n * r128 * 4)?;
        let res_bytes = self.check_bytes("wgpu merge result bytes", (r128 * d128 + r128) * 4)?;
        let (ry, rz) = self.fold(rows)?;
        let params = Params {
            rows: rows as u32,
            d: d as u32,
            n_parts: parts.len() as u32,
            ..Params::default()
        };
        let st = wgpu::BufferUsages::STORAGE;
        let cd = wgpu::BufferUsages::COPY_DST;
        self.scoped(|| {
            let pbuf = self.params_buffer(&params);
            let po = self.take(st | cd, po_bytes);
            let pl = self.take(st | cd, pl_bytes);
            let res = self.take(st | wgpu::BufferUsages::COPY_SRC, res_bytes);
            let staging = self.take(wgpu::BufferUsages::MAP_READ | cd, res_bytes);
            for (i, p) in parts.iter().enumerate() {
                if !p.out().is_empty() {
                    let off = (i * rows * d * 4) as u64;
                    self.queue
                        .write_buffer(&po, off, bytemuck::cast_slice(p.out()));
                }
                self.queue
                    .write_buffer(&pl, (i * rows * 4) as u64, bytemuck::cast_slice(p.lse()));
            }
            let bg = self.bind(&self.pipes.merge, &[&pbuf, &po, &pl, &res]);
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("hgca merge"),
                });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("hgca merge"),
                    timestamp_writes: None,
                });
                pass.set_pipeline(&self.pipes.merge);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups(1, ry, rz);
            }
            enc.copy_buffer_to_buffer(&res, 0, &staging, 0, res_bytes);
            let index = self.queue.submit([enc.finish()]);
            let rx = start_map(&[(&staging, res_bytes)]);
            InFlight {
                index,
                staging,
                res_bytes,
                w_bytes: 0,
                rx,
                keep: vec![pbuf, po, pl, res],
            }
        })
    }

    /// Waits for `f` and copies its result into `out`, `lse` and `weights`.
    fn finish(
        &self,
        f: InFlight,
        out: &mut [f32],
        lse: &mut [f32],
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        self.await_map(f.index.clone(), &f.rx, 1)?;
        {
            let view = f
                .staging
                .slice(..f.res_bytes + f.w_bytes)
                .get_mapped_range()
                .map_err(|e| backend_err(format!("reading the staging buffer: {e}")))?;
            let (res, wts) = view.split_at(f.res_bytes as usize);
            let (o, l) = res.split_at(out.len() * 4);
            read_f32s(o, out);
            read_f32s(l, lse);
            if let Some(w) = weights {
                read_f32s(wts, w);
            }
        }
        f.staging.unmap();
        self.pool.give(f.keep);
        self.pool.give([f.staging]);
        Ok(())
    }
}

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// Little-endian f32s from `src` into `dst` (`src.len() == 4 * dst.len()`).
fn read_f32s(src: &[u8], dst: &mut [f32]) {
    for (x, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Rows `i0..i0 + n` of KV head `h` of token-major `src [tokens, hk, d]`,
/// rounded to `dtype` and laid out as `rw` little-endian 32-bit words per row.
#[allow(clippy::too_many_arguments)]
fn encode_rows(
    dtype: DType,
    src: &[f32],
    hk: usize,
    d: usize,
    h: usize,
    i0: usize,
    n: usize,
    out: &mut Vec<u8>,
) {
    out.clear();
    for i in i0..i0 + n {
        let row = &src[(i * hk + h) * d..(i * hk + h + 1) * d];
        match dtype {
            DType::F32 => {
                for &x in row {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            DType::F16 => {
                for &x in row {
                    out.extend_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
                }
            }
            DType::BF16 => {
                for &x in row {
                    out.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
                }
            }
        }
        if dtype != DType::F32 && d % 2 == 1 {
            out.extend_from_slice(&[0, 0]);
        }
    }
}

/// A GPU KV window: a ring of `capacity` tokens, `[kv_heads, capacity, d]`
/// for K and for V in device memory, stored as the spec's dtype (16-bit rows
/// padded to an even length).
pub struct WgpuWindow {
    spec: WindowSpec,
    owner: u64,
    /// 32-bit words per row.
    rw: usize,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    /// Ring slot of the oldest token.
    head: usize,
    len: usize,
    start_pos: u64,
    scratch: Vec<u8>,
    /// A prefetch of the oldest rows, if one was started (in a mutex only
    /// to keep the window `Sync`: it is reached through `&mut` alone).
    staged: Mutex<Option<Staged>>,
    /// Evictions that found their rows prefetched.
    prefetched: u64,
}

impl fmt::Debug for WgpuWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuWindow")
            .field("spec", &self.spec)
            .field("len", &self.len)
            .field("start_pos", &self.start_pos)
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

impl KvWindow for WgpuWindow {
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

impl WgpuWindow {
    /// Evictions so far that found their rows already copied out by
    /// [`WindowBackend::prefetch_oldest`].
    pub fn prefetched_evictions(&self) -> u64 {
        self.prefetched
    }

    fn staged_mut(&mut self) -> &mut Option<Staged> {
        self.staged.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// Ring runs `(slot, offset in the block, count)` of `n` tokens from `slot`.
    fn runs(&self, slot: usize, n: usize) -> [(usize, usize, usize); 2] {
        let first = n.min(self.spec.capacity - slot);
        [(slot, 0, first), (0, first, n - first)]
    }
}

/// Starts mapping `bufs` for reading; each callback sends its result.
fn start_map(bufs: &[(&wgpu::Buffer, u64)]) -> mpsc::Receiver<MapResult> {
    let (tx, rx) = mpsc::channel();
    for &(b, bytes) in bufs {
        let tx = tx.clone();
        b.slice(..bytes).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
    }
    // Only the callbacks hold senders now: a callback dropped without
    // being called shows as a disconnect, not as the full deadline.
    drop(tx);
    rx
}

type MapResult = std::result::Result<(), wgpu::BufferAsyncError>;

/// The oldest rows of a window copied into staging buffers (by an eviction,
/// or ahead of it by [`WindowBackend::prefetch_oldest`], then being mapped).
struct Staged {
    /// The window's ring head and token count the copy was made for.
    head: usize,
    n: usize,
    bytes: u64,
    ks: wgpu::Buffer,
    vs: wgpu::Buffer,
    index: wgpu::SubmissionIndex,
    /// The map callbacks' results.
    rx: mpsc::Receiver<MapResult>,
}

/// Work submitted by [`WgpuBackend`] and not yet waited for.
pub struct WgpuPending {
    owner: u64,
    layout: PartialLayout,
    weights_len: Option<usize>,
    gpu: Option<InFlight>,
}

struct InFlight {
    index: wgpu::SubmissionIndex,
    staging: wgpu::Buffer,
    res_bytes: u64,
    w_bytes: u64,
    rx: mpsc::Receiver<MapResult>,
    keep: Vec<wgpu::Buffer>,
}

impl fmt::Debug for WgpuPending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuPending")
            .field("layout", &self.layout)
            .field("weights_len", &self.weights_len)
            .field("in_flight", &self.gpu.is_some())
            .finish_non_exhaustive()
    }
}

impl WindowBackend for WgpuBackend {
    type Window = WgpuWindow;

    fn new_window(&self, spec: WindowSpec) -> Result<WgpuWindow> {
        let shape = spec.shape;
        let d = shape.head_dim();
        if d > MAX_HEAD_DIM {
            return Err(Error::Capacity {
                what: "wgpu head_dim",
                capacity: MAX_HEAD_DIM,
                requested: d,
            });
        }
        let rw = match spec.dtype {
            DType::F32 => d,
            DType::F16 | DType::BF16 => d.div_ceil(2),
        };
        if spec.capacity > (i32::MAX / 4) as usize {
            return Err(Error::Capacity {
                what: "wgpu window capacity",
                capacity: (i32::MAX / 4) as usize,
                requested: spec.capacity,
            });
        }
        let bytes = self.check_bytes(
            "wgpu window bytes (K or V)",
            shape.kv_heads() as u128 * spec.capacity as u128 * rw as u128 * 4,
        )?;
        let (k, v) = self.scoped(|| {
            let mk = |label| {
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: bytes,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_DST
                        | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                })
            };
            (mk("hgca window K"), mk("hgca window V"))
        })?;
        Ok(WgpuWindow {
            spec,
            owner: self.id,
            rw,
            k,
            v,
            head: 0,
            len: 0,
            start_pos: 0,
            scratch: Vec::new(),
            staged: Mutex::new(None),
            prefetched: 0,
        })
    }

    fn append(&self, w: &mut WgpuWindow, n: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.own("wgpu window", w.owner)?;
        w.spec.check_append(w.free(), n, k, v)?;
        let (hk, d) = (w.spec.shape.kv_heads(), w.spec.shape.head_dim());
        if n == 0 {
            return Ok(());
        }
        let cap = w.spec.capacity;
        let runs = w.runs((w.head + w.len) % cap, n);
        let row_bytes = (w.rw * 4) as u64;
        let mut scratch = std::mem::take(&mut w.scratch);
        self.scoped(|| {
            for (src, buf) in [(k, &w.k), (v, &w.v)] {
                for h in 0..hk {
                    for &(slot, i0, cnt) in &runs {
                        if cnt == 0 {
                            continue;
                        }
                        encode_rows(w.spec.dtype, src, hk, d, h, i0, cnt, &mut scratch);
                        let off = (h * cap + slot) as u64 * row_bytes;
                        self.queue.write_buffer(buf, off, &scratch);
                    }
                }
            }
        })?;
        w.scratch = scratch;
        w.len += n;
        Ok(())
    }

    fn evict_oldest<T: KvElem>(
        &self,
        w: &mut WgpuWindow,
        n: usize,
        k_out: &mut [T],
        v_out: &mut [T],
    ) -> Result<()> {
        self.own("wgpu window", w.owner)?;
        w.spec.check_evict(BACKEND, w.len, n, k_out, v_out)?;
        let d = w.spec.shape.head_dim();
        if n == 0 {
            return Ok(());
        }
        let (cap, row_bytes) = (w.spec.capacity, w.rw * 4);
        // A prefetch of exactly these rows is used; any other is dropped.
        let head = w.head;
        let staged = w
            .staged_mut()
            .take()
            .filter(|st| st.head == head && st.n == n);
        let prefetched = staged.is_some();
        let st = match staged {
            Some(st) => st,
            None => self.copy_oldest(w, n)?,
        };
        self.await_map(st.index.clone(), &st.rx, 2)?;
        w.prefetched += u64::from(prefetched);
        let Staged { ks, vs, bytes, .. } = st;
        let esz = size_of::<T>();
        for (stage, out) in [(&ks, k_out), (&vs, v_out)] {
            {
                let view = stage
                    .slice(..bytes)
                    .get_mapped_range()
                    .map_err(|e| backend_err(format!("reading evicted rows: {e}")))?;
                let out: &mut [u8] = bytemuck::cast_slice_mut(out);
                for (src, dst) in view
                    .chunks_exact(row_bytes)
                    .zip(out.chunks_exact_mut(d * esz))
                {
                    dst.copy_from_slice(&src[..d * esz]);
                }
                if cfg!(target_endian = "big") {
                    for e in out.chunks_exact_mut(esz) {
                        e.reverse();
                    }
                }
            }
            stage.unmap();
        }
        self.pool.give([ks, vs]);
        w.head = (w.head + n) % cap;
        w.len -= n;
        w.start_pos += n as u64;
        Ok(())
    }

    fn prefetch_oldest(&self, w: &mut WgpuWindow, n: usize) -> Result<()> {
        self.own("wgpu window", w.owner)?;
        if n > w.len {
            return Err(Error::Capacity {
                what: "window tokens to prefetch",
                capacity: w.len,
                requested: n,
            });
        }
        let head = w.head;
        if n == 0
            || w.staged_mut()
                .as_ref()
                .is_some_and(|st| st.head == head && st.n == n)
        {
            return Ok(());
        }
        *w.staged_mut() = None;
        let st = self.copy_oldest(w, n)?;
        *w.staged_mut() = Some(st);
        Ok(())
    }
}

impl DenseAttention for WgpuBackend {
    type Pending = WgpuPending;

    fn name(&self) -> String {
        format!("wgpu {}", self.info.name)
    }

    fn submit_decode(&self, w: &WgpuWindow, q: &[f32], want_weights: bool) -> Result<WgpuPending> {
        self.own("wgpu window", w.owner)?;
        check_len("q", w.spec.shape.q_len(), q.len())?;
        self.submit_rows(w, q, 1, w.len as i32, want_weights)
    }

    fn submit_append(&self, w: &WgpuWindow, q: &[f32], n_q: usize, p0: u64) -> Result<WgpuPending> {
        self.own("wgpu window", w.owner)?;
        let limit = (i32::MAX / 4) as usize;
        if n_q > limit {
            return Err(Error::Capacity {
                what: "wgpu append queries",
                capacity: limit,
                requested: n_q,
            });
        }
        check_len_of("q", &[n_q, w.spec.shape.q_len()], q.len())?;
        // Query i sees positions <= p0 + i, i.e. the oldest p0 + 1 + i - start_pos tokens.
        let vis0 = (p0 as i128 + 1 - w.start_pos as i128).clamp(-(n_q as i128) - 1, w.len as i128);
        self.submit_rows(w, q, n_q, vis0 as i32, false)
    }

    fn wait(
        &self,
        p: WgpuPending,
        mut out: PartialMut<'_>,
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        self.own("wgpu pending work", p.owner)?;
        if out.layout() != p.layout {
            return Err(Error::ShapeMismatch {
                what: "wait: partial layout",
                expected: format!("{:?}", p.layout),
                found: format!("{:?}", out.layout()),
            });
        }
        let weights = match (weights, p.weights_len) {
            (Some(w), Some(n)) => {
                check_len("weights", n, w.len())?;
                Some(w)
            }
            (Some(_), None) => return Err(hgca_kernels::weights_not_requested()),
            (None, _) => None,
        };
        let (o, l) = out.parts_mut();
        match p.gpu {
            Some(f) => self.finish(f, o, l, weights),
            None => Ok(()),
        }
    }
}

impl MergeBackend for WgpuBackend {
    fn merge(&self, parts: &[PartialRef<'_>], mut dst: PartialMut<'_>) -> Result<()> {
        let layout = dst.layout();
        check_layouts(layout, parts.iter().map(PartialRef::layout))?;
        if layout.rows() == 0 {
            return Ok(());
        }
        if parts.is_empty() {
            dst.set_empty();
            return Ok(());
        }
        let f = self.submit_merge(parts, layout)?;
        let (o, l) = dst.parts_mut();
        self.finish(f, o, l, None)
    }

    fn merge_into(&self, mut acc: PartialMut<'_>, src: PartialRef<'_>) -> Result<()> {
        let layout = acc.layout();
        check_layouts(layout, [src.layout()])?;
        if layout.rows() == 0 {
            return Ok(());
        }
        let f = self.submit_merge(&[acc.as_ref(), src], layout)?;
        let (o, l) = acc.parts_mut();
        self.finish(f, o, l, None)
    }
}

fn check_layouts(
    want: PartialLayout,
    found: impl IntoIterator<Item = PartialLayout>,
) -> Result<()> {
    for l in found {
        if l != want {
            return Err(Error::ShapeMismatch {
                what: "partial layout",
                expected: format!("{want:?}"),
                found: format!("{l:?}"),
            });
        }
    }
    Ok(())
}
