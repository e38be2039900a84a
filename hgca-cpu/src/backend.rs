//! The CPU backend: validation at the boundary, task splitting over
//! (query token, KV head, head subgroup, token chunk), rayon, and the exact
//! merge of the chunks' partials.

use std::sync::{Arc, Mutex};

use hgca_kernels::{
    AttnShape, Error, KvSource, LseFormat, LseLayout, MergeBackend, PagedBatch, PartialLayout,
    PartialMut, PartialRef, Result, Selection, SelectionRef, SparseAttention, check_len,
    check_len_of, merge_rows,
};
use pulp::Simd;

use crate::isa::{Isa, IsaKind, SimdElem, dispatch, exp_neg};
use crate::kernel::{
    Heads, ListTokens, MAX_HEADS, RangeTokens, Run, ScoreOut, ThresholdTokens, attend, finish,
};
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

/// Tokens a chunk of the work attends to smallest (smaller splits cost more in merges than they win).
const MIN_CHUNK: usize = 256;

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
    isa: Isa,
    par: Par,
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

/// How one KV head's tokens are given.
#[derive(Clone, Copy)]
enum Spec<'a> {
    List(&'a [u32]),
    Range(usize, usize),
    Threshold(&'a [f32], f32),
}

impl Spec<'_> {
    fn len(&self) -> usize {
        match self {
            Spec::List(l) => l.len(),
            Spec::Range(a, b) => b - a,
            Spec::Threshold(m, _) => m.len(),
        }
    }
}

/// What one call of [`CpuBackend::run`] computes: for each unit `u` of
/// `units` (query token or sequence `t = u / kv_heads`, KV head `g = u %
/// kv_heads`), attention of the queries of row `t` over the tokens
/// `spec(t, g)` of `kv(t)`; the weights of unit `(t, g)`, `[group, len]`,
/// at `weight_offset(t, g)` (relative offsets: the first unit's is
/// subtracted).
struct Job<KF, SF, WF> {
    units: std::ops::Range<usize>,
    kv: KF,
    spec: SF,
    weight_offset: WF,
    par: Par,
}

thread_local! {
    /// The calling thread's scratch for [`CpuBackend::run`].
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// One piece of work: query token `t`, KV head `g`, query heads
/// `h0..h0+hn` of its group, chunk `c` of its tokens.
#[derive(Clone, Copy)]
struct Task {
    t: usize,
    g: usize,
    h0: usize,
    hn: usize,
    c: usize,
}

struct Plan {
    /// The first (token or sequence, KV head) unit, `t * kv_heads + g`.
    unit0: usize,
    units: usize,
    kv_heads: usize,
    group: usize,
    subs: usize,
    hsub: usize,
    chunks: usize,
    d: usize,
    scores: usize,
    /// Each task writes its weights itself (see [`CpuBackend::plan`]).
    direct: bool,
}

impl Plan {
    fn tasks(&self) -> usize {
        self.units * self.subs * self.chunks
    }
    fn task(&self, i: usize) -> Task {
        let c = i % self.chunks;
        let i = i / self.chunks;
        let sub = i % self.subs;
        let u = self.unit0 + i / self.subs;
        let g = u % self.kv_heads;
        let t = u / self.kv_heads;
        let h0 = sub * self.hsub;
        Task {
            t,
            g,
            h0,
            hn: self.hsub.min(self.group - h0),
            c,
        }
    }
    /// Floats of scratch per task: `o [hsub, d]`, `lse [hsub]`, scores `[hsub, scores]`.
    fn stride(&self) -> usize {
        self.hsub * (self.d + 1 + self.scores)
    }
    fn bounds(&self, len: usize, c: usize) -> (usize, usize) {
        (c * len / self.chunks, (c + 1) * len / self.chunks)
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
                    .map_err(|e| Error::Backend {
                        backend: "cpu",
                        message: e.to_string(),
                    })?,
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

    /// Causal append where query `t` sees tokens `0..visible(t)` (`<= tokens`).
    pub(crate) fn dense_append_with<T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        n_q: usize,
        visible: impl Fn(usize) -> usize + Sync,
        kv: &K,
        mut out: PartialMut<'_>,
    ) -> Result<()> {
        check_common(shape, q, n_q, kv, &out)?;
        let n = kv.tokens();
        if n_q >= prefill::MIN_QUERIES {
            // Many queries: the tiled kernel (query rows x key tiles).
            let scale = shape.scale();
            let qs: Vec<f32> = q.iter().map(|&x| x * scale).collect();
            let (o, l) = out.parts_mut();
            prefill::append_tiled(self, shape, &qs, n_q, &|t| visible(t).min(n), kv, o, l);
            return Ok(());
        }
        self.run_whole(
            shape,
            q,
            n_q,
            |_| kv,
            |t, _| Spec::Range(0, visible(t).min(n)),
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

    fn plan(
        &self,
        shape: &AttnShape,
        units: std::ops::Range<usize>,
        par: Par,
        max_len: usize,
        weights: bool,
    ) -> Plan {
        let group = shape.group();
        let subs = group.div_ceil(MAX_HEADS);
        let hsub = group.div_ceil(subs);
        let base = units.len() * subs;
        let threads = if par == Par::Seq { 1 } else { self.threads() };
        let chunks = if threads > 1 && base > 0 && base < 4 * threads {
            (4 * threads)
                .div_ceil(base)
                .min((max_len / MIN_CHUNK).max(1))
        } else {
            1
        };
        // One chunk per row: a task's lse is final when it ends, so it
        // writes its weights in place (no scratch, no later pass). Split
        // rows keep raw scores in scratch until the merge knows the lse.
        let direct = weights && chunks == 1;
        let scores = if weights && !direct {
            max_len.div_ceil(chunks) + 1
        } else {
            0
        };
        Plan {
            unit0: units.start,
            units: units.len(),
            kv_heads: shape.kv_heads(),
            group,
            subs,
            hsub,
            chunks,
            d: shape.head_dim(),
            scores,
            direct,
        }
    }

    /// [`CpuBackend::run`] over every unit of `tokens_q` query rows, on
    /// this backend's parallelism, into a whole partial.
    #[allow(clippy::too_many_arguments)]
    fn run_whole<'s, T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        tokens_q: usize,
        kv: impl Fn(usize) -> K + Sync,
        spec: impl Fn(usize, usize) -> Spec<'s> + Sync,
        weight_offset: impl Fn(usize, usize) -> usize + Sync,
        mut out: PartialMut<'_>,
        weights: Option<&mut [f32]>,
        chosen: Option<&mut Vec<Vec<u32>>>,
    ) {
        let (o, l) = out.parts_mut();
        let job = Job {
            units: 0..tokens_q * shape.kv_heads(),
            kv,
            spec,
            weight_offset,
            par: self.par,
        };
        self.run(shape, q, job, o, l, weights, chosen);
    }

    /// The engine behind every public entry: plans the tasks of `job`,
    /// runs them (in parallel unless `job.par` is [`Par::Seq`]), merges
    /// chunk partials into `out_o`/`out_lse` (the rows of `job.units`,
    /// natural-log lse) exactly, and writes the weights normalised by the
    /// final lse: each task its own when rows are not split, else from raw
    /// scores after the merge.
    ///
    /// Scratch is the calling thread's own (taken out of a thread-local for
    /// the call, so a nested call from a task of the same thread finds it
    /// empty and allocates): no lock is held across the parallel work.
    #[allow(clippy::too_many_arguments)]
    fn run<'s, T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        job: Job<
            impl Fn(usize) -> K + Sync,
            impl Fn(usize, usize) -> Spec<'s> + Sync,
            impl Fn(usize, usize) -> usize + Sync,
        >,
        out_o: &mut [f32],
        out_lse: &mut [f32],
        mut weights: Option<&mut [f32]>,
        mut chosen: Option<&mut Vec<Vec<u32>>>,
    ) {
        let (d, group, qh, hk) = (
            shape.head_dim(),
            shape.group(),
            shape.q_heads(),
            shape.kv_heads(),
        );
        let Job {
            units,
            kv,
            spec,
            weight_offset,
            par,
        } = job;
        let unit_tg = |u: usize| (u / hk, u % hk);
        let max_len = units
            .clone()
            .map(|u| {
                let (t, g) = unit_tg(u);
                spec(t, g).len()
            })
            .max()
            .unwrap_or(0);
        let plan = self.plan(shape, units.clone(), par, max_len, weights.is_some());
        let (n_tasks, stride) = (plan.tasks(), plan.stride());
        let row0 = units.start * group;
        let w0 = if units.is_empty() {
            0
        } else {
            let (t, g) = unit_tg(units.start);
            weight_offset(t, g)
        };
        let mut scratch = SCRATCH.take();
        let qs_len = units.len() * group * d;
        // Every element is written before it is read (queries scaled,
        // each task's output zeroed, lse and scores written): no clearing.
        scratch.resize(qs_len + n_tasks * stride, 0.0);
        let (qs, work) = scratch.split_at_mut(qs_len);
        let scale = shape.scale();
        qs.iter_mut()
            .zip(&q[row0 * d..])
            .for_each(|(a, &b)| *a = b * scale);
        let qs = &*qs;
        if let Some(c) = chosen.as_deref_mut() {
            c.clear();
            c.resize_with(n_tasks, Vec::new);
        }
        let isa = self.isa;
        // What each task writes: its scratch, the indices it picks, and
        // (direct plans) its weights `[hn, len]`, one contiguous run of
        // `weights` in task order.
        let mut io: Vec<TaskIo<'_>> = Vec::with_capacity(n_tasks);
        {
            let mut picked = chosen.map(|p| p.iter_mut());
            let mut rest = if plan.direct { weights.take() } else { None };
            for (i, buf) in work[..n_tasks * stride].chunks_mut(stride).enumerate() {
                let w = rest.take().map(|r| {
                    let tk = plan.task(i);
                    let (head, tail) = r.split_at_mut(tk.hn * spec(tk.t, tk.g).len());
                    rest = Some(tail);
                    head
                });
                io.push(TaskIo {
                    buf,
                    picked: picked.as_mut().and_then(|p| p.next()),
                    w,
                });
            }
        }
        let task_fn = |i: usize, io: &mut TaskIo<'_>| {
            let tk = plan.task(i);
            let (o, rest) = io.buf.split_at_mut(plan.hsub * d);
            let (lse, sc) = rest.split_at_mut(plan.hsub);
            let (o, lse) = (&mut o[..tk.hn * d], &mut lse[..tk.hn]);
            o.fill(0.0);
            let mut run = [Run::EMPTY; MAX_HEADS];
            let run = &mut run[..tk.hn];
            let qrow = (tk.t * qh + tk.g * group + tk.h0 - row0) * d;
            let qv = &qs[qrow..qrow + tk.hn * d];
            let sp = spec(tk.t, tk.g);
            let kv = kv(tk.t);
            let kv = &kv;
            let (a, b) = plan.bounds(sp.len(), tk.c);
            let so = match io.w.as_deref_mut() {
                Some(w) => Some(ScoreOut {
                    buf: w,
                    stride: sp.len(),
                }),
                None => (plan.scores > 0).then_some(ScoreOut {
                    buf: &mut *sc,
                    stride: plan.scores,
                }),
            };
            let heads = |o, run, scores| Heads {
                g: tk.g,
                q: qv,
                heads: tk.hn,
                d,
                o,
                run,
                scores,
            };
            dispatch!(isa, s, x => match sp {
                Spec::List(l) => attend(s, x, kv, ListTokens(&l[a..b]), heads(o, run, so)),
                Spec::Range(lo, _) => attend(s, x, kv, RangeTokens { start: lo + a, end: lo + b }, heads(o, run, so)),
                Spec::Threshold(maw, t) => {
                    let mut sink = Vec::new();
                    // Subgroup 0 records the picks (the others repeat them),
                    // with room for every entry of the range up front: the
                    // scan then never grows the list inside the token loop.
                    let chosen = match io.picked.as_deref_mut() {
                        Some(p) if tk.h0 == 0 => {
                            p.reserve(b - a);
                            p
                        }
                        _ => &mut sink,
                    };
                    let toks = ThresholdTokens { maw, threshold: t, pos: a, end: b, chosen };
                    attend(s, x, kv, toks, heads(o, run, so))
                }
            });
            finish(o, lse, run, d);
            if let Some(w) = io.w.as_deref_mut() {
                for (h, row) in w.chunks_exact_mut(sp.len().max(1)).enumerate() {
                    exp_shifted(isa, row, lse[h]);
                }
            }
        };
        if par == Par::Seq {
            io.iter_mut().enumerate().for_each(|(i, t)| task_fn(i, t));
        } else {
            self.for_each_item(&mut io, task_fn);
        }
        drop(io);
        let work = &work[..n_tasks * stride];
        // Merge the chunks of each (token, head) row, exactly: a task's
        // chunks are consecutive, merged at once with f64 accumulation.
        let nc = plan.chunks;
        for (i, bufs) in work.chunks(stride * nc).enumerate() {
            let tk = plan.task(i * nc);
            for h in 0..tk.hn {
                let r = tk.t * qh + tk.g * group + tk.h0 + h - row0;
                let chunk = |c: usize| {
                    let buf = &bufs[c * stride..(c + 1) * stride];
                    (&buf[h * d..(h + 1) * d], buf[plan.hsub * d + h])
                };
                let dst = &mut out_o[r * d..(r + 1) * d];
                if nc == 1 {
                    let (src, l) = chunk(0);
                    dst.copy_from_slice(src);
                    out_lse[r] = l;
                } else {
                    merge_rows(nc, chunk, dst, &mut out_lse[r]);
                }
            }
        }
        // Split rows: raw scores -> softmax weights over everything this call attended.
        if let Some(w) = weights {
            for (i, buf) in work.chunks(stride).enumerate() {
                let tk = plan.task(i);
                let len = spec(tk.t, tk.g).len();
                let (a, b) = plan.bounds(len, tk.c);
                let sc = &buf[plan.hsub * (d + 1)..];
                for h in 0..tk.hn {
                    let hg = tk.h0 + h;
                    let base = weight_offset(tk.t, tk.g) - w0 + hg * len;
                    let dst = &mut w[base + a..base + b];
                    dst.copy_from_slice(&sc[h * plan.scores..h * plan.scores + (b - a)]);
                    exp_shifted(isa, dst, out_lse[tk.t * qh + tk.g * group + hg - row0]);
                }
            }
        }
        SCRATCH.set(scratch);
    }
}

/// One task's outputs (see [`CpuBackend::run`]).
struct TaskIo<'a> {
    buf: &'a mut [f32],
    picked: Option<&'a mut Vec<u32>>,
    w: Option<&'a mut [f32]>,
}

/// Which tokens of each sequence a batched decode attends.
#[derive(Debug, Clone, Copy)]
pub enum BatchTokens<'a> {
    /// Every token of every sequence.
    Dense,
    /// Per sequence, its per-KV-head [`Selection`] (indices `< seq_len`).
    Sparse(&'a [Selection]),
    /// The same, as views of the caller's own buffers (no copy: a C or
    /// Python caller's arrays).
    SparseRef(&'a [SelectionRef<'a>]),
}

/// Shard `ith` of `nth` of a call, for running a call on the caller's own
/// thread pool (as ggml runs custom ops): each shard computes a contiguous
/// range of (sequence, KV head) units on the calling thread, without
/// rayon, and the shards `0..nth` together give, bit for bit, the whole
/// call on a sequential backend ([`Par::Seq`]; a threaded whole call may
/// split a long sequence's tokens into chunks merged by LSE, which rounds
/// differently in the last bits). With more shards than units, some
/// shards are empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    ith: usize,
    nth: usize,
}

impl Shard {
    /// Shard `ith` of `nth`.
    ///
    /// # Errors
    /// [`Error::Zero`] for `nth == 0`, [`Error::Index`] for `ith >= nth`.
    pub fn new(ith: usize, nth: usize) -> Result<Self> {
        if nth == 0 {
            return Err(Error::Zero {
                what: "nth (shards)",
            });
        }
        if ith >= nth {
            return Err(Error::Index {
                what: "ith (shard)",
                index: ith,
                len: nth,
            });
        }
        Ok(Self { ith, nth })
    }
    /// The whole call as one shard.
    pub const WHOLE: Shard = Shard { ith: 0, nth: 1 };
    /// This shard's part of `0..units`.
    pub fn units(&self, units: usize) -> std::ops::Range<usize> {
        // In u128: `units * nth` may not fit a usize.
        let at = |i: usize| (units as u128 * i as u128 / self.nth as u128) as usize;
        at(self.ith)..at(self.ith + 1)
    }
}

/// Per-sequence offsets of a batch's weights: sequence `t`'s block starts
/// at `base[t]`; inside it, KV head `g`'s `[group, len]` block.
struct BatchWeights<'a> {
    base: Vec<usize>,
    group: usize,
    /// The selections as views (none for dense).
    sels: Option<Vec<SelectionRef<'a>>>,
    lens: Vec<usize>,
}

impl BatchWeights<'_> {
    /// Offset of unit `u` (`t * kv_heads + g`), for `u <= batch * kv_heads`.
    fn at(&self, kv_heads: usize, u: usize) -> usize {
        let (t, g) = (u / kv_heads, u % kv_heads);
        if t >= self.lens.len() {
            return self.base[self.lens.len()];
        }
        self.base[t]
            + match &self.sels {
                Some(s) => self.group * s[t].offset(g),
                None => g * self.group * self.lens[t],
            }
    }
}

impl CpuBackend {
    /// Batched varlen decode over an engine's paged cache: for each of the
    /// `B = kv.batch()` sequences, its query `q[b] [q_heads, d]` attends
    /// its own tokens (all of them, or its selection), in one call,
    /// parallel over (sequence, KV head, token chunk) with the exact LSE
    /// merge of chunks.
    ///
    /// - `out [B, q_heads, d]`; `lse [B, q_heads]` written in `fmt` (base
    ///   and layout: [`LseFormat::FLASHINFER`], [`LseFormat::VLLM`], ...).
    /// - `weights`, if given, receives the softmax weights of the attended
    ///   entries, sequence after sequence: dense, `[q_heads, seq_len]` per
    ///   sequence; sparse, per KV head `g` the block `[group,
    ///   sel.head(g).len()]` at `group * sel.offset(g)` of the sequence's
    ///   `group * sel.total()` (as [`SparseAttention::sparse_decode`]).
    ///
    /// ```
    /// use hgca_cpu::{BatchTokens, CpuBackend};
    /// use hgca_kernels::{AttnShape, BlockTable, LseFormat, PagedBatch, PagedPool};
    /// let shape = AttnShape::new(2, 1, 4)?;
    /// // FlashInfer NHD pages: 3 pages of 2 tokens, 1 KV head, d 4
    /// let k = vec![0.25f32; 3 * 2 * 4];
    /// let v: Vec<f32> = (0..3 * 2 * 4).map(|i| (i / 4) as f32).collect();
    /// let pool = PagedPool::flashinfer_nhd(&k, &v, 3, 2, 1, 4)?;
    /// // CSR: sequence 0 = pages [2, 0] (3 tokens), sequence 1 = page [1] (1 token)
    /// let (indptr, indices, last) = ([0u32, 2, 3], [2u32, 0, 1], [1u32, 1]);
    /// let batch = PagedBatch::new(pool, BlockTable::csr(&indptr, &indices, &last)?)?;
    /// let q = vec![1.0f32; 2 * 2 * 4];
    /// let (mut out, mut lse) = (vec![0.0; 2 * 2 * 4], vec![0.0; 2 * 2]);
    /// CpuBackend::new().decode_batch(&shape, &q, &batch, BatchTokens::Dense, &mut out, &mut lse, LseFormat::NATURAL, None)?;
    /// // equal scores: sequence 0 averages the values of tokens 4, 5 (page 2) and 0 (page 0)
    /// assert!((out[0] - (4.0 + 5.0 + 0.0) / 3.0).abs() < 1e-6);
    /// assert_eq!(out[2 * 4], 2.0); // sequence 1: token 0 of page 1
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Length`] naming the buffer that does not fit `B` and
    /// `shape`, [`Error::ShapeMismatch`] for a pool of other heads or head
    /// dim or a selection list count that is not `B`, [`Error::Index`] for a
    /// selected token `>= seq_len`.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_batch<T: SimdElem>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        kv: &PagedBatch<'_, T>,
        tokens: BatchTokens<'_>,
        out: &mut [f32],
        lse: &mut [f32],
        fmt: LseFormat,
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        let rows = kv.batch() * shape.q_heads();
        check_len("lse", rows, lse.len())?;
        let mut natural = if fmt == LseFormat::NATURAL {
            None
        } else {
            Some(vec![0.0f32; rows])
        };
        let l = natural.as_deref_mut().unwrap_or(&mut *lse);
        self.batch_job(
            shape,
            q,
            kv,
            tokens,
            Shard::WHOLE,
            self.par,
            out,
            l,
            weights,
        )?;
        if let Some(n) = natural {
            fmt.write(&n, kv.batch(), shape.q_heads(), lse)?;
        }
        Ok(())
    }

    /// Query rows (`b * q_heads + h`) that `shard` of a batched decode of
    /// `batch` sequences computes: its `out` holds these rows (`rows.len() *
    /// d`), its `lse` one entry each, its `weights` the range
    /// [`CpuBackend::shard_weights`] gives.
    pub fn shard_rows(shape: &AttnShape, batch: usize, shard: Shard) -> std::ops::Range<usize> {
        let u = shard.units(batch * shape.kv_heads());
        u.start * shape.group()..u.end * shape.group()
    }

    /// The part of a batched decode's `weights` (as [`CpuBackend::decode_batch`]
    /// lays them out) that `shard` writes.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the selections are not one per sequence.
    pub fn shard_weights<T: SimdElem>(
        shape: &AttnShape,
        kv: &PagedBatch<'_, T>,
        tokens: BatchTokens<'_>,
        shard: Shard,
    ) -> Result<std::ops::Range<usize>> {
        let hk = shape.kv_heads();
        let u = shard.units(kv.batch() * hk);
        let w = batch_weights(shape, kv, tokens)?;
        Ok(w.at(hk, u.start)..w.at(hk, u.end))
    }

    /// Shard `shard` of [`CpuBackend::decode_batch`], computed on the
    /// calling thread (no rayon, whatever this backend's [`Par`]): `out`,
    /// `lse` and `weights` are this shard's parts only
    /// ([`CpuBackend::shard_rows`], [`CpuBackend::shard_weights`]), so each
    /// thread of the caller's pool writes its own slices. `lse` is in
    /// `fmt.base`, in row order: a shard's rows are not a `[heads,
    /// tokens]` block, so `fmt.layout` must be `TokensHeads`.
    ///
    /// ```
    /// use hgca_cpu::{BatchTokens, CpuBackend, Shard};
    /// use hgca_kernels::{AttnShape, BlockTable, LseFormat, PagedBatch, PagedPool};
    /// let shape = AttnShape::new(4, 2, 8)?;
    /// let kv: Vec<f32> = (0..2 * 4 * 2 * 16 * 8).map(|i| (i % 7) as f32 * 0.1).collect();
    /// let pool = PagedPool::vllm_cpu(&kv, 4, 2, 16, 8)?;
    /// let (table, lens) = ([0u32, 1, 2, 3], [30u32, 20]);
    /// let batch = PagedBatch::new(pool, BlockTable::dense(&table, 2, &lens)?)?;
    /// let q = vec![0.5f32; 2 * 4 * 8];
    /// let (mut out, mut lse) = (vec![0.0; 2 * 4 * 8], vec![0.0; 2 * 4]);
    /// let (o, l) = (out.as_mut_slice(), lse.as_mut_slice());
    /// // three shards on three threads, each writing its own rows
    /// std::thread::scope(|s| {
    ///     let (mut o, mut l) = (o, l);
    ///     for ith in 0..3 {
    ///         let shard = Shard::new(ith, 3).unwrap();
    ///         let rows = CpuBackend::shard_rows(&shape, 2, shard).len();
    ///         let (so, ro) = std::mem::take(&mut o).split_at_mut(rows * 8);
    ///         let (sl, rl) = std::mem::take(&mut l).split_at_mut(rows);
    ///         (o, l) = (ro, rl);
    ///         let (q, batch) = (&q, &batch);
    ///         s.spawn(move || {
    ///             CpuBackend::new().decode_batch_shard(shard, &shape, q, batch, BatchTokens::Dense,
    ///                 so, sl, LseFormat::NATURAL, None).unwrap()
    ///         });
    ///     }
    /// });
    /// let (mut whole, mut wl) = (vec![0.0; 2 * 4 * 8], vec![0.0; 2 * 4]);
    /// CpuBackend::new().decode_batch(&shape, &q, &batch, BatchTokens::Dense, &mut whole, &mut wl, LseFormat::NATURAL, None)?;
    /// assert_eq!((out, lse), (whole, wl));
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`CpuBackend::decode_batch`] (lengths are the shard's);
    /// [`Error::Param`] for a `[heads, tokens]` `fmt`.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_batch_shard<T: SimdElem>(
        &self,
        shard: Shard,
        shape: &AttnShape,
        q: &[f32],
        kv: &PagedBatch<'_, T>,
        tokens: BatchTokens<'_>,
        out: &mut [f32],
        lse: &mut [f32],
        fmt: LseFormat,
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        if fmt.layout != LseLayout::TokensHeads {
            return Err(Error::Param {
                what: "lse layout of a shard",
                value: 0.0,
                expected: "TokensHeads: a shard writes its rows in order",
            });
        }
        self.batch_job(shape, q, kv, tokens, shard, Par::Seq, out, lse, weights)?;
        lse.iter_mut().for_each(|x| *x = fmt.from_natural(*x));
        Ok(())
    }

    /// Checks and runs (a shard of) a batched decode; lse in natural log.
    #[allow(clippy::too_many_arguments)]
    fn batch_job<T: SimdElem>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        kv: &PagedBatch<'_, T>,
        tokens: BatchTokens<'_>,
        shard: Shard,
        par: Par,
        out: &mut [f32],
        lse: &mut [f32],
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        let b = kv.batch();
        let (hk, d) = (shape.kv_heads(), shape.head_dim());
        kv.check_shape(shape)?;
        check_len_of("q [batch, q_heads, d]", &[b, shape.q_len()], q.len())?;
        let bw = batch_weights(shape, kv, tokens)?;
        if let Some(sels) = &bw.sels {
            for (t, s) in sels.iter().enumerate() {
                s.validate(hk, kv.seq_len(t))?;
            }
        }
        let rows = Self::shard_rows(shape, b, shard);
        check_len_of("out", &[rows.len(), d], out.len())?;
        check_len("lse", rows.len(), lse.len())?;
        let units = shard.units(b * hk);
        if let Some(w) = &weights {
            check_len(
                "weights",
                bw.at(hk, units.end) - bw.at(hk, units.start),
                w.len(),
            )?;
        }
        let seq = |t: usize| kv.seq(t).expect("t < batch: units are inside the batch");
        let job = Job {
            units,
            kv: seq,
            spec: |t: usize, g: usize| match &bw.sels {
                None => Spec::Range(0, kv.seq_len(t)),
                Some(s) => Spec::List(s[t].head(g)),
            },
            weight_offset: |t: usize, g: usize| bw.at(hk, t * hk + g),
            par,
        };
        self.run(shape, q, job, out, lse, weights, None);
        Ok(())
    }
}

/// The batch's weight offsets, its selections checked to be one per sequence.
fn batch_weights<'a, T: SimdElem>(
    shape: &AttnShape,
    kv: &PagedBatch<'_, T>,
    tokens: BatchTokens<'a>,
) -> Result<BatchWeights<'a>> {
    let group = shape.group();
    let lens: Vec<usize> = (0..kv.batch()).map(|t| kv.seq_len(t)).collect();
    let sels = match tokens {
        BatchTokens::Dense => None,
        BatchTokens::Sparse(s) => Some(s.iter().map(Selection::as_view).collect::<Vec<_>>()),
        BatchTokens::SparseRef(s) => Some(s.to_vec()),
    };
    if let Some(s) = &sels
        && s.len() != kv.batch()
    {
        return Err(Error::ShapeMismatch {
            what: "selections (one per sequence)",
            expected: kv.batch().to_string(),
            found: s.len().to_string(),
        });
    }
    let mut base = Vec::with_capacity(lens.len() + 1);
    base.push(0);
    for (t, &len) in lens.iter().enumerate() {
        let n = match &sels {
            Some(s) => group * s[t].total(),
            None => shape.q_heads() * len,
        };
        base.push(base[t] + n);
    }
    Ok(BatchWeights {
        base,
        group,
        sels,
        lens,
    })
}

/// `x[i] = exp(x[i] - shift)`, vectorised.
fn exp_shifted(isa: Isa, x: &mut [f32], shift: f32) {
    dispatch!(isa, s => exp_shifted_simd(s, x, shift))
}

#[inline(always)]
fn exp_shifted_simd<S: Simd>(s: S, x: &mut [f32], shift: f32) {
    let m = s.splat_f32s(shift);
    let (head, tail) = S::as_mut_simd_f32s(x);
    for v in head {
        *v = exp_neg(s, s.sub_f32s(*v, m));
    }
    for v in tail {
        *v = (*v - shift).exp();
    }
}

fn check_common<T: SimdElem, K: KvSource<T>>(
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
