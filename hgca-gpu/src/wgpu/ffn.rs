//! The dense side of a hybrid FFN on the GPU: resident f16 weights and the
//! two passes of `shaders/ffn_up.wgsl` and `shaders/ffn_down.wgsl`.

use std::fmt;

use hgca_kernels::{DenseFfnBackend, FfnAct, FfnWeights, Result, check_len_of, f16};

use super::{attention::InFlight, backend::*, window::start_map};

/// FFN weights resident on a [`WgpuBackend`]: gate, up and `down_t` rows of
/// f16 pairs packed in 32-bit words (`ceil(d_model / 2)` a row).
pub struct WgpuFfn {
    owner: u64,
    d_model: usize,
    n_ff: usize,
    /// `None` when there is no neuron (a zero-sized binding is invalid).
    bufs: Option<[wgpu::Buffer; 3]>,
}

impl fmt::Debug for WgpuFfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuFfn")
            .field("owner", &self.owner)
            .field("d_model", &self.d_model)
            .field("n_ff", &self.n_ff)
            .finish_non_exhaustive()
    }
}

impl WgpuFfn {
    /// Neurons held.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// Model width.
    pub fn d_model(&self) -> usize {
        self.d_model
    }
}

impl DenseFfnBackend for WgpuBackend {
    type Resident = WgpuFfn;

    fn upload_ffn(&self, w: &FfnWeights<'_, f16>) -> Result<WgpuFfn> {
        let (d, n_ff) = (w.d_model, w.n_ff);
        let rw = d.div_ceil(2);
        let bytes = self.check_bytes(
            "wgpu FFN weight matrix bytes",
            n_ff as u128 * rw as u128 * 4,
        )?;
        if n_ff == 0 || d == 0 {
            return Ok(WgpuFfn {
                owner: self.id,
                d_model: d,
                n_ff,
                bufs: None,
            });
        }
        let bufs = self.scoped(|| {
            w.matrices().map(|m| {
                let b = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("hgca ffn weights"),
                    size: bytes,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                self.queue.write_buffer(
                    &b,
                    0,
                    bytemuck::cast_slice(&crate::pack_f16_pairs(&m, d, rw)),
                );
                b
            })
        })?;
        Ok(WgpuFfn {
            owner: self.id,
            d_model: d,
            n_ff,
            bufs: Some(bufs),
        })
    }

    fn dense_ffn(
        &self,
        act: FfnAct,
        w: &WgpuFfn,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        self.own("FFN weights", w.owner)?;
        let d = w.d_model;
        check_len_of("x", &[n, d], x.len())?;
        check_len_of("out", &[n, d], out.len())?;
        let Some([gate, up, down]) = &w.bufs else {
            out.fill(0.0);
            return Ok(());
        };
        if n == 0 {
            return Ok(());
        }
        let rw = d.div_ceil(2);
        let x_bytes = self.check_bytes("wgpu FFN token bytes", n as u128 * d as u128 * 4)?;
        let h_bytes =
            self.check_bytes("wgpu FFN activation bytes", n as u128 * w.n_ff as u128 * 4)?;
        let (uy, uz) = self.fold(n * w.n_ff)?;
        let (dy, dz) = self.fold(n)?;
        let dx = u32::try_from(rw.div_ceil(WG)).unwrap_or(u32::MAX);
        let params = Params {
            rows: n as u32,
            d: d as u32,
            rw: rw as u32,
            len: w.n_ff as u32,
            want_scores: u32::from(act == FfnAct::Relu),
            ..Params::default()
        };
        let st = wgpu::BufferUsages::STORAGE;
        let cd = wgpu::BufferUsages::COPY_DST;
        let f = self.scoped(|| {
            let pbuf = self.params_buffer(&params);
            let xb = self.take(st | cd, x_bytes);
            let hb = self.take(st, h_bytes);
            let ob = self.take(st | wgpu::BufferUsages::COPY_SRC, x_bytes);
            let staging = self.take(wgpu::BufferUsages::MAP_READ | cd, x_bytes);
            self.queue.write_buffer(&xb, 0, bytemuck::cast_slice(x));
            let bg_up = self.bind(&self.pipes.ffn_up, &[&pbuf, gate, up, &xb, &hb]);
            let bg_down = self.bind(&self.pipes.ffn_down, &[&pbuf, down, &hb, &ob]);
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("hgca ffn"),
                });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("hgca ffn gate up"),
                    timestamp_writes: None,
                });
                pass.set_pipeline(&self.pipes.ffn_up);
                pass.set_bind_group(0, &bg_up, &[]);
                pass.dispatch_workgroups(1, uy, uz);
            }
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("hgca ffn down"),
                    timestamp_writes: None,
                });
                pass.set_pipeline(&self.pipes.ffn_down);
                pass.set_bind_group(0, &bg_down, &[]);
                pass.dispatch_workgroups(dx, dy, dz);
            }
            enc.copy_buffer_to_buffer(&ob, 0, &staging, 0, x_bytes);
            let index = self.queue.submit([enc.finish()]);
            let rx = start_map(&[(&staging, x_bytes)]);
            InFlight {
                index,
                staging,
                res_bytes: x_bytes,
                w_bytes: 0,
                rx,
                keep: vec![pbuf, xb, hb, ob],
            }
        })?;
        self.finish(f, out, &mut [], None)
    }

    fn runs_beside_cpu(&self) -> bool {
        // A software adapter (lavapipe) runs on the CPU's own cores.
        self.adapter_info().device_type != "Cpu"
    }
}
