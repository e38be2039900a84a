//! The CPU backend: its builder (ISA, parallelism, the caller's
//! [`Executor`]), validation at the boundary and the public calls (dense
//! decode and append, sparse decode by index list or fused threshold,
//! merge). The task split is in `plan.rs`, batched decode in `batch.rs`,
//! the path of one call down to the SIMD kernel in `kernel.rs`.

use std::sync::{Arc, Mutex};

use hgca_kernels::{
    AttnShape, Error, KvSource, MergeBackend, PartialLayout, PartialMut, PartialRef, Result,
    Selection, SparseAttention, check_len, check_len_of,
};

use crate::isa::{Isa, IsaKind, SimdElem};
use crate::kernel::{MAX_HEADS, exp_shifted};
use crate::plan::Spec;
use crate::prefill;

/// Parallelism of a CPU call (faer's `Par`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Par {
    /// The calling thread only.
    Seq,
    /// A rayon pool of this many threads (0: rayon's global pool).
    Rayon(usize),
}

impl Par {
    /// The parallelism of a thread count as C and Python callers give it:
    /// 1 is the calling thread ([`Par::Seq`]), 0 rayon's global pool, `n`
    /// a pool of `n` threads.
    pub fn from_threads(threads: usize) -> Par {
        match threads {
            1 => Par::Seq,
            n => Par::Rayon(n),
        }
    }
}

/// Threads a caller owns, on which a [`CpuBackend`] can run its parallel
/// work instead of rayon's ([`CpuBackend::with_executor`]): an inference
/// engine's own pool, so that hgca's attention and the engine's matmuls
/// share the same workers and no two pools compete for the cores.
pub trait Executor: Send + Sync + std::fmt::Debug {
    /// Threads that run the calls of [`Executor::run`] (the calling thread
    /// included); the backend splits its work for this many.
    fn threads(&self) -> usize;
    /// Calls `f(i)` exactly once for every `i` in `0..n`, on any of its
    /// threads (the calling one included), and returns when every call
    /// has returned. A panic in `f` may propagate to the caller.
    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync));
}

/// The CPU backend: SIMD kernels on the ISA detected once (or forced), threaded with rayon.
///
/// ```
/// use hgca_cpu::CpuBackend;
/// use hgca_kernels::{AttnShape, KvSlices, Partial, PartialLayout, Selection, SparseAttention};
/// let shape = AttnShape::new(4, 2, 8)?;
/// let tokens = 10;
/// let k = vec![0.5f32; 2 * tokens * 8];
/// let v: Vec<f32> = (0..2 * tokens * 8).map(|i| i as f32).collect();
/// let kv = KvSlices::new(2, 8, tokens, &k, &v)?;
/// let sel = Selection::from_heads(&[vec![1u32, 4], vec![9]]);
/// let cpu = CpuBackend::new();
/// let mut out = Partial::empty(PartialLayout::decode(&shape));
/// cpu.sparse_decode(&shape, &[1.0; 32], &kv, &sel, out.as_mut(), None)?;
/// // equal scores: head 0 averages the values of tokens 1 and 4 of KV head 0
/// assert_eq!(out.out()[0], (8.0 + 32.0) / 2.0);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct CpuBackend {
    pub(crate) isa: Isa,
    pub(crate) par: Par,
    pool: Option<Arc<rayon::ThreadPool>>,
    /// The caller's threads, when given ([`CpuBackend::with_executor`]).
    exec: Option<Arc<dyn Executor>>,
    /// Reused buffer of the window weights a dense submit produces.
    pub(crate) wbuf: Arc<Mutex<Vec<f32>>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// The best ISA of this machine, rayon's global pool.
    pub fn new() -> Self {
        Self {
            isa: Isa::detect(),
            par: Par::Rayon(0),
            pool: None,
            exec: None,
            wbuf: Arc::default(),
        }
    }

    /// Forces an ISA (for tests and benches).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when this CPU lacks it.
    pub fn with_isa(mut self, kind: IsaKind) -> Result<Self> {
        self.isa = Isa::of_kind(kind)?;
        Ok(self)
    }

    /// Sets the parallelism; `Par::Rayon(n)` with `n > 0` builds a pool of `n` threads.
    ///
    /// # Errors
    /// [`Error::Backend`] when rayon cannot start the threads.
    pub fn with_par(mut self, par: Par) -> Result<Self> {
        self.pool = match par {
            Par::Rayon(n) if n > 0 => Some(Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .map_err(|e| Error::backend_from("cpu", "starting the rayon pool", e))?,
            )),
            _ => None,
        };
        self.par = par;
        self.exec = None;
        Ok(self)
    }

    /// Runs this backend's parallel work on the caller's threads
    /// (`exec`) instead of rayon: an engine whose own pool spins between
    /// its operations (ggml's, candle's quantised matmuls) keeps its cores
    /// busy while hgca's attention runs, so rayon's threads would have to
    /// fight it for them. Replaces the parallelism of [`CpuBackend::with_par`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use hgca_cpu::{CpuBackend, Executor};
    /// /// Two "threads": the calls run in turn on the calling thread.
    /// #[derive(Debug)]
    /// struct Inline;
    /// impl Executor for Inline {
    ///     fn threads(&self) -> usize { 2 }
    ///     fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) { (0..n).for_each(f) }
    /// }
    /// let cpu = CpuBackend::new().with_executor(Arc::new(Inline));
    /// assert_eq!(cpu.threads(), 2);
    /// let mut v = vec![0u32; 6];
    /// cpu.for_chunks(&mut v, 2, |i, c| c.fill(i as u32));
    /// assert_eq!(v, [0, 0, 1, 1, 2, 2]);
    /// ```
    #[must_use]
    pub fn with_executor(mut self, exec: Arc<dyn Executor>) -> Self {
        self.par = Par::Rayon(0);
        self.pool = None;
        self.exec = Some(exec);
        self
    }

    /// Runs `f(i, &mut items[i])` for every item: in order on the calling
    /// thread with [`Par::Seq`], else on the executor or rayon pool.
    pub(crate) fn for_each_item<T: Send>(&self, items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
        if matches!(self.par, Par::Seq) || items.len() <= 1 {
            items.iter_mut().enumerate().for_each(|(i, t)| f(i, t));
            return;
        }
        if let Some(exec) = &self.exec {
            // Each item is taken by exactly one call; the locks are never contended.
            let cells: Vec<Mutex<&mut T>> = items.iter_mut().map(Mutex::new).collect();
            exec.run(cells.len(), &|i| {
                let mut t = cells[i].lock().unwrap_or_else(|e| e.into_inner());
                f(i, &mut t)
            });
            return;
        }
        use rayon::prelude::*;
        let mut go = || items.par_iter_mut().enumerate().for_each(|(i, t)| f(i, t));
        match &self.pool {
            Some(p) => p.install(go),
            None => go(),
        }
    }

    /// The ISA in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The parallelism in use.
    pub fn par(&self) -> Par {
        self.par
    }

    /// Threads a call uses.
    pub fn threads(&self) -> usize {
        match (&self.par, &self.pool) {
            (Par::Seq, _) => 1,
            _ if self.exec.is_some() => self.exec.as_ref().map_or(1, |e| e.threads().max(1)),
            (_, Some(p)) => p.current_num_threads(),
            (_, None) => rayon::current_num_threads(),
        }
    }

    /// Runs `f(i, chunk)` on the `chunk`-long pieces of `data` (the last may
    /// be shorter), on this backend's threads (in order on one thread with
    /// [`Par::Seq`]). For callers' own per-head work beside the kernels,
    /// e.g. the MAW updates of the hybrid layer.
    ///
    /// ```
    /// use hgca_cpu::CpuBackend;
    /// let mut v = vec![1.0f32; 10];
    /// CpuBackend::new().for_chunks(&mut v, 4, |i, c| c.iter_mut().for_each(|x| *x += i as f32));
    /// assert_eq!(v, [1., 1., 1., 1., 2., 2., 2., 2., 3., 3.]);
    /// ```
    pub fn for_chunks<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let chunk = chunk.max(1);
        let mut parts: Vec<&mut [T]> = data.chunks_mut(chunk).collect();
        self.for_each_item(&mut parts, |i, c| f(i, c));
    }

    /// `x[i] = exp(x[i] - shift)` in place, vectorised (relative error
    /// about 2e-7), for `x[i] <= shift` (softmax weights against their
    /// max); `-inf` gives 0. Larger inputs give unspecified values.
    ///
    /// ```
    /// let mut x = [0.0f32, -1.0, f32::NEG_INFINITY];
    /// hgca_cpu::CpuBackend::new().exp_shifted(&mut x, 0.0);
    /// assert!((x[1] - (-1.0f32).exp()).abs() < 1e-6 && x[0] == 1.0 && x[2] == 0.0);
    /// ```
    pub fn exp_shifted(&self, x: &mut [f32], shift: f32) {
        exp_shifted(self.isa, x, shift);
    }

    /// Dense decode attention of `q [q_heads, d]` over every token of `kv`.
    /// `weights`, if given, receives `[q_heads, tokens]`.
    ///
    /// # Errors
    /// [`Error::Length`] / [`Error::ShapeMismatch`] when the inputs do not fit `shape`.
    pub fn dense_decode<T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        kv: &K,
        out: PartialMut<'_>,
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        check_common(shape, q, 1, kv, &out)?;
        let n = kv.tokens();
        if let Some(w) = &weights {
            check_len_of("weights", &[shape.q_heads(), n], w.len())?;
        }
        let group = shape.group();
        self.run_whole(
            shape,
            q,
            1,
            |_| kv,
            |_, _| Spec::Range(0, n),
            |_, g| g * group * n,
            out,
            weights,
            None,
        );
        Ok(())
    }

    /// Causal append (prefill) attention: `n_q` queries `[n_q, q_heads, d]`;
    /// query `i` sees tokens `0 .. min(visible0 + i, tokens)` of `kv` (for a
    /// chunk whose own K/V are the last `n_q` tokens, `visible0 = tokens - n_q + 1`).
    ///
    /// # Errors
    /// [`Error::Length`] / [`Error::ShapeMismatch`] when the inputs do not fit `shape`.
    pub fn dense_append<T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        n_q: usize,
        visible0: usize,
        kv: &K,
        out: PartialMut<'_>,
    ) -> Result<()> {
        let n = kv.tokens();
        self.dense_append_with(
            shape,
            q,
            n_q,
            |t| visible0.saturating_add(t).min(n),
            kv,
            out,
        )
    }

    /// Causal append over a sliding window (the local layers of Gemma 3 and
    /// the like): as [`CpuBackend::dense_append`], but query `i` sees only
    /// the last `window` of its tokens, `v - window .. v` for
    /// `v = min(visible0 + i, tokens)` (from 0 when `v < window`). A chunk of many queries
    /// takes the tiled prefill kernel, each tile walking only the keys its
    /// queries' windows cover.
    ///
    /// # Errors
    /// [`Error::Zero`] for a window of 0 tokens; [`Error::Length`] /
    /// [`Error::ShapeMismatch`] when the inputs do not fit `shape`.
    ///
    /// ```
    /// use hgca_cpu::CpuBackend;
    /// use hgca_kernels::{AttnShape, KvSlices, Partial, PartialLayout};
    /// let shape = AttnShape::new(1, 1, 1)?;
    /// // Three tokens with equal scores (q = 0): each query averages the
    /// // values of its last two tokens.
    /// let (k, v) = ([1.0f32; 3], [1.0f32, 3.0, 5.0]);
    /// let kv = KvSlices::new(1, 1, 3, &k, &v)?;
    /// let mut out = Partial::empty(PartialLayout::append(&shape, 3));
    /// CpuBackend::new().dense_append_window(&shape, &[0.0; 3], 3, 1, 2, &kv, out.as_mut())?;
    /// assert_eq!(out.out(), &[1.0, 2.0, 4.0]);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn dense_append_window<T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        n_q: usize,
        visible0: usize,
        window: usize,
        kv: &K,
        out: PartialMut<'_>,
    ) -> Result<()> {
        if window == 0 {
            return Err(Error::Zero {
                what: "sliding window",
            });
        }
        let n = kv.tokens();
        let visible = move |t: usize| visible0.saturating_add(t).min(n);
        self.dense_append_band(
            shape,
            q,
            n_q,
            move |t| visible(t).saturating_sub(window),
            visible,
            kv,
            out,
        )
    }

    /// Causal append where query `t` sees tokens `0..visible(t)` (`<= tokens`).
    pub(crate) fn dense_append_with<T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        n_q: usize,
        visible: impl Fn(usize) -> usize + Sync,
        kv: &K,
        out: PartialMut<'_>,
    ) -> Result<()> {
        self.dense_append_band(shape, q, n_q, |_| 0, visible, kv, out)
    }

    /// Append where query `t` sees tokens `first(t)..visible(t)` (both
    /// non-decreasing in `t`; clamped here to `first(t) <= visible(t) <=
    /// tokens`, as the kernels take them).
    #[allow(clippy::too_many_arguments)]
    fn dense_append_band<T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        n_q: usize,
        first: impl Fn(usize) -> usize + Sync,
        visible: impl Fn(usize) -> usize + Sync,
        kv: &K,
        mut out: PartialMut<'_>,
    ) -> Result<()> {
        check_common(shape, q, n_q, kv, &out)?;
        let n = kv.tokens();
        let visible = |t: usize| visible(t).min(n);
        let first = |t: usize| first(t).min(visible(t));
        if n_q >= prefill::MIN_QUERIES {
            // Many queries: the tiled kernel (query rows x key tiles).
            let scale = shape.scale();
            let qs: Vec<f32> = q.iter().map(|&x| x * scale).collect();
            let (o, l) = out.parts_mut();
            prefill::append_tiled(self, shape, &qs, n_q, &first, &visible, kv, o, l);
            return Ok(());
        }
        self.run_whole(
            shape,
            q,
            n_q,
            |_| kv,
            |t, _| Spec::Range(first(t), visible(t)),
            |_, _| 0,
            out,
            None,
            None,
        );
        Ok(())
    }

    /// Sparse decode that selects while it scans: KV head `g` attends to
    /// every token `j` with `maw[g * tokens + j] > thresholds[g]` (the
    /// paper's rule with `thresholds[g] = beta_g / n_gpu`), without building
    /// an index list first. The chosen indices are written to `chosen`.
    ///
    /// # Errors
    /// [`Error::Length`] / [`Error::ShapeMismatch`] for inputs that do not
    /// fit, [`Error::Param`] for a NaN threshold.
    #[allow(clippy::too_many_arguments)]
    pub fn sparse_decode_threshold<T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        kv: &K,
        maw: &[f32],
        thresholds: &[f32],
        out: PartialMut<'_>,
        chosen: &mut Selection,
    ) -> Result<()> {
        check_common(shape, q, 1, kv, &out)?;
        let n = kv.tokens();
        check_len_of("maw", &[shape.kv_heads(), n], maw.len())?;
        check_len("thresholds", shape.kv_heads(), thresholds.len())?;
        if let Some(&t) = thresholds.iter().find(|t| t.is_nan()) {
            return Err(Error::Param {
                what: "threshold",
                value: t as f64,
                expected: "a number (not NaN)",
            });
        }
        let mut lists: Vec<Vec<u32>> = Vec::new();
        self.run_whole(
            shape,
            q,
            1,
            |_| kv,
            |_, g| Spec::Threshold(&maw[g * n..(g + 1) * n], thresholds[g]),
            |_, _| 0,
            out,
            None,
            Some(&mut lists),
        );
        chosen.clear();
        // Lists come per task in (g, sub, chunk) order. A group larger than
        // `MAX_HEADS` is split into subgroups that each scan the same
        // entries: the picks of subgroup 0 are the head's, the others'
        // repeat them.
        let subs = shape.group().div_ceil(MAX_HEADS);
        let chunks = lists.len() / (shape.kv_heads() * subs).max(1);
        for g in 0..shape.kv_heads() {
            chosen.begin_head();
            for l in &lists[g * subs * chunks..][..chunks] {
                for &j in l {
                    chosen.push_index(j);
                }
            }
        }
        Ok(())
    }
}

pub(crate) fn check_common<T: SimdElem, K: KvSource<T>>(
    shape: &AttnShape,
    q: &[f32],
    n_q: usize,
    kv: &K,
    out: &PartialMut<'_>,
) -> Result<()> {
    check_len_of("q", &[n_q, shape.q_len()], q.len())?;
    kv.check_shape(shape)?;
    let want = PartialLayout::append(shape, n_q);
    if out.layout() != want {
        return Err(Error::ShapeMismatch {
            what: "output partial",
            expected: format!("{want:?}"),
            found: format!("{:?}", out.layout()),
        });
    }
    Ok(())
}

impl SparseAttention for CpuBackend {
    fn sparse_decode<T: hgca_kernels::KvElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        kv: &K,
        sel: &Selection,
        out: PartialMut<'_>,
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        check_common(shape, q, 1, kv, &out)?;
        sel.validate(shape.kv_heads(), kv.tokens())?;
        if let Some(w) = &weights {
            check_len_of("weights", &[shape.group(), sel.total()], w.len())?;
        }
        let group = shape.group();
        self.run_whole(
            shape,
            q,
            1,
            |_| kv,
            |_, g| Spec::List(sel.head(g)),
            |_, g| group * sel.offset(g),
            out,
            weights,
            None,
        );
        Ok(())
    }
}

impl MergeBackend for CpuBackend {
    fn merge(&self, parts: &[PartialRef<'_>], dst: PartialMut<'_>) -> Result<()> {
        hgca_kernels::merge(parts, dst)
    }
    fn merge_into(&self, acc: PartialMut<'_>, src: PartialRef<'_>) -> Result<()> {
        hgca_kernels::merge_into(acc, src)
    }
}
