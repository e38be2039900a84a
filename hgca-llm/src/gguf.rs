//! GGUF file access: the metadata keys of a Llama model and its tensors.
//!
//! Files are untrusted input. Before candle parses a header, [`check_header`]
//! walks it with every length checked against the bytes that are left (so
//! no allocation is sized by a field the file does not back) and rejects
//! what would make candle panic (an alignment of 0); after it, every
//! tensor's data range is checked to lie inside the file. Errors are one
//! line naming the file and the cause.

use std::fs::File;
use std::io::{BufReader, Cursor, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::QTensor;
use candle_core::quantized::gguf_file::{Content, Value};

use crate::{Error, Result};

/// A reader of a GGUF file's bytes.
trait Source: Read + Seek + Send {}
impl<R: Read + Seek + Send> Source for R {}

/// An opened GGUF file: its parsed header and a reader for tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: Box<dyn Source>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.content.tensor_infos.len())
            .field("metadata", &self.content.metadata.len())
            .finish()
    }
}

/// Largest string or array a header may declare (candle's own caps are
/// looser; no GGUF model needs more: vocabularies are ~250k entries).
const MAX_ELEMENTS: u64 = 1 << 24;
/// Deepest nesting of arrays a header may declare.
const MAX_DEPTH: usize = 4;

/// Walks a GGUF header (magic, version, metadata, tensor table) from the
/// start of `r`, `len` bytes long, checking every count and length against
/// the bytes left and the alignment; returns the alignment. Reads only
/// what it checks; allocates nothing sized by the file.
///
/// # Errors
/// [`Error::Gguf`] (with an empty path) naming the offset and the cause.
pub fn check_header<R: Read + Seek>(r: &mut R, len: u64) -> Result<u64> {
    let mut w = Walk { r, len, at: 0 };
    w.header()
}

struct Walk<'a, R> {
    r: &'a mut R,
    len: u64,
    at: u64,
}

impl<R: Read + Seek> Walk<'_, R> {
    fn fail<T>(&self, msg: impl Into<String>) -> Result<T> {
        Err(Error::Gguf {
            path: PathBuf::new(),
            msg: format!("at byte {}: {}", self.at, msg.into()),
        })
    }
    fn left(&self) -> u64 {
        self.len.saturating_sub(self.at)
    }
    fn need(&self, bytes: u64, what: &str) -> Result<()> {
        if bytes > self.left() {
            return self.fail(format!("{what} needs {bytes} bytes, {} left", self.left()));
        }
        Ok(())
    }
    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        if let Err(e) = self.r.read_exact(&mut b) {
            return self.fail(format!("{what}: {e}"));
        }
        self.at += N as u64;
        Ok(b)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }
    fn skip(&mut self, bytes: u64, what: &str) -> Result<()> {
        self.need(bytes, what)?;
        if let Err(e) = self.r.seek(SeekFrom::Current(bytes as i64)) {
            return self.fail(format!("{what}: {e}"));
        }
        self.at += bytes;
        Ok(())
    }
    fn count(&mut self, v1: bool, what: &str) -> Result<u64> {
        let n = if v1 {
            u64::from(self.u32(what)?)
        } else {
            self.u64(what)?
        };
        if n > MAX_ELEMENTS {
            return self.fail(format!("{what} {n} exceeds the limit {MAX_ELEMENTS}"));
        }
        Ok(n)
    }
    fn string(&mut self, v1: bool, what: &str) -> Result<()> {
        let n = self.count(v1, what)?;
        self.skip(n, what)
    }
    /// Skips one value of type `t`; returns it when it is an integer.
    fn value(&mut self, t: u32, v1: bool, depth: usize) -> Result<Option<u64>> {
        let fixed = match t {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => return self.string(v1, "a string value").map(|()| None),
            9 => {
                if depth >= MAX_DEPTH {
                    return self.fail(format!("arrays nested deeper than {MAX_DEPTH}"));
                }
                let et = self.u32("an array's element type")?;
                let n = self.count(v1, "array length")?;
                let min = match et {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => return self.fail(format!("unknown element type {et}")),
                };
                self.need(n * min, &format!("an array of {n} elements"))?;
                if matches!(et, 8 | 9) {
                    for _ in 0..n {
                        self.value(et, v1, depth + 1)?;
                    }
                } else {
                    self.skip(n * min, "array")?;
                }
                return Ok(None);
            }
            _ => return self.fail(format!("unknown value type {t}")),
        };
        self.need(fixed, "a value")?;
        let mut v = [0u8; 8];
        if let Err(e) = self.r.read_exact(&mut v[..fixed as usize]) {
            return self.fail(format!("a value: {e}"));
        }
        self.at += fixed;
        let x = u64::from_le_bytes(v);
        let signed_neg = match t {
            1 => x & 0x80 != 0,
            3 => x & 0x8000 != 0,
            5 => x & 0x8000_0000 != 0,
            11 => x >> 63 != 0,
            _ => false,
        };
        Ok(matches!(t, 0..=5 | 10 | 11)
            .then_some(x)
            .filter(|_| !signed_neg))
    }
    fn header(&mut self) -> Result<u64> {
        if self.u32("the magic")? != 0x4655_4747 {
            return self.fail("not a GGUF file (no `GGUF` magic)");
        }
        let version = self.u32("the version")?;
        if !(1..=3).contains(&version) {
            return self.fail(format!("GGUF version {version} is not 1, 2 or 3"));
        }
        let v1 = version == 1;
        let tensors = self.count(v1, "tensor count")?;
        let kvs = self.count(v1, "metadata count")?;
        let mut alignment = 32;
        for _ in 0..kvs {
            let klen = self.count(v1, "key length")?;
            self.need(klen, "a key")?;
            let is_alignment = if klen == 17 {
                let key = self.bytes::<17>("a key")?;
                &key == b"general.alignment"
            } else {
                self.skip(klen, "a key")?;
                false
            };
            let t = self.u32("a value type")?;
            let v = self.value(t, v1, 0)?;
            if is_alignment {
                match v {
                    Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => alignment = a,
                    // candle reads other encodings as the default, 32.
                    None if !matches!(t, 0..=5) => {}
                    _ => {
                        return self.fail(format!(
                            "general.alignment {v:?} is not a power of two up to 65536"
                        ));
                    }
                }
            }
        }
        for _ in 0..tensors {
            self.string(v1, "a tensor name")?;
            let dims = self.u32("a tensor's dimension count")?;
            if dims > 4 {
                return self.fail(format!("a tensor of {dims} dimensions (at most 4)"));
            }
            self.skip(
                u64::from(dims) * if v1 { 4 } else { 8 },
                "a tensor's dimensions",
            )?;
            self.skip(12, "a tensor's type and offset")?;
        }
        Ok(alignment)
    }
}

impl GgufFile {
    /// Opens and parses the header (metadata and tensor table) of `path`.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be opened, [`Error::Gguf`] if it is
    /// not a valid GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_reader(path, BufReader::new(file))
    }

    /// Parses a GGUF file held in memory; `name` names it in errors.
    ///
    /// # Errors
    /// [`Error::Gguf`] if it is not a valid GGUF file.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::from_reader(name.into(), Cursor::new(bytes))
    }

    fn from_reader<R: Read + Seek + Send + 'static>(path: PathBuf, mut reader: R) -> Result<Self> {
        let at = |e: Error| e.in_file(&path);
        let io = |e: std::io::Error| Error::Gguf {
            path: path.clone(),
            msg: e.to_string(),
        };
        let len = reader.seek(SeekFrom::End(0)).map_err(io)?;
        reader.seek(SeekFrom::Start(0)).map_err(io)?;
        let alignment = check_header(&mut reader, len).map_err(at)?;
        reader.seek(SeekFrom::Start(0)).map_err(io)?;
        let content = Content::read(&mut reader).map_err(|e| at(e.into()))?;
        // Every tensor's bytes inside the file, computed without overflow.
        for (name, info) in &content.tensor_infos {
            let bad = |msg: String| Error::Gguf {
                path: path.clone(),
                msg: crate::error::one_line(&format!("tensor `{name}`: {msg}")),
            };
            let elems = info
                .shape
                .dims()
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                .ok_or_else(|| bad(format!("{:?} elements overflow", info.shape.dims())))?;
            let (bs, ts) = (
                info.ggml_dtype.block_size() as u64,
                info.ggml_dtype.type_size() as u64,
            );
            if !elems.is_multiple_of(bs) {
                return Err(bad(format!(
                    "{elems} elements are not whole blocks of {bs}"
                )));
            }
            let end = (elems / bs)
                .checked_mul(ts)
                .and_then(|b| b.checked_add(info.offset))
                .and_then(|b| b.checked_add(content.tensor_data_offset));
            match end {
                Some(end) if end <= len && info.offset.is_multiple_of(alignment) => {}
                _ => {
                    return Err(bad(format!(
                        "data at offset {} ({elems} elements of {:?}) does not fit in the file's {len} bytes at alignment {alignment}",
                        info.offset, info.ggml_dtype
                    )));
                }
            }
        }
        Ok(Self {
            path,
            content,
            reader: Box::new(reader),
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
        let path = &self.path;
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| Error::from(e).in_file(path))
    }

    /// True when the file has a tensor of this name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }
}

/// The architectures hgca-llm runs (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama (SmolLM2): no projection biases, RoPE on adjacent pairs (the
    /// GGUF converter permutes Q/K rows for it).
    Llama,
    /// Qwen2 (Qwen2.5): Q/K/V biases, RoPE on the two halves of a head
    /// (GPT-NeoX style, rows as in the checkpoint).
    Qwen2,
    /// Gemma 3: head size from `attention.key_length` (the query width is
    /// not the model's), RMS norms of each query and key head before RoPE
    /// (halves, as Qwen2), norms after attention and after the FFN too,
    /// GELU (tanh) gating, embeddings scaled by `sqrt(dim)`; five of every
    /// six layers attend a sliding window (`attention.sliding_window`) with
    /// RoPE base 10000, the sixth all tokens with `rope.freq_base`.
    Gemma3,
}

impl Arch {
    /// The GGUF name, also the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Gemma3 => "gemma3",
        }
    }
}

/// The hyper-parameters of a Llama-family model, from GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// The architecture.
    pub arch: Arch,
    /// Vocabulary size (rows of `token_embd.weight`).
    pub vocab_size: usize,
    /// Model width (`{arch}.embedding_length`).
    pub dim: usize,
    /// Transformer blocks (`{arch}.block_count`).
    pub n_layers: usize,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_heads: usize,
    /// KV heads (`{arch}.attention.head_count_kv`).
    pub n_kv_heads: usize,
    /// Per-head dimension: `{arch}.attention.key_length`, else `dim / n_heads`.
    pub head_dim: usize,
    /// FFN hidden width (`{arch}.feed_forward_length`).
    pub ffn_dim: usize,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// RoPE base (`{arch}.rope.freq_base`, 10000 when missing).
    pub rope_theta: f32,
    /// Trained context length (`{arch}.context_length`).
    pub context_length: usize,
    /// Gemma 3: the local layers' window in tokens
    /// (`{arch}.attention.sliding_window`); `None`: every layer is global.
    pub sliding_window: Option<usize>,
    /// The local layers' RoPE base (Gemma 3: 10000; else `rope_theta`).
    pub rope_theta_local: f32,
}

impl LlamaConfig {
    /// Reads and validates the `{arch}.*` metadata (`llama` or `qwen2`).
    ///
    /// # Errors
    /// [`Error::Metadata`] for a missing key, another architecture or
    /// inconsistent values (heads that do not divide the width, an odd head
    /// dimension, a partial RoPE dimension).
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch = match f.get_str("general.architecture")? {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gemma3" => Arch::Gemma3,
            other => {
                return Err(Error::meta(
                    "general.architecture",
                    format!("expected `llama`, `qwen2` or `gemma3`, found `{other}`"),
                ));
            }
        };
        let key = |k: &str| format!("{}.{k}", arch.name());
        let dim = f.get_usize(&key("embedding_length"))?;
        let n_heads = f.get_usize(&key("attention.head_count"))?;
        let n_kv_heads = f.get_usize(&key("attention.head_count_kv"))?;
        let n_layers = f.get_usize(&key("block_count"))?;
        let ffn_dim = f.get_usize(&key("feed_forward_length"))?;
        let context_length = f.get_usize(&key("context_length"))?;
        let rms_eps = f.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_theta = match f.get_f32(&key("rope.freq_base")) {
            Ok(x) => x,
            Err(Error::Metadata { msg, .. }) if msg == "missing" => 10_000.0,
            Err(e) => return Err(e),
        };
        let vocab_size = match f.content().tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims().first().copied().unwrap_or(0),
            None => f.get_array("tokenizer.ggml.tokens")?.len(),
        };
        for (k, v) in [
            ("embedding_length", dim),
            ("attention.head_count", n_heads),
            ("attention.head_count_kv", n_kv_heads),
            ("block_count", n_layers),
            ("feed_forward_length", ffn_dim),
            ("context_length", context_length),
        ] {
            if v == 0 {
                return Err(Error::meta(&key(k), "must be at least 1"));
            }
        }
        if vocab_size == 0 {
            return Err(Error::meta("vocabulary size", "must be at least 1"));
        }
        // Each block holds 9 tensors or more: a count the file cannot back
        // is refused before anything is sized by it.
        let tensors = f.content().tensor_infos.len();
        if n_layers > tensors / 9 {
            return Err(Error::meta(
                &key("block_count"),
                format!("{n_layers} blocks, but the file holds {tensors} tensors"),
            ));
        }
        let key_length = match f.get_usize(&key("attention.key_length")) {
            Ok(x) => Some(x),
            Err(Error::Metadata { msg, .. }) if msg == "missing" => None,
            Err(e) => return Err(e),
        };
        if (key_length.is_none() && !dim.is_multiple_of(n_heads))
            || !n_heads.is_multiple_of(n_kv_heads)
        {
            return Err(Error::meta(
                &key("attention.head_count"),
                format!("{n_heads} heads / {n_kv_heads} KV heads do not divide width {dim}"),
            ));
        }
        let head_dim = key_length.unwrap_or(dim / n_heads);
        if head_dim == 0 || head_dim > 1 << 14 {
            return Err(Error::meta(
                &key("attention.key_length"),
                format!("head dimension {head_dim} is out of range"),
            ));
        }
        if let Ok(vl) = f.get_usize(&key("attention.value_length"))
            && vl != head_dim
        {
            return Err(Error::meta(
                &key("attention.value_length"),
                format!("{vl}: value heads unlike key heads ({head_dim}) are not supported"),
            ));
        }
        let sliding_window = match (arch, f.get_usize(&key("attention.sliding_window"))) {
            (Arch::Gemma3, Ok(w)) if w > 0 => Some(w),
            _ => None,
        };
        if !head_dim.is_multiple_of(2) {
            return Err(Error::meta(
                &key("embedding_length"),
                format!("head dimension {head_dim} must be even for RoPE"),
            ));
        }
        if let Ok(rd) = f.get_usize(&key("rope.dimension_count"))
            && rd != head_dim
        {
            return Err(Error::meta(
                &key("rope.dimension_count"),
                format!("partial RoPE ({rd} of {head_dim}) is not supported"),
            ));
        }
        if !(rms_eps.is_finite() && rms_eps >= 0.0) {
            return Err(Error::meta(
                &key("attention.layer_norm_rms_epsilon"),
                format!("{rms_eps} is not a valid epsilon"),
            ));
        }
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(Error::meta(
                &key("rope.freq_base"),
                format!("{rope_theta} is not a valid RoPE base"),
            ));
        }
        Ok(Self {
            arch,
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
            sliding_window,
            rope_theta_local: if arch == Arch::Gemma3 {
                10_000.0
            } else {
                rope_theta
            },
        })
    }

    /// Width of the K (or V) projection, `n_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Width of the Q projection (and the attention output),
    /// `n_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// The sliding window of layer `layer` when it is a local layer (Gemma
    /// 3: all but every sixth, `layer % 6 < 5`), `None` for a global one.
    pub fn local_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| layer % 6 < 5)
    }

    /// The global layers (every token attended): where a hybrid split applies.
    pub fn global_layers(&self) -> usize {
        (0..self.n_layers)
            .filter(|&l| self.local_window(l).is_none())
            .count()
    }
}
