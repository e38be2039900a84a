//! hgca's sparse FFN in place of candle's dense one: neuron-major f16
//! weights, per-layer CATS thresholds and their calibration.

use std::sync::Arc;

use crate::model::{Llama, Logits};
use crate::weights::LlamaWeights;
use crate::{Error, Result};

/// hgca's sparse FFN for every layer of a model (PowerInfer's CPU side,
/// CATS thresholds): neuron-major f16 copies of the FFN weights, and per
/// layer a threshold on `|silu(gate)|`; a token's neurons below it are not
/// computed (their up and down rows are not read). With every threshold 0
/// it is the dense FFN up to f16 rounding of the weights.
#[derive(Debug)]
pub struct SparseFfn {
    d: usize,
    n_ff: usize,
    /// Per layer: gate, up, down transposed (`[n_ff, d]` each).
    layers: Vec<[Vec<hgca_kernels::f16>; 3]>,
    thresholds: Vec<f32>,
    cpu: hgca_cpu::CpuBackend,
    count: std::sync::Mutex<FfnCount>,
}

/// What a [`SparseFfn`] computed since it was made (or last reset).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FfnCount {
    /// (token, layer) FFN evaluations.
    pub evals: u64,
    /// (token, neuron) pairs computed, summed over layers.
    pub active: u64,
    /// Weight rows read per token (gate rows of every neuron, up and down
    /// rows of the active ones), summed; the dense FFN reads `3 n_ff` per
    /// evaluation.
    pub rows: u64,
    /// Time in the FFN kernel.
    pub time: std::time::Duration,
}

impl SparseFfn {
    /// Neuron-major f16 copies of `w`'s FFN weights, thresholds 0.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for a model whose FFN is not SiLU-gated
    /// (Gemma 3: GELU, and norms after the FFN); candle errors dequantising
    /// the weights.
    pub fn new(w: &LlamaWeights, cpu: hgca_cpu::CpuBackend) -> Result<Self> {
        let c = &w.config;
        if c.arch == crate::Arch::Gemma3 {
            return Err(crate::Error::invalid(
                "sparse FFN",
                "Gemma 3's GELU-gated FFN is not supported (SiLU-gated models only)",
            ));
        }
        let (d, ff) = (c.dim, c.ffn_dim);
        let to16 = |v: &[f32]| {
            v.iter()
                .map(|&x| hgca_kernels::f16::from_f32(x))
                .collect::<Vec<_>>()
        };
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let gu = l.gate_up.dense_f32()?;
            let dn = l.down.dense_f32()?; // [d, ff]
            let mut down_t = vec![0.0f32; ff * d];
            for r in 0..d {
                for i in 0..ff {
                    down_t[i * d + r] = dn[r * ff + i];
                }
            }
            layers.push([to16(&gu[..ff * d]), to16(&gu[ff * d..]), to16(&down_t)]);
        }
        Ok(Self {
            d,
            n_ff: ff,
            thresholds: vec![0.0; layers.len()],
            layers,
            cpu,
            count: std::sync::Mutex::new(FfnCount::default()),
        })
    }

    /// Sets each layer's threshold to the `sparsity` quantile of
    /// `|silu(gate)|` over the dense FFN's activations on `tokens` (run
    /// through `weights` with exact attention): about that share of the
    /// neurons is then skipped per token. `sparsity` 0 keeps every neuron.
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
        if !(0.0..1.0).contains(&sparsity) {
            return Err(Error::invalid(
                "ffn sparsity",
                format!("{sparsity} is not in [0, 1)"),
            ));
        }
        if tokens.is_empty() {
            return Err(Error::invalid("calibration", "no tokens"));
        }
        if sparsity == 0.0 {
            self.thresholds.fill(0.0);
            return Ok(());
        }
        let mut llm = Llama::with_full_attention::<f32>(Arc::clone(weights))?;
        llm.record = Some(vec![Vec::new(); self.layers.len()]);
        for c in tokens.chunks(512) {
            llm.forward(c, Logits::None)?;
        }
        let rec = llm.record.take().unwrap_or_default();
        for (t, mut v) in self.thresholds.iter_mut().zip(rec) {
            v.sort_by(f32::total_cmp);
            *t = v
                .get(((v.len() as f64) * f64::from(sparsity)) as usize)
                .copied()
                .unwrap_or(0.0);
        }
        Ok(())
    }

    /// The per-layer thresholds.
    pub fn thresholds(&self) -> &[f32] {
        &self.thresholds
    }

    /// What was computed so far.
    pub fn count(&self) -> FfnCount {
        *self.count.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The FFN of layer `l` for `n` normalised tokens `h` (`[n, d]`).
    pub(crate) fn forward(&self, l: usize, h: &[f32], n: usize) -> Result<Vec<f32>> {
        let [g, u, dt] = &self.layers[l];
        let w = hgca_kernels::FfnWeights::new(self.d, self.n_ff, g, u, dt)?;
        let mut out = vec![0.0f32; n * self.d];
        let t0 = std::time::Instant::now();
        let st = self.cpu.sparse_ffn(
            hgca_kernels::FfnAct::Silu,
            &w,
            h,
            n,
            hgca_kernels::Neurons::Threshold(self.thresholds[l]),
            &mut out,
        )?;
        let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
        c.evals += n as u64;
        c.active += st.active as u64;
        c.rows += st.rows as u64;
        c.time += t0.elapsed();
        Ok(out)
    }
}
