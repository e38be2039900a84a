//! # hgca-llm: a real model end to end through hgca
//!
//! Loads a Llama, Qwen2 or Gemma 3 GGUF (e.g. SmolLM2-135M, Qwen2.5-Coder-0.5B,
//! Gemma 3 270M) with `candle-core`, rebuilds its tokenizer (byte-level BPE
//! with `tokenizers`, or SentencePiece from the vocabulary's scores), and runs the
//! forward pass on the CPU with one [`hgca_hybrid::SequenceAttention`] per
//! layer: exact full attention ([`hgca_hybrid::FullAttention`]) or hgca's
//! hybrid layer, chosen by a per-layer factory. [`perplexity`] measures
//! quality over a text, [`Llama::forward`] prefills and decodes.
//!
//! ```no_run
//! use std::sync::Arc;
//! use hgca_llm::{GgufFile, GgufTokenizer, Llama, LlamaWeights, Logits, WeightFormat};
//! let mut f = GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tok = GgufTokenizer::from_gguf(&f)?;
//! let weights = Arc::new(LlamaWeights::load(&mut f, WeightFormat::Quantized)?);
//! let mut llm = Llama::with_full_attention::<f32>(weights)?;
//! let ids = tok.encode("The capital of France is", true)?;
//! let logits = llm.forward(&ids, Logits::Last)?;
//! let next = hgca_llm::argmax(&logits).unwrap_or(0) as u32;
//! println!("{}", tok.decode(&[next])?);
//! # Ok::<(), hgca_llm::Error>(())
//! ```
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

mod error;
pub mod gguf;
mod model;
mod ppl;
mod profile;
mod sparse_ffn;
mod spm;
pub mod synth;
mod threads;
mod tokenizer;
mod weights;

pub use error::{Error, Result};
pub use gguf::{Arch, GgufFile, LlamaConfig, check_header};
pub use model::{BoxedAttention, LayerAttention, Llama, Logits, argmax, full_attention, log_prob};
pub use ppl::{PplOptions, PplReport, perplexity, perplexity_with};
pub use profile::Profile;
pub use sparse_ffn::{FfnCount, FfnFormat, NeuronProfile, SparseFfn};
pub use threads::{CandleThreads, cpu_backend};
pub use tokenizer::{ChatFormat, GgufTokenizer};
pub use weights::{AUTO_DENSE_ROWS, LlamaWeights, WeightFormat};

/// Where `scripts/fetch-model.sh` puts the model, relative to the repository root.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where `scripts/fetch-model.sh --qwen2` puts Qwen2.5-Coder-0.5B-Instruct.
pub const QWEN2_MODEL: &str = "models/Qwen2.5-Coder-0.5B-Instruct.gguf";

/// Where `scripts/fetch-model.sh --gemma3` puts Gemma 3 270M (Q4_K_M).
pub const GEMMA3_MODEL: &str = "models/gemma-3-270m-q4_k_m.gguf";
/// Where `scripts/fetch-model.sh` puts Austen's *Persuasion*.
pub const DEFAULT_TEXT: &str = "data/persuasion.txt";
