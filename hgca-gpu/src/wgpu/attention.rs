//! Dense attention on the GPU window: split-K decode and causal append
//! submitted without waiting, and their read-back.

use std::fmt;
use std::sync::mpsc;

use hgca_kernels::{
    DenseAttention, Error, PartialLayout, PartialMut, Result, check_len, check_len_of,
};

use super::{backend::*, window::*};

/// Most splits of one split-K decode.
const MAX_SPLITS: usize = 4096;

impl WgpuBackend {
    /// Tokens per split and the number of splits for `len` tokens and `rows` query rows.
    pub(super) fn split_plan(&self, len: usize, rows: usize) -> (usize, usize) {
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
    pub(super) fn submit_rows(
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

    /// Waits for `f` and copies its result into `out`, `lse` and `weights`.
    pub(super) fn finish(
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
                .map_err(wgpu_err("reading the staging buffer"))?;
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
/// Work submitted by [`WgpuBackend`] and not yet waited for.
pub struct WgpuPending {
    pub(super) owner: u64,
    pub(super) layout: PartialLayout,
    pub(super) weights_len: Option<usize>,
    pub(super) gpu: Option<InFlight>,
}

pub(super) struct InFlight {
    pub(super) index: wgpu::SubmissionIndex,
    pub(super) staging: wgpu::Buffer,
    pub(super) res_bytes: u64,
    pub(super) w_bytes: u64,
    pub(super) rx: mpsc::Receiver<MapResult>,
    pub(super) keep: Vec<wgpu::Buffer>,
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
