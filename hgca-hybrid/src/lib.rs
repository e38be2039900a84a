//! # hgca-hybrid: the hybrid attention engine
//!
//! A per-layer attention whose KV cache is split between a dense window
//! (GPU, or the CPU standing in) and a CPU store attended sparsely, merged
//! exactly by LSE. [`SequenceAttention`] is the interface a model uses;
//! [`HybridBatch`] holds a batch of independent sequences on shared backends;
//! [`FullAttention`] is the exact baseline behind the same interface.
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

mod batch;
mod config;
mod ffn;
mod full;
mod layer;
mod mass;
pub mod planner;
mod predict;
mod select;
mod seq;
mod sliding;
mod stats;

pub use batch::{HybridBatch, SeqId};
pub use config::{HybridConfig, KeyCodes, Recovery};
pub use ffn::{HybridFfn, HybridFfnStats};
pub use full::FullAttention;
pub use layer::HybridAttention;
pub use predict::GatePredictor;
pub use sliding::SlidingAttention;
pub use stats::StepStats;

use hgca_kernels::{AttnShape, Result, check_len_of};

/// Causal self-attention of one model layer over a growing sequence.
pub trait SequenceAttention {
    /// Appends `n` tokens (K and V token-major `[n, kv_heads, d]`) and writes
    /// into `out` (`[n, q_heads, d]`) the attention of their queries
    /// (`q`: `[n, q_heads, d]`) over every token so far, causally: query `i`
    /// sees the tokens before the chunk and chunk tokens `0..=i`.
    /// `n = 1` is a decode step, larger `n` a prompt chunk.
    ///
    /// # Errors
    /// Typed errors for lengths that do not fit the layer's shape, checked
    /// before anything changes: the cache is then as it was. A backend that
    /// fails later in the step (memory refused, a device lost) returns its
    /// error with this call's tokens possibly appended and `out` possibly
    /// partly written; tokens held before the call are never lost (an eviction
    /// reserves the store's memory before rows leave the window, and a
    /// window gives up rows only once they are read back).
    fn forward(&mut self, q: &[f32], k: &[f32], v: &[f32], n: usize, out: &mut [f32])
    -> Result<()>;

    /// Tokens held so far.
    fn len(&self) -> usize;

    /// True before the first token.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The boundary check of [`SequenceAttention::forward`], shared by its implementations.
fn check_forward(
    s: &AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    out: &[f32],
) -> Result<()> {
    check_len_of("q", &[n, s.q_len()], q.len())?;
    check_len_of("k", &[n, s.kv_token_len()], k.len())?;
    check_len_of("v", &[n, s.kv_token_len()], v.len())?;
    check_len_of("out", &[n, s.q_len()], out.len())
}
