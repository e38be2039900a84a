//! A model's weights as loaded from a GGUF: the weight format, the linear
//! layers (`y = x W^T`, quantised, f32 or both) and [`LlamaWeights`].

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use hgca_kernels::AttnShape;

#[cfg(doc)]
use crate::Llama;
use crate::gguf::{Arch, GgufFile, LlamaConfig};
use crate::{Error, Result};

/// How the projection weights are held and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// As stored in the GGUF (e.g. Q4_1), multiplied by candle's quantised
    /// kernels (activations quantised to 8 bits per block, like llama.cpp).
    #[default]
    Quantized,
    /// Dequantised to f32 at load time, multiplied by candle's f32 GEMM:
    /// more memory (4 bytes per weight) and exact activations.
    F32,
    /// Dequantised and re-quantised to Q8_0 at load (candle has AVX2 kernels
    /// for Q8_0 but not for Q4_1): the stored values up to 8-bit rounding.
    Q8,
    /// Both [`WeightFormat::Q8`] and [`WeightFormat::F32`]: forward calls of
    /// fewer than [`AUTO_DENSE_ROWS`] tokens (decoding) use the Q8_0 copy, longer
    /// ones (prefill chunks) the f32 GEMM. The fastest on x86 CPUs.
    Auto,
}

/// Rows from which [`WeightFormat::Auto`] switches to the f32 GEMM.
pub const AUTO_DENSE_ROWS: usize = 16;

/// One linear layer `y = x W^T`, `W: [out, in]`.
#[derive(Debug)]
pub(crate) struct Linear {
    w: LinearW,
    in_dim: usize,
    out_dim: usize,
}

#[derive(Debug)]
enum LinearW {
    Quant(QMatMul),
    Dense(Tensor),
    Both(QMatMul, Tensor),
}

impl Linear {
    /// Stacks `parts` (each `[out_i, in]`) along the output dimension.
    fn stacked(parts: Vec<QTensor>, format: WeightFormat) -> Result<Self> {
        let in_dim = parts[0].shape().dims()[1];
        let out_dim = parts.iter().map(|p| p.shape().dims()[0]).sum();
        let dtype = parts[0].dtype();
        let same = parts.iter().all(|p| p.dtype() == dtype);
        let w = match format {
            WeightFormat::Quantized if same => {
                let qt = if parts.len() == 1 {
                    parts
                        .into_iter()
                        .next()
                        .ok_or_else(|| Error::invalid("linear", "no parts"))?
                } else {
                    // Rows of blocks are contiguous: stacking rows is concatenating bytes.
                    let mut bytes = Vec::new();
                    for p in &parts {
                        bytes.extend_from_slice(&p.data()?);
                    }
                    let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
                    QTensor::new(storage, (out_dim, in_dim))?
                };
                LinearW::Quant(QMatMul::from_qtensor(qt)?)
            }
            _ => {
                let ts = parts
                    .iter()
                    .map(|p| p.dequantize(&Device::Cpu))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                let w = Tensor::cat(&ts, 0)?.contiguous()?;
                let q8 = |w: &Tensor| -> Result<QMatMul> {
                    Ok(QMatMul::from_qtensor(QTensor::quantize(
                        w,
                        GgmlDType::Q8_0,
                    )?)?)
                };
                match format {
                    WeightFormat::Quantized => LinearW::Quant(QMatMul::Tensor(w)),
                    WeightFormat::F32 => LinearW::Dense(w),
                    WeightFormat::Q8 => LinearW::Quant(q8(&w)?),
                    WeightFormat::Auto => LinearW::Both(q8(&w)?, w),
                }
            }
        };
        Ok(Self { w, in_dim, out_dim })
    }

    /// The weights dequantised to f32, `[out, in]` row-major.
    pub(crate) fn dense_f32(&self) -> Result<Vec<f32>> {
        let t = match &self.w {
            LinearW::Quant(QMatMul::QTensor(q)) => q.dequantize(&Device::Cpu)?,
            LinearW::Quant(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.clone(),
            LinearW::Dense(w) | LinearW::Both(_, w) => w.clone(),
        };
        Ok(t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// `x: [n, in]` row-major to `[n, out]`.
    pub(crate) fn forward(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        debug_assert_eq!(x.len(), n * self.in_dim);
        let t = Tensor::from_slice(x, (n, self.in_dim), &Device::Cpu)?;
        let y = match &self.w {
            LinearW::Quant(q) => q.forward(&t)?,
            LinearW::Both(q, _) if n < AUTO_DENSE_ROWS => q.forward(&t)?,
            LinearW::Dense(w) | LinearW::Both(_, w) => t.matmul(&w.t()?)?,
        };
        let y = y.flatten_all()?.to_vec1::<f32>()?;
        debug_assert_eq!(y.len(), n * self.out_dim);
        Ok(y)
    }
}

#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) qkv: Linear,
    /// Qwen2's Q, K and V biases, concatenated like the rows of `qkv`.
    pub(crate) qkv_bias: Option<Vec<f32>>,
    pub(crate) wo: Linear,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
    /// Gemma 3: RMS norms of each query and key head (`[head_dim]`) before
    /// RoPE, and of the attention and FFN outputs (`[dim]`) before the
    /// residual adds.
    pub(crate) qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    pub(crate) post_norms: Option<(Vec<f32>, Vec<f32>)>,
}

/// The weights of a Llama model, loaded once and shared (`Arc`) by any
/// number of [`Llama`] sessions.
#[derive(Debug)]
pub struct LlamaWeights {
    pub(crate) config: LlamaConfig,
    format: WeightFormat,
    pub(crate) embed: Vec<f32>,
    pub(crate) out_norm: Vec<f32>,
    pub(crate) lm_head: Linear,
    pub(crate) layers: Vec<Layer>,
    pub(crate) inv_freq: Vec<f64>,
    /// The local layers' RoPE frequencies (Gemma 3; else `inv_freq`'s).
    pub(crate) inv_freq_local: Vec<f64>,
}

fn vector(f: &mut GgufFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = f.tensor(name, &[len])?;
    Ok(t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
}

impl LlamaWeights {
    /// Loads every tensor of a Llama, Qwen2 or Gemma 3 GGUF (`token_embd`,
    /// `output_norm`, optional `output`, and `blk.{i}.{attn_norm, attn_q,
    /// attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}`,
    /// plus Qwen2's `attn_{q,k,v}.bias` and Gemma 3's `attn_{q,k}_norm`,
    /// `post_attention_norm` and `post_ffw_norm`, whose weights GGUF holds
    /// with Gemma's `1 +` already added). Q/K rows are taken as stored: in
    /// GGUF's RoPE layout for the architecture (adjacent pairs for Llama,
    /// halves for Qwen2 and Gemma 3).
    ///
    /// # Errors
    /// [`Error::Metadata`]/[`Error::Tensor`] for missing or misshaped
    /// entries, [`Error::Candle`] for read or dequantisation errors.
    pub fn load(f: &mut GgufFile, format: WeightFormat) -> Result<Self> {
        let c = LlamaConfig::from_gguf(f)?;
        let (d, kv, ff, qd) = (c.dim, c.kv_dim(), c.ffn_dim, c.q_dim());
        let embd_q = f.tensor("token_embd.weight", &[c.vocab_size, d])?;
        let embed = embd_q
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let head_q = if f.has_tensor("output.weight") {
            f.tensor("output.weight", &[c.vocab_size, d])?
        } else {
            embd_q
        };
        let lm_head = Linear::stacked(vec![head_q], format)?;
        let out_norm = vector(f, "output_norm.weight", d)?;
        // No capacity from the header's count: layers come as their tensors load.
        let mut layers = Vec::new();
        for i in 0..c.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let q = f.tensor(&p("attn_q"), &[qd, d])?;
            let k = f.tensor(&p("attn_k"), &[kv, d])?;
            let v = f.tensor(&p("attn_v"), &[kv, d])?;
            let o = f.tensor(&p("attn_output"), &[d, qd])?;
            let g = f.tensor(&p("ffn_gate"), &[ff, d])?;
            let u = f.tensor(&p("ffn_up"), &[ff, d])?;
            let dn = f.tensor(&p("ffn_down"), &[d, ff])?;
            let gemma = c.arch == Arch::Gemma3;
            let qk_norm = if gemma {
                Some((
                    vector(f, &p("attn_q_norm"), c.head_dim)?,
                    vector(f, &p("attn_k_norm"), c.head_dim)?,
                ))
            } else {
                None
            };
            let post_norms = if gemma {
                Some((
                    vector(f, &p("post_attention_norm"), d)?,
                    vector(f, &p("post_ffw_norm"), d)?,
                ))
            } else {
                None
            };
            let qkv_bias = match c.arch {
                Arch::Llama | Arch::Gemma3 => None,
                Arch::Qwen2 => {
                    let b = |s: &str| format!("blk.{i}.{s}.bias");
                    let mut all = vector(f, &b("attn_q"), d)?;
                    all.extend(vector(f, &b("attn_k"), kv)?);
                    all.extend(vector(f, &b("attn_v"), kv)?);
                    Some(all)
                }
            };
            layers.push(Layer {
                qkv_bias,
                qk_norm,
                post_norms,
                attn_norm: vector(f, &p("attn_norm"), d)?,
                ffn_norm: vector(f, &p("ffn_norm"), d)?,
                qkv: Linear::stacked(vec![q, k, v], format)?,
                wo: Linear::stacked(vec![o], format)?,
                gate_up: Linear::stacked(vec![g, u], format)?,
                down: Linear::stacked(vec![dn], format)?,
            });
        }
        let half = c.head_dim / 2;
        let freqs = |base: f32| -> Vec<f64> {
            (0..half)
                .map(|i| f64::from(base).powf(-2.0 * i as f64 / c.head_dim as f64))
                .collect()
        };
        let (inv_freq, inv_freq_local) = (freqs(c.rope_theta), freqs(c.rope_theta_local));
        Ok(Self {
            config: c,
            format,
            embed,
            out_norm,
            lm_head,
            layers,
            inv_freq,
            inv_freq_local,
        })
    }

    /// Opens `path` and loads it with [`LlamaWeights::load`].
    ///
    /// # Errors
    /// As [`GgufFile::open`] and [`LlamaWeights::load`].
    pub fn from_path(path: impl AsRef<std::path::Path>, format: WeightFormat) -> Result<Self> {
        let mut f = GgufFile::open(path)?;
        Self::load(&mut f, format)
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The weight format chosen at load.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// The attention shape of every layer (`n_heads`, `n_kv_heads`,
    /// `head_dim`, scale `1/sqrt(head_dim)`, which is also Gemma 3 270M's
    /// `query_pre_attn_scalar` of 256).
    ///
    /// # Errors
    /// Never for a config that passed validation.
    pub fn attn_shape(&self) -> Result<AttnShape> {
        let c = &self.config;
        Ok(AttnShape::new(c.n_heads, c.n_kv_heads, c.head_dim)?)
    }
}
