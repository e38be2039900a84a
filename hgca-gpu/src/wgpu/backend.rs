//! The wgpu context: device, pipelines, the buffer pool and the helpers
//! the window, attention and merge modules share.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hgca_kernels::{DType, Error, Result};

use super::{WgpuAdapterInfo, WgpuOptions};

pub(super) const BACKEND: &str = "wgpu";
/// Invocations per workgroup of every kernel (the `64u` in the shaders).
pub(super) const WG: usize = 64;
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
const FFN_UP_SRC: &str = concat!(
    include_str!("shaders/common.wgsl"),
    include_str!("shaders/ffn_up.wgsl")
);
const FFN_DOWN_SRC: &str = concat!(
    include_str!("shaders/common.wgsl"),
    include_str!("shaders/ffn_down.wgsl")
);
const MERGE_SRC: &str = concat!(
    include_str!("shaders/common.wgsl"),
    include_str!("shaders/merge.wgsl")
);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(super) fn backend_err(message: impl Into<String>) -> Error {
    Error::backend(BACKEND, message)
}

/// `cause`, wgpu's own error, met while doing `what`.
pub(super) fn wgpu_err<E: std::error::Error + Send + Sync + 'static>(
    what: &str,
) -> impl FnOnce(E) -> Error + '_ {
    move |cause| Error::backend_from(BACKEND, what, cause)
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The uniform parameter block, `Params` in `shaders/common.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Params {
    pub(super) rows: u32,
    pub(super) q_heads: u32,
    pub(super) group: u32,
    pub(super) d: u32,
    pub(super) rw: u32,
    pub(super) cap: u32,
    pub(super) start: u32,
    pub(super) len: u32,
    pub(super) n_splits: u32,
    pub(super) split_len: u32,
    pub(super) vis0: i32,
    pub(super) want_scores: u32,
    pub(super) scale: f32,
    pub(super) n_parts: u32,
    pub(super) nblk: u32,
    pub(super) pad: u32,
}

#[derive(Debug)]
pub(super) struct Pipelines {
    /// `attn_split` specialised for f32, f16 and bf16 storage.
    pub(super) attn: [wgpu::ComputePipeline; 3],
    pub(super) weights: wgpu::ComputePipeline,
    pub(super) merge: wgpu::ComputePipeline,
    /// The dense FFN's two passes.
    pub(super) ffn_up: wgpu::ComputePipeline,
    pub(super) ffn_down: wgpu::ComputePipeline,
}

/// Idle device buffers, reused by size class (powers of two) and usage.
#[derive(Debug)]
pub(super) struct Pool {
    pub(super) free: Mutex<Vec<wgpu::Buffer>>,
    /// Largest buffer the pool hands out (bytes).
    pub(super) max: u64,
}

impl Pool {
    pub(super) fn take(
        &self,
        device: &wgpu::Device,
        usage: wgpu::BufferUsages,
        size: u64,
    ) -> wgpu::Buffer {
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

    pub(super) fn give(&self, bufs: impl IntoIterator<Item = wgpu::Buffer>) {
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
/// Implements [`hgca_kernels::WindowBackend`], [`hgca_kernels::DenseAttention`]
/// and [`hgca_kernels::MergeBackend`].
/// `Send + Sync`: one backend may serve several threads.
pub struct WgpuBackend {
    pub(super) id: u64,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    pub(super) info: WgpuAdapterInfo,
    pub(super) max_dim: u32,
    pub(super) max_binding: u64,
    pub(super) opts: WgpuOptions,
    pub(super) pipes: Pipelines,
    pub(super) pool: Pool,
    pub(super) errors: Arc<Mutex<Option<Error>>>,
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
        .map_err(|e| Error::unavailable_from(BACKEND, "no wgpu adapter", e))?;
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
        .map_err(wgpu_err("request_device"))?;
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

        let errors = Arc::new(Mutex::new(None::<Error>));
        let slot = Arc::clone(&errors);
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            lock(&slot).get_or_insert_with(|| wgpu_err("an uncaptured device error")(e));
        }));
        let slot = Arc::clone(&errors);
        device.set_device_lost_callback(move |reason, msg| {
            lock(&slot)
                .get_or_insert_with(|| backend_err(format!("device lost ({reason:?}): {msg}")));
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
        let ffn_up = module("hgca ffn up", FFN_UP_SRC);
        let ffn_down = module("hgca ffn down", FFN_DOWN_SRC);
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
            ffn_up: pipeline(&ffn_up, "ffn_gate_up", &[]),
            ffn_down: pipeline(&ffn_down, "ffn_down", &[]),
        };
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(wgpu_err("building the pipelines")(e));
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

    pub(super) fn take_error(&self) -> Result<()> {
        match lock(&self.errors).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Runs `f` inside validation and out-of-memory error scopes.
    pub(super) fn scoped<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let e1 = pollster::block_on(val.pop());
        let e2 = pollster::block_on(oom.pop());
        if let Some(e) = e1.or(e2) {
            return Err(wgpu_err("a scoped device call")(e));
        }
        self.take_error()?;
        Ok(out)
    }

    pub(super) fn own(&self, what: &'static str, owner: u64) -> Result<()> {
        if owner == self.id {
            Ok(())
        } else {
            Err(Error::ForeignObject {
                what,
                backend: BACKEND,
            })
        }
    }

    pub(super) fn check_bytes(&self, what: &'static str, bytes: u128) -> Result<u64> {
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

    pub(super) fn take(&self, usage: wgpu::BufferUsages, size: u64) -> wgpu::Buffer {
        self.pool.take(&self.device, usage, size)
    }

    /// `n` workgroups folded into `(y, z)` under the per-dimension limit.
    pub(super) fn fold(&self, n: usize) -> Result<(u32, u32)> {
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

    pub(super) fn bind(
        &self,
        pipe: &wgpu::ComputePipeline,
        bufs: &[&wgpu::Buffer],
    ) -> wgpu::BindGroup {
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

    pub(super) fn params_buffer(&self, p: &Params) -> wgpu::Buffer {
        let b = self.take(
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            size_of::<Params>() as u64,
        );
        self.queue.write_buffer(&b, 0, bytemuck::bytes_of(p));
        b
    }
}

pub(super) fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// Little-endian f32s from `src` into `dst` (`src.len() == 4 * dst.len()`).
pub(super) fn read_f32s(src: &[u8], dst: &mut [f32]) {
    for (x, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}
