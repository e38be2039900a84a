//! The LSE merge of partials on the device.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use hgca_kernels::{Error, MergeBackend, PartialMut, PartialRef, Result};

use super::launch::MergeArgs;
use super::{backend::*, device::*};

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

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_merge(
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
            self.dev.merge.launch(
                s,
                launch_cfg((grid, 1, 1), 256, 0),
                &MergeArgs {
                    parts_o: pop,
                    parts_lse: plp,
                    out: op,
                    lse: lp,
                    n_parts: np,
                    rows: r,
                    d: dd,
                },
            )?;
        }
        Ok(())
    }
}
