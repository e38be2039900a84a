//! The Llama forward pass. Projections and the FFN run through candle
//! (quantised or f32 matmuls on the CPU); attention is one
//! [`SequenceAttention`] per layer, supplied by the caller.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use hgca_hybrid::{FullAttention, SequenceAttention};
use hgca_kernels::{AttnShape, KvElem};

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
struct Linear {
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
    fn dense_f32(&self) -> Result<Vec<f32>> {
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
    fn forward(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
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
struct Layer {
    attn_norm: Vec<f32>,
    qkv: Linear,
    /// Qwen2's Q, K and V biases, concatenated like the rows of `qkv`.
    qkv_bias: Option<Vec<f32>>,
    wo: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Linear,
    down: Linear,
}

/// The weights of a Llama model, loaded once and shared (`Arc`) by any
/// number of [`Llama`] sessions.
#[derive(Debug)]
pub struct LlamaWeights {
    config: LlamaConfig,
    format: WeightFormat,
    embed: Vec<f32>,
    out_norm: Vec<f32>,
    lm_head: Linear,
    layers: Vec<Layer>,
    inv_freq: Vec<f64>,
}

fn vector(f: &mut GgufFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = f.tensor(name, &[len])?;
    Ok(t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
}

impl LlamaWeights {
    /// Loads every tensor of a Llama or Qwen2 GGUF (`token_embd`,
    /// `output_norm`, optional `output`, and `blk.{i}.{attn_norm, attn_q,
    /// attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}`,
    /// plus Qwen2's `attn_{q,k,v}.bias`). Q/K rows are taken as stored: in
    /// GGUF's RoPE layout for the architecture (adjacent pairs for Llama,
    /// halves for Qwen2).
    ///
    /// # Errors
    /// [`Error::Metadata`]/[`Error::Tensor`] for missing or misshaped
    /// entries, [`Error::Candle`] for read or dequantisation errors.
    pub fn load(f: &mut GgufFile, format: WeightFormat) -> Result<Self> {
        let c = LlamaConfig::from_gguf(f)?;
        let (d, kv, ff) = (c.dim, c.kv_dim(), c.ffn_dim);
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
            let q = f.tensor(&p("attn_q"), &[d, d])?;
            let k = f.tensor(&p("attn_k"), &[kv, d])?;
            let v = f.tensor(&p("attn_v"), &[kv, d])?;
            let o = f.tensor(&p("attn_output"), &[d, d])?;
            let g = f.tensor(&p("ffn_gate"), &[ff, d])?;
            let u = f.tensor(&p("ffn_up"), &[ff, d])?;
            let dn = f.tensor(&p("ffn_down"), &[d, ff])?;
            let qkv_bias = match c.arch {
                Arch::Llama => None,
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
                attn_norm: vector(f, &p("attn_norm"), d)?,
                ffn_norm: vector(f, &p("ffn_norm"), d)?,
                qkv: Linear::stacked(vec![q, k, v], format)?,
                wo: Linear::stacked(vec![o], format)?,
                gate_up: Linear::stacked(vec![g, u], format)?,
                down: Linear::stacked(vec![dn], format)?,
            });
        }
        let half = c.head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| (c.rope_theta as f64).powf(-2.0 * i as f64 / c.head_dim as f64))
            .collect();
        Ok(Self {
            config: c,
            format,
            embed,
            out_norm,
            lm_head,
            layers,
            inv_freq,
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
    /// `head_dim`, scale `1/sqrt(head_dim)`).
    ///
    /// # Errors
    /// Never for a config that passed validation.
    pub fn attn_shape(&self) -> Result<AttnShape> {
        let c = &self.config;
        Ok(AttnShape::new(c.n_heads, c.n_kv_heads, c.head_dim)?)
    }
}

/// Which logits [`Llama::forward`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (prefill of a prompt whose predictions are not needed).
    None,
    /// Those of the last token only: `[vocab]`.
    Last,
    /// Those of every token: `[n, vocab]`.
    All,
}

/// A per-layer attention, as [`Llama`] holds it.
pub type BoxedAttention = Box<dyn SequenceAttention + Send>;

/// candle's own worker threads (the barrier pool of its quantised
/// matmuls) as an [`hgca_cpu::Executor`], so that hgca's attention runs on
/// the threads the matmuls use. Those threads spin for a while after each
/// matmul before they sleep: attention on rayon's threads beside them
/// fought them for the cores (SmolLM2 decode at context 2048 on 2 cores:
/// attention 6.6 ms per token in the model, 2.8 ms alone).
#[derive(Debug, Clone, Copy, Default)]
pub struct CandleThreads;

impl hgca_cpu::Executor for CandleThreads {
    fn threads(&self) -> usize {
        candle_core::utils::get_num_threads()
    }
    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        candle_core::utils::barrier_pool().execute_chunked(n, |r| r.for_each(f));
    }
}

/// The CPU backend hgca-llm's attention runs on: the best ISA, and
/// candle's threads ([`CandleThreads`]).
pub fn cpu_backend() -> hgca_cpu::CpuBackend {
    hgca_cpu::CpuBackend::new().with_executor(Arc::new(CandleThreads))
}

/// The attention factory of exact full attention (hgca's CPU baseline) with
/// KV stored as `T`, for [`Llama::new`] and [`crate::perplexity`]: every
/// layer gets a [`FullAttention`] on [`cpu_backend`].
pub fn full_attention<T: KvElem + Send + 'static>()
-> impl FnMut(usize, AttnShape) -> Result<BoxedAttention> + Copy {
    |_, shape| Ok(Box::new(FullAttention::<T>::new(shape, cpu_backend())?) as BoxedAttention)
}

/// One running sequence of a Llama model: shared weights, one attention
/// layer (with its KV cache) per model layer, and the position.
pub struct Llama {
    weights: Arc<LlamaWeights>,
    attn: Vec<BoxedAttention>,
    pos: usize,
    poisoned: bool,
    /// hgca's sparse FFN in place of candle's dense one, when set.
    ffn: Option<Arc<SparseFfn>>,
    /// Per layer, samples of `|silu(gate)|` of the dense FFN (calibration).
    record: Option<Vec<Vec<f32>>>,
    /// Where the time of forward calls went, when asked.
    profile: Option<Profile>,
}

/// Where the time of [`Llama::forward`] calls went, summed over the calls
/// since [`Llama::set_profile`] turned it on (wall-clock time of the calling
/// thread around each part; the parts' own threads run inside them).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Profile {
    /// Forward calls and the tokens they took.
    pub calls: u64,
    /// Tokens of those calls.
    pub tokens: u64,
    /// The Q/K/V projection, its biases and RoPE.
    pub qkv: std::time::Duration,
    /// Attention (the layer's [`SequenceAttention::forward`]).
    pub attn: std::time::Duration,
    /// The output projection and its residual.
    pub wo: std::time::Duration,
    /// The FFN (gate/up, activation, down) and its residual.
    pub ffn: std::time::Duration,
    /// The final norm and the LM head.
    pub head: std::time::Duration,
    /// The whole calls.
    pub total: std::time::Duration,
}

impl Profile {
    /// Everything outside the parts (embedding, norms, RoPE tables, copies).
    pub fn other(&self) -> std::time::Duration {
        self.total
            .saturating_sub(self.qkv + self.attn + self.wo + self.ffn + self.head)
    }
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("config", &self.weights.config)
            .field("pos", &self.pos)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * r * g;
        }
    }
}

/// Rotates the pairs of every head of every row by the angles of its
/// position: adjacent pairs `(2i, 2i+1)` for Llama (GGUF permutes Q/K rows
/// for it), the halves `(i, i + d/2)` for Qwen2 (GPT-NeoX style).
fn rope(x: &mut [f32], row: usize, head_dim: usize, cos: &[f32], sin: &[f32], arch: Arch) {
    let half = head_dim / 2;
    for (t, r) in x.chunks_exact_mut(row).enumerate() {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for h in r.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (ia, ib) = match arch {
                    Arch::Llama => (2 * i, 2 * i + 1),
                    Arch::Qwen2 => (i, i + half),
                };
                let (a, b) = (h[ia], h[ib]);
                h[ia] = a * c[i] - b * s[i];
                h[ib] = a * s[i] + b * c[i];
            }
        }
    }
}

impl Llama {
    /// A new empty sequence; `attention(layer, shape)` makes the attention
    /// of each layer.
    ///
    /// # Errors
    /// What `attention` returns.
    pub fn new<F>(weights: Arc<LlamaWeights>, mut attention: F) -> Result<Self>
    where
        F: FnMut(usize, AttnShape) -> Result<BoxedAttention>,
    {
        let shape = weights.attn_shape()?;
        let attn = (0..weights.config.n_layers)
            .map(|l| attention(l, shape))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            weights,
            attn,
            pos: 0,
            poisoned: false,
            ffn: None,
            record: None,
            profile: None,
        })
    }

    /// Turns the time profile of forward calls on (from zero) or off.
    pub fn set_profile(&mut self, on: bool) {
        self.profile = on.then(Profile::default);
    }

    /// The time profile since [`Llama::set_profile`] turned it on.
    pub fn profile(&self) -> Option<Profile> {
        self.profile
    }

    /// A new sequence with exact full attention (hgca's CPU baseline), KV
    /// stored as `T` (`f32`, `f16` or `bf16`).
    ///
    /// # Errors
    /// As [`FullAttention::new`].
    pub fn with_full_attention<T: KvElem + Send + 'static>(
        weights: Arc<LlamaWeights>,
    ) -> Result<Self> {
        Self::new(weights, full_attention::<T>())
    }

    /// Runs the FFN of every layer through hgca's sparse FFN (`ffn`, built
    /// from these weights) instead of candle's dense one.
    #[must_use]
    pub fn with_sparse_ffn(mut self, ffn: Arc<SparseFfn>) -> Self {
        self.ffn = Some(ffn);
        self
    }

    /// Tokens processed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    /// The attention layers (e.g. to read statistics).
    pub fn attention_layers(&self) -> &[BoxedAttention] {
        &self.attn
    }

    /// Appends `tokens` (a prompt chunk, or one token to decode) and returns
    /// the requested logits (row-major `[n, vocab]` for [`Logits::All`]).
    /// An empty `tokens` returns an empty vector and changes nothing.
    ///
    /// # Errors
    /// [`Error::TokenId`] for an id outside the vocabulary (nothing changed);
    /// attention or candle errors otherwise. After such an error the
    /// sequence is inconsistent (some layers appended, some not) and every
    /// later call returns [`Error::Invalid`]: start a new sequence.
    pub fn forward(&mut self, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        if self.poisoned {
            return Err(Error::invalid(
                "forward",
                "an earlier forward failed mid-way; start a new sequence",
            ));
        }
        let w = &*self.weights;
        let c = &w.config;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::TokenId {
                id,
                vocab: c.vocab_size,
            });
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        self.poisoned = true;
        let t0 = std::time::Instant::now();
        let out = self.forward_inner(tokens, logits)?;
        if let Some(p) = &mut self.profile {
            p.calls += 1;
            p.tokens += n as u64;
            p.total += t0.elapsed();
        }
        self.poisoned = false;
        self.pos += n;
        Ok(out)
    }

    fn forward_inner(&mut self, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let w = &*self.weights;
        let c = &w.config;
        let (n, d, hd, kvd) = (tokens.len(), c.dim, c.head_dim, c.kv_dim());
        let half = hd / 2;
        let mut x = Vec::with_capacity(n * d);
        for &t in tokens {
            let t = t as usize;
            x.extend_from_slice(&w.embed[t * d..(t + 1) * d]);
        }
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in self.pos..self.pos + n {
            for &f in &w.inv_freq {
                let (s, co) = (p as f64 * f).sin_cos();
                cos.push(co as f32);
                sin.push(s as f32);
            }
        }
        let mut h = vec![0.0f32; n * d];
        let mut q = vec![0.0f32; n * d];
        let mut k = vec![0.0f32; n * kvd];
        let mut v = vec![0.0f32; n * kvd];
        let mut att = vec![0.0f32; n * d];
        let mut act = vec![0.0f32; n * c.ffn_dim];
        let mut laps = Laps::new(self.profile.take());
        for (li, (layer, attn)) in w.layers.iter().zip(self.attn.iter_mut()).enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            laps.skip();
            let mut qkv = layer.qkv.forward(&h, n)?;
            let row = d + 2 * kvd;
            if let Some(bias) = &layer.qkv_bias {
                for r in qkv.chunks_exact_mut(row) {
                    for (x, b) in r.iter_mut().zip(bias) {
                        *x += b;
                    }
                }
            }
            for t in 0..n {
                let r = &qkv[t * row..(t + 1) * row];
                q[t * d..(t + 1) * d].copy_from_slice(&r[..d]);
                k[t * kvd..(t + 1) * kvd].copy_from_slice(&r[d..d + kvd]);
                v[t * kvd..(t + 1) * kvd].copy_from_slice(&r[d + kvd..]);
            }
            rope(&mut q, d, hd, &cos, &sin, c.arch);
            rope(&mut k, kvd, hd, &cos, &sin, c.arch);
            laps.add(|p| &mut p.qkv);
            attn.forward(&q, &k, &v, n, &mut att)?;
            laps.add(|p| &mut p.attn);
            let o = layer.wo.forward(&att, n)?;
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            laps.add(|p| &mut p.wo);
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            laps.skip();
            if let Some(ffn) = &self.ffn {
                let dn = ffn.forward(li, &h, n)?;
                for (a, b) in x.iter_mut().zip(&dn) {
                    *a += b;
                }
                laps.add(|p| &mut p.ffn);
                continue;
            }
            let gu = layer.gate_up.forward(&h, n)?;
            let ff = c.ffn_dim;
            for t in 0..n {
                let (g, u) = gu[t * 2 * ff..(t + 1) * 2 * ff].split_at(ff);
                if let Some(rec) = &mut self.record {
                    // Every 7th neuron: enough for a layer's quantiles.
                    rec[li].extend(g.iter().step_by(7).map(|&g| (g / (1.0 + (-g).exp())).abs()));
                }
                for ((a, &g), &u) in act[t * ff..(t + 1) * ff].iter_mut().zip(g).zip(u) {
                    *a = g / (1.0 + (-g).exp()) * u;
                }
            }
            let dn = layer.down.forward(&act, n)?;
            for (a, b) in x.iter_mut().zip(&dn) {
                *a += b;
            }
            laps.add(|p| &mut p.ffn);
        }
        let (rows, m) = match logits {
            Logits::None => {
                self.profile = laps.done();
                return Ok(Vec::new());
            }
            Logits::Last => (&x[(n - 1) * d..], 1),
            Logits::All => (&x[..], n),
        };
        let mut hn = vec![0.0f32; m * d];
        rms_norm(rows, &w.out_norm, c.rms_eps, &mut hn);
        let out = w.lm_head.forward(&hn, m)?;
        laps.add(|p| &mut p.head);
        self.profile = laps.done();
        Ok(out)
    }
}

/// The laps of one forward call, added to parts of a [`Profile`] (nothing
/// when there is none).
struct Laps {
    prof: Option<Profile>,
    lap: std::time::Instant,
}

impl Laps {
    fn new(prof: Option<Profile>) -> Self {
        Self {
            prof,
            lap: std::time::Instant::now(),
        }
    }
    /// Adds the time since the last lap to `part`.
    fn add(&mut self, part: fn(&mut Profile) -> &mut std::time::Duration) {
        if let Some(p) = self.prof.as_mut() {
            let now = std::time::Instant::now();
            *part(p) += now - self.lap;
            self.lap = now;
        }
    }
    /// Starts a new lap without counting the last one in a part.
    fn skip(&mut self) {
        if self.prof.is_some() {
            self.lap = std::time::Instant::now();
        }
    }
    fn done(self) -> Option<Profile> {
        self.prof
    }
}

/// Numerically stable `ln softmax(logits)[target]`.
pub fn log_prob(logits: &[f32], target: usize) -> Option<f64> {
    let t = *logits.get(target)? as f64;
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let s: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
    Some(t - m - s.ln())
}

/// Index of the largest logit (greedy decoding); `None` when empty.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
}

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
    /// Candle errors dequantising the weights.
    pub fn new(w: &LlamaWeights, cpu: hgca_cpu::CpuBackend) -> Result<Self> {
        let c = &w.config;
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
    fn forward(&self, l: usize, h: &[f32], n: usize) -> Result<Vec<f32>> {
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
