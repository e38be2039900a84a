//! The causal append (prefill) kernel for many queries at once: a tile of
//! (query, head) rows against a tile of keys at a time, with an online
//! softmax (flash attention on the CPU). [`crate::CpuBackend::dense_append`]
//! takes it from [`MIN_QUERIES`] queries; fewer go through the decode
//! kernel, query by query.
//!
//! One task holds the rows of up to [`ROWS`] / group consecutive queries
//! for one KV head at a time (the GQA group's heads are rows of the same
//! tile, so they share every K and V load), and walks the key tiles that
//! the tile's last query sees:
//!
//! 1. the tile's [`TK`] K rows are widened to f32 and stored transposed
//!    (`[d][TK]`), its V rows widened (`[TK][d padded to a vector]`): once
//!    per tile, for all its rows;
//! 2. scores: `MR` rows x `TK` keys in registers, one broadcast of a query
//!    element and `TK / lanes` vector FMAs per element (a GEMM micro-kernel);
//! 3. mask (only on tiles the rows do not all see: the causal edge, and
//!    a sliding window's far edge, whose rows start their walk at the
//!    first key any of them sees), online softmax:
//!    running max and sum per row, the row's output rescaled when its max
//!    moves, weights from the vectorised `exp`;
//! 4. values: `MR` rows x 4 vectors of output columns in registers, one
//!    broadcast of a weight and four vector FMAs per key.
//!
//! Accumulation is f32; the result and its lse are written per row as the
//! decode kernel writes them (an empty row: zeros and lse -inf; a NaN score:
//! NaN output and lse).

use hgca_kernels::{AttnShape, KvSource};
use pulp::Simd;

use crate::CpuBackend;
use crate::isa::{Kern, SimdElem, dispatch, exp_neg, load, store};

/// Keys per tile (a multiple of every ISA's lane count).
pub(crate) const TK: usize = 32;
/// (query, head) rows of one task's tile, at most (a query's whole GQA
/// group is always in one tile).
const ROWS: usize = 64;
/// Rows the micro-kernels hold in registers at once.
const MR: usize = 4;
/// Queries from which a causal append takes this kernel.
pub(crate) const MIN_QUERIES: usize = 8;

/// Per-task scratch: the packed tiles, the tile's queries, scores and the
/// running state of each row.
struct Tile {
    /// `[d][TK]`: the key tile, transposed.
    kt: Vec<f32>,
    /// `[TK][dp]`: the value tile, each row zero-padded to `dp`.
    vt: Vec<f32>,
    /// `[rows][d]`: the tile's queries (scaled), padded rows zero.
    q: Vec<f32>,
    /// `[rows][TK]`: scores, then weights.
    sc: Vec<f32>,
    /// `[rows][dp]`: unnormalised outputs.
    o: Vec<f32>,
    /// Running max and sum per row.
    m: Vec<f32>,
    l: Vec<f32>,
    /// Tokens each row sees: `first[r]..vis[r]`.
    vis: Vec<usize>,
    first: Vec<usize>,
}

/// The causal append of `n_q` queries (`qs`: `[n_q, q_heads, d]`, already
/// scaled), query `t` seeing tokens `first(t)..visible(t)` of `kv` (both
/// non-decreasing functions, `first(t) <= visible(t) <= kv.tokens()`;
/// `first` is 0 but for a sliding window), into `out_o`
/// (`[n_q, q_heads, d]`, normalised) and `out_lse` (`[n_q, q_heads]`,
/// natural log). The caller has checked the lengths.
#[allow(clippy::too_many_arguments)]
pub(crate) fn append_tiled<T: SimdElem, K: KvSource<T>>(
    cpu: &CpuBackend,
    shape: &AttnShape,
    qs: &[f32],
    n_q: usize,
    first: &(impl Fn(usize) -> usize + Sync),
    visible: &(impl Fn(usize) -> usize + Sync),
    kv: &K,
    out_o: &mut [f32],
    out_lse: &mut [f32],
) {
    let (d, group, qh) = (shape.head_dim(), shape.group(), shape.q_heads());
    let tq = (ROWS / group).max(1);
    let isa = cpu.isa();
    let task = |i: usize, o: &mut [f32], lse: &mut [f32]| {
        let t0 = i * tq;
        let nt = lse.len() / qh;
        dispatch!(isa, s, x => tile_task(s, x, shape, qs, t0, nt, first, visible, kv, o, lse));
    };
    debug_assert!(out_o.len() == n_q * qh * d && out_lse.len() == n_q * qh);
    let mut tiles: Vec<(&mut [f32], &mut [f32])> = out_o
        .chunks_mut(tq * qh * d)
        .zip(out_lse.chunks_mut(tq * qh))
        .collect();
    cpu.for_each_item(&mut tiles, |i, (o, l)| task(i, o, l));
}

/// Queries `t0..t0 + nt`, every KV head, into their rows of `o` / `lse`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_task<S: Kern, T: SimdElem, K: KvSource<T>>(
    s: S,
    x: S::Extra,
    shape: &AttnShape,
    qs: &[f32],
    t0: usize,
    nt: usize,
    first: &impl Fn(usize) -> usize,
    visible: &impl Fn(usize) -> usize,
    kv: &K,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let (d, group, qh, hk) = (
        shape.head_dim(),
        shape.group(),
        shape.q_heads(),
        shape.kv_heads(),
    );
    let lanes = S::F32_LANES;
    let dp = d.div_ceil(lanes) * lanes;
    let rows = nt * group;
    let rows_p = rows.div_ceil(MR) * MR;
    let mut tile = Tile {
        kt: vec![0.0; d * TK],
        vt: vec![0.0; TK * dp],
        q: vec![0.0; rows_p * d],
        sc: vec![0.0; rows_p * TK],
        o: vec![0.0; rows_p * dp],
        m: vec![0.0; rows_p],
        l: vec![0.0; rows_p],
        vis: vec![0; rows_p],
        first: vec![0; rows_p],
    };
    for r in 0..rows {
        tile.vis[r] = visible(t0 + r / group);
        tile.first[r] = first(t0 + r / group);
    }
    let (lo_vis, hi_vis) = (tile.vis[0], tile.vis[rows - 1]);
    let (lo_first, hi_first) = (tile.first[0], tile.first[rows - 1]);
    for g in 0..hk {
        for ti in 0..nt {
            let src = &qs[((t0 + ti) * qh + g * group) * d..][..group * d];
            tile.q[ti * group * d..][..group * d].copy_from_slice(src);
        }
        tile.o.fill(0.0);
        tile.m.fill(f32::NEG_INFINITY);
        tile.l.fill(0.0);
        let mut j0 = lo_first;
        while j0 < hi_vis {
            let nk = (hi_vis - j0).min(TK);
            pack(s, x, kv, g, j0, nk, d, dp, &mut tile);
            for r0 in (0..rows_p).step_by(MR) {
                match TK / lanes {
                    2 => scores::<S, 2>(s, &mut tile, r0, d),
                    4 => scores::<S, 4>(s, &mut tile, r0, d),
                    8 => scores::<S, 8>(s, &mut tile, r0, d),
                    _ => scores::<S, TK>(s, &mut tile, r0, d),
                }
            }
            // Rows that see every key of the tile need no mask.
            let masked = j0 + TK > lo_vis || j0 < hi_first;
            for r in 0..rows_p {
                softmax_row(s, &mut tile, r, j0, nk, masked, dp);
            }
            for r0 in (0..rows_p).step_by(MR) {
                values(s, &mut tile, r0, nk, dp);
            }
            j0 += nk;
        }
        // Finish: normalise into the natural layout's rows of this head.
        for r in 0..rows {
            let (ti, h) = (r / group, r % group);
            let row = ti * qh + g * group + h;
            let dst = &mut o[row * d..(row + 1) * d];
            let l = tile.l[r];
            if l == 0.0 {
                dst.fill(0.0);
                lse[row] = f32::NEG_INFINITY;
            } else {
                let inv = 1.0 / l;
                for (a, &b) in dst.iter_mut().zip(&tile.o[r * dp..]) {
                    *a = b * inv;
                }
                lse[row] = tile.m[r] + l.ln();
            }
        }
    }
}

/// Widens keys `j0..j0 + nk` of KV head `g` into the transposed K tile
/// and the V tile; the keys past `nk` are zero.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pack<S: Kern, T: SimdElem, K: KvSource<T>>(
    s: S,
    x: S::Extra,
    kv: &K,
    g: usize,
    j0: usize,
    nk: usize,
    d: usize,
    dp: usize,
    tile: &mut Tile,
) {
    let lanes = S::F32_LANES;
    let full = d / lanes * lanes;
    let mut krow = [0.0f32; 1024];
    for jj in 0..nk {
        let (k, v) = kv.kv_rows(g, j0 + jj);
        let vdst = &mut tile.vt[jj * dp..(jj + 1) * dp];
        for c in (0..full).step_by(lanes) {
            store(s, &mut vdst[c..], T::load(s, x, &v[c..]));
        }
        for c in full..d {
            vdst[c] = v[c].to_f32();
        }
        // K: widened a vector at a time into a row, then scattered into
        // the tile's columns (a head_dim above the 1024 of this stack row,
        // which no model has but a shape allows, goes element by element).
        if d <= krow.len() {
            for c in (0..full).step_by(lanes) {
                store(s, &mut krow[c..], T::load(s, x, &k[c..]));
            }
            for c in full..d {
                krow[c] = k[c].to_f32();
            }
            for (c, &kc) in krow[..d].iter().enumerate() {
                tile.kt[c * TK + jj] = kc;
            }
        } else {
            for (c, kc) in k[..d].iter().enumerate() {
                tile.kt[c * TK + jj] = kc.to_f32();
            }
        }
    }
    if nk < TK {
        for c in 0..d {
            tile.kt[c * TK + nk..(c + 1) * TK].fill(0.0);
        }
        tile.vt[nk * dp..].fill(0.0);
    }
}

/// Scores of rows `r0..r0 + MR` against the K tile: `NV` vectors of keys
/// per row in registers.
#[inline(always)]
fn scores<S: Simd, const NV: usize>(s: S, tile: &mut Tile, r0: usize, d: usize) {
    let lanes = S::F32_LANES;
    let mut acc = [[s.splat_f32s(0.0); NV]; MR];
    let q = &tile.q[r0 * d..(r0 + MR) * d];
    for (c, kc) in tile.kt.chunks_exact(TK).enumerate().take(d) {
        let mut kv = [s.splat_f32s(0.0); NV];
        for (v, kvv) in kv.iter_mut().enumerate() {
            *kvv = load(s, &kc[v * lanes..]);
        }
        for (r, a) in acc.iter_mut().enumerate() {
            let qb = s.splat_f32s(q[r * d + c]);
            for v in 0..NV {
                a[v] = s.mul_add_f32s(qb, kv[v], a[v]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let dst = &mut tile.sc[(r0 + r) * TK..(r0 + r + 1) * TK];
        for (v, &av) in a.iter().enumerate() {
            store(s, &mut dst[v * lanes..], av);
        }
    }
}

/// Row `r`'s scores of keys `j0..j0 + nk` to weights: the mask, the
/// running max and sum, the output rescaled when the max moves.
#[inline(always)]
fn softmax_row<S: Simd>(
    s: S,
    tile: &mut Tile,
    r: usize,
    j0: usize,
    nk: usize,
    masked: bool,
    dp: usize,
) {
    let row = &mut tile.sc[r * TK..(r + 1) * TK];
    let (lo, lim) = if masked {
        (
            tile.first[r].saturating_sub(j0).min(nk),
            tile.vis[r].saturating_sub(j0).min(nk),
        )
    } else {
        (0, nk)
    };
    row[lim..].fill(f32::NEG_INFINITY);
    row[..lo.min(lim)].fill(f32::NEG_INFINITY);
    let (m, l) = (&mut tile.m[r], &mut tile.l[r]);
    if l.is_nan() || lim <= lo {
        // A poisoned row stays NaN; a row that sees none of these keys adds nothing.
        row.fill(0.0);
        return;
    }
    let (vr, _) = S::as_simd_f32s(row);
    let mut vm = s.splat_f32s(f32::NEG_INFINITY);
    let mut vs = s.splat_f32s(0.0);
    for &xv in vr {
        vm = s.max_f32s(vm, xv);
        vs = s.add_f32s(vs, xv);
    }
    if s.reduce_sum_f32s(vs).is_nan() {
        // A NaN score (NaN in q or k) poisons the row, as in the reference.
        *l = f32::NAN;
        row.fill(0.0);
        return;
    }
    let bm = s.reduce_max_f32s(vm);
    if bm > *m {
        let alpha = (*m - bm).exp();
        *l *= alpha;
        let a = s.splat_f32s(alpha);
        let (orow, _) = S::as_mut_simd_f32s(&mut tile.o[r * dp..(r + 1) * dp]);
        for ov in orow {
            *ov = s.mul_f32s(*ov, a);
        }
        *m = bm;
    }
    let mv = s.splat_f32s(*m);
    let (vr, _) = S::as_mut_simd_f32s(row);
    let mut sum = s.splat_f32s(0.0);
    for xv in vr {
        let p = exp_neg(s, s.sub_f32s(*xv, mv));
        sum = s.add_f32s(sum, p);
        *xv = p;
    }
    *l += s.reduce_sum_f32s(sum);
}

/// `o[r] += Σ_j w[r][j] v[j]` for rows `r0..r0 + MR` over the tile's
/// `nk` keys: four vectors of output columns per row in registers.
#[inline(always)]
fn values<S: Simd>(s: S, tile: &mut Tile, r0: usize, nk: usize, dp: usize) {
    let lanes = S::F32_LANES;
    let nvec = dp / lanes;
    let mut c0 = 0;
    while c0 + 4 <= nvec {
        values_cols::<S, 4>(s, tile, r0, nk, dp, c0 * lanes);
        c0 += 4;
    }
    while c0 < nvec {
        values_cols::<S, 1>(s, tile, r0, nk, dp, c0 * lanes);
        c0 += 1;
    }
}

/// [`values`] for the `NC` vectors of columns from `col`.
#[inline(always)]
fn values_cols<S: Simd, const NC: usize>(
    s: S,
    tile: &mut Tile,
    r0: usize,
    nk: usize,
    dp: usize,
    col: usize,
) {
    let lanes = S::F32_LANES;
    let mut acc = [[s.splat_f32s(0.0); NC]; MR];
    for (r, a) in acc.iter_mut().enumerate() {
        let orow = &tile.o[(r0 + r) * dp + col..];
        for (c, av) in a.iter_mut().enumerate() {
            *av = load(s, &orow[c * lanes..]);
        }
    }
    let w = &tile.sc[r0 * TK..(r0 + MR) * TK];
    for j in 0..nk {
        let vrow = &tile.vt[j * dp + col..];
        let mut vv = [s.splat_f32s(0.0); NC];
        for (c, v) in vv.iter_mut().enumerate() {
            *v = load(s, &vrow[c * lanes..]);
        }
        for (r, a) in acc.iter_mut().enumerate() {
            let wb = s.splat_f32s(w[r * TK + j]);
            for c in 0..NC {
                a[c] = s.mul_add_f32s(wb, vv[c], a[c]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let orow = &mut tile.o[(r0 + r) * dp + col..];
        for (c, &av) in a.iter().enumerate() {
            store(s, &mut orow[c * lanes..], av);
        }
    }
}
