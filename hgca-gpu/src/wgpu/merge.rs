//! The LSE merge of partials on the GPU.

use hgca_kernels::{Error, MergeBackend, PartialLayout, PartialMut, PartialRef, Result};

use super::{attention::*, backend::*, window::*};

impl WgpuBackend {
    /// Uploads `parts` and submits their merge; `layout` is checked by the caller.
    pub(super) fn submit_merge(
        &self,
        parts: &[PartialRef<'_>],
        layout: PartialLayout,
    ) -> Result<InFlight> {
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

pub(super) fn check_layouts(
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
