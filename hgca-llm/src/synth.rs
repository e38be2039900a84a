//! A tiny random Llama GGUF with a real byte-level BPE tokenizer, written on
//! the fly: tests and demos run the whole pipeline without downloading.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::{Arch, Error, Result};

/// The shape of the synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// Model width (a multiple of 32 when `quantized`).
    pub dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// FFN width (a multiple of 32 when `quantized`).
    pub ffn_dim: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// Seed of the weights.
    pub seed: u64,
    /// Store matrices as Q4_1 and the embedding as Q8_0 (like SmolLM2's
    /// GGUF) instead of f32.
    pub quantized: bool,
    /// The architecture: Qwen2 adds Q/K/V biases, its metadata prefix and
    /// its pre-tokenizer; Gemma 3 its norms, heads twice `dim / n_heads`
    /// wide (`attention.key_length`, so the query width is not the model's)
    /// and a sliding window of [`SYNTH_WINDOW`] tokens on its local layers
    /// (the tokenizer stays the byte-level BPE one).
    pub arch: Arch,
}

impl Default for SynthSpec {
    fn default() -> Self {
        Self {
            dim: 64,
            n_heads: 4,
            n_kv_heads: 2,
            n_layers: 2,
            ffn_dim: 128,
            rope_theta: 10_000.0,
            seed: 7,
            quantized: true,
            arch: Arch::Llama,
        }
    }
}

/// GPT-2's byte-to-character table of byte-level BPE: printable bytes map
/// to themselves, the others to `U+0100..` in order.
pub fn byte_level_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let keep = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let cp = if keep {
            b as u32
        } else {
            let c = next;
            next += 1;
            c
        };
        *slot = char::from_u32(cp).unwrap_or('\u{fffd}');
    }
    table
}

/// The sliding window of a synthetic Gemma 3's local layers, in tokens.
pub const SYNTH_WINDOW: usize = 8;

/// Special tokens of the synthetic vocabulary (ids 0, 1, 2).
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Merges of the synthetic vocabulary, in priority order (`Ġ` is a space).
pub const MERGES: [&str; 12] = [
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "in g", "Ġa n", "Ġan d",
];

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Token strings and types (3 = control) of the synthetic vocabulary.
pub fn vocabulary() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3; SPECIALS.len()];
    tokens.extend(byte_level_alphabet().iter().map(|c| c.to_string()));
    for m in MERGES {
        let (a, b) = m.split_once(' ').unwrap_or((m, ""));
        tokens.push(format!("{a}{b}"));
    }
    types.resize(tokens.len(), 1);
    (tokens, types)
}

/// Writes a random Llama model with the synthetic tokenizer to `path`.
///
/// # Errors
/// [`Error::Invalid`] for an inconsistent spec, [`Error::Io`] or
/// [`Error::Candle`] when writing fails.
pub fn write_tiny_llama(path: impl AsRef<Path>, spec: &SynthSpec) -> Result<()> {
    let s = spec;
    if s.n_heads == 0
        || s.n_kv_heads == 0
        || !s.dim.is_multiple_of(s.n_heads)
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
    {
        return Err(Error::invalid(
            "spec",
            "heads must divide the width and each other",
        ));
    }
    if s.quantized && (!s.dim.is_multiple_of(32) || !s.ffn_dim.is_multiple_of(32)) {
        return Err(Error::invalid(
            "spec",
            "quantized widths must be multiples of 32",
        ));
    }
    let gemma = s.arch == Arch::Gemma3;
    let head_dim = s.dim / s.n_heads * if gemma { 2 } else { 1 };
    let (kv, qd) = (s.n_kv_heads * head_dim, s.n_heads * head_dim);
    let (tokens, types) = vocabulary();
    let vocab = tokens.len();
    let mut rng = Lcg(s.seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut mat = |rows: usize, cols: usize, scale: f32, dtype: GgmlDType| -> Result<QTensor> {
        let data: Vec<f32> = (0..rows * cols).map(|_| rng.next() * scale).collect();
        let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu)?;
        let dtype = if s.quantized { dtype } else { GgmlDType::F32 };
        Ok(QTensor::quantize(&t, dtype)?)
    };
    let w = 1.0 / (s.dim as f32).sqrt();
    let mut named: Vec<(String, QTensor)> = vec![(
        "token_embd.weight".into(),
        mat(vocab, s.dim, 1.0, GgmlDType::Q8_0)?,
    )];
    let norm = |len: usize, seed: u64| -> Result<QTensor> {
        let data: Vec<f32> = (0..len)
            .map(|i| 1.0 + 0.1 * (((i as u64 * 31 + seed) % 7) as f32 - 3.0) / 3.0)
            .collect();
        Ok(QTensor::quantize(
            &Tensor::from_vec(data, len, &Device::Cpu)?,
            GgmlDType::F32,
        )?)
    };
    named.push(("output_norm.weight".into(), norm(s.dim, 1)?));
    let mut bias_rng = Lcg(s.seed ^ 0x2545_f491_4f6c_dd1d);
    for l in 0..s.n_layers {
        let p = |x: &str| format!("blk.{l}.{x}.weight");
        named.push((p("attn_norm"), norm(s.dim, 2 + l as u64)?));
        named.push((p("ffn_norm"), norm(s.dim, 5 + l as u64)?));
        named.push((p("attn_q"), mat(qd, s.dim, 2.0 * w, GgmlDType::Q4_1)?));
        named.push((p("attn_k"), mat(kv, s.dim, 2.0 * w, GgmlDType::Q4_1)?));
        named.push((p("attn_v"), mat(kv, s.dim, w, GgmlDType::Q4_1)?));
        named.push((p("attn_output"), mat(s.dim, qd, w, GgmlDType::Q4_1)?));
        if gemma {
            named.push((p("attn_q_norm"), norm(head_dim, 11 + l as u64)?));
            named.push((p("attn_k_norm"), norm(head_dim, 13 + l as u64)?));
            named.push((p("post_attention_norm"), norm(s.dim, 17 + l as u64)?));
            named.push((p("post_ffw_norm"), norm(s.dim, 19 + l as u64)?));
        }
        named.push((p("ffn_gate"), mat(s.ffn_dim, s.dim, w, GgmlDType::Q4_1)?));
        named.push((p("ffn_up"), mat(s.ffn_dim, s.dim, w, GgmlDType::Q4_1)?));
        named.push((
            p("ffn_down"),
            mat(
                s.dim,
                s.ffn_dim,
                1.0 / (s.ffn_dim as f32).sqrt(),
                GgmlDType::Q4_1,
            )?,
        ));
        if s.arch == Arch::Qwen2 {
            let b = |x: &str| format!("blk.{l}.{x}.bias");
            for (name, len) in [("attn_q", s.dim), ("attn_k", kv), ("attn_v", kv)] {
                let data: Vec<f32> = (0..len).map(|_| 0.5 * bias_rng.next()).collect();
                let t = Tensor::from_vec(data, len, &Device::Cpu)?;
                named.push((b(name), QTensor::quantize(&t, GgmlDType::F32)?));
            }
        }
    }
    let str_arr = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let merges: Vec<String> = MERGES.iter().map(|m| m.to_string()).collect();
    let a = s.arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let mut arch_meta: Vec<(String, Value)> = vec![
        (key("block_count"), Value::U32(s.n_layers as u32)),
        (key("context_length"), Value::U32(8192)),
        (key("embedding_length"), Value::U32(s.dim as u32)),
        (key("feed_forward_length"), Value::U32(s.ffn_dim as u32)),
        (key("attention.head_count"), Value::U32(s.n_heads as u32)),
        (
            key("attention.head_count_kv"),
            Value::U32(s.n_kv_heads as u32),
        ),
        (key("rope.freq_base"), Value::F32(s.rope_theta)),
        (key("rope.dimension_count"), Value::U32(head_dim as u32)),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (key("vocab_size"), Value::U32(vocab as u32)),
    ];
    if gemma {
        arch_meta.extend([
            (key("attention.key_length"), Value::U32(head_dim as u32)),
            (key("attention.value_length"), Value::U32(head_dim as u32)),
            (
                key("attention.sliding_window"),
                Value::U32(SYNTH_WINDOW as u32),
            ),
        ]);
    }
    let pre = match s.arch {
        Arch::Llama | Arch::Gemma3 => "smollm",
        Arch::Qwen2 => "qwen2",
    };
    let mut meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String(a.into())),
        ("general.name", Value::String("hgca-llm synthetic".into())),
        ("general.alignment", Value::U32(32)),
    ];
    meta.extend(arch_meta.iter().map(|(k, v)| (k.as_str(), v.clone())));
    meta.extend([
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        ("tokenizer.ggml.tokens", str_arr(&tokens)),
        (
            "tokenizer.ggml.token_type",
            Value::Array(types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        ("tokenizer.ggml.merges", str_arr(&merges)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
    ]);
    let path = path.as_ref();
    let file = File::create(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = BufWriter::new(file);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = named.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &meta_refs, &tensor_refs)?;
    std::io::Write::flush(&mut out).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(())
}
