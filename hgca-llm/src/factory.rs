//! The attention factories of the commands (full attention, the hybrid
//! layer) and the selection statistics the hybrid layers add up.

use std::sync::{Arc, Mutex};

use hgca_cpu::CpuBackend;
use hgca_hybrid::{HybridAttention, HybridConfig, KeyCodes, Recovery, SequenceAttention};
use hgca_kernels::{AttnShape, KvElem, bf16, f16};
use hgca_llm::{BoxedAttention, Error, Llama, Result};

use crate::cli::Kv;

pub(crate) fn full_factory(kv: Kv) -> impl FnMut(usize, AttnShape) -> Result<BoxedAttention> {
    move |layer, shape| match kv {
        Kv::F32 => hgca_llm::full_attention::<f32>()(layer, shape),
        Kv::F16 => hgca_llm::full_attention::<f16>()(layer, shape),
        Kv::Bf16 => hgca_llm::full_attention::<bf16>()(layer, shape),
    }
}

/// `llm` with its local layers' KV (Gemma 3's sliding windows) held as
/// `kv`, like its global layers'.
pub(crate) fn local_kv(llm: Llama, kv: Kv) -> Result<Llama> {
    match kv {
        Kv::F32 => llm.with_local_kv::<f32>(),
        Kv::F16 => llm.with_local_kv::<f16>(),
        Kv::Bf16 => llm.with_local_kv::<bf16>(),
    }
}

/// Selected CPU entries and CPU entries seen, summed over decode steps
/// that selected (not re-score steps or prompt chunks) and layers.
#[derive(Debug, Default)]
pub(crate) struct SelCount {
    pub(crate) selected: u64,
    pub(crate) candidates: u64,
    /// CPU-side bytes the decode steps read (selected K/V rows, the
    /// selector's block bounds and low-bit key rows) and what full attention over
    /// the same CPU entries reads.
    pub(crate) bytes_read: u64,
    pub(crate) bytes_full: u64,
    /// KV-head steps of the mass selector, and those that fell back to dense.
    pub(crate) head_steps: u64,
    pub(crate) dense_heads: u64,
    /// The mass selector's estimated share of the attention mass attended,
    /// summed over the layers' decode steps that report it, and those steps.
    pub(crate) mass_sum: f64,
    pub(crate) mass_steps: u64,
    /// The layers' decode-step time split (summed over steps and layers):
    /// dense side (the window), selection, sparse side (selection included),
    /// merge and MAW, whole steps.
    pub(crate) t_dense: std::time::Duration,
    pub(crate) t_select: std::time::Duration,
    pub(crate) t_sparse: std::time::Duration,
    pub(crate) t_merge: std::time::Duration,
    pub(crate) t_total: std::time::Duration,
    pub(crate) steps: u64,
}

impl SelCount {
    /// Adds `o`'s selection and byte counters (not its times) to these.
    pub(crate) fn add(&mut self, o: &SelCount) {
        self.selected += o.selected;
        self.candidates += o.candidates;
        self.bytes_read += o.bytes_read;
        self.bytes_full += o.bytes_full;
        self.head_steps += o.head_steps;
        self.dense_heads += o.dense_heads;
        self.mass_sum += o.mass_sum;
        self.mass_steps += o.mass_steps;
    }
}

/// A hybrid layer that adds its selection statistics to a shared counter
/// (which its forks share).
#[derive(Clone)]
struct Counted<A> {
    inner: A,
    count: Arc<Mutex<SelCount>>,
}

impl<T: KvElem> SequenceAttention for Counted<HybridAttention<CpuBackend, CpuBackend, T>> {
    fn forward(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> hgca_kernels::Result<()> {
        self.inner.forward(q, k, v, n, out)?;
        let st = self.inner.stats();
        if n == 1 && !st.full_cpu && st.cpu_tokens > 0 {
            let kvh = self.inner.shape().kv_heads();
            let d = self.inner.shape().head_dim() as u64;
            let row = 2 * d * core::mem::size_of::<T>() as u64;
            let cfg = self.inner.config();
            let blocks = (st.cpu_tokens.div_ceil(cfg.block) * kvh) as u64;
            let oracle = self.inner.oracle_scores();
            let bounds = match cfg.recovery {
                Recovery::Mass(_) => st.bounded_blocks as u64 * row,
                Recovery::BlockBounds { .. } => blocks * row,
                _ => 0,
            };
            // What the estimate read per entry: its low-bit row (codes and
            // a scale), or for the oracle the key itself.
            let est_row = if oracle {
                row / 2
            } else {
                cfg.key_codes.row_bytes(d as usize) as u64
            };
            let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
            c.selected += st.selected as u64;
            c.candidates += (st.cpu_tokens * kvh) as u64;
            c.bytes_read +=
                st.selected as u64 * row + st.estimated_entries as u64 * est_row + bounds;
            c.bytes_full += (st.cpu_tokens * kvh) as u64 * row;
            if st.mass_estimated.is_some() || st.dense_heads > 0 {
                c.head_steps += kvh as u64;
                c.dense_heads += st.dense_heads as u64;
            }
            if let Some(m) = st.mass_estimated {
                c.mass_sum += f64::from(m);
                c.mass_steps += 1;
            }
            c.t_dense += st.dense;
            c.t_select += st.select;
            c.t_sparse += st.sparse;
            c.t_merge += st.merge;
            c.t_total += st.total;
            c.steps += 1;
        }
        Ok(())
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
}

/// A recovery rule as the command lines take it: the rule, the mass
/// selector's key copy, and whether it is the mass rule's oracle.
/// `oracle:P[:S]` is `mass:P[:S]` with exact scores
/// ([`HybridAttention::with_oracle_scores`]); `mass8:P[:S]` and
/// `mass4:P[:S]` are the mass rule with an int8 or int4 key copy (`mass:`
/// takes the library's default, [`KeyCodes::default`]).
pub(crate) fn parse_recovery(s: &str) -> Result<(Recovery, KeyCodes, bool)> {
    let (rule, codes, oracle) = if let Some(rest) = s.strip_prefix("oracle:") {
        (format!("mass:{rest}"), KeyCodes::default(), true)
    } else if let Some(rest) = s.strip_prefix("mass8:") {
        (format!("mass:{rest}"), KeyCodes::Int8, false)
    } else if let Some(rest) = s.strip_prefix("mass4:") {
        (format!("mass:{rest}"), KeyCodes::Int4, false)
    } else {
        (s.to_owned(), KeyCodes::default(), false)
    };
    let r = rule.parse().map_err(|_| Error::Invalid {
        what: "--recovery",
        msg: format!(
            "`{s}`: expected frozen, rescore:N, bounds:N, mass:P[:S], mass8:P[:S], mass4:P[:S] or oracle:P[:S]"
        ),
    })?;
    Ok((r, codes, oracle))
}

/// The window of a hybrid layer: `ratio` of `context` tokens, in whole
/// blocks (at least one).
pub(crate) fn window_for(context: usize, ratio: f64, block: usize) -> usize {
    (((ratio * context as f64) / block as f64).round() as usize).max(1) * block
}

/// The default hybrid configuration with a window of `ratio` of `context`
/// and the recovery rule `rule` (as `--recovery` takes it), and whether
/// the rule is the oracle.
pub(crate) fn hybrid_config(
    context: usize,
    ratio: f64,
    rule: &str,
) -> Result<(HybridConfig, bool)> {
    let d = HybridConfig::default();
    let (recovery, key_codes, oracle) = parse_recovery(rule)?;
    Ok((
        HybridConfig {
            window: window_for(context, ratio, d.block),
            recovery,
            key_codes,
            ..d
        },
        oracle,
    ))
}

/// Hybrid layers of `cfg` (with exact scores when `oracle`) on the
/// process's CPU backend, adding their statistics to `count`.
pub(crate) fn hybrid_factory(
    kv: Kv,
    (cfg, oracle): (HybridConfig, bool),
    count: Arc<Mutex<SelCount>>,
) -> impl FnMut(usize, AttnShape) -> Result<BoxedAttention> {
    move |_, shape| {
        let count = Arc::clone(&count);
        match kv {
            Kv::F32 => counted::<f32>(shape, &cfg, oracle, count),
            Kv::F16 => counted::<f16>(shape, &cfg, oracle, count),
            Kv::Bf16 => counted::<bf16>(shape, &cfg, oracle, count),
        }
    }
}

/// One counted hybrid layer with KV stored as `T`.
fn counted<T: KvElem>(
    shape: AttnShape,
    cfg: &HybridConfig,
    oracle: bool,
    count: Arc<Mutex<SelCount>>,
) -> Result<BoxedAttention> {
    let mut inner =
        HybridAttention::<_, _, T>::cpu_on(shape, cfg.clone(), hgca_llm::cpu_backend())?;
    if oracle {
        inner = inner.with_oracle_scores();
    }
    Ok(Box::new(Counted { inner, count }))
}
