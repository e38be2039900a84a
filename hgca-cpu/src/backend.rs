//! The CPU backend: validation at the boundary, task splitting over
//! (query token, KV head, head subgroup, token chunk), rayon, and the exact
//! merge of the chunks' partials.

use std::sync::{Arc, Mutex};

use hgca_kernels::{
    AttnShape, Error, KvSource, MergeBackend, PartialLayout, PartialMut, PartialRef, Result,
    Selection, SparseAttention, check_len, merge2_row,
};
use pulp::Simd;

use crate::isa::{Isa, IsaKind, Kern, SimdElem, dispatch, exp_neg, load, store};
use crate::kernel::{
    Heads, ListTokens, MAX_HEADS, RangeTokens, Run, ScoreOut, ThresholdTokens, attend, by_heads,
    finish, prefetch_row,
};

/// Parallelism of a CPU call (faer's `Par`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Par {
    /// The calling thread only.
    Seq,
    /// A rayon pool of this many threads (0: rayon's global pool).
    Rayon(usize),
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
    scratch: Arc<Mutex<Vec<f32>>>,
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
    tokens_q: usize,
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
        self.tokens_q * self.kv_heads * self.subs * self.chunks
    }
    fn task(&self, i: usize) -> Task {
        let c = i % self.chunks;
        let i = i / self.chunks;
        let sub = i % self.subs;
        let i = i / self.subs;
        let g = i % self.kv_heads;
        let t = i / self.kv_heads;
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
            scratch: Arc::default(),
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
        Ok(self)
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
        use rayon::prelude::*;
        let chunk = chunk.max(1);
        if matches!(self.par, Par::Seq) || data.len() <= chunk {
            data.chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, c)| f(i, c));
            return;
        }
        let f = &f;
        let mut go = move || {
            data.par_chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, c)| f(i, c))
        };
        match &self.pool {
            Some(p) => p.install(go),
            None => go(),
        }
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
            check_len("weights", shape.q_heads() * n, w.len())?;
        }
        self.run(
            shape,
            q,
            1,
            kv,
            |_, _| Spec::Range(0, n),
            |g| g * n,
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
        out: PartialMut<'_>,
    ) -> Result<()> {
        check_common(shape, q, n_q, kv, &out)?;
        let n = kv.tokens();
        self.run(
            shape,
            q,
            n_q,
            kv,
            |t, _| Spec::Range(0, visible(t).min(n)),
            |_| 0,
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
        check_len("maw", shape.kv_heads() * n, maw.len())?;
        check_len("thresholds", shape.kv_heads(), thresholds.len())?;
        if let Some(&t) = thresholds.iter().find(|t| t.is_nan()) {
            return Err(Error::Param {
                what: "threshold",
                value: t as f64,
                expected: "a number (not NaN)",
            });
        }
        let mut lists: Vec<Vec<u32>> = Vec::new();
        self.run(
            shape,
            q,
            1,
            kv,
            |_, g| Spec::Threshold(&maw[g * n..(g + 1) * n], thresholds[g]),
            |_| 0,
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

    fn plan(&self, shape: &AttnShape, tokens_q: usize, max_len: usize, weights: bool) -> Plan {
        let group = shape.group();
        let subs = group.div_ceil(MAX_HEADS);
        let hsub = group.div_ceil(subs);
        let base = tokens_q * shape.kv_heads() * subs;
        let threads = self.threads();
        let chunks = if threads > 1 && base < 4 * threads {
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
            tokens_q,
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

    /// The engine behind every public entry: plans tasks, runs them (in
    /// parallel), merges chunk partials into `out` exactly, and writes the
    /// weights normalised by the final lse: each task its own when rows are
    /// not split, else from raw scores after the merge.
    #[allow(clippy::too_many_arguments)]
    fn run<'s, T: SimdElem, K: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        tokens_q: usize,
        kv: &K,
        spec: impl Fn(usize, usize) -> Spec<'s> + Sync,
        weight_offset: impl Fn(usize) -> usize + Sync,
        mut out: PartialMut<'_>,
        mut weights: Option<&mut [f32]>,
        mut chosen: Option<&mut Vec<Vec<u32>>>,
    ) {
        let (d, group, qh) = (shape.head_dim(), shape.group(), shape.q_heads());
        let max_len = (0..shape.kv_heads())
            .map(|g| spec(0, g).len())
            .max()
            .unwrap_or(0);
        let plan = self.plan(shape, tokens_q, max_len, weights.is_some());
        let (n_tasks, stride) = (plan.tasks(), plan.stride());
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let qs_len = tokens_q * qh * d;
        scratch.resize(qs_len + n_tasks * stride, 0.0);
        let (qs, work) = scratch.split_at_mut(qs_len);
        let scale = shape.scale();
        qs.iter_mut().zip(q).for_each(|(a, &b)| *a = b * scale);
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
            let qrow = (tk.t * qh + tk.g * group + tk.h0) * d;
            let qv = &qs[qrow..qrow + tk.hn * d];
            let sp = spec(tk.t, tk.g);
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
        match (&self.par, &self.pool) {
            (Par::Seq, _) => {
                for (i, t) in io.iter_mut().enumerate() {
                    task_fn(i, t);
                }
            }
            (_, pool) => {
                use rayon::prelude::*;
                let mut go = || {
                    io.par_iter_mut()
                        .enumerate()
                        .for_each(|(i, t)| task_fn(i, t))
                };
                match pool {
                    Some(p) => p.install(go),
                    None => go(),
                }
            }
        }
        drop(io);
        let work = &work[..n_tasks * stride];
        // Merge the chunks of each (token, head) row, exactly.
        let (out_o, out_lse) = out.parts_mut();
        for (i, buf) in work.chunks(stride).enumerate() {
            let tk = plan.task(i);
            for h in 0..tk.hn {
                let r = tk.t * qh + tk.g * group + tk.h0 + h;
                let (src, l) = (&buf[h * d..(h + 1) * d], buf[plan.hsub * d + h]);
                let dst = &mut out_o[r * d..(r + 1) * d];
                if tk.c == 0 {
                    dst.copy_from_slice(src);
                    out_lse[r] = l;
                } else {
                    merge2_row(dst, &mut out_lse[r], src, l);
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
                    let base = group * weight_offset(tk.g) + hg * len;
                    let dst = &mut w[base + a..base + b];
                    dst.copy_from_slice(&sc[h * plan.scores..h * plan.scores + (b - a)]);
                    exp_shifted(isa, dst, out_lse[tk.g * group + hg]);
                }
            }
        }
    }
}

/// One task's outputs (see [`CpuBackend::run`]).
struct TaskIo<'a> {
    buf: &'a mut [f32],
    picked: Option<&'a mut Vec<u32>>,
    w: Option<&'a mut [f32]>,
}

impl CpuBackend {
    /// Upper bounds of the scores of key blocks (Quest): `bounds` holds, per
    /// block, the elementwise minimum then maximum of its keys (`[blocks, 2, d]`);
    /// for query row `h` of `q` (`[heads, d]`), `out[b * heads + h] =
    /// Σ_i max(q_i lo_i, q_i hi_i)`, which no key of block `b` can exceed
    /// in `q·k`. The bounds are kept in the KV dtype: the minimum and
    /// maximum of keys stored as `T` are values of `T`, so nothing rounds,
    /// and f16/bf16 bounds are half the bytes to read.
    ///
    /// # Errors
    /// [`Error::Length`] when the slices do not fit `heads`, `d` and the block count.
    pub fn block_upper_bounds<T: SimdElem>(
        &self,
        q: &[f32],
        heads: usize,
        d: usize,
        bounds: &[T],
        out: &mut [f32],
    ) -> Result<()> {
        check_len("q", heads * d, q.len())?;
        if d == 0 || !bounds.len().is_multiple_of(2 * d) {
            return Err(Error::Length {
                what: "bounds (a multiple of 2 * d)",
                expected: (bounds.len() / (2 * d).max(1)) * 2 * d,
                found: bounds.len(),
            });
        }
        let nb = bounds.len() / (2 * d);
        check_len("out", nb * heads, out.len())?;
        dispatch!(self.isa, s, x => bounds_simd(s, x, q, heads, d, bounds, out));
        Ok(())
    }

    /// Appends `base + i` to `out` for every `values[i] > threshold` (NaN
    /// never passes), in order: the MAW rule's scan, one vector compare per
    /// `LANES` entries and scalar work only where a vector has a hit.
    ///
    /// ```
    /// let mut out = vec![7];
    /// hgca_cpu::CpuBackend::new().indices_above(&[0.1, 0.5, f32::NAN, 0.9], 0.2, 10, &mut out);
    /// assert_eq!(out, [7, 11, 13]);
    /// ```
    pub fn indices_above(&self, values: &[f32], threshold: f32, base: u32, out: &mut Vec<u32>) {
        dispatch!(self.isa, s => above_simd(s, values, threshold, base, out))
    }

    /// One step of a moving average of attention weights (the MAW update),
    /// in one vectorised pass: with `len = at.map_or(avg.len(), <[u32]>::len)`
    /// and weight rows `w_i = w[i * stride..][..len]` for `i < c.len()`,
    ///
    /// - `at == None`: `avg[j] = a * avg[j] + Σ_i c[i] * w_i[j]` for `j < len`;
    /// - `at == Some(idx)`: `avg[idx[k]] = a * avg[idx[k]] + Σ_i c[i] * w_i[k]`
    ///   for `k < len` (the weights of a gathered selection; indices are
    ///   expected distinct, a repeated one is updated once per occurrence).
    ///
    /// Equal up to f32 rounding (fused multiply-adds) to the formula in f64.
    ///
    /// ```
    /// let cpu = hgca_cpu::CpuBackend::new();
    /// let mut avg = vec![1.0f32; 4];
    /// // two weight rows of 2 entries, stride 2: [0.5, 0.25] and [1.0, 0.0]
    /// cpu.decay_accumulate(&mut avg, Some(&[3, 0]), 0.5, &[0.5, 0.25, 1.0, 0.0], 2, &[1.0, 0.5])?;
    /// assert_eq!(avg, [0.75, 1.0, 1.0, 1.5]);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Length`] when `w` is too short for `c.len()` rows of `len` at
    /// `stride`, or `stride < len` with more than one row; [`Error::Index`]
    /// for an index `>= avg.len()`. Nothing is written then.
    pub fn decay_accumulate(
        &self,
        avg: &mut [f32],
        at: Option<&[u32]>,
        a: f32,
        w: &[f32],
        stride: usize,
        c: &[f32],
    ) -> Result<()> {
        let len = at.map_or(avg.len(), <[u32]>::len);
        if c.len() > 1 && stride < len {
            return Err(Error::Length {
                what: "decay_accumulate stride (at least the row length)",
                expected: len,
                found: stride,
            });
        }
        let need = match c.len() {
            0 => 0,
            rows => (rows - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(len))
                .unwrap_or(usize::MAX),
        };
        if w.len() < need {
            return Err(Error::Length {
                what: "decay_accumulate weights",
                expected: need,
                found: w.len(),
            });
        }
        if let Some(idx) = at
            && let Some(&bad) = idx.iter().find(|&&j| j as usize >= avg.len())
        {
            return Err(Error::Index {
                what: "decay_accumulate index",
                index: bad as usize,
                len: avg.len(),
            });
        }
        dispatch!(self.isa, s => decay_simd(s, avg, at, a, w, stride, c));
        Ok(())
    }
}

/// `Σ_i c[i] * w[i * stride + k..][..LANES]` plus `init`, as fused multiply-adds.
#[inline(always)]
fn weighted_rows<S: Simd>(
    s: S,
    init: S::f32s,
    w: &[f32],
    stride: usize,
    c: &[f32],
    k: usize,
) -> S::f32s {
    c.iter().enumerate().fold(init, |x, (i, &ci)| {
        s.mul_add_f32s(s.splat_f32s(ci), load(s, &w[i * stride + k..]), x)
    })
}

#[inline(always)]
fn decay_simd<S: Simd>(
    s: S,
    avg: &mut [f32],
    at: Option<&[u32]>,
    a: f32,
    w: &[f32],
    stride: usize,
    c: &[f32],
) {
    let lanes = S::F32_LANES;
    let av = s.splat_f32s(a);
    let scalar = |k: usize, x: f32| {
        c.iter()
            .enumerate()
            .fold(a * x, |x, (i, &ci)| ci.mul_add(w[i * stride + k], x))
    };
    match at {
        None => {
            let (head, tail) = S::as_mut_simd_f32s(avg);
            for (k, m) in head.iter_mut().enumerate() {
                *m = weighted_rows(s, s.mul_f32s(av, *m), w, stride, c, k * lanes);
            }
            let k0 = head.len() * lanes;
            for (k, m) in tail.iter_mut().enumerate() {
                *m = scalar(k0 + k, *m);
            }
        }
        Some(idx) => {
            // One vector's sums (16: the widest ISA's lanes).
            let mut sums = [0.0f32; 16];
            let mut chunks = idx.chunks_exact(lanes);
            let mut k0 = 0;
            for js in &mut chunks {
                let v = weighted_rows(s, s.splat_f32s(0.0), w, stride, c, k0);
                store(s, &mut sums, v);
                for (&j, &x) in js.iter().zip(&sums) {
                    let m = &mut avg[j as usize];
                    *m = a.mul_add(*m, x);
                }
                k0 += lanes;
            }
            for (k, &j) in chunks.remainder().iter().enumerate() {
                let m = &mut avg[j as usize];
                *m = scalar(k0 + k, *m);
            }
        }
    }
}

#[inline(always)]
fn above_simd<S: Simd>(s: S, values: &[f32], t: f32, base: u32, out: &mut Vec<u32>) {
    let lanes = S::F32_LANES;
    let tv = s.splat_f32s(t);
    let mut push_hits = |chunk: &[f32], at: usize| {
        for (i, &x) in chunk.iter().enumerate() {
            if x > t {
                out.push(base + (at + i) as u32);
            }
        }
    };
    let mut chunks = values.chunks_exact(lanes);
    let mut at = 0;
    for c in &mut chunks {
        if s.first_true_m32s(s.less_than_f32s(tv, load(s, c))) < lanes {
            push_hits(c, at);
        }
        at += lanes;
    }
    push_hits(chunks.remainder(), at);
}

#[inline(always)]
fn bounds_simd<S: Kern, T: SimdElem>(
    s: S,
    extra: S::Extra,
    q: &[f32],
    heads: usize,
    d: usize,
    bounds: &[T],
    out: &mut [f32],
) {
    let mut h0 = 0;
    while h0 < heads {
        let q = &q[h0 * d..];
        by_heads!(heads - h0, H => bounds_heads::<S, T, H>(s, extra, q, heads, h0, d, bounds, out));
        h0 += 4;
    }
}

/// How many blocks ahead [`bounds_heads`] prefetches.
const PREFETCH_BLOCKS: usize = 4;

/// [`bounds_simd`] for heads `h0..h0 + H` (`q` starts at head `h0`): each
/// block's bounds are loaded and widened once for the `H` heads.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn bounds_heads<S: Kern, T: SimdElem, const H: usize>(
    s: S,
    extra: S::Extra,
    q: &[f32],
    heads: usize,
    h0: usize,
    d: usize,
    bounds: &[T],
    out: &mut [f32],
) {
    let lanes = S::F32_LANES;
    let nv = d / lanes;
    let full = nv * lanes;
    // Whole vectors of each head's query, all of length `nv`: with the
    // loop bound known, the indexing below compiles without bounds checks
    // (with them, this loop was bound by its scalar instructions).
    let qv: [&[S::f32s]; H] =
        core::array::from_fn(|h| &S::as_simd_f32s(&q[h * d..(h + 1) * d]).0[..nv]);
    for (b, blk) in bounds.chunks_exact(2 * d).enumerate() {
        // The stream is read once per step and is cold: fetch a few blocks
        // ahead (no hardware prefetcher keeps up with this loop alone).
        let ahead = (b + PREFETCH_BLOCKS) * 2 * d;
        if let Some(row) = bounds.get(ahead..ahead + 2 * d) {
            prefetch_row(s, row);
        }
        let (lo, hi) = blk.split_at(d);
        let mut acc = [s.splat_f32s(0.0); 4];
        for (i, (l, u)) in lo[..full]
            .chunks_exact(lanes)
            .zip(hi[..full].chunks_exact(lanes))
            .enumerate()
        {
            let (l, u) = (T::load(s, extra, l), T::load(s, extra, u));
            for (a, q) in acc.iter_mut().zip(&qv) {
                let x = q[i];
                *a = s.add_f32s(*a, s.max_f32s(s.mul_f32s(x, l), s.mul_f32s(x, u)));
            }
        }
        let sums = s.reduce_sum4(acc);
        for (h, &sum) in sums.iter().enumerate().take(H) {
            let qh = &q[h * d..(h + 1) * d];
            let mut t = sum;
            for i in full..d {
                t += (qh[i] * lo[i].to_f32()).max(qh[i] * hi[i].to_f32());
            }
            out[b * heads + h0 + h] = t;
        }
    }
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
    check_len("q", n_q * shape.q_len(), q.len())?;
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
            check_len("weights", shape.group() * sel.total(), w.len())?;
        }
        self.run(
            shape,
            q,
            1,
            kv,
            |_, g| Spec::List(sel.head(g)),
            |g| sel.offset(g),
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
