//! GGUF file access: the metadata keys of a Llama model and its tensors.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::QTensor;
use candle_core::quantized::gguf_file::{Content, Value};

use crate::{Error, Result};

/// An opened GGUF file: its parsed header and a reader for tensor data.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Opens and parses the header (metadata and tensor table) of `path`.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be opened, [`Error::Candle`] if it is
    /// not a valid GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader)?;
        Ok(Self {
            path,
            content,
            reader,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header.
    pub fn content(&self) -> &Content {
        &self.content
    }

    /// A metadata value.
    ///
    /// # Errors
    /// [`Error::Metadata`] if the key is missing.
    pub fn get(&self, key: &str) -> Result<&Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| Error::meta(key, "missing"))
    }

    /// A metadata value as a non-negative integer (any integer encoding).
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing, not an integer or negative.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        let x: i128 = match *v {
            Value::U8(x) => x.into(),
            Value::I8(x) => x.into(),
            Value::U16(x) => x.into(),
            Value::I16(x) => x.into(),
            Value::U32(x) => x.into(),
            Value::I32(x) => x.into(),
            Value::U64(x) => x.into(),
            Value::I64(x) => x.into(),
            _ => {
                return Err(Error::meta(
                    key,
                    format!("expected an integer, found {v:?}"),
                ));
            }
        };
        usize::try_from(x).map_err(|_| Error::meta(key, format!("{x} is not a valid count")))
    }

    /// A metadata value as `f32` (any float encoding).
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing or not a float.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match *self.get(key)? {
            Value::F32(x) => Ok(x),
            Value::F64(x) => Ok(x as f32),
            ref v => Err(Error::meta(key, format!("expected a float, found {v:?}"))),
        }
    }

    /// A metadata value as a string.
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing or not a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            v => Err(Error::meta(key, format!("expected a string, found {v:?}"))),
        }
    }

    /// A metadata boolean, `default` when missing.
    ///
    /// # Errors
    /// [`Error::Metadata`] if present but not a boolean.
    pub fn get_bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.content.metadata.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(Error::meta(key, format!("expected a bool, found {v:?}"))),
        }
    }

    /// A metadata array.
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing or not an array.
    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        match self.get(key)? {
            Value::Array(a) => Ok(a),
            v => Err(Error::meta(
                key,
                format!("expected an array, found {:?}", v.value_type()),
            )),
        }
    }

    /// Reads a tensor onto the CPU and checks its shape (candle's order:
    /// outermost first, e.g. `[out_features, in_features]` for a weight).
    ///
    /// # Errors
    /// [`Error::Tensor`] if missing or of another shape; [`Error::Candle`] on
    /// a read error.
    pub fn tensor(&mut self, name: &str, dims: &[usize]) -> Result<QTensor> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(Error::Tensor {
                name: name.to_owned(),
                expected: format!("{dims:?}"),
                found: "no such tensor".into(),
            });
        };
        if info.shape.dims() != dims {
            return Err(Error::Tensor {
                name: name.to_owned(),
                expected: format!("{dims:?}"),
                found: format!("{:?}", info.shape.dims()),
            });
        }
        Ok(self.content.tensor(&mut self.reader, name, &Device::Cpu)?)
    }

    /// True when the file has a tensor of this name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }
}

/// The hyper-parameters of a Llama-architecture model, from GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size (rows of `token_embd.weight`).
    pub vocab_size: usize,
    /// Model width (`llama.embedding_length`).
    pub dim: usize,
    /// Transformer blocks (`llama.block_count`).
    pub n_layers: usize,
    /// Query heads (`llama.attention.head_count`).
    pub n_heads: usize,
    /// KV heads (`llama.attention.head_count_kv`).
    pub n_kv_heads: usize,
    /// Per-head dimension, `dim / n_heads`.
    pub head_dim: usize,
    /// FFN hidden width (`llama.feed_forward_length`).
    pub ffn_dim: usize,
    /// RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// RoPE base (`llama.rope.freq_base`, 10000 when missing).
    pub rope_theta: f32,
    /// Trained context length (`llama.context_length`).
    pub context_length: usize,
}

impl LlamaConfig {
    /// Reads and validates the `llama.*` metadata.
    ///
    /// # Errors
    /// [`Error::Metadata`] for a missing key, a non-Llama architecture or
    /// inconsistent values (heads that do not divide the width, an odd head
    /// dimension, a partial RoPE dimension).
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch = f.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(Error::meta(
                "general.architecture",
                format!("expected `llama`, found `{arch}`"),
            ));
        }
        let dim = f.get_usize("llama.embedding_length")?;
        let n_heads = f.get_usize("llama.attention.head_count")?;
        let n_kv_heads = f.get_usize("llama.attention.head_count_kv")?;
        let n_layers = f.get_usize("llama.block_count")?;
        let ffn_dim = f.get_usize("llama.feed_forward_length")?;
        let context_length = f.get_usize("llama.context_length")?;
        let rms_eps = f.get_f32("llama.attention.layer_norm_rms_epsilon")?;
        let rope_theta = match f.get_f32("llama.rope.freq_base") {
            Ok(x) => x,
            Err(Error::Metadata { msg, .. }) if msg == "missing" => 10_000.0,
            Err(e) => return Err(e),
        };
        let vocab_size = match f.content().tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims().first().copied().unwrap_or(0),
            None => f.get_array("tokenizer.ggml.tokens")?.len(),
        };
        for (key, v) in [
            ("llama.embedding_length", dim),
            ("llama.attention.head_count", n_heads),
            ("llama.attention.head_count_kv", n_kv_heads),
            ("llama.block_count", n_layers),
            ("llama.feed_forward_length", ffn_dim),
            ("llama.context_length", context_length),
            ("vocabulary size", vocab_size),
        ] {
            if v == 0 {
                return Err(Error::meta(key, "must be at least 1"));
            }
        }
        if !dim.is_multiple_of(n_heads) || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(Error::meta(
                "llama.attention.head_count",
                format!("{n_heads} heads / {n_kv_heads} KV heads do not divide width {dim}"),
            ));
        }
        let head_dim = dim / n_heads;
        if !head_dim.is_multiple_of(2) {
            return Err(Error::meta(
                "llama.embedding_length",
                format!("head dimension {head_dim} must be even for RoPE"),
            ));
        }
        if let Ok(rd) = f.get_usize("llama.rope.dimension_count")
            && rd != head_dim
        {
            return Err(Error::meta(
                "llama.rope.dimension_count",
                format!("partial RoPE ({rd} of {head_dim}) is not supported"),
            ));
        }
        if !(rms_eps.is_finite() && rms_eps >= 0.0) {
            return Err(Error::meta(
                "llama.attention.layer_norm_rms_epsilon",
                format!("{rms_eps} is not a valid epsilon"),
            ));
        }
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(Error::meta(
                "llama.rope.freq_base",
                format!("{rope_theta} is not a valid RoPE base"),
            ));
        }
        Ok(Self {
            vocab_size,
            dim,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            rms_eps,
            rope_theta,
            context_length,
        })
    }

    /// Width of the K (or V) projection, `n_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
