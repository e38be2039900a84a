//! The hybrid layer: dense window + CPU store + MAW selection + exact merge.

use std::time::{Duration, Instant};

use hgca_cpu::CpuBackend;
use hgca_kernels::{
    Alpha, AttnShape, Beta, CpuStore, DenseAttention, Error, KvElem, KvStore, KvWindow, MassTarget,
    Partial, PartialLayout, Result, Selection, SparseAttention, WindowSpec, check_len,
    check_len_of, merge_into,
};

use crate::SequenceAttention;
use crate::mass;
use hgca_cpu::Int8Keys;

/// How CPU entries whose importance rises get back into the selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Recovery {
    /// The paper: MAW of CPU entries changes only when they are attended;
    /// an entry below the threshold never comes back between appends.
    Frozen,
    /// Every `every` decode steps, attend to *all* CPU entries exactly
    /// (that step is full attention) and refresh every entry's MAW.
    Rescore {
        /// Period in decode steps (>= 1).
        every: usize,
    },
    /// Quest-style: per block of the CPU store, elementwise key bounds give
    /// an upper bound of any score in the block; each step admits the `top`
    /// blocks with the highest bound (per KV head) on top of the MAW rule.
    BlockBounds {
        /// Blocks admitted per step and KV head.
        top: usize,
    },
    /// Mass-targeted (top-p): per KV head and step, CPU entries are
    /// admitted in decreasing estimated weight until the estimated share of
    /// the attention mass (window included) they leave out is at most
    /// `1 - target`; a head that would need more than `max_share` of the
    /// CPU entries takes all of them that step (counted in
    /// [`StepStats::dense_heads`]). The estimate: block key bounds drop
    /// blocks that cannot matter, an int8 copy of the keys scores the rest
    /// (its memory: one byte per key element). The MAW rule is not used;
    /// the sinks are always attended.
    Mass(MassTarget),
}

impl std::str::FromStr for Recovery {
    type Err = Error;

    /// `frozen` (or `paper`), `rescore:N`, `bounds:N`, `mass:P` or
    /// `mass:P:S` (target `P`, max share `S`, by default 0.5): the form
    /// command lines take.
    ///
    /// ```
    /// use hgca_hybrid::Recovery;
    /// assert_eq!("bounds:32".parse::<Recovery>()?, Recovery::BlockBounds { top: 32 });
    /// assert!("rescore:x".parse::<Recovery>().is_err());
    /// let m = hgca_kernels::MassTarget::new(0.99, 0.5)?;
    /// assert_eq!("mass:0.99".parse::<Recovery>()?, Recovery::Mass(m));
    /// assert!("mass:1.5".parse::<Recovery>().is_err());
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::Param {
            what: "recovery",
            value: f64::NAN,
            expected: "frozen, rescore:N, bounds:N, mass:P or mass:P:S",
        };
        let (kind, n) = s.split_once(':').unwrap_or((s, ""));
        let int = || n.parse::<usize>().map_err(|_| bad());
        Ok(match kind {
            "frozen" | "paper" => Recovery::Frozen,
            "rescore" => Recovery::Rescore { every: int()? },
            "bounds" => Recovery::BlockBounds { top: int()? },
            "mass" => {
                let (p, share) = n.split_once(':').unwrap_or((n, "0.5"));
                let f = |x: &str| x.parse::<f32>().map_err(|_| bad());
                Recovery::Mass(MassTarget::new(f(p)?, f(share)?)?)
            }
            _ => return Err(bad()),
        })
    }
}

/// Configuration of a [`HybridAttention`] layer.
#[derive(Debug, Clone)]
pub struct HybridConfig {
    /// Dense window capacity in tokens (the GPU's share of the cache).
    pub window: usize,
    /// Eviction block in tokens (a power of two, `<= window`).
    pub block: usize,
    /// The first `sinks` tokens of the sequence are always attended.
    pub sinks: usize,
    /// `beta` of the selection rule `maw > beta / n_gpu`, one value for
    /// every KV head (see [`HybridConfig::beta_per_head`] for per-head values).
    pub beta: f32,
    /// Per-head `beta`, overriding `beta` when set (one per KV head).
    pub beta_per_head: Option<Vec<f32>>,
    /// MAW smoothing: `maw <- alpha * maw + (1 - alpha) * weight`.
    pub alpha: f32,
    /// How entries whose importance rises come back.
    pub recovery: Recovery,
    /// Queries a prompt chunk re-evaluates the MAW with: the MAW of every
    /// entry becomes its mean weight over the chunk's last `refresh_queries`
    /// queries (each over every token held, so those before the last also
    /// see the chunk's last few tokens). 1 is the chunk's last query alone;
    /// a chunk shorter than `refresh_queries` uses all its queries.
    pub refresh_queries: usize,
}

impl Default for HybridConfig {
    /// Window 1024 tokens, blocks of 64, 4 sinks, beta 1.0, alpha 0.9,
    /// mass-targeted selection of 90% of the estimated attention mass, at
    /// most half the CPU entries per head ([`Recovery::Mass`]). Measured
    /// (perplexity over 2048 tokens of *Persuasion* decoded token by token,
    /// window a quarter of the context, f16 KV): SmolLM2-135M +0.04% over
    /// full attention with 8.6% of the CPU entries, Qwen2.5-0.5B +0.02%
    /// with 19.3%, where the paper's rule costs several percent; and it
    /// follows a shift of the attention to needles scattered over the whole
    /// store, which the MAW rules and the top-32 block bounds lose. The KV
    /// storage type is the layer's type parameter, on both sides.
    fn default() -> Self {
        Self {
            window: 1024,
            block: 64,
            sinks: 4,
            beta: 1.0,
            beta_per_head: None,
            alpha: 0.9,
            recovery: Recovery::Mass(MassTarget {
                target: 0.9,
                max_share: 0.5,
            }),
            refresh_queries: 1,
        }
    }
}

impl HybridConfig {
    fn validate(&self, shape: &AttnShape) -> Result<(Beta, Alpha)> {
        if self.block == 0 {
            return Err(Error::Zero { what: "block" });
        }
        if self.window < self.block {
            return Err(Error::Capacity {
                what: "window smaller than one block",
                capacity: self.window,
                requested: self.block,
            });
        }
        if self.refresh_queries == 0 {
            return Err(Error::Zero {
                what: "refresh queries",
            });
        }
        if !self.block.is_power_of_two() {
            return Err(Error::Param {
                what: "block",
                value: self.block as f64,
                expected: "a power of two",
            });
        }
        match self.recovery {
            Recovery::Rescore { every: 0 } => {
                return Err(Error::Zero {
                    what: "rescore period",
                });
            }
            Recovery::BlockBounds { top: 0 } => {
                return Err(Error::Zero {
                    what: "block bounds top",
                });
            }
            Recovery::Mass(m) => {
                // The fields are public: checked as the constructor does.
                MassTarget::new(m.target, m.max_share)?;
            }
            _ => {}
        }
        let beta = match &self.beta_per_head {
            Some(b) => {
                check_len("beta_per_head", shape.kv_heads(), b.len())?;
                Beta::new(b.clone())?
            }
            None => Beta::uniform(shape.kv_heads(), self.beta)?,
        };
        Ok((beta, Alpha::new(self.alpha)?))
    }
}

/// What the last `forward` did and how long each part took.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    /// Tokens in the dense window.
    pub window_tokens: usize,
    /// Tokens in the CPU store.
    pub cpu_tokens: usize,
    /// CPU entries attended, summed over KV heads.
    pub selected: usize,
    /// Whether this step attended every CPU entry (a re-score step or a prompt chunk).
    pub full_cpu: bool,
    /// Time the step spent on the dense side: submitting its work plus
    /// waiting for (and copying out) its result; GPU time hidden behind the
    /// CPU side is not in it.
    pub dense: Duration,
    /// The submitting part of [`StepStats::dense`] (uploads and launches).
    pub dense_submit: Duration,
    /// The selection part of [`StepStats::sparse`] (MAW rule, block bounds).
    pub select: Duration,
    /// Time of the CPU side (selection and sparse attention).
    pub sparse: Duration,
    /// Time of the merge and the MAW updates.
    pub merge: Duration,
    /// [`Recovery::Mass`]: the estimated share of the attention mass the
    /// step attended, the mean over KV heads (`None` under the other rules
    /// and on steps that attend everything).
    pub mass_estimated: Option<f32>,
    /// [`Recovery::Mass`]: KV heads that took every CPU entry this step
    /// because the target needed more than the max share.
    pub dense_heads: usize,
    /// [`Recovery::Mass`]: CPU entries whose int8 estimate was read,
    /// summed over KV heads (the others were dropped by block bounds).
    pub estimated_entries: usize,
    /// Wall time of the whole step.
    pub total: Duration,
}

impl StepStats {
    /// Selected fraction of the CPU entries (0 when the store is empty).
    pub fn selected_fraction(&self, kv_heads: usize) -> f64 {
        if self.cpu_tokens == 0 {
            0.0
        } else {
            self.selected as f64 / (self.cpu_tokens * kv_heads) as f64
        }
    }
}

/// The per-layer parts every sequence shares: shape, configuration and
/// backends.
#[derive(Debug)]
pub(crate) struct Shared<D, S> {
    pub(crate) shape: AttnShape,
    pub(crate) cfg: HybridConfig,
    beta: Beta,
    alpha: Alpha,
    pub(crate) dense: D,
    pub(crate) sparse: S,
    pub(crate) cpu: CpuBackend,
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
    l: Shared<D, S>,
    seq: Seq<D, T, C>,
}

/// One sequence's cache (window and CPU store) and selection state.
pub(crate) struct Seq<D: DenseAttention, T: KvElem, C> {
    window: D::Window,
    /// MAW of the window's tokens, `[kv_heads][capacity]`, in the window's ring order.
    win_maw: Vec<f32>,
    win_head: usize,
    store: C,
    /// MAW of the CPU entries, per KV head.
    maw: Vec<HeadMaw>,
    /// Per KV head, per store block: elementwise min and max of its keys (`[2, d]`).
    bounds: Vec<Vec<T>>,
    sel: Selection,
    steps: usize,
    /// Union lse of the last decode step per query head (reference for block bounds).
    last_lse: Vec<f32>,
    /// The window's lse of the last decode step per query head (the mass selector's reference).
    last_win_lse: Vec<f32>,
    /// [`Recovery::Mass`]: an int8 copy of each KV head's CPU keys.
    int8: Vec<Int8Keys>,
    stats: StepStats,
    /// Per-KV-head scratch of the selection.
    heads: Vec<HeadScratch>,
    /// Reused weight buffers of the two sides, and the per-head factors to the union.
    gpu_w: Vec<f32>,
    cpu_w: Vec<f32>,
    to_union: Vec<f32>,
    evict_k: Vec<T>,
    evict_v: Vec<T>,
}

/// The MAW of one KV head's CPU entries, with each store block's maximum:
/// the selection skips the blocks whose maximum does not pass (an MAW scan
/// of every entry was about a third of the selection's time at 128k).
#[derive(Debug, Default, Clone)]
struct HeadMaw {
    values: Vec<f32>,
    /// Per store block, the maximum of its values (NaN ignored, as the MAW
    /// rule never passes NaN); recomputed whenever one of them changes.
    block_max: Vec<f32>,
}

impl HeadMaw {
    /// Recomputes the maxima of the blocks of `tokens`, given in ascending
    /// order (a block is recomputed once per run of its tokens, with one
    /// division per block, not per token).
    fn refresh(&mut self, block: usize, tokens: impl IntoIterator<Item = usize>) {
        let len = self.values.len();
        self.block_max
            .resize(len.div_ceil(block), f32::NEG_INFINITY);
        let mut done = 0..0;
        for j in tokens {
            if !done.contains(&j) {
                let b = j / block;
                done = b * block..((b + 1) * block).min(len);
                self.block_max[b] = max_ignoring_nan(&self.values[done.clone()]);
            }
        }
    }
}

/// The maximum of `v` ignoring NaN (-inf when empty), in 8 independent
/// lanes (a serial `max` chain is bound by its latency).
fn max_ignoring_nan(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.max(x);
        }
    }
    chunks
        .remainder()
        .iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// The first error of work spread over threads.
#[derive(Default)]
struct ErrSlot(std::sync::Mutex<Option<Error>>);

impl ErrSlot {
    /// Keeps `r`'s error if it is the first; true when `r` is `Ok`.
    fn keep(&self, r: Result<()>) -> bool {
        match r {
            Ok(()) => true,
            Err(e) => {
                self.0
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
                false
            }
        }
    }

    fn into_result(self) -> Result<()> {
        match self.0.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Scratch of one KV head's selection: its indices, block bounds, ranking.
#[derive(Debug, Default, Clone)]
struct HeadScratch {
    idx: Vec<u32>,
    ub: Vec<f32>,
    ranked: Vec<(f32, u32)>,
    admitted: Vec<bool>,
    mass: mass::Scratch,
    report: mass::HeadReport,
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
    /// [`Error::Zero`], [`Error::Param`], [`Error::Capacity`] for a bad
    /// config (block 0 or not a power of two, window smaller than a block,
    /// NaN or negative beta, alpha outside [0, 1]); [`Error::UnsupportedDType`]
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
    /// As [`HybridAttention::new`]; [`Error::ShapeMismatch`] for a store of
    /// other heads or head dim, [`Error::Capacity`] for a store that
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
    /// [`Error::Length`] when `q` is not `[q_heads, d]`; backend errors.
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
    /// [`Error::Length`] for lengths that do not fit, checked before
    /// anything changes; backend errors (tokens held before are never lost).
    pub fn append(&mut self, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        self.seq.append(&self.l, k, v, n)
    }

    /// Decode attention of one query (`q`: `[q_heads, d]`) over every token
    /// held: dense over the window, sparse over the selected CPU entries,
    /// merged exactly, MAW updated. Writes `out` (`[q_heads, d]`); before
    /// the first token, the empty attention (zeros), and nothing changes.
    /// Each call is a decode step: attending twice without an append decays
    /// the MAW twice and advances the [`Recovery::Rescore`] schedule.
    ///
    /// # Errors
    /// [`Error::Length`] for lengths that do not fit (checked first);
    /// backend errors.
    pub fn attend(&mut self, q: &[f32], out: &mut [f32]) -> Result<()> {
        self.seq.attend(&self.l, q, out)
    }

    /// Appends `n` tokens (token-major K and V) whose attention outputs are
    /// not needed, as for a context prefilled elsewhere, then re-evaluates
    /// every entry's MAW against `probe` (one query, `[q_heads, d]`).
    ///
    /// # Errors
    /// [`Error::Length`] for lengths that do not fit; backend errors.
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

impl<D: DenseAttention, T: KvElem, C: CpuStore<T>> std::fmt::Debug for Seq<D, T, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seq")
            .field("window_tokens", &self.window.len())
            .field("cpu_tokens", &self.store.tokens())
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

/// A decode step's CPU side, run while the dense side works.
pub(crate) struct CpuSide {
    part: Partial,
    /// Whether every CPU entry was attended (a re-score step).
    full: bool,
    select: Duration,
    time: Duration,
}

/// A decode step's dense side, submitted and not yet waited for.
pub(crate) struct Submitted<P> {
    pending: P,
    /// When the step began, and how long its submit took.
    t0: Instant,
    submit: Duration,
}

impl<D: DenseAttention, T: KvElem, C: CpuStore<T>> Seq<D, T, C> {
    /// An empty sequence: a new window on `l.dense`, over `store` (empty).
    pub(crate) fn new<S>(l: &Shared<D, S>, store: C) -> Result<Self> {
        let (shape, cfg) = (l.shape, &l.cfg);
        store.check_shape(&shape)?;
        if store.tokens() != 0 {
            return Err(Error::Capacity {
                what: "tokens of a new sequence's CPU store (must be empty)",
                capacity: 0,
                requested: store.tokens(),
            });
        }
        let window = l
            .dense
            .new_window(WindowSpec::new(shape, cfg.window, T::DTYPE)?)?;
        let hk = shape.kv_heads();
        Ok(Self {
            window,
            win_maw: vec![0.0; hk * cfg.window],
            win_head: 0,
            store,
            maw: vec![HeadMaw::default(); hk],
            bounds: vec![Vec::new(); hk],
            sel: Selection::new(),
            steps: 0,
            last_lse: vec![f32::NEG_INFINITY; shape.q_heads()],
            last_win_lse: vec![f32::NEG_INFINITY; shape.q_heads()],
            int8: if matches!(cfg.recovery, Recovery::Mass(_)) {
                vec![Int8Keys::new(shape.head_dim()); hk]
            } else {
                Vec::new()
            },
            stats: StepStats::default(),
            heads: Vec::new(),
            gpu_w: Vec::new(),
            cpu_w: Vec::new(),
            to_union: Vec::new(),
            evict_k: Vec::new(),
            evict_v: Vec::new(),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.store.tokens() + self.window.len()
    }

    pub(crate) fn stats(&self) -> &StepStats {
        &self.stats
    }

    pub(crate) fn cpu_tokens(&self) -> usize {
        self.store.tokens()
    }

    pub(crate) fn selection(&self) -> &Selection {
        &self.sel
    }

    pub(crate) fn window(&self) -> &D::Window {
        &self.window
    }

    fn maw_snapshot<S>(&self, l: &Shared<D, S>) -> Vec<Vec<f32>> {
        let cap = l.cfg.window;
        (0..l.shape.kv_heads())
            .map(|g| {
                let mut v = self.maw[g].values.clone();
                v.extend(
                    (0..self.window.len())
                        .map(|j| self.win_maw[g * cap + (self.win_head + j) % cap]),
                );
                v
            })
            .collect()
    }

    /// [`SequenceAttention::forward`] of this sequence.
    pub(crate) fn forward<S: SparseAttention>(
        &mut self,
        l: &Shared<D, S>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        crate::check_forward(&l.shape, q, k, v, n, out)?;
        match n {
            0 => Ok(()),
            1 => {
                let t0 = Instant::now();
                self.append(l, k, v, 1)?;
                self.attend_since(l, q, out, t0)
            }
            _ => self.prefill(l, q, k, v, n, out),
        }
    }

    /// Evicts one block (or what the window holds, if less) to the CPU store.
    fn evict_block<S>(&mut self, l: &Shared<D, S>) -> Result<()> {
        let n = l.cfg.block.min(self.window.len());
        let (hk, d, cap, bt) = (
            l.shape.kv_heads(),
            l.shape.head_dim(),
            l.cfg.window,
            l.cfg.block,
        );
        self.evict_k.resize(hk * n * d, T::default());
        self.evict_v.resize(hk * n * d, T::default());
        // The store's memory first: once the rows have left the window,
        // their push must not fail (they would be lost).
        self.store.reserve(n)?;
        l.dense
            .evict_oldest(&mut self.window, n, &mut self.evict_k, &mut self.evict_v)?;
        self.store
            .push_head_major(n, &self.evict_k, &self.evict_v)?;
        for g in 0..hk {
            let base = self.store.tokens() - n;
            let maw = &mut self.maw[g];
            maw.values
                .extend((0..n).map(|i| self.win_maw[g * cap + (self.win_head + i) % cap]));
            maw.refresh(bt, base..base + n);
            // Key bounds of the new rows, folded into their store blocks.
            for i in 0..n {
                let j = base + i;
                let b = j / bt;
                let bnd = &mut self.bounds[g];
                if bnd.len() < (b + 1) * 2 * d {
                    bnd.extend(std::iter::repeat_n(T::from_f32(f32::INFINITY), d));
                    bnd.extend(std::iter::repeat_n(T::from_f32(f32::NEG_INFINITY), d));
                }
                let row = &self.evict_k[(g * n + i) * d..(g * n + i + 1) * d];
                let (lo, hi) = bnd[b * 2 * d..(b + 1) * 2 * d].split_at_mut(d);
                // Stored keys are values of T: their min and max are too.
                for ((l, h), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(row) {
                    let x = x.to_f32();
                    *l = T::from_f32(l.to_f32().min(x));
                    *h = T::from_f32(h.to_f32().max(x));
                }
            }
        }
        // The mass selector's int8 copy (empty under the other rules).
        let mut row = vec![0.0f32; d];
        for (g, keys) in self.int8.iter_mut().enumerate() {
            for i in 0..n {
                let k = &self.evict_k[(g * n + i) * d..(g * n + i + 1) * d];
                for (r, x) in row.iter_mut().zip(k) {
                    *r = x.to_f32();
                }
                keys.push(&row);
            }
        }
        self.win_head = (self.win_head + n) % cap;
        Ok(())
    }

    /// Appends `n` tokens to the window (space must be free), MAW starting at `init`.
    fn push_window<S>(
        &mut self,
        l: &Shared<D, S>,
        k: &[f32],
        v: &[f32],
        n: usize,
        init: f32,
    ) -> Result<()> {
        let cap = l.cfg.window;
        let at = (self.win_head + self.window.len()) % cap;
        l.dense.append(&mut self.window, n, k, v)?;
        for g in 0..l.shape.kv_heads() {
            for i in 0..n {
                self.win_maw[g * cap + (at + i) % cap] = init;
            }
        }
        Ok(())
    }

    /// Appends `n` tokens in pieces that fit the window, evicting blocks as
    /// needed; each piece's MAW starts at `1 / n_gpu` after it.
    pub(crate) fn append<S>(
        &mut self,
        l: &Shared<D, S>,
        k: &[f32],
        v: &[f32],
        n: usize,
    ) -> Result<()> {
        let kl = l.shape.kv_token_len();
        check_len_of("k", &[n, kl], k.len())?;
        check_len_of("v", &[n, kl], v.len())?;
        let mut done = 0;
        while done < n {
            if self.window.free() == 0 {
                self.evict_block(l)?;
            }
            let m = (n - done).min(self.window.free());
            let init = 1.0 / (self.window.len() + m) as f32;
            self.push_window(
                l,
                &k[done * kl..(done + m) * kl],
                &v[done * kl..(done + m) * kl],
                m,
                init,
            )?;
            done += m;
        }
        Ok(())
    }

    /// Decode attention of one query over every token held, lengths
    /// checked first: submit, CPU side, wait and merge.
    pub(crate) fn attend<S: SparseAttention>(
        &mut self,
        l: &Shared<D, S>,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        check_len("q", l.shape.q_len(), q.len())?;
        check_len("out", l.shape.q_len(), out.len())?;
        self.attend_since(l, q, out, Instant::now())
    }

    /// [`Seq::attend`] as part of a step that began at `t0` (its
    /// [`StepStats::total`] counts from there). Before the first token: the
    /// empty attention, and nothing else changes.
    pub(crate) fn attend_since<S: SparseAttention>(
        &mut self,
        l: &Shared<D, S>,
        q: &[f32],
        out: &mut [f32],
        t0: Instant,
    ) -> Result<()> {
        if self.len() == 0 {
            out.fill(0.0);
            return Ok(());
        }
        let sub = self.submit(l, q, t0)?;
        let cpu = self.cpu_side(l, q)?;
        self.finish(l, sub, cpu, out)
    }

    /// Step 1 of a decode (of a step that began at `t0`): submits the dense
    /// side (it runs while the CPU side does). When the window is full, the next token will evict its
    /// oldest block: the read-back of that block is started too, so that on
    /// a GPU it runs beside this step's CPU side instead of stalling the
    /// next step ([`hgca_kernels::WindowBackend::prefetch_oldest`]).
    pub(crate) fn submit<S>(
        &mut self,
        l: &Shared<D, S>,
        q: &[f32],
        t0: Instant,
    ) -> Result<Submitted<D::Pending>> {
        let ts = Instant::now();
        let pending = l.dense.submit_decode(&self.window, q, true)?;
        let submit = ts.elapsed();
        if self.window.free() == 0 {
            let n = l.cfg.block.min(self.window.len());
            // Only a head start: if it fails, the eviction copies the rows
            // itself (and meets the error then, if it lasts).
            let _ = l.dense.prefetch_oldest(&mut self.window, n);
        }
        Ok(Submitted {
            pending,
            t0,
            submit,
        })
    }

    /// Step 2 of a decode: the CPU side (selection and sparse attention, or
    /// every entry on a re-score step).
    pub(crate) fn cpu_side<S: SparseAttention>(
        &mut self,
        l: &Shared<D, S>,
        q: &[f32],
    ) -> Result<CpuSide> {
        let s = l.shape;
        let ts = Instant::now();
        let full = matches!(l.cfg.recovery, Recovery::Rescore { every } if self.steps % every == every - 1);
        let mut part = Partial::empty(PartialLayout::decode(&s));
        // The weight buffer of the last step is reused and not cleared: a
        // fresh multi-MiB vector per step costs its page faults and a fill,
        // and the backends write every weight (the conformance suites check
        // that on NaN-poisoned buffers).
        let mut cpu_w = std::mem::take(&mut self.cpu_w);
        let mut select = Duration::ZERO;
        let r = if full {
            self.sel = Selection::all(s.kv_heads(), self.store.tokens());
            cpu_w.resize(s.q_heads() * self.store.tokens(), 0.0);
            l.cpu
                .dense_decode(&s, q, &self.store, part.as_mut(), Some(&mut cpu_w))
        } else {
            let tsel = Instant::now();
            self.select(l, q).and_then(|()| {
                select = tsel.elapsed();
                cpu_w.resize(s.group() * self.sel.total(), 0.0);
                l.sparse.sparse_decode(
                    &s,
                    q,
                    &self.store,
                    &self.sel,
                    part.as_mut(),
                    Some(&mut cpu_w),
                )
            })
        };
        self.cpu_w = cpu_w;
        r?;
        Ok(CpuSide {
            part,
            full,
            select,
            time: ts.elapsed(),
        })
    }

    /// Step 3 of a decode: waits for the dense side, merges exactly into
    /// `out`, updates the MAW.
    pub(crate) fn finish<S>(
        &mut self,
        l: &Shared<D, S>,
        sub: Submitted<D::Pending>,
        cpu: CpuSide,
        out: &mut [f32],
    ) -> Result<()> {
        let s = l.shape;
        let n_win = self.window.len();
        let tw = Instant::now();
        let mut gpu_part = Partial::empty(PartialLayout::decode(&s));
        let mut gpu_w = std::mem::take(&mut self.gpu_w);
        gpu_w.resize(s.q_heads() * n_win, 0.0);
        let r = l
            .dense
            .wait_weights(sub.pending, gpu_part.as_mut(), &mut gpu_w);
        let waited = tw.elapsed();
        let tm = Instant::now();
        let cpu_w = std::mem::take(&mut self.cpu_w);
        let r = r.and_then(|()| {
            let mut merged = gpu_part.clone();
            merge_into(merged.as_mut(), cpu.part.as_ref())?;
            out.copy_from_slice(merged.out());
            self.last_lse.copy_from_slice(merged.lse());
            self.last_win_lse.copy_from_slice(gpu_part.lse());
            // MAW from weights normalised over the union, mean over each
            // query group. A re-score step observes every entry exactly:
            // like the re-evaluation on append, it resets the MAW to the
            // current weights.
            let a = if cpu.full { 0.0 } else { l.alpha.get() };
            self.update_maw(l, a, (&gpu_part, &gpu_w), (&cpu.part, &cpu_w), merged.lse())
        });
        (self.gpu_w, self.cpu_w) = (gpu_w, cpu_w);
        r?;
        self.steps += 1;
        self.stats = StepStats {
            window_tokens: n_win,
            cpu_tokens: self.store.tokens(),
            selected: self.sel.total(),
            full_cpu: cpu.full,
            dense: sub.submit + waited,
            dense_submit: sub.submit,
            select: cpu.select,
            sparse: cpu.time,
            merge: tm.elapsed(),
            total: sub.t0.elapsed(),
            mass_estimated: (matches!(l.cfg.recovery, Recovery::Mass(_)) && !cpu.full).then(|| {
                let hs = &self.heads;
                hs.iter().map(|h| h.report.estimated).sum::<f32>() / hs.len().max(1) as f32
            }),
            dense_heads: self.heads.iter().filter(|h| h.report.dense).count(),
            estimated_entries: self.heads.iter().map(|h| h.report.estimated_entries).sum(),
        };
        Ok(())
    }

    /// The selection of this decode step: the MAW rule, the sinks, and the
    /// recovery rule's admissions.
    fn select<S>(&mut self, l: &Shared<D, S>, q: &[f32]) -> Result<()> {
        let n_gpu = self.window.len();
        let n = self.store.tokens();
        let (hk, d, group) = (l.shape.kv_heads(), l.shape.head_dim(), l.shape.group());
        let bt = l.cfg.block;
        let recovery = l.cfg.recovery;
        let sinks = l.cfg.sinks.min(n);
        let scale = l.shape.scale();
        let mut heads = std::mem::take(&mut self.heads);
        heads.resize_with(hk, HeadScratch::default);
        let (cpu, bounds, maw, beta, last_lse) =
            (&l.cpu, &self.bounds, &self.maw, &l.beta, &self.last_lse);
        let (int8, last_win_lse) = (&self.int8, &self.last_win_lse);
        // The KV heads select independently: on the CPU backend's threads
        // (a serial scan of every entry's MAW was most of the CPU side's
        // time at 128k).
        let errors = ErrSlot::default();
        cpu.for_chunks(&mut heads, 1, |g, h| {
            let h = &mut h[0];
            h.idx.clear();
            h.admitted.clear();
            h.report = mass::HeadReport::default();
            if let Recovery::Mass(target) = recovery {
                let rows = g * group..(g + 1) * group;
                let head = mass::Head {
                    q: &q[g * group * d..(g + 1) * group * d],
                    scale,
                    lse_ref: &last_lse[rows.clone()],
                    win_lse: &last_win_lse[rows],
                    bounds: &bounds[g],
                    keys: &int8[g],
                    block: bt,
                    sinks,
                };
                match mass::select(cpu, &head, target, &mut h.mass, &mut h.idx) {
                    Ok(r) => h.report = r,
                    Err(e) => {
                        errors.keep(Err(e));
                    }
                }
                return;
            }
            if let Recovery::BlockBounds { top } = recovery {
                // Upper bound of each block's scores, minus the head's last
                // lse (a log-weight bound), max over the group's heads.
                let nb = n.div_ceil(bt);
                let qg = &q[g * group * d..(g + 1) * group * d];
                h.ub.resize(nb * group, 0.0);
                if !errors.keep(cpu.block_upper_bounds(
                    qg,
                    group,
                    d,
                    &bounds[g][..nb * 2 * d],
                    &mut h.ub,
                )) {
                    return;
                }
                let ub = &h.ub;
                h.ranked.clear();
                h.ranked.extend((0..nb).map(|b| {
                    let best = (0..group)
                        .map(|i| ub[b * group + i] * scale - last_lse[g * group + i])
                        .fold(f32::NEG_INFINITY, f32::max);
                    (best, b as u32)
                }));
                let top = top.min(nb);
                if top > 0 && top < nb {
                    h.ranked
                        .select_nth_unstable_by(top - 1, |a, b| b.0.total_cmp(&a.0));
                }
                h.admitted.resize(nb, false);
                for &(_, b) in &h.ranked[..top] {
                    h.admitted[b as usize] = true;
                }
            }
            let t = beta.threshold(g, n_gpu);
            let HeadMaw {
                values: maw,
                block_max,
            } = &maw[g];
            h.idx.extend(0..sinks as u32);
            // Admitted blocks whole; the MAW rule over each run of the others.
            let mut j0 = sinks;
            while j0 < n {
                let admitted = |j: usize| h.admitted.get(j / bt).copied().unwrap_or(false);
                let take = admitted(j0);
                let mut end = ((j0 / bt + 1) * bt).min(n);
                while end < n && admitted(end) == take {
                    end = ((end / bt + 1) * bt).min(n);
                }
                if take {
                    h.idx.extend(j0 as u32..end as u32);
                } else {
                    // Only blocks whose maximum passes hold entries that do.
                    let mut a = j0;
                    while a < end {
                        let b_end = ((a / bt + 1) * bt).min(end);
                        if block_max[a / bt] > t {
                            cpu.indices_above(&maw[a..b_end], t, a as u32, &mut h.idx);
                        } else {
                            debug_assert!(
                                !maw[a..b_end].iter().any(|&x| x > t),
                                "a skipped block holds an entry that passes"
                            );
                        }
                        a = b_end;
                    }
                }
                j0 = end;
            }
        });
        if let Err(e) = errors.into_result() {
            self.heads = heads;
            return Err(e);
        }
        self.sel.clear();
        for h in &heads {
            self.sel.push_head(h.idx.iter().copied());
        }
        self.heads = heads;
        Ok(())
    }

    /// The MAW update with decay `a` (the step's alpha, or 0 to reset to
    /// the current weights), from each side's partial and weights and the
    /// union's lse.
    fn update_maw<S>(
        &mut self,
        l: &Shared<D, S>,
        a: f32,
        (gpu, gpu_w): (&Partial, &[f32]),
        (cpu, cpu_w): (&Partial, &[f32]),
        lse: &[f32],
    ) -> Result<()> {
        let s = l.shape;
        let (group, cap) = (s.group(), l.cfg.window);
        let n_win = self.window.len();
        // The factors c rescaling each head's weights to the union, with
        // (1 - a) and the group mean folded in: window heads, then CPU heads.
        let qh = s.q_heads();
        let f = &mut self.to_union;
        f.clear();
        for side_lse in [gpu.lse(), cpu.lse()] {
            f.extend(side_lse.iter().zip(lse).map(|(&c, &u)| {
                if c == f32::NEG_INFINITY {
                    0.0
                } else {
                    (1.0 - a) * (c - u).exp() / group as f32
                }
            }));
        }
        let (f, cpu_b, errors) = (&*f, &l.cpu, ErrSlot::default());
        // Window entries: one pass per KV head, on the backend's threads.
        // The ring holds logical token j at slot (win_head + j) % cap.
        let head = self.win_head;
        l.cpu.for_chunks(&mut self.win_maw, cap, |g, ring| {
            let c = &f[g * group..(g + 1) * group];
            let w = &gpu_w[g * group * n_win..(g + 1) * group * n_win];
            let first = (cap - head).min(n_win);
            let (wrapped, tail) = ring.split_at_mut(head);
            errors.keep(cpu_b.decay_accumulate(&mut tail[..first], None, a, w, n_win, c));
            errors.keep(cpu_b.decay_accumulate(
                &mut wrapped[..n_win - first],
                None,
                a,
                &w[first..],
                n_win,
                c,
            ));
        });
        // CPU entries that were attended (their weights are gathered).
        let (sel, block) = (&self.sel, l.cfg.block);
        l.cpu.for_chunks(&mut self.maw, 1, |g, maw| {
            let maw = &mut maw[0];
            let c = &f[qh + g * group..qh + (g + 1) * group];
            let idx = sel.head(g);
            let w = &cpu_w[group * sel.offset(g)..][..group * idx.len()];
            // Refreshed only when the update took (its indices are then in range).
            if errors.keep(cpu_b.decay_accumulate(&mut maw.values, Some(idx), a, w, idx.len(), c)) {
                maw.refresh(block, idx.iter().map(|&j| j as usize));
            }
        });
        errors.into_result()
    }

    /// Re-evaluates the MAW of every entry (window and CPU) from the exact
    /// weights of the queries `qs` (`[m, q_heads, d]`, each over every token
    /// held): the MAW becomes the mean weight over them, the paper's
    /// re-evaluation on append. The running mean is the MAW update with
    /// decay `i / (i + 1)` for the `i`-th query (0 for the first: the old
    /// MAW is forgotten).
    pub(crate) fn refresh_maw<S>(&mut self, l: &Shared<D, S>, qs: &[f32]) -> Result<()> {
        let s = l.shape;
        let layout = PartialLayout::decode(&s);
        let m = qs.len() / s.q_len();
        let mut cpu_w = vec![0.0; s.q_heads() * self.store.tokens()];
        let mut gpu_w = vec![0.0; s.q_heads() * self.window.len()];
        for (i, q) in qs.chunks_exact(s.q_len()).enumerate() {
            let pending = l.dense.submit_decode(&self.window, q, true)?;
            let mut cpu_part = Partial::empty(layout);
            l.cpu
                .dense_decode(&s, q, &self.store, cpu_part.as_mut(), Some(&mut cpu_w))?;
            let mut gpu_part = Partial::empty(layout);
            l.dense
                .wait_weights(pending, gpu_part.as_mut(), &mut gpu_w)?;
            let mut merged = gpu_part.clone();
            merge_into(merged.as_mut(), cpu_part.as_ref())?;
            if i + 1 == m {
                self.last_lse.copy_from_slice(merged.lse());
                self.last_win_lse.copy_from_slice(gpu_part.lse());
            }
            if i == 0 {
                self.sel = Selection::all(s.kv_heads(), self.store.tokens());
            }
            self.update_maw(
                l,
                i as f32 / (i + 1) as f32,
                (&gpu_part, &gpu_w),
                (&cpu_part, &cpu_w),
                merged.lse(),
            )?;
        }
        Ok(())
    }

    /// A prompt chunk: pieces of at most a window; each piece's queries
    /// attend densely to the window (causal) and to the whole CPU store (all
    /// older), merged; then the MAW of every entry is re-evaluated from the
    /// chunk's last queries (the paper's re-evaluation on append, see
    /// [`HybridConfig::refresh_queries`]).
    fn prefill<S>(
        &mut self,
        l: &Shared<D, S>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let t0 = Instant::now();
        let s = l.shape;
        let (ql, kl) = (s.q_len(), s.kv_token_len());
        let piece_max = l.cfg.window;
        let (mut dense_t, mut submit_t, mut cpu_t) =
            (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut done = 0;
        while done < n {
            let m = (n - done).min(piece_max);
            while self.window.free() < m {
                self.evict_block(l)?;
            }
            let p0 = (self.store.tokens() + self.window.len()) as u64;
            self.push_window(
                l,
                &k[done * kl..(done + m) * kl],
                &v[done * kl..(done + m) * kl],
                m,
                0.0,
            )?;
            let qp = &q[done * ql..(done + m) * ql];
            let layout = PartialLayout::append(&s, m);
            let td = Instant::now();
            let pending = l.dense.submit_append(&self.window, qp, m, p0)?;
            submit_t += td.elapsed();
            dense_t += td.elapsed();
            let tc = Instant::now();
            let mut cpu_part = Partial::empty(layout);
            let all = self.store.tokens();
            l.cpu
                .dense_append(&s, qp, m, all, &self.store, cpu_part.as_mut())?;
            cpu_t += tc.elapsed();
            let tw = Instant::now();
            let mut part = Partial::empty(layout);
            l.dense.wait(pending, part.as_mut(), None)?;
            dense_t += tw.elapsed();
            merge_into(part.as_mut(), cpu_part.as_ref())?;
            out[done * ql..(done + m) * ql].copy_from_slice(part.out());
            done += m;
        }
        let m = l.cfg.refresh_queries.min(n);
        self.refresh_maw(l, &q[(n - m) * ql..n * ql])?;
        self.stats = StepStats {
            window_tokens: self.window.len(),
            cpu_tokens: self.store.tokens(),
            selected: self.sel.total(),
            full_cpu: true,
            dense: dense_t,
            dense_submit: submit_t,
            select: Duration::ZERO,
            sparse: cpu_t,
            merge: Duration::ZERO,
            total: t0.elapsed(),
            ..StepStats::default()
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{HeadMaw, max_ignoring_nan};

    #[test]
    fn max_ignoring_nan_is_the_max_of_the_numbers() {
        assert_eq!(max_ignoring_nan(&[]), f32::NEG_INFINITY);
        assert_eq!(max_ignoring_nan(&[f32::NAN; 11]), f32::NEG_INFINITY);
        // Every length around the 8 lanes, the maximum at every place,
        // a NaN elsewhere.
        for len in 2..40 {
            for at in 0..len {
                let mut v: Vec<f32> = (0..len).map(|i| -(i as f32)).collect();
                v[at] = 7.0;
                v[(at + 1) % len] = f32::NAN;
                assert_eq!(max_ignoring_nan(&v), 7.0, "len {len} at {at}");
            }
        }
    }

    #[test]
    fn block_maxima_follow_their_values() {
        let mut m = HeadMaw::default();
        m.values.extend((0..10).map(|i| i as f32));
        m.refresh(4, 0..10);
        assert_eq!(m.block_max, [3.0, 7.0, 9.0]);
        // A value drops (the MAW decays): its block's maximum drops with it.
        m.values[7] = -1.0;
        m.values[9] = f32::NAN;
        m.refresh(4, [7, 9]);
        assert_eq!(m.block_max, [3.0, 6.0, 8.0]);
        // New entries open a block.
        m.values.push(0.5);
        m.refresh(4, [10]);
        assert_eq!(m.block_max, [3.0, 6.0, 8.0]);
        m.values.extend([0.25, 2.0]);
        m.refresh(4, 11..13);
        assert_eq!(m.block_max, [3.0, 6.0, 8.0, 2.0]);
    }
}
