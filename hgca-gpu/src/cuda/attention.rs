//! Dense attention on the CUDA window: the split-K decode and causal append
//! launches, their buffers, and submit/wait ([`CudaPending`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice};
use hgca_kernels::{
    DenseAttention, Error, PartialLayout, PartialMut, Result, check_len, check_len_of,
};

use super::spec::{APPEND_ROWS, BLOCK_THREADS};

use super::launch::{AppendArgs, DecodeCombineArgs, DecodeSplitArgs, DecodeWeightsArgs};
use super::{backend::*, device::*, window::*};

/// Weights (f32 elements) from which `wait` copies them out on several threads.
const PAR_COPY_MIN: usize = 1 << 18;

const LOG2_E: f32 = std::f32::consts::LOG2_E;

#[derive(Debug, Clone, Copy)]
pub(super) struct DecodePlan {
    pub(super) splits: usize,
    pub(super) chunk: usize,
    pub(super) nz: usize,
}

#[derive(Debug)]
pub(super) struct DecodeBufs {
    pub(super) part_o: CudaSlice<f32>,
    pub(super) part_lse: CudaSlice<f32>,
    pub(super) lse2: CudaSlice<f32>,
    /// `out [q_heads, d] | lse [q_heads] | weights [q_heads, len]`.
    pub(super) res: CudaSlice<f32>,
    pub(super) plan: DecodePlan,
    pub(super) want_weights: bool,
}

#[derive(Debug)]
pub(super) enum Work {
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
    /// The device of the backend that submitted it.
    pub(super) dev: Arc<Device>,
    pub(super) layout: PartialLayout,
    /// Window tokens whose weights come back (decode with `want_weights`).
    pub(super) weights: Option<usize>,
    pub(super) work: Work,
    pub(super) host: Option<PinnedHostSlice<f32>>,
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
                dev: Arc::clone(&self.dev),
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
                dev: Arc::clone(&self.dev),
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
                w.fns.append.launch(
                    s,
                    launch_cfg(
                        (grid_x, shape.kv_heads() as u32, 1),
                        BLOCK_THREADS,
                        w.fns.spec.append_smem_bytes(),
                    ),
                    &AppendArgs {
                        kc: kp,
                        vc: vp,
                        q: qp,
                        out: rp,
                        lse_out: lp,
                        cap,
                        start_slot: start,
                        len,
                        rel,
                        n_q: nq,
                        group,
                        q_heads: qhi,
                        qscale,
                    },
                )?;
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
        if !Arc::ptr_eq(&self.dev, &pending.dev) {
            return Err(Error::ForeignObject {
                what: "cuda pending work",
                backend: BACKEND,
            });
        }
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

impl CudaBackend {
    pub(super) fn decode_plan(&self, w: &CudaWindow) -> DecodePlan {
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

    pub(super) fn alloc_decode(&self, w: &CudaWindow, want_weights: bool) -> Result<DecodeBufs> {
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
    pub(super) fn launch_decode(
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
            fns.decode.launch(
                s,
                launch_cfg(grid, BLOCK_THREADS, spec.decode_smem_bytes()),
                &DecodeSplitArgs {
                    kc: kp,
                    vc: vp,
                    q: qp,
                    part_o: po,
                    part_lse: pl,
                    scores: w_p,
                    cap,
                    start_slot: start,
                    len,
                    chunk,
                    group,
                    q_heads: qhi,
                    qscale,
                },
            )?;
        }
        // SAFETY: matches hgca_decode_combine; partials as above, out/lse inside `res`.
        unsafe {
            fns.combine.launch(
                s,
                launch_cfg((qh as u32, 1, 1), BLOCK_THREADS, 0),
                &DecodeCombineArgs {
                    part_o: po,
                    part_lse: pl,
                    out: out_p,
                    lse_out: lse_p,
                    lse2_out: l2,
                    splits,
                    q_heads: qhi,
                },
            )?;
        }
        if b.want_weights {
            let total = qh * w.len;
            // SAFETY: matches hgca_decode_weights; `w_p` holds q_heads * len floats.
            unsafe {
                fns.weights.launch(
                    s,
                    launch_cfg((elementwise_grid(total, 256), 1, 1), 256, 0),
                    &DecodeWeightsArgs {
                        scores: w_p,
                        lse2: l2,
                        len,
                        q_heads: qhi,
                    },
                )?;
            }
        }
        Ok(())
    }

    pub(super) fn finish_submit(
        &self,
        res: &CudaSlice<f32>,
        layout: PartialLayout,
        weights: Option<usize>,
        work: Work,
    ) -> Result<CudaPending> {
        let mut host = self.dev.take_pinned(res.len())?;
        dtoh_prefix(&self.dev.compute, res, &mut host)?;
        Ok(CudaPending {
            dev: Arc::clone(&self.dev),
            layout,
            weights,
            work,
            host: Some(host),
        })
    }
}
