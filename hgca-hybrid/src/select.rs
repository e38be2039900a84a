//! Which CPU entries a decode step attends, per KV head: the MAW rule and
//! the recovery rules (block bounds, the mass-targeted selector of
//! [`crate::mass`]), and the MAW update after the step.

use hgca_kernels::{CpuStore, DenseAttention, Error, KvElem, KvWindow, Partial, Result};

use crate::layer::Shared;
use crate::seq::Seq;
use crate::{Recovery, mass};

/// The MAW of one KV head's CPU entries, with each store block's maximum:
/// the selection skips the blocks whose maximum does not pass (an MAW scan
/// of every entry was about a third of the selection's time at 128k).
#[derive(Debug, Default, Clone)]
pub(crate) struct HeadMaw {
    pub(crate) values: Vec<f32>,
    /// Per store block, the maximum of its values (NaN ignored, as the MAW
    /// rule never passes NaN); recomputed whenever one of them changes.
    pub(crate) block_max: Vec<f32>,
}

impl HeadMaw {
    /// Recomputes the maxima of the blocks of `tokens`, given in ascending
    /// order (a block is recomputed once per run of its tokens, with one
    /// division per block, not per token).
    pub(crate) fn refresh(&mut self, block: usize, tokens: impl IntoIterator<Item = usize>) {
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
pub(crate) fn max_ignoring_nan(v: &[f32]) -> f32 {
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
pub(crate) struct ErrSlot(std::sync::Mutex<Option<Error>>);

impl ErrSlot {
    /// Keeps `r`'s error if it is the first; true when `r` is `Ok`.
    pub(crate) fn keep(&self, r: Result<()>) -> bool {
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

    pub(crate) fn into_result(self) -> Result<()> {
        match self.0.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Scratch of one KV head's selection: its indices, block bounds, ranking.
#[derive(Debug, Default, Clone)]
pub(crate) struct HeadScratch {
    pub(crate) idx: Vec<u32>,
    pub(crate) ub: Vec<f32>,
    pub(crate) ranked: Vec<(f32, u32)>,
    pub(crate) admitted: Vec<bool>,
    pub(crate) mass: mass::Scratch,
    pub(crate) report: mass::HeadReport,
}

impl<D: DenseAttention, T: KvElem, C: CpuStore<T>> Seq<D, T, C> {
    /// The selection of this decode step: the MAW rule, the sinks, and the
    /// recovery rule's admissions.
    pub(crate) fn select<S>(&mut self, l: &Shared<D, S>, q: &[f32]) -> Result<()> {
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
        let (codes, last_win_lse) = (&self.codes, &self.last_win_lse);
        let store: &dyn hgca_kernels::KvSource<T> = &self.store;
        let oracle = l.oracle;
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
                    keys: &codes[g],
                    block: bt,
                    sinks,
                    exact: oracle.then_some((store, g)),
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
    pub(crate) fn update_maw<S>(
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
