//! The mass-targeted selector ([`crate::Recovery::Mass`]) of one KV head:
//! CPU entries are admitted in decreasing estimated weight until the
//! estimated share of the attention mass they leave out is at most
//! `1 - target`, so a head with flat attention takes many entries and a
//! head with sharp attention few, under one setting.
//!
//! The estimate has two stages, both cheap next to exact attention:
//!
//! 1. **Block bounds** (Quest): per store block, an upper bound of every
//!    score in it. Blocks whose bounded mass, summed from the smallest,
//!    stays within a quarter of the budget are dropped unseen: what they
//!    hold is at most that (the bound is rigorous; the normaliser is an
//!    estimate). A head skips them for a while after they dropped nothing
//!    (on real models' keys they hardly ever do).
//! 2. **A low-bit copy of the keys** ([`KeyCodes`]: int4 codes of keys
//!    whitened per channel, or int8 codes; one scale per row): estimated
//!    scores of every entry of the remaining blocks.
//!
//! The weights are normalised against the union of the window and the CPU
//! store: the reference is the union's lse of the previous step, and the
//! window's share of it then (the window changes by one token a step).

use hgca_cpu::{CpuBackend, INT8_TILE, Int4Keys, Int8Keys};
use hgca_kernels::{KvElem, KvSource, MassTarget, Result};

use crate::KeyCodes;

/// The codes of a [`KeyCopy`].
#[derive(Debug, Clone)]
enum Codes {
    Int8(Int8Keys),
    Int4(Int4Keys),
}

/// The low-bit copy of one KV head's CPU keys: each row (for int4 codes)
/// whitened per channel, `(k - center) / gain`, then quantised with its own
/// scale. The centre and gain are the per-channel mean and deviation of
/// the rows held (the sinks left out when there are others), measured again
/// each time the rows double, when every row is encoded anew from the
/// store: an affine map the estimate folds into the query (`q·k = (q ∘
/// gain)·k' + q·center`), fitted to more of the keys as the context grows
/// (fitted to the first evicted block alone, the int4 estimate needed
/// twice the entries on Qwen2.5-0.5B's keys), at an amortised cost of one
/// more encoding of each row.
#[derive(Debug, Clone)]
pub(crate) struct KeyCopy {
    codes: Codes,
    /// The whitening (int4 only; empty before the first rows, and always
    /// for int8, whose rows are quantised as they are).
    center: Vec<f32>,
    gain: Vec<f32>,
    /// Rows the whitening was measured on (0: none yet).
    calibrated: usize,
    row: Vec<f32>,
}

impl KeyCopy {
    pub(crate) fn new(kind: KeyCodes, d: usize) -> Self {
        Self {
            codes: match kind {
                KeyCodes::Int8 => Codes::Int8(Int8Keys::new(d)),
                KeyCodes::Int4 => Codes::Int4(Int4Keys::new(d)),
            },
            center: Vec::new(),
            gain: Vec::new(),
            calibrated: 0,
            row: vec![0.0; d],
        }
    }

    /// Rows held.
    pub(crate) fn len(&self) -> usize {
        match &self.codes {
            Codes::Int8(k) => k.len(),
            Codes::Int4(k) => k.len(),
        }
    }

    /// Encodes the rows of KV head `head` that `store` holds past the ones
    /// copied (all of them again, after a new whitening, when an int4 copy's
    /// rows reach twice those it was measured on, or when the store holds
    /// fewer rows than the copy).
    pub(crate) fn sync<T: KvElem, S: KvSource<T> + ?Sized>(
        &mut self,
        store: &S,
        head: usize,
        sinks: usize,
    ) {
        let (d, n) = (self.row.len(), store.tokens());
        if d == 0 || n == self.len() {
            return;
        }
        let int4 = matches!(self.codes, Codes::Int4(_));
        if n < self.len() || (int4 && n >= 2 * self.calibrated) {
            match &mut self.codes {
                Codes::Int8(c) => c.clear(),
                Codes::Int4(c) => c.clear(),
            }
            if int4 {
                // Int8 rows go as they are: whitening them selected more
                // entries for no better answers (Qwen2.5-0.5B, 4k ruler).
                let skip = if sinks < n { sinks } else { 0 };
                self.calibrate((skip..n).map(|j| store.k_row(head, j)));
                self.calibrated = n;
            }
        }
        for j in self.len()..n {
            let k = store.k_row(head, j);
            if self.gain.is_empty() {
                for (r, &x) in self.row.iter_mut().zip(k) {
                    *r = x.to_f32();
                }
            } else {
                for (((r, &x), &c), &g) in
                    self.row.iter_mut().zip(k).zip(&self.center).zip(&self.gain)
                {
                    *r = (x.to_f32() - c) / g;
                }
            }
            match &mut self.codes {
                Codes::Int8(c) => c.push(&self.row),
                Codes::Int4(c) => c.push(&self.row),
            }
        }
    }

    /// The per-channel mean and standard deviation of `rows` (finite values
    /// only), the gains floored at a hundredth of the largest (a channel
    /// nearly constant in the first rows must not blow up later ones).
    fn calibrate<'a, T: KvElem + 'a>(&mut self, rows: impl Iterator<Item = &'a [T]>) {
        let d = self.row.len();
        let (mut sum, mut sq, mut cnt) = (vec![0f64; d], vec![0f64; d], vec![0u32; d]);
        for k in rows {
            for (i, &x) in k.iter().enumerate() {
                let x = f64::from(x.to_f32());
                if x.is_finite() {
                    sum[i] += x;
                    sq[i] += x * x;
                    cnt[i] += 1;
                }
            }
        }
        self.center = (0..d)
            .map(|i| {
                if cnt[i] > 0 {
                    (sum[i] / f64::from(cnt[i])) as f32
                } else {
                    0.0
                }
            })
            .collect();
        let sd: Vec<f64> = (0..d)
            .map(|i| {
                if cnt[i] == 0 {
                    return 0.0;
                }
                let m = sum[i] / f64::from(cnt[i]);
                (sq[i] / f64::from(cnt[i]) - m * m).max(0.0).sqrt()
            })
            .collect();
        let top = sd.iter().copied().fold(0.0, f64::max);
        self.gain = sd
            .iter()
            .map(|&g| {
                let g = if top > 0.0 && top.is_finite() {
                    g.max(top / 100.0)
                } else {
                    1.0
                };
                if g.is_finite() && g > 0.0 {
                    g as f32
                } else {
                    1.0
                }
            })
            .collect();
        if !self.center.iter().all(|c| c.is_finite()) {
            self.center.fill(0.0);
        }
    }

    /// One scale per row (the quantisation step of its codes).
    fn scales(&self) -> &[f32] {
        match &self.codes {
            Codes::Int8(k) => k.scales(),
            Codes::Int4(k) => k.scales(),
        }
    }

    /// The queries and offsets the codes are scored with: `q` and
    /// `offset` with the whitening folded in (into `qw`, `ow`), or as they
    /// are when there is none.
    fn fold<'a>(
        &self,
        q: &'a [f32],
        offset: &'a [f32],
        qw: &'a mut Vec<f32>,
        ow: &'a mut Vec<f32>,
    ) -> (&'a [f32], &'a [f32]) {
        if self.gain.is_empty() {
            return (q, offset);
        }
        let d = self.row.len();
        qw.clear();
        ow.clear();
        for (qh, &o) in q.chunks_exact(d).zip(offset) {
            qw.extend(qh.iter().zip(&self.gain).map(|(&x, &g)| x * g));
            let shift: f32 = qh.iter().zip(&self.center).map(|(&x, &c)| x * c).sum();
            ow.push(o - shift);
        }
        (qw, ow)
    }

    /// Estimated `max_h (q_h·k_j - offset_h)` for rows `rows` (starting on
    /// a tile boundary) into `out`, with `q` and `offset` from [`Self::fold`].
    fn scores(
        &self,
        cpu: &CpuBackend,
        q: &[f32],
        offset: &[f32],
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let d = self.row.len();
        match &self.codes {
            Codes::Int8(k) => {
                let (codes, scales) = k.rows(rows);
                cpu.int8_max_scores(q, offset, d, codes, scales, out)
            }
            Codes::Int4(k) => {
                let (codes, scales) = k.rows(rows);
                cpu.int4_max_scores(q, offset, d, codes, scales, out)
            }
        }
    }
}

/// Log-space histogram of the estimated weights: buckets of
/// `1 / BUCKETS_PER_NAT` nats below the largest, the last one holding
/// everything further down.
const BUCKETS_PER_NAT: f32 = 4.0;
const BUCKETS: usize = 96;

/// What the selector did for one KV head in one step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct HeadReport {
    /// The estimated share of the head's attention mass (window included)
    /// that the step attends.
    pub(crate) estimated: f32,
    /// True when the target needed more than `max_share` of the CPU
    /// entries and the head took all of them instead.
    pub(crate) dense: bool,
    /// Entries whose low-bit estimate was computed (the rest were dropped by
    /// their block bounds).
    pub(crate) estimated_entries: usize,
    /// Blocks whose key bounds were read.
    pub(crate) bounded_blocks: usize,
}

/// Reused buffers of one head's selection.
#[derive(Debug, Default, Clone)]
pub(crate) struct Scratch {
    q: Vec<f32>,
    qw: Vec<f32>,
    ow: Vec<f32>,
    ub: Vec<f32>,
    blocks: Vec<(f32, u32)>,
    culled: Vec<bool>,
    est: Vec<f32>,
    /// The estimates' weights against the largest, `exp(est - top)`.
    w: Vec<f32>,
    /// Per unit of a row's scale, the admission margin of its estimate
    /// (0 for exact scores).
    margin: f32,
    /// Steps left before the block bounds are read again.
    bounds_idle: u32,
    /// Blocks whose bounds the last step read.
    bounded_blocks: usize,
}

/// Steps the block bounds are skipped for after a step where they dropped
/// no block. On real keys they are loose: they dropped none on Qwen2.5-0.5B
/// and Gemma 3 at 4k-16k tokens (the bytes read were those of the selected
/// rows, every entry's low-bit row and every block's bounds, to the
/// rounding), where reading them cost a 64th of full attention's bytes
/// (blocks of 64, bounds of two rows); they pay on sharp heads over
/// clustered keys (the synthetic harness). Skipping only estimates more
/// entries, never fewer.
const BOUNDS_IDLE: u32 = 15;

/// The admission margin of int4 estimates in standard deviations of their
/// rounding error: an entry is admitted when its estimate is within this
/// many of them below the threshold. Without one, the entries left out
/// next to the threshold are those the rounding pushed down: on the
/// synthetic scattered shift (48 needles of equal score holding 99% of the
/// mass, target 0.99) 4% of the mass went missing. On real keys the
/// errors cancel and the margin only adds entries (`scripts/selector_study.py`
/// over Qwen2.5-0.5B's keys at 4096 tokens: 17.9% of the entries admitted
/// with none, 21.7% with half a sigma, 33.7% with two, and with two a
/// quarter of the head-steps fell back to dense); half a sigma holds the
/// synthetic needles.
const MARGIN_SIGMAS: f32 = 0.5;

/// One KV head's inputs.
pub(crate) struct Head<'a, T> {
    /// The group's queries, `[group, d]`.
    pub(crate) q: &'a [f32],
    /// Score scale.
    pub(crate) scale: f32,
    /// Per query head of the group, the union lse of the previous step.
    pub(crate) lse_ref: &'a [f32],
    /// Per query head, the window's lse of the previous step.
    pub(crate) win_lse: &'a [f32],
    /// The head's block bounds (`[blocks, 2, d]`, the KV dtype).
    pub(crate) bounds: &'a [T],
    /// The low-bit copy of the head's CPU keys.
    pub(crate) keys: &'a KeyCopy,
    /// Store block size in tokens.
    pub(crate) block: usize,
    /// Entries always attended (the first ones).
    pub(crate) sinks: usize,
    /// The oracle ([`crate::HybridAttention::with_oracle_scores`]): the
    /// exact scores of every entry, from the store's keys of this KV head,
    /// in place of the two estimate stages.
    pub(crate) exact: Option<(&'a dyn KvSource<T>, usize)>,
}

/// Selects for one head: `idx` (cleared) gets the admitted entries in
/// ascending order.
pub(crate) fn select<T: KvElem>(
    cpu: &CpuBackend,
    h: &Head<'_, T>,
    target: MassTarget,
    s: &mut Scratch,
    idx: &mut Vec<u32>,
) -> Result<HeadReport> {
    let n = h.exact.map_or(h.keys.len(), |(k, _)| k.tokens());
    let group = h.lse_ref.len();
    let d = h.q.len() / group.max(1);
    idx.clear();
    let all = |idx: &mut Vec<u32>| idx.extend(0..n as u32);
    if n == 0 {
        return Ok(HeadReport {
            estimated: 1.0,
            ..HeadReport::default()
        });
    }
    // The window's share of the previous union: the smallest over the
    // group, so that the normaliser is never overestimated (an
    // underestimate only admits more).
    let win = h
        .win_lse
        .iter()
        .zip(h.lse_ref)
        .map(|(&w, &u)| (w - u).exp())
        .fold(f32::INFINITY, f32::min);
    if !(win.is_finite() && win > 0.0) || h.lse_ref.iter().any(|x| !x.is_finite()) {
        // No usable reference (no previous step, an empty window): dense.
        all(idx);
        return Ok(HeadReport {
            estimated: 1.0,
            dense: true,
            estimated_entries: 0,
            bounded_blocks: 0,
        });
    }
    let budget = 1.0 - target.target;
    let (culled_mass, estimated_entries) = match h.exact {
        Some((keys, kvh)) => {
            exact_scores(h, keys, kvh, n, d, s);
            s.margin = 0.0;
            s.bounded_blocks = 0;
            (0.0, n)
        }
        None => estimate(cpu, h, n, d, budget, win, s)?,
    };
    admit(
        cpu,
        h,
        target,
        n,
        win,
        culled_mass,
        estimated_entries,
        s,
        idx,
    )
}

/// The exact counterpart of the estimate: `est[j]` is the largest over the
/// group of `scale q_i . k_j - lse_ref_i`, from the keys themselves (f32
/// products, a scalar loop: an evaluation's bound, not a selector's cost).
fn exact_scores<T: KvElem>(
    h: &Head<'_, T>,
    keys: &dyn KvSource<T>,
    kvh: usize,
    n: usize,
    d: usize,
    s: &mut Scratch,
) {
    s.est.clear();
    s.est.extend((0..n).map(|j| {
        let k = keys.k_row(kvh, j);
        h.q.chunks_exact(d)
            .zip(h.lse_ref)
            .map(|(q, &r)| {
                let dot: f32 = q.iter().zip(k).map(|(&a, &b)| a * b.to_f32()).sum();
                dot * h.scale - r
            })
            .fold(f32::NEG_INFINITY, f32::max)
    }));
}

/// The two estimate stages: fills `s.est` (`-inf` for the entries of
/// dropped blocks) and returns the dropped blocks' bounded mass (relative
/// to the reference's window share) and the entries estimated.
fn estimate<T: KvElem>(
    cpu: &CpuBackend,
    h: &Head<'_, T>,
    n: usize,
    d: usize,
    budget: f32,
    win: f32,
    s: &mut Scratch,
) -> Result<(f64, usize)> {
    let (group, bt) = (h.lse_ref.len(), h.block);
    let nb = n.div_ceil(bt);
    s.culled.clear();
    s.culled.resize(nb, false);
    let mut culled_mass = 0.0f64;
    s.bounded_blocks = 0;
    if s.bounds_idle > 0 {
        // Stage 1 culled nothing when it last ran: skipped this step.
        s.bounds_idle -= 1;
    } else {
        // Stage 1: block bounds, as log weights against the reference.
        s.ub.resize(nb * group, 0.0);
        cpu.block_upper_bounds(h.q, group, d, &h.bounds[..nb * 2 * d], &mut s.ub)?;
        s.bounded_blocks = nb;
        s.blocks.clear();
        s.blocks.extend((0..nb).map(|b| {
            let u = (0..group)
                .map(|i| s.ub[b * group + i] * h.scale - h.lse_ref[i])
                .fold(f32::NEG_INFINITY, f32::max);
            (u, b as u32)
        }));
        s.blocks.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        for &(u, b) in &s.blocks {
            let b = b as usize;
            if b * bt < h.sinks {
                // The sinks' blocks are estimated (the sinks are taken anyway).
                continue;
            }
            let cnt = (n.min((b + 1) * bt) - b * bt) as f64;
            let m = cnt * f64::from(u).exp() / f64::from(win);
            if culled_mass + m > f64::from(budget) / 4.0 {
                break;
            }
            culled_mass += m;
            s.culled[b] = true;
        }
        if !s.culled.contains(&true) {
            s.bounds_idle = BOUNDS_IDLE;
        }
    }
    // Stage 2: low-bit estimates of the entries of the other blocks, in runs
    // of consecutive kept blocks (a run starts at a tile boundary: a few
    // entries of a dropped block may be estimated too, which only adds).
    s.q.clear();
    s.q.extend(h.q.iter().map(|&x| x * h.scale));
    let (q, offset) = h.keys.fold(&s.q, h.lse_ref, &mut s.qw, &mut s.ow);
    s.est.clear();
    s.est.resize(n, f32::NEG_INFINITY);
    let mut estimated_entries = 0;
    let mut b = 0;
    while b < nb {
        if s.culled[b] {
            b += 1;
            continue;
        }
        let mut e = b + 1;
        while e < nb && !s.culled[e] {
            e += 1;
        }
        let start = (b * bt) / INT8_TILE * INT8_TILE;
        let end = (e * bt).min(n);
        h.keys
            .scores(cpu, q, offset, start..end, &mut s.est[start..end])?;
        estimated_entries += end - start;
        b = e;
    }
    s.margin = if matches!(h.keys.codes, Codes::Int4(_)) {
        // A row's codes are within half its scale of the whitened key, an
        // error uniform over that interval: the estimate's is then of
        // standard deviation `scale |q'|_2 / sqrt(12)` (q' the whitened
        // query), the largest over the group.
        let qn = q
            .chunks_exact(d)
            .map(|q| q.iter().map(|x| x * x).sum::<f32>().sqrt())
            .fold(0.0f32, f32::max);
        MARGIN_SIGMAS * qn / 12f32.sqrt()
    } else {
        // Int8 rounding is 18 times finer: no margin (with one, more
        // entries were admitted for no better answers).
        0.0
    };
    Ok((culled_mass, estimated_entries))
}

/// Admits entries by their (estimated or exact) weight in `s.est` until
/// the target's share of the mass, the sinks always; a head past the max
/// share takes every entry.
#[allow(clippy::too_many_arguments)]
fn admit<T: KvElem>(
    cpu: &CpuBackend,
    h: &Head<'_, T>,
    target: MassTarget,
    n: usize,
    win: f32,
    culled_mass: f64,
    estimated_entries: usize,
    s: &mut Scratch,
    idx: &mut Vec<u32>,
) -> Result<HeadReport> {
    let budget = 1.0 - target.target;
    let all = |idx: &mut Vec<u32>| idx.extend(0..n as u32);
    // The normaliser (relative to the reference): the window's share plus
    // the estimated CPU mass; the sinks are admitted whatever they weigh.
    let sinks = h.sinks.min(n);
    let mut hist = [0.0f64; BUCKETS];
    let mut cpu_mass = 0.0f64;
    // The weights in one vectorised pass (a scalar exp per entry was most
    // of the selection's time); an estimate that is not finite weighs 0
    // here (+inf, a key the low-bit copy cannot hold, passes any threshold
    // below). The largest finite estimate in the same pass, eight lanes
    // at a time (a scalar filter-and-max was 40% of the admission's own
    // time in a profile of Qwen2.5-0.5B at 8k).
    s.w.clear();
    s.w.resize(n - sinks, 0.0);
    let mut lanes = [f32::NEG_INFINITY; 8];
    {
        let (e8, e_tail) = s.est[sinks..].as_chunks::<8>();
        let (w8, w_tail) = s.w.as_chunks_mut::<8>();
        let finite = |x: f32| if x.is_finite() { x } else { f32::NEG_INFINITY };
        for (e, w) in e8.iter().zip(w8) {
            for l in 0..8 {
                w[l] = finite(e[l]);
                lanes[l] = if w[l] > lanes[l] { w[l] } else { lanes[l] };
            }
        }
        for (&e, w) in e_tail.iter().zip(w_tail) {
            *w = finite(e);
            lanes[0] = lanes[0].max(*w);
        }
    }
    let top = lanes.into_iter().fold(f32::NEG_INFINITY, f32::max);
    if top.is_finite() {
        cpu.exp_shifted(&mut s.w, top);
    }
    if top.is_finite() {
        // Branch-free: the weight of an estimate that is not finite is 0
        // (`exp_shifted` of -inf), whatever bucket the saturating
        // conversion gives it. Four histograms taken in turn, so that runs
        // of entries in one bucket do not wait on each other's stores.
        // The float's `min` first (NaN gives the last bucket), then a
        // 32-bit conversion (negatives give 0): no 64-bit saturation.
        let bucket =
            |x: f32| ((top - x) * BUCKETS_PER_NAT).min((BUCKETS - 1) as f32) as u32 as usize;
        let mut part = [[0.0f64; BUCKETS]; 4];
        let (e4, e_tail) = s.est[sinks..].as_chunks::<4>();
        let (w4, w_tail) = s.w.as_chunks::<4>();
        for (x, w) in e4.iter().zip(w4) {
            for l in 0..4 {
                part[l][bucket(x[l])] += f64::from(w[l]);
            }
        }
        for (&x, &w) in e_tail.iter().zip(w_tail) {
            part[0][bucket(x)] += f64::from(w);
        }
        for (k, h) in hist.iter_mut().enumerate() {
            *h = (part[0][k] + part[1][k]) + (part[2][k] + part[3][k]);
            cpu_mass += *h;
        }
    }
    let sink_mass: f64 = s.est[..sinks]
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| f64::from(x - top).exp())
        .sum();
    // In units of exp(top): the window's share and the CPU's estimate.
    let scale_top = f64::from(top).exp();
    let z = if top.is_finite() {
        f64::from(win) / scale_top + cpu_mass + sink_mass
    } else {
        // Nothing estimated outside the sinks: the window holds the rest.
        f64::from(win)
    };
    let culled_rel = if top.is_finite() {
        culled_mass * f64::from(win) / (z * scale_top)
    } else {
        culled_mass * f64::from(win) / z
    };
    let allowed = (f64::from(budget) - culled_rel).max(0.0) * z;
    // The lowest buckets whose mass fits the budget are left out.
    let mut left = 0.0f64;
    let mut threshold = f32::INFINITY;
    for k in (0..BUCKETS).rev() {
        if left + hist[k] > allowed {
            threshold = top - (k + 1) as f32 / BUCKETS_PER_NAT;
            if k == BUCKETS - 1 {
                threshold = f32::NEG_INFINITY;
            }
            break;
        }
        left += hist[k];
    }
    if !top.is_finite() || threshold == f32::INFINITY {
        // Nothing finite to admit; entries estimated +inf still pass.
        threshold = f32::MAX;
    }
    if s.margin > 0.0 && threshold > f32::NEG_INFINITY && threshold < f32::MAX {
        // Each estimate raised by its margin before the comparison (only
        // the admission: the mass accounting above used the estimates).
        for (e, &sc) in s.est[sinks..].iter_mut().zip(&h.keys.scales()[sinks..]) {
            *e += s.margin * sc;
        }
    }
    idx.extend(0..sinks as u32);
    cpu.indices_above(&s.est[sinks..], threshold, sinks as u32, idx);
    let limit = (f64::from(target.max_share) * n as f64).ceil() as usize;
    if idx.len() > limit.min(n) {
        idx.clear();
        all(idx);
        return Ok(HeadReport {
            estimated: 1.0,
            dense: true,
            estimated_entries,
            bounded_blocks: s.bounded_blocks,
        });
    }
    let omitted = if z > 0.0 {
        (left / z) + culled_rel
    } else {
        0.0
    };
    Ok(HeadReport {
        estimated: (1.0 - omitted).clamp(0.0, 1.0) as f32,
        dense: false,
        estimated_entries,
        bounded_blocks: s.bounded_blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hgca_kernels::KvStore;

    /// The oracle's admission on exact scores with the step's own union
    /// lse as the reference: the entries left out weigh no more than any
    /// entry admitted, together at most `1 - target` of the union, and the
    /// reported share is the exact one. The int8 copy is empty, so an
    /// oracle that fell back to the estimate would admit nothing.
    #[test]
    fn oracle_admits_by_exact_weight_to_the_target() {
        let (d, n) = (8usize, 300usize);
        let mut rng = hgca_testkit::Rng::new(0x2545_F491_4F6C_DD1D);
        let mut rnd = || rng.sym();
        let k: Vec<f32> = (0..n * d).map(|_| 3.0 * rnd()).collect();
        let mut store = KvStore::<f32>::new(1, d, 64).unwrap();
        store.push_head_major(n, &k, &k).unwrap();
        let q: Vec<f32> = (0..d).map(|_| rnd()).collect();
        let scale = 1.0 / (d as f32).sqrt();
        let s: Vec<f64> = (0..n)
            .map(|j| {
                let dot: f32 = q
                    .iter()
                    .zip(&k[j * d..(j + 1) * d])
                    .map(|(a, b)| a * b)
                    .sum();
                f64::from(dot * scale)
            })
            .collect();
        // A window holding as much mass as a tenth of the entries' total.
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let cpu_sum: f64 = s.iter().map(|v| (v - m).exp()).sum();
        let win_lse = m + (0.1 * cpu_sum).ln();
        let union = m + (1.1 * cpu_sum).ln();
        let (lse_ref, win) = ([union as f32], [win_lse as f32]);
        let empty = KeyCopy::new(KeyCodes::Int4, d);
        for target in [0.5f32, 0.9, 0.99] {
            let head = Head {
                q: &q,
                scale,
                lse_ref: &lse_ref,
                win_lse: &win,
                bounds: &[],
                keys: &empty,
                block: 64,
                sinks: 0,
                exact: Some((&store as &dyn KvSource<f32>, 0)),
            };
            let mut idx = Vec::new();
            let r = select(
                &CpuBackend::new(),
                &head,
                MassTarget::new(target, 1.0).unwrap(),
                &mut Scratch::default(),
                &mut idx,
            )
            .unwrap();
            assert!(!r.dense && r.estimated_entries == n, "{r:?}");
            let w = |j: usize| (s[j] - union).exp();
            let (mut min_in, mut max_out, mut out) = (f64::INFINITY, 0f64, 0f64);
            for j in 0..n {
                if idx.contains(&(j as u32)) {
                    min_in = min_in.min(w(j));
                } else {
                    max_out = max_out.max(w(j));
                    out += w(j);
                }
            }
            assert!(
                !idx.is_empty() && idx.len() < n,
                "target {target}: {} admitted",
                idx.len()
            );
            assert!(
                max_out <= min_in * (1.0 + 1e-5),
                "target {target}: {max_out} out, {min_in} in"
            );
            assert!(
                out <= f64::from(1.0 - target) + 1e-5,
                "target {target}: {out} left out"
            );
            assert!(
                (f64::from(r.estimated) - (1.0 - out)).abs() < 1e-4,
                "target {target}: reported {} vs exact {}",
                r.estimated,
                1.0 - out
            );
        }
    }
    /// The int4 copy is whitened on the rows it holds and measured again
    /// (every row encoded anew) when they double: synced in blocks of 64
    /// up to 300 rows, it holds what a copy synced once at 256 and then at
    /// 300 holds, its centre is the mean of rows 4..256 (the sinks left
    /// out), and a copy of a store that shrank starts again.
    #[test]
    fn int4_copy_is_whitened_again_as_the_rows_double() {
        let (d, n, sinks) = (8usize, 300usize, 4usize);
        let mut rng = hgca_testkit::Rng::new(0x9E37_79B9_7F4A_7C15);
        let mut rnd = || rng.sym();
        // Channels whose spread grows along the sequence: a whitening
        // fitted to the first rows alone differs from one fitted to more.
        let k: Vec<f32> = (0..n * d)
            .map(|e| (1.0 + (e / d) as f32 / 32.0) * rnd() + (e % d) as f32)
            .collect();
        let mut store = KvStore::<f32>::new(1, d, 64).unwrap();
        let mut stepwise = KeyCopy::new(KeyCodes::Int4, d);
        let mut first = None;
        for c in k.chunks(64 * d) {
            store.push_head_major(c.len() / d, c, c).unwrap();
            stepwise.sync(&store, 0, sinks);
            first.get_or_insert_with(|| stepwise.gain.clone());
        }
        assert_eq!(stepwise.len(), n);
        let mut once = KeyCopy::new(KeyCodes::Int4, d);
        let mut part = KvStore::<f32>::new(1, d, 64).unwrap();
        part.push_head_major(256, &k[..256 * d], &k[..256 * d])
            .unwrap();
        once.sync(&part, 0, sinks);
        part.push_head_major(n - 256, &k[256 * d..], &k[256 * d..])
            .unwrap();
        once.sync(&part, 0, sinks);
        let (Codes::Int4(a), Codes::Int4(b)) = (&stepwise.codes, &once.codes) else {
            unreachable!()
        };
        assert_eq!(a.codes(), b.codes());
        assert_eq!(a.scales(), b.scales());
        assert_eq!(stepwise.calibrated, 256);
        for i in 0..d {
            let m = (sinks..256).map(|j| f64::from(k[j * d + i])).sum::<f64>() / 252.0;
            assert!(
                (f64::from(stepwise.center[i]) - m).abs() < 1e-5,
                "channel {i}"
            );
        }
        assert_ne!(
            first.unwrap(),
            stepwise.gain,
            "the whitening was never refitted"
        );
        // A store that holds fewer rows than the copy: encoded from scratch.
        let mut short = KvStore::<f32>::new(1, d, 64).unwrap();
        short
            .push_head_major(100, &k[..100 * d], &k[..100 * d])
            .unwrap();
        stepwise.sync(&short, 0, sinks);
        let mut fresh = KeyCopy::new(KeyCodes::Int4, d);
        fresh.sync(&short, 0, sinks);
        let (Codes::Int4(a), Codes::Int4(b)) = (&stepwise.codes, &fresh.codes) else {
            unreachable!()
        };
        assert_eq!((a.codes(), a.scales()), (b.codes(), b.scales()));
    }
    /// The block bounds are read every step while they drop blocks, and
    /// skipped for `BOUNDS_IDLE` steps after a step where they dropped none.
    #[test]
    fn block_bounds_are_skipped_while_they_drop_nothing() {
        let (d, n, bt) = (8usize, 256usize, 64usize);
        let mut rng = hgca_testkit::Rng::new(0xD1B5_4A32_D192_ED03);
        let mut rnd = || rng.sym();
        let k: Vec<f32> = (0..n * d).map(|_| rnd()).collect();
        let mut store = KvStore::<f32>::new(1, d, 64).unwrap();
        store.push_head_major(n, &k, &k).unwrap();
        let mut keys = KeyCopy::new(KeyCodes::Int4, d);
        keys.sync(&store, 0, 0);
        let mut bounds = Vec::new();
        for b in k.chunks(bt * d) {
            let lo = (0..d).map(|i| {
                b.iter()
                    .skip(i)
                    .step_by(d)
                    .copied()
                    .fold(f32::INFINITY, f32::min)
            });
            let hi = (0..d).map(|i| {
                b.iter()
                    .skip(i)
                    .step_by(d)
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max)
            });
            bounds.extend(lo.collect::<Vec<_>>());
            bounds.extend(hi.collect::<Vec<_>>());
        }
        let q: Vec<f32> = (0..d).map(|_| rnd()).collect();
        let run = |lse_ref: f32, win_lse: f32| -> Vec<usize> {
            let (r, w) = ([lse_ref], [win_lse]);
            let head = Head {
                q: &q,
                scale: 1.0,
                lse_ref: &r,
                win_lse: &w,
                bounds: &bounds,
                keys: &keys,
                block: bt,
                sinks: 0,
                exact: None,
            };
            let (mut s, mut idx) = (Scratch::default(), Vec::new());
            let target = MassTarget::new(0.9, 1.0).unwrap();
            (0..2 * BOUNDS_IDLE as usize + 3)
                .map(|_| {
                    select(&CpuBackend::new(), &head, target, &mut s, &mut idx)
                        .unwrap()
                        .bounded_blocks
                })
                .collect()
        };
        // The window holds all but e^-60 of the mass: every block dropped,
        // the bounds read every step.
        assert!(run(60.0, 60.0).iter().all(|&b| b == n / bt));
        // The CPU entries hold nine tenths of it: no block can go.
        let cpu_lse = (0..n)
            .map(|j| q.iter().zip(&k[j * d..]).map(|(a, b)| a * b).sum::<f32>())
            .map(f64::from)
            .map(f64::exp)
            .sum::<f64>()
            .ln() as f32;
        let union = cpu_lse + (1.0f32 / 0.9).ln();
        let win = union + 0.1f32.ln();
        let every = BOUNDS_IDLE as usize + 1;
        let read = run(union, win);
        for (t, &b) in read.iter().enumerate() {
            let want = if t % every == 0 { n / bt } else { 0 };
            assert_eq!(b, want, "step {t}: {read:?}");
        }
    }
}
