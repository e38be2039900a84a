//! The attention factories of the commands (full attention, the hybrid
//! layer) and the selection statistics the hybrid layers add up.

use std::sync::{Arc, Mutex};

use hgca_cpu::CpuBackend;
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
use hgca_kernels::{AttnShape, KvElem, bf16, f16};
use hgca_llm::{BoxedAttention, Error, Result};

use crate::cli::Kv;

pub(crate) fn full_factory(kv: Kv) -> impl FnMut(usize, AttnShape) -> Result<BoxedAttention> {
    move |layer, shape| match kv {
        Kv::F32 => hgca_llm::full_attention::<f32>()(layer, shape),
        Kv::F16 => hgca_llm::full_attention::<f16>()(layer, shape),
        Kv::Bf16 => hgca_llm::full_attention::<bf16>()(layer, shape),
    }
}

/// Selected CPU entries and CPU entries seen, summed over decode steps
/// that selected (not re-score steps or prompt chunks) and layers.
#[derive(Debug, Default)]
pub(crate) struct SelCount {
    pub(crate) selected: u64,
    pub(crate) candidates: u64,
    /// CPU-side bytes the decode steps read (selected K/V rows, the
    /// selector's block bounds and int8 rows) and what full attention over
    /// the same CPU entries reads.
    pub(crate) bytes_read: u64,
    pub(crate) bytes_full: u64,
    /// KV-head steps of the mass selector, and those that fell back to dense.
    pub(crate) head_steps: u64,
    pub(crate) dense_heads: u64,
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

/// A hybrid layer that adds its selection statistics to a shared counter.
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
            let bounds = match cfg.recovery {
                Recovery::BlockBounds { .. } | Recovery::Mass(_) => blocks * row,
                _ => 0,
            };
            let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
            c.selected += st.selected as u64;
            c.candidates += (st.cpu_tokens * kvh) as u64;
            c.bytes_read +=
                st.selected as u64 * row + st.estimated_entries as u64 * (d + 4) + bounds;
            c.bytes_full += (st.cpu_tokens * kvh) as u64 * row;
            if st.mass_estimated.is_some() || st.dense_heads > 0 {
                c.head_steps += kvh as u64;
                c.dense_heads += st.dense_heads as u64;
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

pub(crate) fn parse_recovery(s: &str) -> Result<Recovery> {
    s.parse().map_err(|_| Error::Invalid {
        what: "--recovery",
        msg: format!("`{s}`: expected frozen, rescore:N, bounds:N or mass:P[:S]"),
    })
}

pub(crate) fn hybrid_factory(
    kv: Kv,
    cfg: HybridConfig,
    count: Arc<Mutex<SelCount>>,
) -> impl FnMut(usize, AttnShape) -> Result<BoxedAttention> {
    move |_, shape| {
        let count = Arc::clone(&count);
        Ok(match kv {
            Kv::F32 => Box::new(Counted {
                inner: HybridAttention::<_, _, f32>::cpu_on(
                    shape,
                    cfg.clone(),
                    hgca_llm::cpu_backend(),
                )?,
                count,
            }) as BoxedAttention,
            Kv::F16 => Box::new(Counted {
                inner: HybridAttention::<_, _, f16>::cpu_on(
                    shape,
                    cfg.clone(),
                    hgca_llm::cpu_backend(),
                )?,
                count,
            }),
            Kv::Bf16 => Box::new(Counted {
                inner: HybridAttention::<_, _, bf16>::cpu_on(
                    shape,
                    cfg.clone(),
                    hgca_llm::cpu_backend(),
                )?,
                count,
            }),
        })
    }
}
