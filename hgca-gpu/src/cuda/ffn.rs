//! The dense side of a hybrid FFN on the device: resident f16 weights and
//! the passes of `ffn.cu`.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use hgca_kernels::{DenseFfnBackend, Error, FfnAct, FfnWeights, Result, check_len_of, f16};

use super::launch::{
    FfnDownArgs, FfnDownSumArgs, FfnDownTiledArgs, FfnGateUpArgs, FfnGateUpTiledArgs,
};
use super::{backend::*, device::*};

/// Tokens of a tile (ffn.cu's FFN_TT).
const TILE: usize = 8;
/// Calls of at least this many tokens take the tiled kernels.
const TILED_MIN: usize = 4;
/// Neurons of a gate/up block, a warp each (ffn.cu's FFN_WARPS).
const GATE_UP_NEURONS: usize = 8;
/// Threads of a gate/up block.
const GATE_UP_BLOCK: usize = 32 * GATE_UP_NEURONS;
/// Threads of a down block (ffn.cu's launch bounds).
const BLOCK: usize = 128;
/// Threads of a block of the split sum.
const SUM_BLOCK: usize = 256;
/// Fewest neurons a split of the down pass takes.
const MIN_SPLIT: usize = 64;
/// The most tokens one launch takes (its tiles within a grid's y).
const MAX_TOKENS: usize = 65_535;

/// FFN weights resident on a [`CudaBackend`]: gate, up and `down_t` rows
/// of f16 pairs packed in 32-bit words (`ceil(d_model / 2)` a row).
pub struct CudaFfn {
    dev: Arc<Device>,
    d_model: usize,
    n_ff: usize,
    /// `None` when there is no neuron or no column.
    bufs: Option<[CudaSlice<u32>; 3]>,
}

/// The device buffers and geometry of one call.
pub(super) struct FfnScratch {
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    pub(super) o: CudaSlice<f32>,
    /// The down pass's partial sums, with more than one split.
    part: Option<CudaSlice<f32>>,
    n: usize,
    /// Tokens per launch.
    tc: usize,
    tiled: bool,
    splits: usize,
    chunk: usize,
}

impl fmt::Debug for CudaFfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaFfn")
            .field("device", &self.dev.name)
            .field("d_model", &self.d_model)
            .field("n_ff", &self.n_ff)
            .finish_non_exhaustive()
    }
}

impl CudaFfn {
    /// Neurons held.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// Model width.
    pub fn d_model(&self) -> usize {
        self.d_model
    }

    /// [`Error::ForeignObject`] unless `b` made these weights resident
    /// (or is a clone of the backend that did).
    pub(super) fn check_owner(&self, b: &CudaBackend) -> Result<()> {
        b.check_device("cuda FFN weights", &self.dev)
    }
}

impl DenseFfnBackend for CudaBackend {
    type Resident = CudaFfn;

    fn upload_ffn(&self, w: &FfnWeights<'_, f16>) -> Result<CudaFfn> {
        let (d, n_ff) = (w.d_model, w.n_ff);
        let rw = d.div_ceil(2);
        to_i32("FFN d_model", d)?;
        // The per-token gate/up pass indexes (token, neuron) warps' threads
        // in 32 bits: fewer than TILED_MIN tokens of n_ff neurons.
        let most = i32::MAX as usize / (32 * TILED_MIN);
        if n_ff > most {
            return Err(Error::Capacity {
                what: "cuda FFN neurons",
                capacity: most,
                requested: n_ff,
            });
        }
        mul("FFN weight words", n_ff, rw)?;
        if n_ff == 0 || d == 0 {
            return Ok(CudaFfn {
                dev: self.dev.clone(),
                d_model: d,
                n_ff,
                bufs: None,
            });
        }
        // Compiled now, so that a compile or load error comes at upload.
        self.dev.ffn()?;
        let s = &self.dev.compute;
        let [g, u, dn] = w.matrices();
        let put = |m: &[f16]| s.clone_htod(&crate::pack_f16_pairs(m, d, rw)).map_err(drv);
        let bufs = [put(&g)?, put(&u)?, put(&dn)?];
        s.synchronize().map_err(drv)?;
        Ok(CudaFfn {
            dev: self.dev.clone(),
            d_model: d,
            n_ff,
            bufs: Some(bufs),
        })
    }

    fn dense_ffn(
        &self,
        act: FfnAct,
        w: &CudaFfn,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        w.check_owner(self)?;
        let d = w.d_model;
        check_len_of("x", &[n, d], x.len())?;
        check_len_of("out", &[n, d], out.len())?;
        if w.bufs.is_none() {
            out.fill(0.0);
            return Ok(());
        }
        if n == 0 {
            return Ok(());
        }
        let mut sc = self.ffn_scratch(w, x, n, n >= TILED_MIN)?;
        self.launch_ffn(w, act, &mut sc)?;
        let st = &self.dev.compute;
        st.memcpy_dtoh(&sc.o, out).map_err(drv)?;
        st.synchronize().map_err(drv)?;
        Ok(())
    }

    fn runs_beside_cpu(&self) -> bool {
        true
    }
}

impl CudaBackend {
    /// The buffers of a call of `n` tokens `x` on `w` (neurons and
    /// columns both present), `x` uploaded; `tiled` picks the kernels.
    pub(super) fn ffn_scratch(
        &self,
        w: &CudaFfn,
        x: &[f32],
        n: usize,
        tiled: bool,
    ) -> Result<FfnScratch> {
        let (d, n_ff) = (w.d_model, w.n_ff);
        let s = &self.dev.compute;
        let tc = n.min(MAX_TOKENS);
        let x_blocks = d.div_ceil(2).div_ceil(BLOCK);
        // Splits of the neurons: enough blocks to fill the device (four
        // per SM), none of fewer than MIN_SPLIT neurons.
        let rows = if tiled { tc.div_ceil(TILE) } else { tc };
        let want = (4 * self.dev.sms).div_ceil(x_blocks * rows);
        let splits = want.clamp(1, n_ff.div_ceil(MIN_SPLIT).max(1));
        let chunk = n_ff.div_ceil(splits);
        let splits = n_ff.div_ceil(chunk);
        let x = s.clone_htod(x).map_err(drv)?;
        // SAFETY: every element is written by the gate/up pass before the
        // down pass reads it.
        let h = unsafe { s.alloc::<f32>(mul("FFN activations", tc, n_ff)?) }.map_err(drv)?;
        // SAFETY: written by the down pass (or the sum) before the copy out.
        let o = unsafe { s.alloc::<f32>(mul("FFN output", n, d)?) }.map_err(drv)?;
        let part = if splits > 1 {
            let len = mul("FFN partial sums", splits, mul("FFN partial sums", tc, d)?)?;
            // SAFETY: every element a sum reads is written by the down pass.
            Some(unsafe { s.alloc::<f32>(len) }.map_err(drv)?)
        } else {
            None
        };
        Ok(FfnScratch {
            x,
            h,
            o,
            part,
            n,
            tc,
            tiled,
            splits,
            chunk,
        })
    }

    /// Queues the passes of one call on the compute stream: `sc.o` gets
    /// the FFN of `sc.x`.
    pub(super) fn launch_ffn(&self, w: &CudaFfn, act: FfnAct, sc: &mut FfnScratch) -> Result<()> {
        let Some([gate, up, down]) = &w.bufs else {
            return Err(Error::Zero {
                what: "FFN neurons or columns",
            });
        };
        let fns = self.dev.ffn()?;
        let s = &self.dev.compute;
        let (d, n_ff) = (w.d_model, w.n_ff);
        let rw = d.div_ceil(2);
        let x_blocks = rw.div_ceil(BLOCK) as u32;
        let (gp, _g1) = gate.device_ptr(s);
        let (upp, _g2) = up.device_ptr(s);
        let (dp, _g3) = down.device_ptr(s);
        let (xp, _g4) = sc.x.device_ptr(s);
        let (hp, _g5) = sc.h.device_ptr_mut(s);
        let (op, _g6) = sc.o.device_ptr_mut(s);
        let pp = sc.part.as_mut().map(|p| p.device_ptr_mut(s));
        let f32b = std::mem::size_of::<f32>() as u64;
        let (splits, chunk) = (sc.splits, sc.chunk);
        let act = i32::from(act == FfnAct::Relu);
        let mut t0 = 0;
        while t0 < sc.n {
            let nt = (sc.n - t0).min(sc.tc);
            let xo = xp + (t0 * d) as u64 * f32b;
            let oo = op + (t0 * d) as u64 * f32b;
            let target = pp.as_ref().map_or(oo, |p| p.0);
            macro_rules! gate_up_args {
                ($t:ident) => {
                    $t {
                        gate: gp,
                        up: upp,
                        x: xo,
                        h: hp,
                        n: nt as i32,
                        n_ff: n_ff as i32,
                        d: d as i32,
                        rw: rw as i32,
                        act,
                    }
                };
            }
            macro_rules! down_args {
                ($t:ident) => {
                    $t {
                        down: dp,
                        h: hp,
                        part: target,
                        n: nt as i32,
                        n_ff: n_ff as i32,
                        d: d as i32,
                        rw: rw as i32,
                        chunk: chunk as i32,
                    }
                };
            }
            // SAFETY: the weights hold n_ff rows of rw words, x and out
            // n rows of d floats from t0 (nt of them here), h nt rows of
            // n_ff floats, part splits x nt rows of d; each geometry is
            // ffn.cu's (per token: a warp per (token, neuron) in blocks of
            // BLOCK threads, whose 32-bit thread index upload_ffn's bound on
            // n_ff keeps in range; tiled: tiles of TILE tokens,
            // GATE_UP_NEURONS warps a gate/up block; BLOCK threads a down
            // block).
            unsafe {
                if sc.tiled {
                    let tiles = nt.div_ceil(TILE) as u32;
                    fns.gate_up_tiled.launch(
                        s,
                        launch_cfg(
                            (n_ff.div_ceil(GATE_UP_NEURONS) as u32, tiles, 1),
                            GATE_UP_BLOCK as u32,
                            0,
                        ),
                        &gate_up_args!(FfnGateUpTiledArgs),
                    )?;
                    fns.down_tiled.launch(
                        s,
                        launch_cfg((x_blocks, tiles, splits as u32), BLOCK as u32, 0),
                        &down_args!(FfnDownTiledArgs),
                    )?;
                } else {
                    fns.gate_up.launch(
                        s,
                        launch_cfg(
                            ((nt * n_ff * 32).div_ceil(BLOCK) as u32, 1, 1),
                            BLOCK as u32,
                            0,
                        ),
                        &gate_up_args!(FfnGateUpArgs),
                    )?;
                    fns.down.launch(
                        s,
                        launch_cfg((x_blocks, nt as u32, splits as u32), BLOCK as u32, 0),
                        &down_args!(FfnDownArgs),
                    )?;
                }
                if let Some(p) = &pp {
                    let len = nt * d;
                    fns.down_sum.launch(
                        s,
                        launch_cfg(
                            (elementwise_grid(len, SUM_BLOCK), 1, 1),
                            SUM_BLOCK as u32,
                            0,
                        ),
                        &FfnDownSumArgs {
                            part: p.0,
                            out: oo,
                            splits: splits as i32,
                            len: len as i64,
                        },
                    )?;
                }
            }
            t0 += nt;
        }
        Ok(())
    }
}
