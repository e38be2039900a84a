//! One sequence of the hybrid layer: its window and CPU store, eviction,
//! and the decode step in its three parts (submit the dense side, run the
//! CPU side, wait and merge), the prompt chunks and the MAW re-evaluation.
//! Which CPU entries a step attends, and the MAW update, are in
//! [`crate::select`].

use std::time::{Duration, Instant};

use hgca_kernels::{
    CpuStore, DenseAttention, Error, KvElem, KvWindow, Partial, PartialLayout, Result, Selection,
    SparseAttention, WindowSpec, check_len, check_len_of, merge_into,
};

use crate::layer::Shared;
use crate::select::{HeadMaw, HeadScratch};
use crate::{Recovery, StepStats};

/// The slot of the window's logical token `j` (0: the oldest) in the ring
/// of `cap` slots, starting at `head`, that holds the window's MAW.
fn ring_slot(head: usize, cap: usize, j: usize) -> usize {
    (head + j) % cap
}

/// One sequence's cache (window and CPU store) and selection state.
pub(crate) struct Seq<D: DenseAttention, T: KvElem, C> {
    pub(crate) window: D::Window,
    /// MAW of the window's tokens, `[kv_heads][capacity]`, in the window's ring order.
    pub(crate) win_maw: Vec<f32>,
    pub(crate) win_head: usize,
    pub(crate) store: C,
    /// MAW of the CPU entries, per KV head.
    pub(crate) maw: Vec<HeadMaw>,
    /// Per KV head, per store block: elementwise min and max of its keys (`[2, d]`).
    pub(crate) bounds: Vec<Vec<T>>,
    pub(crate) sel: Selection,
    pub(crate) steps: usize,
    /// Union lse of the last decode step per query head (reference for block bounds).
    pub(crate) last_lse: Vec<f32>,
    /// The window's lse of the last decode step per query head (the mass selector's reference).
    pub(crate) last_win_lse: Vec<f32>,
    /// [`Recovery::Mass`]: the low-bit copy of each KV head's CPU keys.
    pub(crate) codes: Vec<crate::mass::KeyCopy>,
    pub(crate) stats: StepStats,
    /// Per-KV-head scratch of the selection.
    pub(crate) heads: Vec<HeadScratch>,
    /// Reused weight buffers of the two sides, and the per-head factors to the union.
    pub(crate) gpu_w: Vec<f32>,
    pub(crate) cpu_w: Vec<f32>,
    pub(crate) to_union: Vec<f32>,
    pub(crate) evict_k: Vec<T>,
    pub(crate) evict_v: Vec<T>,
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

impl<D, T, C> Clone for Seq<D, T, C>
where
    D: DenseAttention,
    D::Window: Clone,
    T: KvElem,
    C: Clone,
{
    fn clone(&self) -> Self {
        Self {
            window: self.window.clone(),
            win_maw: self.win_maw.clone(),
            win_head: self.win_head,
            store: self.store.clone(),
            maw: self.maw.clone(),
            bounds: self.bounds.clone(),
            sel: self.sel.clone(),
            steps: self.steps,
            last_lse: self.last_lse.clone(),
            last_win_lse: self.last_win_lse.clone(),
            codes: self.codes.clone(),
            stats: self.stats.clone(),
            heads: self.heads.clone(),
            gpu_w: self.gpu_w.clone(),
            cpu_w: self.cpu_w.clone(),
            to_union: self.to_union.clone(),
            evict_k: self.evict_k.clone(),
            evict_v: self.evict_v.clone(),
        }
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
            codes: if matches!(cfg.recovery, Recovery::Mass(_)) {
                vec![crate::mass::KeyCopy::new(cfg.key_codes, shape.head_dim()); hk]
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

    pub(crate) fn maw_snapshot<S>(&self, l: &Shared<D, S>) -> Vec<Vec<f32>> {
        let cap = l.cfg.window;
        (0..l.shape.kv_heads())
            .map(|g| {
                let mut v = self.maw[g].values.clone();
                v.extend(
                    (0..self.window.len())
                        .map(|j| self.win_maw[g * cap + ring_slot(self.win_head, cap, j)]),
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
                .extend((0..n).map(|i| self.win_maw[g * cap + ring_slot(self.win_head, cap, i)]));
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
        // The mass selector's low-bit copy (empty under the other rules).
        for (g, keys) in self.codes.iter_mut().enumerate() {
            keys.sync(&self.store, g, l.cfg.sinks);
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
        let at = ring_slot(self.win_head, cap, self.window.len());
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
            bounded_blocks: self.heads.iter().map(|h| h.report.bounded_blocks).sum(),
        };
        Ok(())
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
