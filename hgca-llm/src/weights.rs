//! A model's weights as loaded from a GGUF: the weight format, the linear
//! layers (`y = x W^T`, quantised, f32 or both) and [`LlamaWeights`].

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use hgca_cpu::{PackedRows, Q8Acts};
use hgca_kernels::{AttnShape, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0};

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
    /// ones (prefill chunks) the f32 GEMM.
    Auto,
    /// Like [`WeightFormat::Auto`], but decoding reads the GGUF's own blocks:
    /// Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K through hgca's kernel
    /// ([`hgca_cpu::CpuBackend::qmatvec`]; candle lacks one for Q4_1 and
    /// Q5_0), the other K formats through candle's; other types are
    /// re-quantised to Q8_0. Fewer bytes per token than a Q8_0 copy of 4- and 5-bit
    /// weights. Where hgca's kernel has no SIMD path (it has AVX2 and
    /// AVX-512 VNNI, no NEON yet), those formats take candle's kernels as
    /// with `Auto`. On the AVX-512 VNNI path, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K
    /// and Q6_K are repacked at load sixteen rows at a time ([`hgca_cpu::PackedRows`],
    /// the same bytes), and prefill chunks multiply them by the same
    /// integer kernel (activations quantised to Q8_0, as llama.cpp
    /// multiplies its prompt), the other parts by the f32 copy.
    Native,
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
    /// [`WeightFormat::Native`]: the parts' own blocks for decoding, the f32
    /// copy for prefill chunks.
    Native(Vec<NativePart>, Tensor),
}

/// Rows of blocks that hgca's kernel multiplies.
#[derive(Debug)]
enum HgcaRows {
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
    Q5_0(Vec<BlockQ5_0>),
    Q8_0(Vec<BlockQ8_0>),
    Q4K(Vec<BlockQ4K>),
    Q6K(Vec<BlockQ6K>),
    /// The formats repacked sixteen rows at a time, where
    /// hgca's kernel takes its AVX-512 VNNI path (the layout is for it).
    PackedQ4_0(PackedRows<BlockQ4_0>),
    PackedQ4_1(PackedRows<BlockQ4_1>),
    PackedQ5_0(PackedRows<BlockQ5_0>),
    PackedQ8_0(PackedRows<BlockQ8_0>),
    PackedQ4K(PackedRows<BlockQ4K>),
    PackedQ6K(PackedRows<BlockQ6K>),
}

/// One stacked part of a [`WeightFormat::Native`] layer (`rows` outputs).
#[derive(Debug)]
enum NativePart {
    Hgca(HgcaRows, usize),
    Candle(QMatMul, usize),
}

/// `parts` (each `[out_i, in]`) dequantised to f32 and stacked along the
/// output dimension.
fn dequantize_stacked(parts: &[QTensor]) -> Result<Tensor> {
    let ts = parts
        .iter()
        .map(|p| p.dequantize(&Device::Cpu))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&ts, 0)?.contiguous()?)
}

/// `parts` (each `[out_i, in]`) with each run of consecutive parts of one
/// block type joined into one tensor (rows of blocks are contiguous:
/// stacking rows is concatenating bytes), so that a decode step runs one
/// parallel matrix-vector product per run instead of one per part (Q, K
/// and V, or gate and up, are usually of one type).
fn merge_runs(parts: Vec<QTensor>) -> Result<Vec<QTensor>> {
    let mut out: Vec<Vec<QTensor>> = Vec::new();
    for p in parts {
        match out.last_mut() {
            Some(run) if run[0].dtype() == p.dtype() => run.push(p),
            _ => out.push(vec![p]),
        }
    }
    out.into_iter()
        .map(|run| {
            if run.len() == 1 {
                return Ok(run.into_iter().next().expect("one part"));
            }
            let (dtype, k) = (run[0].dtype(), run[0].shape().dims()[1]);
            let rows = run.iter().map(|p| p.shape().dims()[0]).sum::<usize>();
            let mut bytes = Vec::new();
            for p in &run {
                bytes.extend_from_slice(&p.data()?);
            }
            let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
            Ok(QTensor::new(storage, (rows, k))?)
        })
        .collect()
}

/// GGUF's bytes of a `[rows, k]` matrix repacked ([`PackedRows`]).
fn packed<B: hgca_cpu::PackBlock>(b: &[u8], rows: usize, k: usize) -> Result<PackedRows<B>> {
    Ok(PackedRows::new(&pod_vec::<B>(b), rows, k)?)
}

/// GGUF's bytes as blocks (copied: the bytes need not be aligned).
fn pod_vec<B: bytemuck::Pod>(b: &[u8]) -> Vec<B> {
    b.chunks_exact(size_of::<B>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

impl NativePart {
    fn new(p: QTensor) -> Result<Self> {
        let (rows, k) = (p.shape().dims()[0], p.shape().dims()[1]);
        let path = hgca_cpu::CpuBackend::qmatvec_path(native_backend().isa());
        // Repacked where its kernel beats a row at a time: on the AVX-512
        // VNNI path every format; on the AVX2 path all but Q8_0 (whose
        // codes' signs cost the AVX2 kernel a step per token: slower than
        // a row at a time there).
        let pack = |dtype: GgmlDType| match path {
            hgca_cpu::QDotPath::Avx512Vnni => true,
            hgca_cpu::QDotPath::Avx2 => dtype != GgmlDType::Q8_0,
            _ => false,
        };
        let blocks = |dtype: GgmlDType, b: &[u8]| -> Result<HgcaRows> {
            let pack = pack(dtype);
            Ok(match dtype {
                GgmlDType::Q4_0 if pack => HgcaRows::PackedQ4_0(packed(b, rows, k)?),
                GgmlDType::Q4_1 if pack => HgcaRows::PackedQ4_1(packed(b, rows, k)?),
                GgmlDType::Q5_0 if pack => HgcaRows::PackedQ5_0(packed(b, rows, k)?),
                GgmlDType::Q8_0 if pack => HgcaRows::PackedQ8_0(packed(b, rows, k)?),
                GgmlDType::Q4K if pack => HgcaRows::PackedQ4K(packed(b, rows, k)?),
                GgmlDType::Q6K if pack => HgcaRows::PackedQ6K(packed(b, rows, k)?),
                GgmlDType::Q4_0 => HgcaRows::Q4_0(pod_vec(b)),
                GgmlDType::Q4_1 => HgcaRows::Q4_1(pod_vec(b)),
                GgmlDType::Q5_0 => HgcaRows::Q5_0(pod_vec(b)),
                GgmlDType::Q4K => HgcaRows::Q4K(pod_vec(b)),
                GgmlDType::Q6K => HgcaRows::Q6K(pod_vec(b)),
                _ => HgcaRows::Q8_0(pod_vec(b)),
            })
        };
        // hgca's kernel where it has an x86 SIMD path; elsewhere (aarch64:
        // no NEON path yet) candle's kernels, as `Auto` would use them.
        let hgca = path != hgca_cpu::QDotPath::Portable;
        Ok(match p.dtype() {
            GgmlDType::Q4_0
            | GgmlDType::Q4_1
            | GgmlDType::Q5_0
            | GgmlDType::Q8_0
            | GgmlDType::Q4K
            | GgmlDType::Q6K
                if hgca =>
            {
                NativePart::Hgca(blocks(p.dtype(), &p.data()?)?, rows)
            }
            // Formats candle has SIMD kernels for.
            GgmlDType::Q4_0
            | GgmlDType::Q8_0
            | GgmlDType::Q2K
            | GgmlDType::Q3K
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K
            | GgmlDType::Q8K => NativePart::Candle(QMatMul::from_qtensor(p)?, rows),
            _ => {
                let w = p.dequantize(&Device::Cpu)?;
                let q8 = QTensor::quantize(&w, GgmlDType::Q8_0)?;
                if hgca {
                    NativePart::Hgca(blocks(GgmlDType::Q8_0, &q8.data()?)?, rows)
                } else {
                    NativePart::Candle(QMatMul::from_qtensor(q8)?, rows)
                }
            }
        })
    }

    fn rows(&self) -> usize {
        match self {
            NativePart::Hgca(_, r) | NativePart::Candle(_, r) => *r,
        }
    }

    /// Whether the part is held repacked ([`PackedRows`]).
    fn packed(&self) -> bool {
        matches!(
            self,
            NativePart::Hgca(
                HgcaRows::PackedQ4_0(_)
                    | HgcaRows::PackedQ4_1(_)
                    | HgcaRows::PackedQ5_0(_)
                    | HgcaRows::PackedQ8_0(_)
                    | HgcaRows::PackedQ4K(_)
                    | HgcaRows::PackedQ6K(_),
                _
            )
        )
    }

    /// `[n, rows]` for the `n` tokens of `x` (`acts` is `x` quantised).
    fn forward(&self, x: &[f32], n: usize, acts: &Q8Acts, y: &mut [f32]) -> Result<()> {
        let cpu = native_backend();
        let rows = self.rows();
        match self {
            NativePart::Hgca(HgcaRows::Q4_0(w), _) => cpu.qmatvec(w, rows, acts, y)?,
            NativePart::Hgca(HgcaRows::Q4_1(w), _) => cpu.qmatvec(w, rows, acts, y)?,
            NativePart::Hgca(HgcaRows::Q5_0(w), _) => cpu.qmatvec(w, rows, acts, y)?,
            NativePart::Hgca(HgcaRows::Q8_0(w), _) => cpu.qmatvec(w, rows, acts, y)?,
            NativePart::Hgca(HgcaRows::Q4K(w), _) => cpu.qmatvec(w, rows, acts, y)?,
            NativePart::Hgca(HgcaRows::Q6K(w), _) => cpu.qmatvec(w, rows, acts, y)?,
            NativePart::Hgca(HgcaRows::PackedQ4_0(w), _) => cpu.qmatvec_packed(w, acts, y)?,
            NativePart::Hgca(HgcaRows::PackedQ4_1(w), _) => cpu.qmatvec_packed(w, acts, y)?,
            NativePart::Hgca(HgcaRows::PackedQ5_0(w), _) => cpu.qmatvec_packed(w, acts, y)?,
            NativePart::Hgca(HgcaRows::PackedQ8_0(w), _) => cpu.qmatvec_packed(w, acts, y)?,
            NativePart::Hgca(HgcaRows::PackedQ4K(w), _) => cpu.qmatvec_packed(w, acts, y)?,
            NativePart::Hgca(HgcaRows::PackedQ6K(w), _) => cpu.qmatvec_packed(w, acts, y)?,
            NativePart::Candle(q, _) => {
                let t = Tensor::from_slice(x, (n, acts.width()), &Device::Cpu)?;
                let out = q.forward(&t)?.flatten_all()?.to_vec1::<f32>()?;
                y.copy_from_slice(&out);
            }
        }
        Ok(())
    }
}

/// The backend of [`WeightFormat::Native`]'s kernels (and of the model's own
/// parallel loops): the best ISA, on
/// candle's threads (those of the other matmuls).
pub(crate) fn native_backend() -> &'static hgca_cpu::CpuBackend {
    static CPU: std::sync::OnceLock<hgca_cpu::CpuBackend> = std::sync::OnceLock::new();
    CPU.get_or_init(crate::threads::cpu_backend)
}

impl Linear {
    /// Stacks `parts` (each `[out_i, in]`) along the output dimension.
    fn stacked(parts: Vec<QTensor>, format: WeightFormat) -> Result<Self> {
        let in_dim = parts[0].shape().dims()[1];
        let out_dim = parts.iter().map(|p| p.shape().dims()[0]).sum();
        let dtype = parts[0].dtype();
        let same = parts.iter().all(|p| p.dtype() == dtype);
        let w = match format {
            // Activations are quantised in blocks of 32 along `in`.
            WeightFormat::Native if in_dim.is_multiple_of(32) => {
                let dense = dequantize_stacked(&parts)?;
                let native = merge_runs(parts)?
                    .into_iter()
                    .map(NativePart::new)
                    .collect::<Result<Vec<_>>>()?;
                LinearW::Native(native, dense)
            }
            WeightFormat::Quantized if same => {
                // One block type: the parts join into one tensor.
                let qt = merge_runs(parts)?
                    .into_iter()
                    .next()
                    .ok_or_else(|| Error::invalid("linear", "no parts"))?;
                LinearW::Quant(QMatMul::from_qtensor(qt)?)
            }
            _ => {
                let w = dequantize_stacked(&parts)?;
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
                    WeightFormat::Auto | WeightFormat::Native => LinearW::Both(q8(&w)?, w),
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
            LinearW::Dense(w) | LinearW::Both(_, w) | LinearW::Native(_, w) => w.clone(),
        };
        Ok(t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// `x: [n, in]` row-major to `[n, out]`.
    pub(crate) fn forward(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        debug_assert_eq!(x.len(), n * self.in_dim);
        if let LinearW::Native(parts, dense) = &self.w
            && n >= AUTO_DENSE_ROWS
            && parts.iter().any(NativePart::packed)
        {
            // A prefill chunk: repacked parts take the integer kernel (its
            // unpacked codes serve four tokens at a time), the others
            // their rows of the f32 copy.
            let acts = Q8Acts::quantize(x, n, self.in_dim)?;
            let t = Tensor::from_slice(x, (n, self.in_dim), &Device::Cpu)?;
            let mut y = vec![0.0f32; n * self.out_dim];
            let mut col = 0;
            for p in parts {
                let r = p.rows();
                let yp = if p.packed() {
                    let mut yp = vec![0.0f32; n * r];
                    p.forward(x, n, &acts, &mut yp)?;
                    yp
                } else {
                    let w = dense.narrow(0, col, r)?;
                    t.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?
                };
                for (dst, src) in y.chunks_exact_mut(self.out_dim).zip(yp.chunks_exact(r)) {
                    dst[col..col + r].copy_from_slice(src);
                }
                col += r;
            }
            return Ok(y);
        }
        if let LinearW::Native(parts, _) = &self.w
            && n < AUTO_DENSE_ROWS
        {
            let acts = Q8Acts::quantize(x, n, self.in_dim)?;
            let mut y = vec![0.0f32; n * self.out_dim];
            if let [p] = &parts[..] {
                p.forward(x, n, &acts, &mut y)?;
                return Ok(y);
            }
            // Stacked parts: each part's [n, rows] into its columns of y.
            let mut col = 0;
            for p in parts {
                let r = p.rows();
                let mut yp = vec![0.0f32; n * r];
                p.forward(x, n, &acts, &mut yp)?;
                for (dst, src) in y.chunks_exact_mut(self.out_dim).zip(yp.chunks_exact(r)) {
                    dst[col..col + r].copy_from_slice(src);
                }
                col += r;
            }
            return Ok(y);
        }
        let t = Tensor::from_slice(x, (n, self.in_dim), &Device::Cpu)?;
        let y = match &self.w {
            LinearW::Quant(q) => q.forward(&t)?,
            LinearW::Both(q, _) if n < AUTO_DENSE_ROWS => q.forward(&t)?,
            LinearW::Dense(w) | LinearW::Both(_, w) | LinearW::Native(_, w) => t.matmul(&w.t()?)?,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A `[rows, k]` matrix of values in [-1, 1] quantised to `dtype`.
    fn matrix(rows: usize, k: usize, dtype: GgmlDType, seed: u64) -> QTensor {
        let v: Vec<f32> = (0..rows * k)
            .map(|i| (((i as u64 + 1) * (seed + 7919)) % 1999) as f32 / 999.5 - 1.0)
            .collect();
        let t = Tensor::from_vec(v, (rows, k), &Device::Cpu).expect("a tensor");
        QTensor::quantize(&t, dtype).expect("quantised")
    }

    /// A layer stacked from parts in every kind of handling (hgca's kernel
    /// for Q5_0, Q4_1, Q4_0, Q8_0, Q4_K and Q6_K, all six repacked
    /// where the AVX-512 VNNI path runs, candle's for Q5_K, re-quantised
    /// for F16)
    /// gives each part's outputs in its own columns, for one token,
    /// several below the prefill switch and a prefill chunk (the repacked
    /// parts through the integer kernel, the others through the f32
    /// copy): checked against the f32 copy, within what 8-bit activations
    /// cost.
    #[test]
    fn native_parts_land_in_their_columns() {
        let k = 256;
        let kinds = [
            GgmlDType::Q5_0,
            GgmlDType::Q4K,
            GgmlDType::Q8_0,
            GgmlDType::Q8_0,
            GgmlDType::F16,
            GgmlDType::Q4_1,
            GgmlDType::Q6K,
            GgmlDType::Q5K,
            GgmlDType::Q4_0,
        ];
        let parts: Vec<QTensor> = kinds
            .iter()
            .enumerate()
            .map(|(i, &t)| matrix(3 + 5 * i, k, t, i as u64))
            .collect();
        let lin = Linear::stacked(parts, WeightFormat::Native).expect("a layer");
        // The two Q8_0 parts in a row are joined into one.
        assert!(matches!(lin.w, LinearW::Native(ref p, _) if p.len() == kinds.len() - 1));
        let dense = lin.dense_f32().expect("f32 copy");
        for n in [1, 3, AUTO_DENSE_ROWS - 1, AUTO_DENSE_ROWS + 5] {
            let x: Vec<f32> = (0..n * k)
                .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let y = lin.forward(&x, n).expect("forward");
            assert_eq!(y.len(), n * lin.out_dim);
            for t in 0..n {
                for r in 0..lin.out_dim {
                    let (w, xt) = (&dense[r * k..(r + 1) * k], &x[t * k..(t + 1) * k]);
                    let want: f32 = w.iter().zip(xt).map(|(a, b)| a * b).sum();
                    let mag: f32 = w.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
                    let got = y[t * lin.out_dim + r];
                    assert!(
                        (got - want).abs() <= 0.01 * mag,
                        "n {n} token {t} row {r}: {got} vs {want} (magnitude {mag})"
                    );
                }
            }
        }
    }
}
