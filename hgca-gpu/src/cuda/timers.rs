//! Device-side timers for the benchmark example (`examples/cuda_bench.rs`):
//! decode, merge and host-device copy, timed with CUDA events. Only with
//! cargo feature `bench-timers`: measurement tools, not library API.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use hgca_kernels::{Error, Result, check_len};

use super::launch::CopyArgs;
use super::{backend::*, device::*, window::*};

impl CudaBackend {
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
                self.dev.copy_fn.launch(
                    s,
                    launch_cfg(grid, 256, 0),
                    &CopyArgs {
                        src: sp,
                        dst: dp,
                        n4: n4u,
                    },
                )?;
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
}

impl CudaBackend {
    /// Seconds per dense FFN call's kernels (no transfers) of `n` tokens
    /// `x` on `w`, with the tiled kernels or the per-token ones, averaged
    /// over `iters` calls after one warm-up. For benchmarks.
    ///
    /// # Errors
    /// [`Error::Length`] for a wrong `x`, [`Error::Zero`] for zero tokens,
    /// neurons, columns or `iters`, [`Error::ForeignObject`], backend errors.
    pub fn time_ffn(
        &self,
        w: &super::CudaFfn,
        x: &[f32],
        n: usize,
        tiled: bool,
        iters: usize,
    ) -> Result<f64> {
        w.check_owner(self)?;
        hgca_kernels::check_len_of("x", &[n, w.d_model()], x.len())?;
        for (what, v) in [("tokens", n), ("iters", iters)] {
            if v == 0 {
                return Err(Error::Zero { what });
            }
        }
        let mut sc = self.ffn_scratch(w, x, n, tiled)?;
        let act = hgca_kernels::FfnAct::Silu;
        self.launch_ffn(w, act, &mut sc)?;
        let s = &self.dev.compute;
        let (e0, e1) = (self.dev.event()?, self.dev.event()?);
        e0.record(s).map_err(drv)?;
        for _ in 0..iters {
            self.launch_ffn(w, act, &mut sc)?;
        }
        e1.record(s).map_err(drv)?;
        let ms = e0.elapsed_ms(&e1).map_err(drv)?;
        Ok(ms as f64 * 1e-3 / iters as f64)
    }
}
