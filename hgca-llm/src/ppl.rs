//! Perplexity over a token sequence.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hgca_kernels::AttnShape;

use crate::model::{BoxedAttention, Llama, Logits, log_prob};
use crate::sparse_ffn::SparseFfn;
use crate::weights::LlamaWeights;
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
    /// Tokens `0..score_from` of each segment are context only (prefilled,
    /// not scored); the predictions of tokens `score_from.max(1)..` are scored.
    pub score_from: usize,
    /// Feed the scored part one token per forward call (decode steps, where
    /// a hybrid layer selects), instead of chunks of `chunk`.
    pub decode: bool,
}

impl Default for PplOptions {
    fn default() -> Self {
        Self {
            context: 4096,
            chunk: 512,
            score_from: 0,
            decode: false,
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
/// [`Error::Invalid`] for `context < 2`, `chunk == 0`, fewer than 2
/// tokens or `score_from` leaving nothing to score; model errors otherwise.
pub fn perplexity<F>(
    weights: &Arc<LlamaWeights>,
    tokens: &[u32],
    opts: PplOptions,
    attention: F,
    progress: impl FnMut(usize),
) -> Result<PplReport>
where
    F: FnMut(usize, AttnShape) -> Result<BoxedAttention>,
{
    perplexity_with(weights, tokens, opts, attention, None, progress)
}

/// [`perplexity`] with hgca's sparse FFN in every layer when `ffn` is
/// given ([`Llama::with_sparse_ffn`]).
///
/// # Errors
/// As [`perplexity`].
pub fn perplexity_with<F>(
    weights: &Arc<LlamaWeights>,
    tokens: &[u32],
    opts: PplOptions,
    mut attention: F,
    ffn: Option<&Arc<SparseFfn>>,
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
    let seg_len = segs[0].len();
    if opts.score_from + 1 >= seg_len {
        return Err(Error::invalid(
            "score_from",
            format!(
                "{} leaves nothing to score in segments of {seg_len}",
                opts.score_from
            ),
        ));
    }
    let vocab = weights.config().vocab_size;
    let (mut nll, mut scored, mut done) = (0.0f64, 0usize, 0usize);
    let mut elapsed = Duration::ZERO;
    for seg in &segs {
        let mut llm = Llama::new(Arc::clone(weights), &mut attention)?;
        if let Some(f) = ffn {
            llm = llm.with_sparse_ffn(Arc::clone(f));
        }
        // Pieces: the context part in chunks, the scored part in chunks or single tokens.
        let first = opts.score_from.saturating_sub(1);
        let mut pieces: Vec<(usize, usize)> = Vec::new();
        let mut at = 0;
        while at < first {
            let m = opts.chunk.min(first - at);
            pieces.push((at, m));
            at += m;
        }
        let step = if opts.decode { 1 } else { opts.chunk };
        while at < seg.len() {
            let m = step.min(seg.len() - at);
            pieces.push((at, m));
            at += m;
        }
        for (base, m) in pieces {
            let chunk = &seg[base..base + m];
            let t0 = Instant::now();
            let want = if base + m <= first {
                Logits::None
            } else {
                Logits::All
            };
            let logits = llm.forward(chunk, want)?;
            for (i, row) in logits.chunks_exact(vocab).enumerate() {
                if base + i < first {
                    continue;
                }
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
