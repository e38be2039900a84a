//! A batch of independent sequences in one layer, on shared backends.

use std::time::{Duration, Instant};

use hgca_cpu::CpuBackend;
use hgca_kernels::{
    AttnShape, CpuStore, DenseAttention, Error, KvElem, KvStore, Result, Selection,
    SparseAttention, check_len_of,
};

use crate::layer::Shared;
use crate::seq::Seq;
use crate::{HybridConfig, StepStats};

/// A sequence of a [`HybridBatch`]. Ids are not reused: the id of a
/// removed sequence stays invalid after other sequences are added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(u64);

impl SeqId {
    /// The id as a number (ids grow from 0 in the order sequences were added).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// The hybrid attention of one layer for a batch of independent sequences
/// (what an inference server decodes together), on one dense and one sparse
/// backend. Each sequence has its own window, CPU store, MAW and selection,
/// exactly as a [`crate::HybridAttention`] has; the configuration and the
/// backends are shared.
///
/// [`HybridBatch::decode`] steps several sequences at once: it submits the
/// dense work of every sequence first, then runs their CPU sides, then waits
/// for and merges each. With a GPU backend the CPU side of the whole batch
/// overlaps the GPU's work for the whole batch.
///
/// ```
/// use hgca_hybrid::{HybridBatch, HybridConfig};
/// use hgca_kernels::{AttnShape, DType};
/// let shape = AttnShape::new(4, 2, 16)?;
/// let cfg = HybridConfig { window: 64, block: 16, ..HybridConfig::default() };
/// let mut batch = HybridBatch::<_, _, f32>::cpu(shape, cfg)?;
/// let a = batch.add()?;
/// let b = batch.add()?;
/// // A prompt of 100 tokens for `a` only.
/// let x: Vec<f32> = (0..100 * 32).map(|i| (i % 13) as f32 / 13.0).collect();
/// let q: Vec<f32> = (0..100 * 64).map(|i| (i % 7) as f32 / 7.0).collect();
/// let mut out = vec![0.0; 100 * 64];
/// batch.forward(a, &q, &x, &x, 100, &mut out)?;
/// // Then decode steps of both together: one token each, rows in `ids` order.
/// let mut out = vec![0.0; 2 * 64];
/// for _ in 0..10 {
///     batch.decode(&[a, b], &q[..2 * 64], &x[..2 * 32], &x[..2 * 32], &mut out)?;
/// }
/// assert_eq!(batch.len(a)?, 110);
/// assert_eq!(batch.len(b)?, 10);
/// batch.remove(a)?;
/// assert!(batch.len(a).is_err());
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug)]
pub struct HybridBatch<
    D: DenseAttention,
    S: SparseAttention,
    T: KvElem,
    C: CpuStore<T> = KvStore<T>,
> {
    l: Shared<D, S>,
    /// Sequences in the order they were added, by id.
    seqs: Vec<(SeqId, Seq<D, T, C>)>,
    next: u64,
    last_step: Duration,
}

impl<T: KvElem> HybridBatch<CpuBackend, CpuBackend, T> {
    /// The CPU in both roles (no GPU).
    ///
    /// # Errors
    /// As [`HybridBatch::new`].
    pub fn cpu(shape: AttnShape, cfg: HybridConfig) -> Result<Self> {
        let cpu = CpuBackend::new();
        Self::new(shape, cfg, cpu.clone(), cpu)
    }
}

impl<D: DenseAttention, S: SparseAttention, T: KvElem> HybridBatch<D, S, T> {
    /// Adds an empty sequence (a new window on the dense backend, a new
    /// [`KvStore`]).
    ///
    /// # Errors
    /// Backend errors creating the window (device memory).
    pub fn add(&mut self) -> Result<SeqId> {
        let s = &self.l.shape;
        let store = KvStore::new(s.kv_heads(), s.head_dim(), self.l.cfg.block)?;
        self.add_with_store(store)
    }
}

impl<D: DenseAttention, S: SparseAttention, T: KvElem, C: CpuStore<T>> HybridBatch<D, S, T, C> {
    /// An empty batch with `dense` owning the windows and `sparse` attending
    /// the CPU stores.
    ///
    /// # Errors
    /// As [`crate::HybridAttention::new`], for the configuration.
    pub fn new(shape: AttnShape, cfg: HybridConfig, dense: D, sparse: S) -> Result<Self> {
        Ok(Self {
            l: Shared::new(shape, cfg, dense, sparse)?,
            seqs: Vec::new(),
            next: 0,
            last_step: Duration::ZERO,
        })
    }

    /// Sets the CPU backend of the layer's own CPU work, as
    /// [`crate::HybridAttention::with_cpu`] does.
    #[must_use]
    pub fn with_cpu(mut self, cpu: CpuBackend) -> Self {
        self.l.cpu = cpu;
        self
    }

    /// The layer's shape.
    pub fn shape(&self) -> &AttnShape {
        &self.l.shape
    }
    /// The configuration.
    pub fn config(&self) -> &HybridConfig {
        &self.l.cfg
    }

    /// Adds an empty sequence over a CPU store of the caller's (see
    /// [`crate::HybridAttention::with_store`]).
    ///
    /// # Errors
    /// As [`crate::HybridAttention::with_store`]; backend errors creating the window.
    pub fn add_with_store(&mut self, store: C) -> Result<SeqId> {
        let seq = Seq::new(&self.l, store)?;
        let id = SeqId(self.next);
        self.next += 1;
        self.seqs.push((id, seq));
        Ok(id)
    }

    /// Removes a sequence and frees its window and store.
    ///
    /// # Errors
    /// [`Error::Index`] for an id that is not in the batch.
    pub fn remove(&mut self, id: SeqId) -> Result<()> {
        let at = self.position(id)?;
        self.seqs.remove(at);
        Ok(())
    }

    /// The sequences in the batch, in the order they were added.
    pub fn ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.iter().map(|(id, _)| *id)
    }

    /// Tokens held by a sequence.
    ///
    /// # Errors
    /// [`Error::Index`] for an id that is not in the batch.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seqs[self.position(id)?].1.len())
    }

    /// Stats of a sequence's last decode step or prompt chunk. In a batched
    /// [`HybridBatch::decode`], its `total` runs from the start of the
    /// batch's step to the end of this sequence's merge, and so includes
    /// the other sequences' appends and CPU sides; [`HybridBatch::last_step`]
    /// is the whole batch's time.
    ///
    /// # Errors
    /// [`Error::Index`] for an id that is not in the batch.
    pub fn stats(&self, id: SeqId) -> Result<&StepStats> {
        Ok(self.seqs[self.position(id)?].1.stats())
    }

    /// Tokens in a sequence's CPU store (its positions `0..cpu_tokens`).
    ///
    /// # Errors
    /// [`Error::Index`] for an id that is not in the batch.
    pub fn cpu_tokens(&self, id: SeqId) -> Result<usize> {
        Ok(self.seqs[self.position(id)?].1.cpu_tokens())
    }

    /// The CPU entries a sequence's last decode step attended, per KV head,
    /// as [`crate::HybridAttention::last_selection`].
    ///
    /// # Errors
    /// [`Error::Index`] for an id that is not in the batch.
    pub fn last_selection(&self, id: SeqId) -> Result<&Selection> {
        Ok(self.seqs[self.position(id)?].1.selection())
    }

    /// A sequence's window on the dense side, as
    /// [`crate::HybridAttention::window`].
    ///
    /// # Errors
    /// [`Error::Index`] for an id that is not in the batch.
    pub fn window(&self, id: SeqId) -> Result<&D::Window> {
        Ok(self.seqs[self.position(id)?].1.window())
    }

    /// Wall time of the last [`HybridBatch::decode`].
    pub fn last_step(&self) -> Duration {
        self.last_step
    }

    /// A prompt chunk or decode step of one sequence, as
    /// [`crate::SequenceAttention::forward`].
    ///
    /// # Errors
    /// [`Error::Index`] for an id not in the batch; as
    /// [`crate::SequenceAttention::forward`].
    pub fn forward(
        &mut self,
        id: SeqId,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let at = self.position(id)?;
        self.seqs[at].1.forward(&self.l, q, k, v, n, out)
    }

    /// Appends `n` tokens to one sequence without attending, as
    /// [`crate::HybridAttention::append`].
    ///
    /// # Errors
    /// [`Error::Index`] for an id not in the batch; as
    /// [`crate::HybridAttention::append`].
    pub fn append(&mut self, id: SeqId, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        let at = self.position(id)?;
        self.seqs[at].1.append(&self.l, k, v, n)
    }

    /// Decode attention of one query of one sequence, as
    /// [`crate::HybridAttention::attend`].
    ///
    /// # Errors
    /// [`Error::Index`] for an id not in the batch; as
    /// [`crate::HybridAttention::attend`].
    pub fn attend(&mut self, id: SeqId, q: &[f32], out: &mut [f32]) -> Result<()> {
        let at = self.position(id)?;
        self.seqs[at].1.attend(&self.l, q, out)
    }

    /// One decode step of each sequence in `ids` (distinct): row `i` of `q`
    /// (`[ids.len(), q_heads, d]`), `k` and `v` (`[ids.len(), kv_heads, d]`)
    /// and `out` (`[ids.len(), q_heads, d]`) belongs to `ids[i]`.
    ///
    /// Every new token enters its window, every dense side is submitted,
    /// then the CPU sides run one sequence after another (each on the CPU
    /// backend's threads), then each sequence waits for its dense result,
    /// merges and updates its MAW. Each sequence's output is the same, bit
    /// for bit, as its own [`crate::HybridAttention`] on the same backends
    /// (and the same [`HybridBatch::with_cpu`] backend) would give.
    ///
    /// # Errors
    /// [`Error::Index`] for an id not in the batch or given twice,
    /// [`Error::Length`] for lengths that do not fit: both checked before
    /// anything changes. A backend error later returns with this step's
    /// tokens possibly appended and `out` possibly partly written; tokens
    /// held before the call are never lost.
    pub fn decode(
        &mut self,
        ids: &[SeqId],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let t0 = Instant::now();
        let s = self.l.shape;
        let (ql, kl, b) = (s.q_len(), s.kv_token_len(), ids.len());
        check_len_of("q", &[b, ql], q.len())?;
        check_len_of("k", &[b, kl], k.len())?;
        check_len_of("v", &[b, kl], v.len())?;
        check_len_of("out", &[b, ql], out.len())?;
        let mut at = Vec::with_capacity(b);
        for &id in ids {
            let p = self.position(id)?;
            if at.contains(&p) {
                return Err(Error::Index {
                    what: "sequence given twice in one decode step",
                    index: id.0 as usize,
                    len: self.seqs.len(),
                });
            }
            at.push(p);
        }
        let l = &self.l;
        for (i, &p) in at.iter().enumerate() {
            self.seqs[p]
                .1
                .append(l, &k[i * kl..(i + 1) * kl], &v[i * kl..(i + 1) * kl], 1)?;
        }
        let mut subs = Vec::with_capacity(b);
        for (i, &p) in at.iter().enumerate() {
            subs.push(self.seqs[p].1.submit(l, &q[i * ql..(i + 1) * ql], t0)?);
        }
        let mut cpus = Vec::with_capacity(b);
        for (i, &p) in at.iter().enumerate() {
            cpus.push(self.seqs[p].1.cpu_side(l, &q[i * ql..(i + 1) * ql])?);
        }
        for (i, ((&p, sub), cpu)) in at.iter().zip(subs).zip(cpus).enumerate() {
            self.seqs[p]
                .1
                .finish(l, sub, cpu, &mut out[i * ql..(i + 1) * ql])?;
        }
        self.last_step = t0.elapsed();
        Ok(())
    }

    fn position(&self, id: SeqId) -> Result<usize> {
        self.seqs
            .binary_search_by_key(&id, |(i, _)| *i)
            .map_err(|_| Error::Index {
                what: "sequence (never added, or removed)",
                index: usize::try_from(id.0).unwrap_or(usize::MAX),
                len: self.seqs.len(),
            })
    }
}
