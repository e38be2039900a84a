//! hgca's sparse and hybrid FFN in place of candle's dense one:
//! neuron-major f16 weights, per-layer CATS thresholds, hot sets
//! (PowerInfer's split, from a [`NeuronProfile`] and the planner), and
//! their calibration.

use std::sync::Arc;

use hgca_cpu::CpuBackend;
use hgca_hybrid::{HybridFfn, HybridFfnStats};
use hgca_kernels::{BlockQ8_0, FfnAct, FfnWeights, WeightElem, f16};

use crate::model::{Llama, Logits};
use crate::weights::LlamaWeights;
use crate::{Error, Result};

/// hgca's FFN for every layer of a model: neuron-major f16 copies of the
/// FFN weights split per layer into **hot** neurons, computed densely on
/// the dense side (here the CPU stands in for the GPU), and **cold** ones,
/// computed on the CPU when their `|silu(gate)|` passes the layer's
/// threshold (CATS; their up and down rows are not read otherwise). With
/// no hot neuron it is the sparse FFN; with every threshold 0 it is the
/// dense FFN up to f16 rounding of the weights, whatever the split.
#[derive(Debug)]
pub struct SparseFfn {
    d: usize,
    n_ff: usize,
    format: FfnFormat,
    layers: Vec<Box<dyn LayerFfn>>,
    count: std::sync::Mutex<FfnCount>,
}

/// The format of a [`SparseFfn`]'s weight copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FfnFormat {
    /// f16 (2 bytes a weight).
    #[default]
    F16,
    /// GGUF's Q8_0 blocks (34 bytes per 32 weights; the format candle's
    /// decode matmuls use under the default `--weights auto`).
    Q8_0,
    /// Q8_0 blocks, the cold neurons' gate and up rows against the token
    /// quantised to Q8_0 by integer dot products (llama.cpp's arithmetic:
    /// [`HybridFfn::with_q8_acts`]).
    Q8_0Int,
}

impl FfnFormat {
    /// Bytes of a row of `d` weights.
    pub fn row_bytes(self, d: usize) -> usize {
        match self {
            FfnFormat::F16 => 2 * d,
            FfnFormat::Q8_0 | FfnFormat::Q8_0Int => d / 32 * size_of::<BlockQ8_0>(),
        }
    }
}

/// One layer's hybrid FFN, whatever its weight format.
trait LayerFfn: std::fmt::Debug + Send + Sync {
    fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) -> Result<HybridFfnStats>;
    fn threshold(&self) -> f32;
    fn set_threshold(&mut self, t: f32) -> Result<()>;
    fn hot(&self) -> usize;
    fn fit_predictor(&mut self, xs: &[f32], tokens: usize, rank: usize, z: f32) -> Result<()>;
    fn clear_predictor(&mut self);
}

impl<W: WeightElem> LayerFfn for HybridFfn<CpuBackend, W> {
    fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) -> Result<HybridFfnStats> {
        Ok(HybridFfn::forward(self, x, n, out)?)
    }
    fn threshold(&self) -> f32 {
        HybridFfn::threshold(self)
    }
    fn set_threshold(&mut self, t: f32) -> Result<()> {
        Ok(HybridFfn::set_threshold(self, t)?)
    }
    fn hot(&self) -> usize {
        self.split().hot().len()
    }
    fn fit_predictor(&mut self, xs: &[f32], tokens: usize, rank: usize, z: f32) -> Result<()> {
        let p = HybridFfn::fit_predictor(self, xs, tokens, rank, z)?;
        Ok(self.set_predictor(Some(p))?)
    }
    fn clear_predictor(&mut self) {
        // None always fits.
        let _ = self.set_predictor(None);
    }
}

/// What a [`SparseFfn`] computed since it was made (or last reset).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FfnCount {
    /// (token, layer) FFN evaluations.
    pub evals: u64,
    /// (token, neuron) pairs computed, hot and cold, summed over layers.
    pub active: u64,
    /// Of which on the dense side (hot neurons).
    pub hot: u64,
    /// Weight rows the CPU read for the cold neurons, per token (gate rows
    /// of every cold neuron, up and down rows of those that pass), summed;
    /// the dense FFN reads `3 n_ff` rows per evaluation.
    pub rows: u64,
    /// Time in the FFN (both sides).
    pub time: std::time::Duration,
    /// Of which the CPU's (cold) side: with a GPU as the dense side, the
    /// sides overlap and this is what the CPU adds.
    pub cold_time: std::time::Duration,
    /// Bytes the gate predictors read ([`SparseFfn::fit_predictors`]),
    /// per token, summed (not in `rows`).
    pub predictor_bytes: u64,
}

/// Per layer and neuron, how often the neuron fires on a calibration text:
/// the share of tokens whose `|silu(gate)|` exceeds the layer's threshold
/// (the `sparsity` quantile of that layer's activations). What
/// `hgca-llm ffn-profile` writes (JSON) and hot sets are chosen from.
#[derive(Debug, Clone, PartialEq)]
pub struct NeuronProfile {
    /// Calibration tokens.
    pub tokens: usize,
    /// The quantile the thresholds were set at.
    pub sparsity: f32,
    /// Per layer, the threshold on `|silu(gate)|`.
    pub thresholds: Vec<f32>,
    /// `[layer][neuron]`: the share of tokens on which the neuron passed.
    pub freq: Vec<Vec<f32>>,
}

impl NeuronProfile {
    /// Runs `weights` (exact attention, dense FFN) over `tokens` and
    /// records, per layer, the threshold at the `sparsity` quantile of
    /// `|silu(gate)|` and each neuron's firing share above it.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a sparsity outside `[0, 1)`, no tokens, or a
    /// model whose FFN is not SiLU-gated; model errors.
    pub fn measure(weights: &Arc<LlamaWeights>, tokens: &[u32], sparsity: f32) -> Result<Self> {
        let mut v = Self::measure_at(weights, tokens, &[sparsity])?;
        v.pop()
            .ok_or_else(|| Error::invalid("ffn sparsity", "no level"))
    }

    /// [`NeuronProfile::measure`] at several sparsity levels, from one run
    /// of the model (one profile per level, in order).
    ///
    /// # Errors
    /// As [`NeuronProfile::measure`], for any level.
    pub fn measure_at(
        weights: &Arc<LlamaWeights>,
        tokens: &[u32],
        sparsities: &[f32],
    ) -> Result<Vec<Self>> {
        if let Some(&s) = sparsities.iter().find(|s| !(0.0..1.0).contains(*s)) {
            return Err(Error::invalid(
                "ffn sparsity",
                format!("{s} is not in [0, 1)"),
            ));
        }
        if tokens.is_empty() {
            return Err(Error::invalid("calibration", "no tokens"));
        }
        silu_gated(weights)?;
        let n_ff = weights.config.ffn_dim;
        let mut llm = Llama::with_full_attention::<f32>(Arc::clone(weights))?;
        llm.record = Some(vec![Vec::new(); weights.layers.len()]);
        for c in tokens.chunks(512) {
            llm.forward(c, Logits::None)?;
        }
        let rec = llm.record.take().unwrap_or_default();
        // Per layer, the quantiles from every 7th value (enough, and a
        // cheap sort).
        let samples: Vec<Vec<f32>> = rec
            .iter()
            .map(|v| {
                let mut s: Vec<f32> = v.iter().step_by(7).copied().collect();
                s.sort_by(f32::total_cmp);
                s
            })
            .collect();
        let profile = |sparsity: f32| {
            let mut thresholds = Vec::with_capacity(rec.len());
            let mut freq = Vec::with_capacity(rec.len());
            for (v, sample) in rec.iter().zip(&samples) {
                let t = if sparsity == 0.0 {
                    0.0
                } else {
                    sample
                        .get(((sample.len() as f64) * f64::from(sparsity)) as usize)
                        .copied()
                        .unwrap_or(0.0)
                };
                let mut f = vec![0.0f32; n_ff];
                for row in v.chunks_exact(n_ff) {
                    for (c, &a) in f.iter_mut().zip(row) {
                        if a > t {
                            *c += 1.0;
                        }
                    }
                }
                let n = (v.len() / n_ff).max(1) as f32;
                f.iter_mut().for_each(|c| *c /= n);
                thresholds.push(t);
                freq.push(f);
            }
            Self {
                tokens: tokens.len(),
                sparsity,
                thresholds,
                freq,
            }
        };
        Ok(sparsities.iter().map(|&s| profile(s)).collect())
    }

    /// Each layer's hot neurons when the dense side holds `hot_ratio` of
    /// all FFN weights: a GPU budget of that share, filled by
    /// [`hgca_hybrid::planner::plan_hot_neurons`] with the most frequent
    /// neurons across layers (so layers get different counts).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a ratio outside `[0, 1]`.
    pub fn hot_sets(&self, hot_ratio: f64) -> Result<Vec<Vec<u32>>> {
        if !(0.0..=1.0).contains(&hot_ratio) {
            return Err(Error::invalid(
                "hot ratio",
                format!("{hot_ratio} is not in [0, 1]"),
            ));
        }
        let total: usize = self.freq.iter().map(Vec::len).sum();
        // In neurons: one "byte" a neuron, as every neuron costs the same.
        let budget = (hot_ratio * total as f64).round() as u64;
        Ok(hgca_hybrid::planner::plan_hot_neurons(
            &self.freq, 1, budget,
        )?)
    }

    /// The profile as JSON.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "tokens": self.tokens,
            "sparsity": self.sparsity,
            "thresholds": self.thresholds,
            "freq": self.freq,
        })
        .to_string()
    }

    /// A profile from [`NeuronProfile::to_json`]'s form.
    ///
    /// # Errors
    /// [`Error::Invalid`] for text that is not such a profile.
    pub fn from_json(s: &str) -> Result<Self> {
        let bad = |m: &str| Error::invalid("neuron profile", m.to_string());
        let v: serde_json::Value =
            serde_json::from_str(s).map_err(|e| bad(&format!("not JSON: {e}")))?;
        let floats = |v: &serde_json::Value| -> Option<Vec<f32>> {
            v.as_array()?
                .iter()
                .map(|x| x.as_f64().map(|f| f as f32))
                .collect()
        };
        let tokens = v["tokens"].as_u64().ok_or_else(|| bad("no `tokens`"))? as usize;
        let sparsity = v["sparsity"].as_f64().ok_or_else(|| bad("no `sparsity`"))? as f32;
        let thresholds = floats(&v["thresholds"]).ok_or_else(|| bad("no `thresholds`"))?;
        let freq: Vec<Vec<f32>> = v["freq"]
            .as_array()
            .and_then(|a| a.iter().map(floats).collect())
            .ok_or_else(|| bad("no `freq`"))?;
        if freq.len() != thresholds.len() {
            return Err(bad("`freq` and `thresholds` differ in layers"));
        }
        Ok(Self {
            tokens,
            sparsity,
            thresholds,
            freq,
        })
    }
}

fn silu_gated(w: &LlamaWeights) -> Result<()> {
    if w.config.arch == crate::Arch::Gemma3 {
        return Err(crate::Error::invalid(
            "sparse FFN",
            "Gemma 3's GELU-gated FFN is not supported (SiLU-gated models only)",
        ));
    }
    Ok(())
}

impl SparseFfn {
    /// Neuron-major f16 copies of `w`'s FFN weights, no hot neuron,
    /// thresholds 0.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for a model whose FFN is not SiLU-gated
    /// (Gemma 3: GELU, and norms after the FFN); candle errors dequantising
    /// the weights.
    pub fn new(w: &LlamaWeights, cpu: CpuBackend) -> Result<Self> {
        let none = vec![Vec::new(); w.layers.len()];
        Self::with_hot(w, cpu, &none, FfnFormat::F16)
    }

    /// As [`SparseFfn::new`], with `hot[layer]` the hot neurons of each
    /// layer (from [`NeuronProfile::hot_sets`]) and weight copies in
    /// `format`.
    ///
    /// # Errors
    /// As [`SparseFfn::new`]; [`Error::Invalid`] for a list per layer
    /// missing; typed kernel errors for a neuron out of range or repeated,
    /// or a model width that is not a multiple of 32 for Q8_0.
    pub fn with_hot(
        w: &LlamaWeights,
        cpu: CpuBackend,
        hot: &[Vec<u32>],
        format: FfnFormat,
    ) -> Result<Self> {
        silu_gated(w)?;
        let c = &w.config;
        if hot.len() != w.layers.len() {
            return Err(Error::invalid(
                "hot sets",
                format!("{} lists for {} layers", hot.len(), w.layers.len()),
            ));
        }
        let (d, ff) = (c.dim, c.ffn_dim);
        let to16 = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let to_q8 = |v: &[f32]| {
            v.chunks_exact(32)
                .map(|c| BlockQ8_0::quantize(c.try_into().unwrap_or(&[0.0; 32])))
                .collect::<Vec<_>>()
        };
        if format != FfnFormat::F16 && !d.is_multiple_of(32) {
            return Err(Error::invalid(
                "ffn weights q8_0",
                format!("model width {d} is not a multiple of 32"),
            ));
        }
        let mut layers: Vec<Box<dyn LayerFfn>> = Vec::with_capacity(w.layers.len());
        for (l, h) in w.layers.iter().zip(hot) {
            let gu = l.gate_up.dense_f32()?;
            let dn = l.down.dense_f32()?; // [d, ff]
            let mut down_t = vec![0.0f32; ff * d];
            for r in 0..d {
                for i in 0..ff {
                    down_t[i * d + r] = dn[r * ff + i];
                }
            }
            let (g, u) = gu.split_at(ff * d);
            let c2 = cpu.clone();
            layers.push(match format {
                FfnFormat::F16 => {
                    let (g, u, dt) = (to16(g), to16(u), to16(&down_t));
                    let fw = FfnWeights::new(d, ff, &g, &u, &dt)?;
                    Box::new(HybridFfn::new(cpu.clone(), c2, FfnAct::Silu, &fw, h, 0.0)?)
                }
                FfnFormat::Q8_0 | FfnFormat::Q8_0Int => {
                    let (g, u, dt) = (to_q8(g), to_q8(u), to_q8(&down_t));
                    let fw = FfnWeights::new(d, ff, &g, &u, &dt)?;
                    let f = HybridFfn::new(cpu.clone(), c2, FfnAct::Silu, &fw, h, 0.0)?;
                    Box::new(if format == FfnFormat::Q8_0Int {
                        f.with_q8_acts()
                    } else {
                        f
                    })
                }
            });
        }
        Ok(Self {
            d,
            n_ff: ff,
            format,
            layers,
            count: std::sync::Mutex::new(FfnCount::default()),
        })
    }

    /// Sets each layer's threshold to the `sparsity` quantile of
    /// `|silu(gate)|` over the dense FFN's activations on `tokens` (run
    /// through `weights` with exact attention): about that share of the
    /// neurons is then skipped per token (of the cold ones, when there are
    /// hot ones). `sparsity` 0 keeps every neuron.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a sparsity outside `[0, 1)` or no tokens;
    /// model errors.
    pub fn calibrate(
        &mut self,
        weights: &Arc<LlamaWeights>,
        tokens: &[u32],
        sparsity: f32,
    ) -> Result<()> {
        let p = NeuronProfile::measure(weights, tokens, sparsity)?;
        self.set_thresholds(&p.thresholds)
    }

    /// Sets the per-layer thresholds.
    ///
    /// # Errors
    /// [`Error::Invalid`] for another number of layers; a typed kernel
    /// error for a threshold that is not finite and `>= 0`.
    pub fn set_thresholds(&mut self, t: &[f32]) -> Result<()> {
        if t.len() != self.layers.len() {
            return Err(Error::invalid(
                "thresholds",
                format!("{} for {} layers", t.len(), self.layers.len()),
            ));
        }
        for (l, &v) in self.layers.iter_mut().zip(t) {
            l.set_threshold(v)?;
        }
        Ok(())
    }

    /// Fits each layer's low-rank gate predictor ([`hgca_hybrid::GatePredictor`]) on
    /// its FFN inputs `inputs[layer]` (`[tokens, d]`, from
    /// [`SparseFfn::record_inputs`]), keeping `rank` directions and a
    /// margin of `z` residual deviations: with a threshold above 0, each
    /// token's cold side then reads the predicted neurons' rows only
    /// instead of every cold gate row.
    ///
    /// # Errors
    /// [`Error::Invalid`] for another number of layers; typed kernel errors
    /// for a bad rank, margin or input length.
    pub fn fit_predictors(&mut self, inputs: &[Vec<f32>], rank: usize, z: f32) -> Result<()> {
        if inputs.len() != self.layers.len() {
            return Err(Error::invalid(
                "ffn inputs",
                format!("{} layers for {}", inputs.len(), self.layers.len()),
            ));
        }
        for (l, xs) in self.layers.iter_mut().zip(inputs) {
            l.fit_predictor(xs, xs.len() / self.d.max(1), rank, z)?;
        }
        Ok(())
    }

    /// Back to the threshold form in every layer.
    pub fn clear_predictors(&mut self) {
        self.layers.iter_mut().for_each(|l| l.clear_predictor());
    }

    /// Per layer, the dense FFN's inputs (after its norm) over `tokens`,
    /// run through `weights` with exact attention: `[tokens, d]` each, what
    /// [`SparseFfn::fit_predictors`] takes.
    ///
    /// # Errors
    /// [`Error::Invalid`] for no tokens; model errors.
    pub fn record_inputs(weights: &Arc<LlamaWeights>, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        if tokens.is_empty() {
            return Err(Error::invalid("calibration", "no tokens"));
        }
        let mut llm = Llama::with_full_attention::<f32>(Arc::clone(weights))?;
        llm.record_inputs = Some(vec![Vec::new(); weights.layers.len()]);
        for c in tokens.chunks(512) {
            llm.forward(c, Logits::None)?;
        }
        Ok(llm.record_inputs.take().unwrap_or_default())
    }

    /// The per-layer thresholds.
    pub fn thresholds(&self) -> Vec<f32> {
        self.layers.iter().map(|l| l.threshold()).collect()
    }

    /// Hot neurons per layer.
    pub fn hot_counts(&self) -> Vec<usize> {
        self.layers.iter().map(|l| l.hot()).collect()
    }

    /// Neurons per layer.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// The format of the weight copies.
    pub fn format(&self) -> FfnFormat {
        self.format
    }

    /// What was computed so far.
    pub fn count(&self) -> FfnCount {
        *self.count.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the count back to zero.
    pub fn reset_count(&self) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) = FfnCount::default();
    }

    /// The FFN of layer `l` for `n` normalised tokens `h` (`[n, d]`).
    pub(crate) fn forward(&self, l: usize, h: &[f32], n: usize) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; n * self.d];
        let t0 = std::time::Instant::now();
        let st = self.layers[l].forward(h, n, &mut out)?;
        let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
        c.evals += n as u64;
        c.active += (st.hot + st.cold.active) as u64;
        c.hot += st.hot as u64;
        c.rows += st.cold.rows as u64;
        c.time += t0.elapsed();
        c.cold_time += st.cpu_time;
        c.predictor_bytes += st.predictor_bytes;
        Ok(out)
    }
}
