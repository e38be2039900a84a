//! The CPU backend's task planner and runner: one call's work split into
//! tasks over (query token, KV head, head subgroup, token chunk), run on the
//! backend's threads ([`CpuBackend::for_each_item`]), and the chunks'
//! partials merged exactly by LSE.

use hgca_kernels::{AttnShape, KvSource, PartialMut, merge_rows};

use crate::backend::{CpuBackend, Par};
use crate::isa::{SimdElem, dispatch};
use crate::kernel::{
    Heads, ListTokens, MAX_HEADS, RangeTokens, Run, ScoreOut, ThresholdTokens, attend, exp_shifted,
    finish,
};

/// Tokens a chunk of the work attends to smallest (smaller splits cost more in merges than they win).
const MIN_CHUNK: usize = 256;

/// How one KV head's tokens are given.
#[derive(Clone, Copy)]
pub(crate) enum Spec<'a> {
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
pub(crate) struct Job<KF, SF, WF> {
    pub(crate) units: std::ops::Range<usize>,
    pub(crate) kv: KF,
    pub(crate) spec: SF,
    pub(crate) weight_offset: WF,
    pub(crate) par: Par,
}

thread_local! {
    /// The calling thread's scratch for [`CpuBackend::run`].
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// One piece of work: query token `t`, KV head `g`, query heads
/// `h0..h0+hn` of its group, chunk `c` of its tokens.
#[derive(Clone, Copy)]
pub(crate) struct Task {
    t: usize,
    g: usize,
    h0: usize,
    hn: usize,
    c: usize,
}

pub(crate) struct Plan {
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
    pub(crate) fn plan(
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
    pub(crate) fn run_whole<'s, T: SimdElem, K: KvSource<T>>(
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
    pub(crate) fn run<'s, T: SimdElem, K: KvSource<T>>(
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
pub(crate) struct TaskIo<'a> {
    buf: &'a mut [f32],
    picked: Option<&'a mut Vec<u32>>,
    w: Option<&'a mut [f32]>,
}
