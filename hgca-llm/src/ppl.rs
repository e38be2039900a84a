//! Perplexity over a token sequence.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hgca_kernels::AttnShape;

use crate::model::{BoxedAttention, Llama, LlamaWeights, Logits, log_prob};
use crate::{Error, Result};

/// How [`perplexity`] walks the tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PplOptions {
    /// Segment length: the tokens are cut into non-overlapping segments of
    /// `context` tokens (the last, shorter one is dropped unless it is the
    /// only one); each segment starts from an empty KV cache.
    pub context: usize,
    /// Tokens per forward call inside a segment (chunked prefill through
    /// the attention layers; 1 = token-by-token decoding).
    pub chunk: usize,
}

impl Default for PplOptions {
    fn default() -> Self {
        Self {
            context: 4096,
            chunk: 512,
        }
    }
}

/// The result of [`perplexity`].
#[derive(Debug, Clone, PartialEq)]
pub struct PplReport {
    /// `exp(mean negative log-likelihood)` over the scored tokens.
    pub ppl: f64,
    /// Mean negative log-likelihood (nats per token).
    pub nll: f64,
    /// Tokens whose probability was scored (each segment's first token is
    /// context only).
    pub scored: usize,
    /// Segments evaluated.
    pub segments: usize,
    /// Tokens run through the model.
    pub tokens: usize,
    /// Wall time of the forward passes (including the logits and their
    /// log-softmax).
    pub elapsed: Duration,
}

impl PplReport {
    /// Tokens per second through the model.
    pub fn tokens_per_sec(&self) -> f64 {
        self.tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Perplexity of `tokens` under the model whose attention layers `attention`
/// makes (called `n_layers` times per segment). Token `i+1` of a segment is
/// scored from the logits of token `i`, with all of the segment up to `i` in
/// context (causal). `progress(done_tokens)` is called after each chunk.
///
/// # Errors
/// [`Error::Invalid`] for `context < 2`, `chunk == 0` or fewer than 2
/// tokens; model errors otherwise.
pub fn perplexity<F>(
    weights: &Arc<LlamaWeights>,
    tokens: &[u32],
    opts: PplOptions,
    mut attention: F,
    mut progress: impl FnMut(usize),
) -> Result<PplReport>
where
    F: FnMut(usize, AttnShape) -> Result<BoxedAttention>,
{
    if opts.context < 2 {
        return Err(Error::invalid("context", "must be at least 2"));
    }
    if opts.chunk == 0 {
        return Err(Error::invalid("chunk", "must be at least 1"));
    }
    if tokens.len() < 2 {
        return Err(Error::invalid("tokens", "need at least 2 tokens"));
    }
    let segs: Vec<&[u32]> = if tokens.len() < opts.context {
        vec![tokens]
    } else {
        tokens.chunks_exact(opts.context).collect()
    };
    let vocab = weights.config().vocab_size;
    let (mut nll, mut scored, mut done) = (0.0f64, 0usize, 0usize);
    let mut elapsed = Duration::ZERO;
    for seg in &segs {
        let mut llm = Llama::new(Arc::clone(weights), &mut attention)?;
        for (ci, chunk) in seg.chunks(opts.chunk).enumerate() {
            let t0 = Instant::now();
            let logits = llm.forward(chunk, Logits::All)?;
            let base = ci * opts.chunk;
            for (i, row) in logits.chunks_exact(vocab).enumerate() {
                if let Some(&target) = seg.get(base + i + 1) {
                    let lp = log_prob(row, target as usize)
                        .ok_or_else(|| Error::invalid("tokens", "target outside vocabulary"))?;
                    nll -= lp;
                    scored += 1;
                }
            }
            elapsed += t0.elapsed();
            done += chunk.len();
            progress(done);
        }
    }
    let mean = nll / scored.max(1) as f64;
    Ok(PplReport {
        ppl: mean.exp(),
        nll: mean,
        scored,
        segments: segs.len(),
        tokens: done,
        elapsed,
    })
}
