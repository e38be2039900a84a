//! The public hybrid layer, [`HybridAttention`]: one sequence (a
//! [`Seq`]) on the backends and configuration of a [`Shared`] layer. The
//! work itself is in [`crate::seq`] (the step) and [`crate::select`] (which
//! CPU entries it attends).

use std::time::{Duration, Instant};

use hgca_cpu::CpuBackend;
use hgca_kernels::{
    Alpha, AttnShape, Beta, CpuStore, DenseAttention, KvElem, KvStore, KvWindow, Partial,
    PartialLayout, Result, Selection, SparseAttention, check_len,
};

use crate::seq::Seq;
use crate::{HybridConfig, SequenceAttention, StepStats};

/// The per-layer parts every sequence shares: shape, configuration and
/// backends.
#[derive(Debug, Clone)]
pub(crate) struct Shared<D, S> {
    pub(crate) shape: AttnShape,
    pub(crate) cfg: HybridConfig,
    pub(crate) beta: Beta,
    pub(crate) alpha: Alpha,
    pub(crate) dense: D,
    pub(crate) sparse: S,
    pub(crate) cpu: CpuBackend,
    /// [`HybridAttention::with_oracle_scores`].
    pub(crate) oracle: bool,
}

impl<D: DenseAttention, S: SparseAttention> Shared<D, S> {
    /// Validates `cfg` for `shape`.
    pub(crate) fn new(shape: AttnShape, cfg: HybridConfig, dense: D, sparse: S) -> Result<Self> {
        let (beta, alpha) = cfg.validate(&shape)?;
        Ok(Self {
            shape,
            cfg,
            beta,
            alpha,
            dense,
            sparse,
            cpu: CpuBackend::new(),
            oracle: false,
        })
    }
}

/// The hybrid attention of one layer: the most recent tokens in a dense
/// window on backend `D` (a GPU, or the CPU standing in), older tokens in a
/// CPU store attended sparsely by `S` over the entries selected per KV head
/// by their MAW, the two partials merged exactly.
///
/// A decode step submits the dense work, runs the CPU side meanwhile, then
/// waits and merges; only outputs and LSE values cross between the sides.
/// This is one sequence; [`crate::HybridBatch`] holds a batch of
/// independent sequences on the same backends.
///
/// ```
/// use hgca_hybrid::{HybridAttention, HybridConfig, SequenceAttention};
/// use hgca_kernels::{AttnShape, DType};
/// let shape = AttnShape::new(4, 2, 16)?;
/// let cfg = HybridConfig { window: 64, block: 16, ..HybridConfig::default() };
/// let mut layer = HybridAttention::<_, _, f32>::cpu(shape, cfg)?;
/// let mut out = vec![0.0; 4 * 16];
/// for t in 0..200 {
///     let x: Vec<f32> = (0..32).map(|i| ((t * 7 + i) % 13) as f32 / 13.0).collect();
///     layer.forward(&vec![0.1; 64], &x, &x, 1, &mut out)?;
/// }
/// assert_eq!(layer.len(), 200);
/// assert!(layer.stats().cpu_tokens >= 200 - 64);
/// // The same decode step in two calls: the token enters, then its query attends.
/// let x = vec![0.5; 32];
/// layer.append(&x, &x, 1)?;
/// layer.attend(&vec![0.1; 64], &mut out)?;
/// assert_eq!(layer.len(), 201);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug)]
pub struct HybridAttention<
    D: DenseAttention,
    S: SparseAttention,
    T: KvElem,
    C: CpuStore<T> = KvStore<T>,
> {
    pub(crate) l: Shared<D, S>,
    pub(crate) seq: Seq<D, T, C>,
}

/// A copy of the sequence: the same cache (window and CPU store), MAW and
/// selection state, on the same backends. Each copy then goes on alone:
/// several continuations of one prefilled prompt (a snapshot), bit for bit
/// what the original would compute. Where the window is device memory its
/// type decides whether it can be copied (the CPU's host window can).
///
/// ```
/// use hgca_hybrid::{HybridAttention, HybridConfig, SequenceAttention};
/// use hgca_kernels::AttnShape;
/// let cfg = HybridConfig { window: 16, block: 8, ..HybridConfig::default() };
/// let mut a = HybridAttention::<_, _, f32>::cpu(AttnShape::new(2, 1, 4)?, cfg)?;
/// let mut out = vec![0.0; 8];
/// for t in 0..40 {
///     let x = [t as f32 / 40.0, 0.5, -0.25, 1.0];
///     a.forward(&[0.3; 8], &x, &x, 1, &mut out)?;
/// }
/// let mut b = a.clone();
/// let (mut oa, mut ob) = (vec![0.0; 8], vec![0.0; 8]);
/// a.forward(&[0.7; 8], &[1.0; 4], &[2.0; 4], 1, &mut oa)?;
/// b.forward(&[0.7; 8], &[1.0; 4], &[2.0; 4], 1, &mut ob)?;
/// assert_eq!(oa, ob);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
impl<D, S, T, C> Clone for HybridAttention<D, S, T, C>
where
    D: DenseAttention + Clone,
    D::Window: Clone,
    S: SparseAttention + Clone,
    T: KvElem,
    C: CpuStore<T> + Clone,
{
    fn clone(&self) -> Self {
        Self {
            l: self.l.clone(),
            seq: self.seq.clone(),
        }
    }
}

impl<T: KvElem> HybridAttention<CpuBackend, CpuBackend, T> {
    /// The CPU in both roles (no GPU): the window is host memory, dense
    /// attention runs on the CPU too.
    ///
    /// # Errors
    /// As [`HybridAttention::new`].
    pub fn cpu(shape: AttnShape, cfg: HybridConfig) -> Result<Self> {
        let cpu = CpuBackend::new();
        Self::new(shape, cfg, cpu.clone(), cpu)
    }

    /// The CPU in every role on the given backend (its ISA and threads):
    /// dense, sparse and the layer's own CPU work ([`Self::with_cpu`]).
    ///
    /// # Errors
    /// As [`HybridAttention::new`].
    pub fn cpu_on(shape: AttnShape, cfg: HybridConfig, cpu: CpuBackend) -> Result<Self> {
        Ok(Self::new(shape, cfg, cpu.clone(), cpu.clone())?.with_cpu(cpu))
    }
}

impl<D: DenseAttention, S: SparseAttention, T: KvElem> HybridAttention<D, S, T> {
    /// A layer with `dense` owning the window (KV stored as `T`) and
    /// `sparse` attending the CPU store, hgca's own [`KvStore`] (see
    /// [`Self::with_store`] for another).
    ///
    /// # Errors
    /// [`Error::Zero`](hgca_kernels::Error::Zero), [`Error::Param`](hgca_kernels::Error::Param), [`Error::Capacity`](hgca_kernels::Error::Capacity) for a bad
    /// config (block 0 or not a power of two, window smaller than a block,
    /// NaN or negative beta, alpha outside [0, 1]); [`Error::UnsupportedDType`](hgca_kernels::Error::UnsupportedDType)
    /// when the dense backend cannot store `T`; backend errors creating the window.
    ///
    /// One backend can serve every layer of a model: `&B` and `Arc<B>` are
    /// backends wherever `B` is (a GPU context need not be `Clone`).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use hgca_cpu::CpuBackend;
    /// use hgca_hybrid::{HybridAttention, HybridConfig, SequenceAttention};
    /// use hgca_kernels::{AttnShape, DType};
    /// let (shape, cpu) = (AttnShape::new(4, 2, 8)?, Arc::new(CpuBackend::new()));
    /// let cfg = HybridConfig { window: 64, block: 16, ..HybridConfig::default() };
    /// let mut layers = (0..4)
    ///     .map(|_| HybridAttention::<_, _, f32>::new(shape, cfg.clone(), Arc::clone(&cpu), &*cpu))
    ///     .collect::<Result<Vec<_>, _>>()?;
    /// let mut out = vec![0.0; 32];
    /// for layer in &mut layers {
    ///     layer.forward(&[0.5; 32], &[0.25; 16], &[1.0; 16], 1, &mut out)?;
    /// }
    /// assert_eq!(out, [1.0; 32]);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    pub fn new(shape: AttnShape, cfg: HybridConfig, dense: D, sparse: S) -> Result<Self> {
        // The config first: its errors name its own fields (`block`), not
        // the store's.
        cfg.validate(&shape)?;
        let store = KvStore::new(shape.kv_heads(), shape.head_dim(), cfg.block)?;
        Self::with_store(shape, cfg, dense, sparse, store)
    }
}

impl<D: DenseAttention, S: SparseAttention, T: KvElem, C: CpuStore<T>> HybridAttention<D, S, T, C> {
    /// A layer over a CPU store of the caller's (an engine's own pages,
    /// through [`CpuStore`]): evicted window rows are pushed into it and the
    /// CPU side reads them where they lie. The store must be empty.
    ///
    /// # Errors
    /// As [`HybridAttention::new`]; [`Error::ShapeMismatch`](hgca_kernels::Error::ShapeMismatch) for a store of
    /// other heads or head dim, [`Error::Capacity`](hgca_kernels::Error::Capacity) for a store that
    /// already holds tokens.
    pub fn with_store(
        shape: AttnShape,
        cfg: HybridConfig,
        dense: D,
        sparse: S,
        store: C,
    ) -> Result<Self> {
        let l = Shared::new(shape, cfg, dense, sparse)?;
        let seq = Seq::new(&l, store)?;
        Ok(Self { l, seq })
    }

    /// The CPU store (sequence positions `0..cpu_tokens()`).
    pub fn store(&self) -> &C {
        &self.seq.store
    }

    /// Sets the CPU backend of the layer's own CPU work: selection (block
    /// bounds, the MAW scan), the MAW update, and the dense passes over the
    /// CPU store (prefill, re-scoring, re-evaluation). By default it is
    /// [`CpuBackend::new`] (the best ISA, rayon's global pool), whatever
    /// `sparse` was built with; pass the same backend to keep one ISA and
    /// one pool for everything.
    ///
    /// ```
    /// use hgca_cpu::{CpuBackend, Par};
    /// use hgca_hybrid::{HybridAttention, HybridConfig};
    /// use hgca_kernels::{AttnShape, DType};
    /// let cpu = CpuBackend::new().with_par(Par::Seq)?;
    /// let cfg = HybridConfig { window: 64, block: 16, ..HybridConfig::default() };
    /// let layer = HybridAttention::<_, _, f32>::new(AttnShape::new(4, 2, 8)?, cfg.clone(), cpu.clone(), cpu.clone())?
    ///     .with_cpu(cpu.clone());
    /// assert_eq!(layer.cpu_backend().threads(), 1);
    /// // The same in one call:
    /// let layer = HybridAttention::<_, _, f32>::cpu_on(AttnShape::new(4, 2, 8)?, cfg, cpu)?;
    /// assert_eq!(layer.cpu_backend().threads(), 1);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    #[must_use]
    pub fn with_cpu(mut self, cpu: CpuBackend) -> Self {
        self.l.cpu = cpu;
        self
    }

    /// The oracle of the mass rule, for evaluations: under
    /// [`Recovery::Mass`](crate::Recovery::Mass), each decode step scores
    /// every CPU entry exactly from its key (reading all of them) instead
    /// of estimating (block bounds, the low-bit copy), then admits entries by
    /// weight to the same target in the same way. It bounds what a better
    /// estimate could buy; it saves no reads. No effect under the other rules.
    #[must_use]
    pub fn with_oracle_scores(mut self) -> Self {
        self.l.oracle = true;
        self
    }

    /// Whether [`Self::with_oracle_scores`] is on.
    pub fn oracle_scores(&self) -> bool {
        self.l.oracle
    }

    /// The CPU backend of the layer's own CPU work (see [`Self::with_cpu`]).
    pub fn cpu_backend(&self) -> &CpuBackend {
        &self.l.cpu
    }

    /// Stats of the last decode step or prompt chunk.
    pub fn stats(&self) -> &StepStats {
        &self.seq.stats
    }
    /// The layer's shape.
    pub fn shape(&self) -> &AttnShape {
        &self.l.shape
    }
    /// The configuration.
    pub fn config(&self) -> &HybridConfig {
        &self.l.cfg
    }
    /// The CPU entries attended by the last decode step, per KV head
    /// (indices into the CPU store, whose token `j` is sequence position `j`).
    pub fn last_selection(&self) -> &Selection {
        self.seq.selection()
    }
    /// Times the dense side of a decode step alone: the same submit and wait
    /// (with the window's weights) as [`Self::attend`] does, with no CPU
    /// work beside it. This is the `dense` term of the overlap bound
    /// `step <= 1.1 max(dense, sparse) + merge`: a step's own
    /// [`StepStats::dense`] only sees the part of the GPU time that the CPU
    /// side did not hide.
    ///
    /// # Errors
    /// [`Error::Length`](hgca_kernels::Error::Length) when `q` is not `[q_heads, d]`; backend errors.
    pub fn time_dense_alone(&self, q: &[f32]) -> Result<Duration> {
        check_len("q", self.l.shape.q_len(), q.len())?;
        let layout = PartialLayout::decode(&self.l.shape);
        let mut part = Partial::empty(layout);
        let mut w = vec![0.0; self.l.shape.q_heads() * self.seq.window.len()];
        let t = Instant::now();
        let pending = self.l.dense.submit_decode(&self.seq.window, q, true)?;
        self.l.dense.wait(pending, part.as_mut(), Some(&mut w))?;
        Ok(t.elapsed())
    }

    /// The dense side's window (its length and first position, and what
    /// its backend reports of it).
    pub fn window(&self) -> &D::Window {
        self.seq.window()
    }

    /// Tokens in the CPU store (sequence positions `0..cpu_tokens`); the
    /// window holds the positions after them.
    pub fn cpu_tokens(&self) -> usize {
        self.seq.cpu_tokens()
    }
    /// The MAW of every token, `[kv_heads][len]` in sequence order (CPU entries, then the window's).
    pub fn maw_snapshot(&self) -> Vec<Vec<f32>> {
        self.seq.maw_snapshot(&self.l)
    }

    /// Appends `n` tokens (token-major K and V, `[n, kv_heads, d]`) without
    /// attending: they enter the window, the oldest blocks moving to the CPU
    /// store when it is full. The tokens go in pieces that fit the window;
    /// each token's MAW starts at `1 / n_gpu`, the window's length after its
    /// piece (for one token, after it, as a decode step's does). With
    /// [`Self::attend`] after it, `append(k, v, 1)` is a decode step
    /// ([`SequenceAttention::forward`] with `n = 1`), bit for bit.
    ///
    /// # Errors
    /// [`Error::Length`](hgca_kernels::Error::Length) for lengths that do not fit, checked before
    /// anything changes; backend errors (tokens held before are never lost).
    pub fn append(&mut self, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        self.seq.append(&self.l, k, v, n)
    }

    /// Decode attention of one query (`q`: `[q_heads, d]`) over every token
    /// held: dense over the window, sparse over the selected CPU entries,
    /// merged exactly, MAW updated. Writes `out` (`[q_heads, d]`); before
    /// the first token, the empty attention (zeros), and nothing changes.
    /// Each call is a decode step: attending twice without an append decays
    /// the MAW twice and advances the [`Recovery::Rescore`](crate::Recovery::Rescore) schedule.
    ///
    /// # Errors
    /// [`Error::Length`](hgca_kernels::Error::Length) for lengths that do not fit (checked first);
    /// backend errors.
    pub fn attend(&mut self, q: &[f32], out: &mut [f32]) -> Result<()> {
        self.seq.attend(&self.l, q, out)
    }

    /// Appends `n` tokens (token-major K and V) whose attention outputs are
    /// not needed, as for a context prefilled elsewhere, then re-evaluates
    /// every entry's MAW against `probe` (one query, `[q_heads, d]`).
    ///
    /// # Errors
    /// [`Error::Length`](hgca_kernels::Error::Length) for lengths that do not fit; backend errors.
    pub fn extend(&mut self, k: &[f32], v: &[f32], n: usize, probe: &[f32]) -> Result<()> {
        check_len("probe", self.l.shape.q_len(), probe.len())?;
        self.seq.append(&self.l, k, v, n)?;
        if self.len() > 0 {
            self.seq.refresh_maw(&self.l, probe)?;
        }
        Ok(())
    }
}

impl<D: DenseAttention, S: SparseAttention, T: KvElem, C: CpuStore<T>> SequenceAttention
    for HybridAttention<D, S, T, C>
{
    fn forward(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        self.seq.forward(&self.l, q, k, v, n, out)
    }

    fn len(&self) -> usize {
        self.seq.len()
    }
}
