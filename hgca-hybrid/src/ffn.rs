//! The hybrid FFN (PowerInfer's split on hgca's machinery): a layer's hot
//! neurons computed densely on the dense side (a [`DenseFfnBackend`]: the
//! GPU, or the CPU standing in), its cold neurons sparsely on the CPU
//! (every one, or those whose gate activation passes a threshold: CATS),
//! and the two partial outputs summed. With threshold 0 the sum is the
//! dense FFN up to float rounding, whatever the split.
//!
//! ```
//! use hgca_hybrid::HybridFfn;
//! use hgca_kernels::{f16, FfnAct, FfnWeights};
//! let (d, n_ff) = (8, 6);
//! let w: Vec<f16> = (0..n_ff * d).map(|i| f16::from_f32((i % 7) as f32 * 0.1 - 0.3)).collect();
//! let weights = FfnWeights::new(d, n_ff, &w, &w, &w)?;
//! let cpu = hgca_cpu::CpuBackend::new();
//! // Neurons 0 and 3 are hot; the four others run on the CPU.
//! let ffn = HybridFfn::new(cpu.clone(), cpu, FfnAct::Silu, &weights, &[0, 3], 0.0)?;
//! let x = vec![0.5f32; d];
//! let mut y = vec![0.0f32; d];
//! let st = ffn.forward(&x, 1, &mut y)?;
//! assert_eq!((st.hot, st.cold.active), (2, 4));
//! # Ok::<(), hgca_kernels::Error>(())
//! ```

use std::time::{Duration, Instant};

use crate::GatePredictor;
use hgca_cpu::{CpuBackend, DotBlock, FfnStats};
use hgca_kernels::{
    DenseFfnBackend, Error, FfnAct, FfnOwned, FfnSplit, FfnWeights, Neurons, Result, WeightElem,
    check_len_of, f16,
};

/// What one [`HybridFfn::forward`] call computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HybridFfnStats {
    /// (token, neuron) pairs the dense side computed.
    pub hot: usize,
    /// The CPU side's (cold neurons') count: pairs computed and rows read.
    pub cold: FfnStats,
    /// Bytes of cold weight rows the CPU read, counted token by token as
    /// [`FfnStats::rows`] is.
    pub cold_bytes: u64,
    /// Wall time of the dense side's call.
    pub dense_time: Duration,
    /// Wall time of the CPU side's call.
    pub cpu_time: Duration,
    /// Bytes the gate predictor read ([`HybridFfn::set_predictor`]),
    /// counted token by token; not in `cold_bytes`.
    pub predictor_bytes: u64,
}

/// One layer's FFN split between a dense side and the CPU: the cold
/// neurons' rows stay in their format `W` (f16 by default, or a GGUF
/// block format), the hot ones go to the dense side as f16.
#[derive(Debug)]
pub struct HybridFfn<D: DenseFfnBackend, W: WeightElem = f16> {
    dense: D,
    hot: D::Resident,
    cold: FfnOwned<W>,
    split: FfnSplit,
    cpu: CpuBackend,
    act: FfnAct,
    threshold: f32,
    d_model: usize,
    cold_call: ColdCall<W>,
    predictor: Option<GatePredictor>,
}

/// How the cold side calls the CPU kernel: [`CpuBackend::sparse_ffn`], or
/// [`CpuBackend::sparse_ffn_q8`] ([`HybridFfn::with_q8_acts`]).
type ColdCall<W> = fn(
    &CpuBackend,
    FfnAct,
    &FfnWeights<'_, W>,
    &[f32],
    usize,
    Neurons<'_>,
    &mut [f32],
) -> Result<FfnStats>;

impl<D: DenseFfnBackend, W: WeightElem> HybridFfn<D, W> {
    /// Splits `w` (neuron-major): the neurons `hot` are made resident on
    /// `dense` (dequantised to f16 when `W` is not f16), the rest are
    /// gathered into the CPU's own matrices (format `W`) and
    /// computed by `cpu` with `threshold` on `|act(gate·x)|` (0: every cold
    /// neuron whose activation is not exactly 0, which is the dense FFN's
    /// sum).
    ///
    /// # Errors
    /// [`Error::Index`] or [`Error::Param`] for a bad hot list (out of
    /// range, a repeat); [`Error::Param`] for a threshold that is not
    /// finite and `>= 0`; the dense side's upload errors.
    pub fn new(
        dense: D,
        cpu: CpuBackend,
        act: FfnAct,
        w: &FfnWeights<'_, W>,
        hot: &[u32],
        threshold: f32,
    ) -> Result<Self> {
        check_threshold(threshold)?;
        let split = FfnSplit::new(w.n_ff, hot)?;
        let hot_w = to_f16(&FfnOwned::gather(w, split.hot())?.view())?;
        let resident = dense.upload_ffn(&hot_w.view())?;
        let cold = FfnOwned::gather(w, split.cold())?;
        Ok(Self {
            dense,
            hot: resident,
            cold,
            split,
            cpu,
            act,
            threshold,
            d_model: w.d_model,
            cold_call: |cpu, act, w, x, n, nr, out| cpu.sparse_ffn(act, w, x, n, nr, out),
            predictor: None,
        })
    }

    /// The split (which neurons are hot).
    pub fn split(&self) -> &FfnSplit {
        &self.split
    }

    /// The cold side's threshold.
    pub fn threshold(&self) -> f32 {
        self.threshold
    }

    /// Sets the cold side's threshold.
    ///
    /// # Errors
    /// [`Error::Param`] unless finite and `>= 0`.
    pub fn set_threshold(&mut self, t: f32) -> Result<()> {
        check_threshold(t)?;
        self.threshold = t;
        Ok(())
    }

    /// Fits a [`GatePredictor`] of the cold neurons' gates from `tokens`
    /// calibration inputs `xs` (`[tokens, d_model]`, the FFN's inputs);
    /// [`HybridFfn::set_predictor`] puts it to use.
    ///
    /// # Errors
    /// As [`GatePredictor::fit`].
    pub fn fit_predictor(
        &self,
        xs: &[f32],
        tokens: usize,
        rank: usize,
        z: f32,
    ) -> Result<GatePredictor> {
        GatePredictor::fit(&self.cold.view(), xs, tokens, rank, z)
    }

    /// With a predictor and a threshold above 0, each token's cold side
    /// computes the neurons the predictor selects (their gate, up and down
    /// rows; none other is read) instead of reading every cold gate row to
    /// apply the threshold. `None` goes back to the threshold form.
    ///
    /// # Errors
    /// [`Error::Param`] for a predictor of another width or neuron count
    /// than the cold side's.
    pub fn set_predictor(&mut self, p: Option<GatePredictor>) -> Result<()> {
        if let Some(p) = &p {
            let n_cold = self.split.cold().len();
            if p.d_model() != self.d_model || p.n_ff() != n_cold {
                return Err(Error::Param {
                    what: "predictor (its width and neurons against the cold side's)",
                    value: p.n_ff() as f64,
                    expected: "a predictor fitted on this layer's cold neurons",
                });
            }
        }
        self.predictor = p;
        Ok(())
    }

    /// The predictor in use, if any.
    pub fn predictor(&self) -> Option<&GatePredictor> {
        self.predictor.as_ref()
    }

    /// Bytes of the cold weights the CPU holds.
    pub fn cold_bytes(&self) -> usize {
        self.cold.bytes()
    }

    /// `out` = the FFN of the `n` tokens `x` (`[n, d_model]` each): the
    /// hot neurons' sum from the dense side plus the cold neurons' from the
    /// CPU. When the dense side runs off the CPU
    /// ([`DenseFfnBackend::runs_beside_cpu`]) the two sides run at once.
    ///
    /// # Errors
    /// [`Error::Length`] for `x` or `out` of another length; either side's
    /// errors.
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) -> Result<HybridFfnStats> {
        let d = self.d_model;
        check_len_of("x", &[n, d], x.len())?;
        check_len_of("out", &[n, d], out.len())?;
        let mut hot_out = vec![0.0f32; n * d];
        // The predictor acts only with a threshold to predict.
        let predictor = self.predictor.as_ref().filter(|_| self.threshold > 0.0);
        let dense = |o: &mut [f32]| -> Result<Duration> {
            let t = Instant::now();
            self.dense.dense_ffn(self.act, &self.hot, x, n, o)?;
            Ok(t.elapsed())
        };
        let cold = |o: &mut [f32]| -> Result<(FfnStats, Duration)> {
            let t = Instant::now();
            let w = self.cold.view();
            if let Some(p) = predictor {
                // Each token its own list.
                let mut st = FfnStats::default();
                let mut list = Vec::new();
                for (xt, ot) in x.chunks_exact(d).zip(o.chunks_exact_mut(d)) {
                    p.select(xt, self.act, self.threshold, &mut list)?;
                    let s =
                        (self.cold_call)(&self.cpu, self.act, &w, xt, 1, Neurons::List(&list), ot)?;
                    st.active += s.active;
                    st.rows += s.rows;
                }
                return Ok((st, t.elapsed()));
            }
            let nb = if self.threshold > 0.0 {
                Neurons::Threshold(self.threshold)
            } else {
                Neurons::All
            };
            let st = (self.cold_call)(&self.cpu, self.act, &w, x, n, nb, o)?;
            Ok((st, t.elapsed()))
        };
        let (dense_time, (st, cpu_time)) = if self.dense.runs_beside_cpu() {
            let (a, b) = std::thread::scope(|sc| {
                let h = sc.spawn(|| dense(&mut hot_out));
                let b = cold(out);
                (h.join(), b)
            });
            let a = a.map_err(|_| Error::Backend {
                backend: "dense FFN",
                message: "the dense side's thread panicked".into(),
                source: None,
            })?;
            (a?, b?)
        } else {
            let a = dense(&mut hot_out)?;
            (a, cold(out)?)
        };
        for (o, h) in out.iter_mut().zip(&hot_out) {
            *o += h;
        }
        let row_bytes = (d / W::VALUES * core::mem::size_of::<W>()) as u64;
        Ok(HybridFfnStats {
            hot: self.split.hot().len() * n,
            cold: st,
            cold_bytes: st.rows as u64 * row_bytes,
            dense_time,
            cpu_time,
            predictor_bytes: predictor.map_or(0, |p| (p.bytes() * n) as u64),
        })
    }
}

/// `w` in f16 (the dense side's format).
impl<D: DenseFfnBackend, W: WeightElem + DotBlock> HybridFfn<D, W> {
    /// The cold neurons' gate and up rows against the tokens quantised to
    /// Q8_0, by integer dot products ([`CpuBackend::sparse_ffn_q8`]: the
    /// arithmetic of llama.cpp's quantised matmuls); their down rows as
    /// before. The hot side is unchanged.
    #[must_use]
    pub fn with_q8_acts(mut self) -> Self {
        self.cold_call = |cpu, act, w, x, n, nr, out| cpu.sparse_ffn_q8(act, w, x, n, nr, out);
        self
    }
}

fn to_f16<W: WeightElem>(w: &FfnWeights<'_, W>) -> Result<FfnOwned<f16>> {
    let conv = |m: &[W]| {
        let mut f = vec![0.0f32; m.len() * W::VALUES];
        W::dequant_slice(m, &mut f);
        f.iter().map(|&v| f16::from_f32(v)).collect::<Vec<f16>>()
    };
    let [g, u, d] = w.matrices();
    FfnOwned::new(w.d_model, w.n_ff, conv(&g), conv(&u), conv(&d))
}

fn check_threshold(t: f32) -> Result<()> {
    if t.is_finite() && t >= 0.0 {
        Ok(())
    } else {
        Err(Error::Param {
            what: "ffn threshold",
            value: f64::from(t),
            expected: "finite and >= 0",
        })
    }
}
