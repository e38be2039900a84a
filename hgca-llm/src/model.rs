//! The Llama forward pass. Projections and the FFN run through candle
//! (quantised or f32 matmuls on the CPU); attention is one
//! [`SequenceAttention`] per layer, supplied by the caller.

use std::sync::Arc;

use hgca_hybrid::{FullAttention, SequenceAttention, SlidingAttention};
use hgca_kernels::{AttnShape, FfnAct, KvElem};

use crate::gguf::Arch;
use crate::profile::{Laps, Profile};
use crate::sparse_ffn::SparseFfn;
use crate::threads::cpu_backend;
use crate::weights::LlamaWeights;
use crate::weights::native_backend;
use crate::{Error, Result};

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

/// A per-layer attention as [`Llama`] holds it: a [`SequenceAttention`]
/// whose cache can be copied, so that one prefilled prompt serves several
/// continuations ([`Llama::fork`]). Every `Clone` attention is one
/// ([`FullAttention`], and [`hgca_hybrid::HybridAttention`] on host windows).
pub trait LayerAttention: SequenceAttention + Send {
    /// A copy of this layer's cache and state that goes on alone.
    fn fork(&self) -> BoxedAttention;
}

impl<A: SequenceAttention + Clone + Send + 'static> LayerAttention for A {
    fn fork(&self) -> BoxedAttention {
        Box::new(self.clone())
    }
}

/// A per-layer attention, as [`Llama`] holds it.
pub type BoxedAttention = Box<dyn LayerAttention>;

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
    /// Other attention variants fed the same queries, keys and values
    /// (per variant, per layer), split off by [`Llama::split`].
    followers: Vec<Vec<BoxedAttention>>,
    pos: usize,
    poisoned: bool,
    /// The local layers' attention ([`Llama::with_local_kv`]).
    local: LocalFactory,
    /// hgca's sparse FFN in place of candle's dense one, when set.
    ffn: Option<Arc<SparseFfn>>,
    /// Per layer, `|silu(gate)|` of every neuron and token of the dense FFN
    /// (calibration, neuron profiles).
    pub(crate) record: Option<Vec<Vec<f32>>>,
    /// Per layer, the FFN's inputs (after its norm), token by token
    /// (calibration of gate predictors).
    pub(crate) record_inputs: Option<Vec<Vec<f32>>>,
    /// Where the time of forward calls went, when asked.
    profile: Option<Profile>,
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

/// Units of work per thread of the gated FFN activation, at most.
const ACT_TASKS_PER_THREAD: usize = 4;
/// Values of the gated activation per task, at least.
const ACT_MIN_VALUES: usize = 512;

/// GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`),
/// `x (1 + tanh y) / 2` with `y = sqrt(2/pi) (x + 0.044715 x^3)`, written as
/// `x / (1 + e^(-2y))`: the same function with one `exp` in place of libm's
/// `tanhf` (11% of a Gemma 3 prefill's samples here); it tends to 0 and to
/// `x` without overflow trouble.
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    let y = C * (x + 0.044_715 * x * x * x);
    x / (1.0 + (-2.0 * y).exp())
}

/// [`rms_norm`] of one row in place.
fn rms_norm_in_place(r: &mut [f32], w: &[f32], eps: f32) {
    let ss: f32 = r.iter().map(|v| v * v).sum::<f32>() / r.len() as f32;
    let s = 1.0 / (ss + eps).sqrt();
    for (v, &g) in r.iter_mut().zip(w) {
        *v *= s * g;
    }
}

/// The attention of a local layer: exact over its sliding window, its KV
/// held as `T`.
fn local_attention<T: KvElem>(shape: AttnShape, window: usize) -> Result<BoxedAttention> {
    Ok(Box::new(SlidingAttention::<T>::new(shape, window, cpu_backend())?) as BoxedAttention)
}

/// Makes a local layer's attention ([`local_attention`] for one KV type).
type LocalFactory = fn(AttnShape, usize) -> Result<BoxedAttention>;

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
/// for it), the halves `(i, i + d/2)` for Qwen2 and Gemma 3 (GPT-NeoX style).
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
                    Arch::Qwen2 | Arch::Gemma3 => (i, i + half),
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
    /// of each global layer. The local layers of a model with sliding
    /// windows (Gemma 3) get exact attention over their window
    /// ([`SlidingAttention`], KV in f32: 1 MiB a layer for Gemma 3 270M;
    /// [`Llama::with_local_kv`] chooses another type), the same whatever
    /// the variant.
    ///
    /// # Errors
    /// What `attention` returns.
    pub fn new<F>(weights: Arc<LlamaWeights>, mut attention: F) -> Result<Self>
    where
        F: FnMut(usize, AttnShape) -> Result<BoxedAttention>,
    {
        let shape = weights.attn_shape()?;
        let attn = (0..weights.config.n_layers)
            .map(|l| match weights.config.local_window(l) {
                Some(w) => local_attention::<f32>(shape, w),
                None => attention(l, shape),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            weights,
            attn,
            followers: Vec::new(),
            pos: 0,
            poisoned: false,
            local: local_attention::<f32>,
            ffn: None,
            record: None,
            record_inputs: None,
            profile: None,
        })
    }

    /// The local layers' KV held as `T` (f32 by default; f16 halves the
    /// bytes a decode step reads over the windows, as llama.cpp's f16
    /// cache does): rebuilds them, and followers added after take the
    /// same.
    ///
    /// # Errors
    /// [`Error::Invalid`] once the sequence holds tokens or has
    /// followers.
    pub fn with_local_kv<T: KvElem>(mut self) -> Result<Self> {
        if self.pos != 0 || !self.followers.is_empty() {
            return Err(Error::invalid(
                "with_local_kv",
                "the local layers' KV type is chosen on an empty sequence without followers",
            ));
        }
        self.local = local_attention::<T>;
        let shape = self.weights.attn_shape()?;
        for (l, a) in self.attn.iter_mut().enumerate() {
            if let Some(w) = self.weights.config.local_window(l) {
                *a = local_attention::<T>(shape, w)?;
            }
        }
        Ok(self)
    }

    /// Adds an attention variant that follows this sequence: every later
    /// [`Llama::forward`] also appends its queries, keys and values to the
    /// follower's layers (made by `attention`), whose outputs are dropped;
    /// the model's residual stream is this sequence's. [`Llama::split`]
    /// then gives each follower as a sequence of its own. This is how one
    /// prefill of a long document (its matmuls, the bulk of the cost)
    /// serves several attention variants: a variant whose prefill is exact
    /// (full attention, the hybrid layer's prompt chunks) holds the cache its
    /// own prefill would have built, up to float rounding in the layers
    /// after the first.
    ///
    /// # Errors
    /// What `attention` returns; [`Error::Invalid`] once tokens were
    /// processed (a follower must see the whole sequence).
    pub fn follow<F>(&mut self, mut attention: F) -> Result<()>
    where
        F: FnMut(usize, AttnShape) -> Result<BoxedAttention>,
    {
        if self.pos != 0 {
            return Err(Error::invalid(
                "follow",
                "followers join an empty sequence (this one holds tokens)",
            ));
        }
        let shape = self.weights.attn_shape()?;
        let c = &self.weights.config;
        let layers = (0..c.n_layers)
            .map(|l| match c.local_window(l) {
                // Exact and the same for every variant: the lead's, copied
                // at the split.
                Some(w) => (self.local)(shape, w),
                None => attention(l, shape),
            })
            .collect::<Result<Vec<_>>>()?;
        self.followers.push(layers);
        Ok(())
    }

    /// This sequence and then each follower ([`Llama::follow`]) in the
    /// order they were added, each a sequence of its own at the same
    /// position (sharing the weights; no profile).
    pub fn split(mut self) -> Vec<Llama> {
        let followers = std::mem::take(&mut self.followers);
        let mut out = Vec::with_capacity(1 + followers.len());
        for mut attn in followers {
            for (l, a) in attn.iter_mut().enumerate() {
                if self.weights.config.local_window(l).is_some() {
                    *a = self.attn[l].fork();
                }
            }
            out.push(Llama {
                weights: Arc::clone(&self.weights),
                attn,
                followers: Vec::new(),
                pos: self.pos,
                poisoned: self.poisoned,
                local: self.local,
                ffn: self.ffn.clone(),
                record: None,
                record_inputs: None,
                profile: None,
            });
        }
        out.insert(0, self);
        out
    }

    /// A copy of this sequence (every layer's cache and state, followers
    /// included) that goes on alone: a snapshot of a prefilled prompt from
    /// which several continuations run, each bit for bit what this
    /// sequence would compute.
    pub fn fork(&self) -> Llama {
        Llama {
            weights: Arc::clone(&self.weights),
            attn: self.attn.iter().map(|a| a.fork()).collect(),
            followers: self
                .followers
                .iter()
                .map(|f| f.iter().map(|a| a.fork()).collect())
                .collect(),
            pos: self.pos,
            poisoned: self.poisoned,
            local: self.local,
            ffn: self.ffn.clone(),
            record: None,
            record_inputs: None,
            profile: self.profile.map(|_| Profile::default()),
        }
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
        let (n, d, hd, kvd, qd) = (tokens.len(), c.dim, c.head_dim, c.kv_dim(), c.q_dim());
        let gemma = c.arch == Arch::Gemma3;
        let mut x = Vec::with_capacity(n * d);
        for &t in tokens {
            let t = t as usize;
            x.extend_from_slice(&w.embed[t * d..(t + 1) * d]);
        }
        if gemma {
            let s = (d as f32).sqrt();
            x.iter_mut().for_each(|a| *a *= s);
        }
        let angles = |freqs: &[f64]| {
            let (mut cos, mut sin) = (Vec::with_capacity(n * freqs.len()), Vec::new());
            for p in self.pos..self.pos + n {
                for &f in freqs {
                    let (s, co) = (p as f64 * f).sin_cos();
                    cos.push(co as f32);
                    sin.push(s as f32);
                }
            }
            (cos, sin)
        };
        let global = angles(&w.inv_freq);
        let local = if c.sliding_window.is_some() {
            angles(&w.inv_freq_local)
        } else {
            (Vec::new(), Vec::new())
        };
        let mut h = vec![0.0f32; n * d];
        let mut q = vec![0.0f32; n * qd];
        let mut k = vec![0.0f32; n * kvd];
        let mut v = vec![0.0f32; n * kvd];
        let mut att = vec![0.0f32; n * qd];
        let mut act = vec![0.0f32; n * c.ffn_dim];
        let mut sink = Vec::new();
        let mut laps = Laps::new(self.profile.take());
        for (li, (layer, attn)) in w.layers.iter().zip(self.attn.iter_mut()).enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            laps.skip();
            let mut qkv = layer.qkv.forward(&h, n)?;
            let row = qd + 2 * kvd;
            if let Some(bias) = &layer.qkv_bias {
                for r in qkv.chunks_exact_mut(row) {
                    for (x, b) in r.iter_mut().zip(bias) {
                        *x += b;
                    }
                }
            }
            for t in 0..n {
                let r = &qkv[t * row..(t + 1) * row];
                q[t * qd..(t + 1) * qd].copy_from_slice(&r[..qd]);
                k[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd..qd + kvd]);
                v[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd + kvd..]);
            }
            if let Some((qn, kn)) = &layer.qk_norm {
                // Per head, in place (a row of one head is its own input).
                for r in q.chunks_exact_mut(hd) {
                    rms_norm_in_place(r, qn, c.rms_eps);
                }
                for r in k.chunks_exact_mut(hd) {
                    rms_norm_in_place(r, kn, c.rms_eps);
                }
            }
            let (cos, sin) = if c.local_window(li).is_some() {
                (&local.0, &local.1)
            } else {
                (&global.0, &global.1)
            };
            rope(&mut q, qd, hd, cos, sin, c.arch);
            rope(&mut k, kvd, hd, cos, sin, c.arch);
            laps.add(|p| &mut p.qkv);
            attn.forward(&q, &k, &v, n, &mut att)?;
            laps.add(|p| &mut p.attn);
            if c.local_window(li).is_none() {
                for f in &mut self.followers {
                    sink.resize(att.len(), 0.0);
                    f[li].forward(&q, &k, &v, n, &mut sink)?;
                    laps.skip();
                }
            }
            let mut o = layer.wo.forward(&att, n)?;
            if let Some((pa, _)) = &layer.post_norms {
                for r in o.chunks_exact_mut(d) {
                    rms_norm_in_place(r, pa, c.rms_eps);
                }
            }
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            laps.add(|p| &mut p.wo);
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            laps.skip();
            if let Some(rec) = &mut self.record_inputs {
                rec[li].extend_from_slice(&h[..n * d]);
            }
            if let Some(ffn) = &self.ffn {
                // SparseFfn refuses models other than SiLU-gated ones.
                let dn = ffn.forward(li, &h, n)?;
                for (a, b) in x.iter_mut().zip(&dn) {
                    *a += b;
                }
                laps.add(|p| &mut p.ffn);
                continue;
            }
            let gu = layer.gate_up.forward(&h, n)?;
            let ff = c.ffn_dim;
            if let Some(rec) = &mut self.record {
                // Every neuron's |silu(gate)|, token by token.
                for t in 0..n {
                    let g = &gu[t * 2 * ff..t * 2 * ff + ff];
                    rec[li].extend(g.iter().map(|&g| FfnAct::Silu.apply(g).abs()));
                }
            }
            // The gated activation, its values shared out over the threads
            // (a prefill chunk's is millions of exp; a decode step's, a few
            // thousand, would otherwise keep the other threads waiting).
            let total = n * ff;
            let per_task = total
                .div_ceil(native_backend().threads() * ACT_TASKS_PER_THREAD)
                .max(ACT_MIN_VALUES);
            native_backend().for_chunks(&mut act[..total], per_task, |i, out| {
                let mut at = i * per_task;
                let mut rest = out;
                // Each piece of a token's values in the chunk in turn.
                while !rest.is_empty() {
                    let (t, c) = (at / ff, at % ff);
                    let (seg, tail) = rest.split_at_mut((ff - c).min(rest.len()));
                    let row = t * 2 * ff + c;
                    let (g, u) = (
                        &gu[row..row + seg.len()],
                        &gu[row + ff..row + ff + seg.len()],
                    );
                    if gemma {
                        for ((a, &g), &u) in seg.iter_mut().zip(g).zip(u) {
                            *a = gelu_tanh(g) * u;
                        }
                    } else {
                        for ((a, &g), &u) in seg.iter_mut().zip(g).zip(u) {
                            *a = FfnAct::Silu.apply(g) * u;
                        }
                    }
                    at += seg.len();
                    rest = tail;
                }
            });
            let mut dn = layer.down.forward(&act, n)?;
            if let Some((_, pf)) = &layer.post_norms {
                for r in dn.chunks_exact_mut(d) {
                    rms_norm_in_place(r, pf, c.rms_eps);
                }
            }
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

/// Numerically stable `ln softmax(logits)[target]`.
pub fn log_prob(logits: &[f32], target: usize) -> Option<f64> {
    let t = *logits.get(target)? as f64;
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let s: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
    Some(t - m - s.ln())
}

/// Index of the largest logit (greedy decoding); `None` when empty. In
/// `f32::total_cmp`'s order (NaN above +inf, 0 above -0), the last of
/// equals.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    // The order as integers, so that the maxima vectorise (over Gemma 3's
    // 262,144 logits, one comparison at a time was 1.5% of the main
    // thread's decode samples); the last chunk that holds the largest, then
    // the last index in it that does.
    let key = |x: f32| {
        let b = x.to_bits() as i32;
        b ^ (((b >> 31) as u32) >> 1) as i32
    };
    const CHUNK: usize = 256;
    let mut best: Option<(i32, usize)> = None;
    for (ci, c) in logits.chunks(CHUNK).enumerate() {
        let m = c
            .iter()
            .map(|&x| key(x))
            .max()
            .expect("a chunk is not empty");
        if best.is_none_or(|(b, _)| m >= b) {
            best = Some((m, ci));
        }
    }
    let (m, ci) = best?;
    let c = &logits[ci * CHUNK..logits.len().min((ci + 1) * CHUNK)];
    c.iter().rposition(|&x| key(x) == m).map(|i| ci * CHUNK + i)
}

#[cfg(test)]
mod tests {
    /// `argmax` picks what `max_by(total_cmp)` picks: ties (the last),
    /// signed zeros, infinities, NaN of either sign, one element, none.
    #[test]
    fn argmax_is_total_cmp_max_by() {
        let by = |x: &[f32]| {
            x.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i)
        };
        let nan = f32::NAN;
        let cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![1.0],
            vec![3.0, 1.0, 3.0, 2.0],
            vec![-0.0, 0.0, -0.0],
            vec![0.0, -0.0],
            vec![-1.0, -5.0, -1.0, -7.0],
            vec![1.0, f32::INFINITY, 2.0, f32::NEG_INFINITY],
            vec![1.0, nan, 2.0],
            vec![1.0, -nan, 2.0],
            vec![f32::NEG_INFINITY, -nan],
            (0..1000)
                .map(|i| ((i * 7919) % 1009) as f32 - 500.0)
                .collect(),
            // Equal maxima in several chunks, and a short last chunk.
            (0..1000).map(|i| (i % 300) as f32).collect(),
            (0..1000)
                .map(|i| if i % 256 == 3 { 9.0 } else { 1.0 })
                .collect(),
            (0..513).map(|i| if i == 512 { 5.0 } else { 0.0 }).collect(),
        ];
        for c in cases {
            assert_eq!(super::argmax(&c), by(&c), "{c:?}");
        }
    }

    /// The exp form of GELU-tanh against the tanh form in f64, over the
    /// range activations take and past both saturations.
    #[test]
    fn gelu_tanh_matches_the_tanh_form() {
        for i in -4000..=4000 {
            let x = i as f32 * 0.01;
            let xd = f64::from(x);
            let want = 0.5
                * xd
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044_715 * xd.powi(3))).tanh());
            let got = f64::from(super::gelu_tanh(x));
            // A few f32 roundings of |x| (exp's error scaled by the
            // sigmoid's slope stays below |x| eps).
            assert!(
                (got - want).abs() <= 8.0 * f64::from(f32::EPSILON) * xd.abs() + 1e-37,
                "x = {x}: {got} against {want}"
            );
        }
        assert_eq!(super::gelu_tanh(-1e30), 0.0);
        assert_eq!(super::gelu_tanh(1e30), 1e30);
    }
}
