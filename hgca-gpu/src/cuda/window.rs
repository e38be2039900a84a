//! The CUDA KV window: a ring on the device, appends and evictions (rows
//! converted to the storage dtype on the host).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice};
use half::slice::HalfFloatSliceExt;
use hgca_kernels::{DType, Error, KvElem, KvWindow, Result, WindowBackend, WindowSpec, bf16, f16};

use super::spec::KernelSpec;

use super::launch::{EvictGatherArgs, RingWriteArgs};
use super::{backend::*, device::*};

/// Largest window: ring indices stay below 2^31 in the kernels' `int`s.
const MAX_CAPACITY: usize = 1 << 30;

/// A KV window in device memory: K and V `[kv_heads, capacity, d]` in the
/// window's dtype, used as a ring.
#[derive(Debug)]
pub struct CudaWindow {
    pub(super) spec: WindowSpec,
    pub(super) dev: Arc<Device>,
    pub(super) fns: Arc<AttnFns>,
    pub(super) k: CudaSlice<u8>,
    pub(super) v: CudaSlice<u8>,
    pub(super) start_slot: usize,
    pub(super) len: usize,
    pub(super) start_pos: u64,
    /// Host conversion buffer of appends (K then V, window dtype), 4-byte aligned.
    pub(super) stage: Vec<u32>,
    pub(super) stage_dev: Option<CudaSlice<u8>>,
    pub(super) evict_dev: Option<CudaSlice<u8>>,
    pub(super) evict_host: Option<PinnedHostSlice<u8>>,
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
pub(super) fn convert_into(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let bad = |_| Error::backend(BACKEND, "misaligned staging buffer");
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
                w.fns.ring_write.launch(
                    s,
                    launch_cfg((elementwise_grid(count, 256), 1, 1), 256, 0),
                    &RingWriteArgs {
                        kc: kp,
                        vc: vp,
                        ks: sp,
                        vs,
                        cap,
                        write_slot,
                        n: ni,
                        kv_heads: kvh,
                    },
                )?;
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
                w.fns.evict.launch(
                    s,
                    launch_cfg((elementwise_grid(count, 256), 1, 1), 256, 0),
                    &EvictGatherArgs {
                        kc: kp,
                        vc: vp,
                        ko: op,
                        vo,
                        cap,
                        start_slot: start,
                        n: ni,
                        kv_heads: kvh,
                    },
                )?;
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

    /// Checks the window is this backend's and holds `n` tokens; the
    /// eviction's copy runs at the eviction (no read-back ahead yet).
    fn prefetch_oldest(&self, window: &mut CudaWindow, n: usize) -> Result<()> {
        self.check_window(window)?;
        hgca_kernels::check_prefetch(window.len, n)
    }
}
