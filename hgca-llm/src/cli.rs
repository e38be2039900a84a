//! The command line of `hgca-llm`: the global options, the subcommands and
//! the value enums they take (weight format, KV dtype, attention kind).

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::{ffn_cmd, needle, ruler};

#[derive(Parser, Debug)]
#[command(version, about = "A real model end to end through hgca's attention")]
pub(crate) struct Cli {
    /// The GGUF model (fetch it with `bash scripts/fetch-model.sh`).
    #[arg(long, global = true, default_value = hgca_llm::DEFAULT_MODEL)]
    pub(crate) model: PathBuf,
    /// Weight format of the projections.
    #[arg(long, global = true, value_enum, default_value_t = Weights::Native)]
    pub(crate) weights: Weights,
    /// Compute threads of candle's matmuls and hgca's attention, which run
    /// on the same (candle's) threads; 0: every core this process may use.
    #[arg(long, global = true, default_value_t = 0)]
    pub(crate) threads: usize,
    /// Storage type of the KV cache: every layer's, Gemma 3's sliding
    /// windows too (but in `ppl`, whose windows stay f32).
    #[arg(long, global = true, value_enum, default_value_t = Kv::F16)]
    pub(crate) kv: Kv,
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Cmd {
    /// Perplexity over N tokens of a text, for each attention variant: a table.
    Ppl(PplArgs),
    /// Prefill throughput and decode speed at a given context.
    Speed {
        /// Text for the prompt tokens.
        #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
        text: PathBuf,
        /// Context tokens to prefill before decoding.
        #[arg(long, default_value_t = 2048)]
        context: usize,
        /// Prefill chunk.
        #[arg(long, default_value_t = 512)]
        chunk: usize,
        /// Tokens to decode after the prefill.
        #[arg(long, default_value_t = 64)]
        decode: usize,
        /// Attention: full (exact) or hybrid (window + sparse CPU store).
        #[arg(long, value_enum, default_value = "full")]
        attn: AttnKind,
        /// Hybrid: window size as a fraction of the context.
        #[arg(long, default_value_t = 0.25)]
        window_ratio: f64,
        /// Hybrid: recovery rule (frozen, rescore:N, bounds:N, mass:P[:S],
        /// mass8:/mass4: for the int8 or int4 (default) key copy, or oracle:P[:S]:
        /// the mass rule on exact scores).
        #[arg(long, default_value = "mass:0.93")]
        recovery: String,
    },
    /// Retrieval of a code hidden in a haystack of real text, full
    /// attention against the hybrid layer, answer by answer.
    Needle(needle::NeedleArgs),
    /// A RULER-style task suite (needles, multi-key, multi-value,
    /// multi-query, variable tracking, the shift task) over every attention
    /// variant from one prefill per document: a table, JSON on request.
    Ruler(ruler::RulerArgs),
    /// Perplexity against FFN sparsity: hgca's sparse FFN with thresholds
    /// calibrated per layer (CATS), exact attention.
    Ffn(ffn_cmd::FfnArgs),
    /// Per layer and neuron, how often it fires on a text (the share of
    /// tokens above the layer's threshold): the profile hot sets are chosen
    /// from, written as JSON.
    FfnProfile(ffn_cmd::ProfileArgs),
    /// Continue a prompt (greedy unless --temperature) and print the text.
    Generate {
        /// The prompt.
        #[arg(long)]
        prompt: String,
        /// Tokens to generate at most.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Wrap the prompt in the model's chat format (user turn).
        #[arg(long)]
        chat: bool,
        /// Sampling temperature (0 = greedy).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Sampling seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

#[derive(clap::Args, Debug)]
pub(crate) struct PplArgs {
    /// The text file (default: Austen's Persuasion from the fetch script).
    #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
    pub(crate) text: PathBuf,
    /// Start the text at the first occurrence of this string (skips the
    /// title page); empty = from the beginning.
    #[arg(long, default_value = "Chapter 1")]
    pub(crate) from: String,
    /// Tokens to evaluate (the first N tokens after `--from`).
    #[arg(long, default_value_t = 4096)]
    pub(crate) tokens: usize,
    /// Context: non-overlapping segments of this many tokens, each from an
    /// empty KV cache.
    #[arg(long, default_value_t = 4096)]
    pub(crate) context: usize,
    /// Prefill chunk (tokens per forward call; 1 = decode token by token).
    #[arg(long, default_value_t = 512)]
    pub(crate) chunk: usize,
    /// Attention variants, comma separated: full, hybrid.
    #[arg(long, value_delimiter = ',', default_value = "full")]
    pub(crate) attn: Vec<AttnKind>,
    /// Hybrid: GPU-window size as a fraction of the context (grid).
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75")]
    pub(crate) window_ratio: Vec<f64>,
    /// Hybrid: per-head selection threshold beta (grid).
    #[arg(long, value_delimiter = ',', default_value = "1.0")]
    pub(crate) beta: Vec<f32>,
    /// Hybrid: recovery rule: frozen (the paper), rescore:N (exact
    /// re-scoring every N steps), bounds:N (Quest-style top N blocks),
    /// mass:P[:S] (the default: per head, CPU entries until an estimated
    /// share P of the attention mass, at most a share S of them, 0.5 by
    /// default, else all; mass8:/mass4: name its int8 or int4 (default)
    /// key copy), oracle:P[:S] (the mass rule on exact scores: its bound,
    /// reading every key).
    #[arg(long, default_value = "mass:0.93")]
    pub(crate) recovery: String,
    /// Hybrid: eviction block (power of two).
    #[arg(long, default_value_t = 64)]
    pub(crate) block: usize,
    /// Hybrid: always-attended first tokens.
    #[arg(long, default_value_t = 4)]
    pub(crate) sinks: usize,
    /// Hybrid: queries of a prompt chunk its MAW re-evaluation averages
    /// over (the chunk's last ones).
    #[arg(long, default_value_t = 1)]
    pub(crate) refresh_queries: usize,
    /// Tokens of each segment that are context only (prefilled in chunks,
    /// not scored); default: 0 (score every prediction).
    #[arg(long, default_value_t = 0)]
    pub(crate) score_from: usize,
    /// Feed the scored tokens one by one (decode steps). The hybrid layer
    /// selects CPU entries only when decoding: its prompt chunks attend
    /// every CPU entry exactly.
    #[arg(long)]
    pub(crate) decode: bool,
    /// The FFN (dense, or hgca's hybrid FFN).
    #[command(flatten)]
    pub(crate) ffn: ffn_cmd::PplFfnArgs,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Weights {
    /// As stored (Q4_1), candle's quantised matmuls.
    Q,
    /// Dequantised to f32 at load.
    F32,
    /// Re-quantised to Q8_0 at load (AVX2 kernels).
    Q8,
    /// Q8_0 copy for decoding, f32 copy for prefill chunks.
    Auto,
    /// The GGUF's own blocks for decoding (hgca's kernels for Q4_0, Q4_1,
    /// Q5_0, Q8_0, Q4_K, Q6_K; candle's for the other K formats), f32 copy
    /// for prefill chunks.
    Native,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kv {
    F32,
    F16,
    Bf16,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AttnKind {
    /// Exact attention over the whole cache (hgca FullAttention).
    Full,
    /// hgca's hybrid layer (window + sparse CPU store).
    Hybrid,
}
