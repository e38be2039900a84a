//! The attention kernel, written once for every ISA (`S: Kern`) and KV
//! dtype (`T: SimdElem`).
//!
//! One call attends `heads <= MAX_HEADS` query heads of one GQA group to a
//! stream of tokens of their KV head, in blocks of [`BLOCK`] tokens:
//!
//! 1. prefetch every K and V cache line of the *next* block, spread evenly
//!    over the whole block's work: the score loop fetches the next block's
//!    K rows, each pass of the value loop the next block's V lines of its
//!    own columns (many rows in flight, not one; a burst of all 256
//!    prefetches at the block's start stalls the core once the line-fill
//!    buffers are full: dense f16 over 1 GiB ran at ~70 ns per row with the
//!    burst, ~56 with the score loop issuing them all, and less again with
//!    the value loop taking its share);
//! 2. scores of the block for all heads: each K row is loaded and widened
//!    once and used by every head of the group;
//! 3. online softmax: the running max moves, accumulators are rescaled, the
//!    block's weights come from a vectorised `exp`;
//! 4. each V row is loaded once and accumulated into every head's output.
//!
//! Accumulation is f32 throughout.
//!
//! # Call path
//!
//! How one call reaches the code below (a sparse decode; dense, threshold,
//! batched and append calls take the same road from step 2):
//!
//! 1. [`SparseAttention::sparse_decode`](hgca_kernels::SparseAttention) on
//!    `CpuBackend` (`backend.rs`): shapes and lengths checked once
//!    (`check_common`), the call described as a `Job` (`plan.rs`: which
//!    tokens each (query token, KV head) unit attends, as a `Spec`).
//! 2. `CpuBackend::run` (`plan.rs`): `plan` splits the units into `Task`s
//!    (head subgroups of at most `MAX_HEADS`, token chunks of at least
//!    `MIN_CHUNK`), and `for_each_item` (`backend.rs`) runs them
//!    sequentially, on the caller's `Executor`, or on rayon.
//! 3. Per task, `dispatch!` (`isa.rs`) binds the ISA's pulp token inside its
//!    `vectorize` (V3: `run_f16c`, after detecting F16C once and making the
//!    `F16c` proof) and calls [`attend`] with the task's tokens
//!    (`ListTokens`, `RangeTokens` or `ThresholdTokens`).
//! 4. [`attend`] / `attend_as` walk the tokens in blocks of [`BLOCK`] and
//!    enter each block through `Kern::step_f32` / `step_f16` / `step_bf16`
//!    (written by `kern_steps!` in `isa.rs`: plain functions of each ISA,
//!    entered again inside its target features); `StepElem::step` leads to
//!    [`step`], which picks the head count (`by_heads!`) and runs
//!    `scores_block`, the online softmax and `values_block`.
//! 5. [`finish`] normalises each task's output and LSE; `run` merges the
//!    chunks of a split unit by LSE (`merge_rows`) and, when asked, writes
//!    the softmax weights (`exp_shifted`).

use half::{bf16, f16};
use hgca_kernels::{DType, KvSource};
use pulp::Simd;

use crate::isa::{Isa, Kern, SimdElem, dispatch, exp_neg, load, store};

/// Tokens per block.
pub(crate) const BLOCK: usize = 32;
/// Query heads one kernel call serves (larger groups are split).
pub(crate) const MAX_HEADS: usize = 8;

/// Runs `$body` with the const `$h` = `$n` heads, for `$n` in 1..=3, else
/// 4: the kernels serve a group in parts of at most four heads, each part
/// compiled for its exact count.
macro_rules! by_heads {
    ($n:expr, $h:ident => $body:expr) => {
        match $n {
            1 => {
                const $h: usize = 1;
                $body
            }
            2 => {
                const $h: usize = 2;
                $body
            }
            3 => {
                const $h: usize = 3;
                $body
            }
            _ => {
                const $h: usize = 4;
                $body
            }
        }
    };
}
pub(crate) use by_heads;

/// Running softmax state of one query head: max score `m`, sum `l` of `exp(s - m)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub m: f32,
    pub l: f32,
}

impl Run {
    pub const EMPTY: Run = Run {
        m: f32::NEG_INFINITY,
        l: 0.0,
    };
}

/// A stream of token indices, handed out a block at a time.
pub(crate) trait Tokens {
    /// Fills `buf` with up to `BLOCK` indices; returns how many (0 at the end).
    fn next_block(&mut self, buf: &mut [usize; BLOCK]) -> usize;
}

/// Tokens from an index list.
pub(crate) struct ListTokens<'a>(pub &'a [u32]);

impl Tokens for ListTokens<'_> {
    #[inline(always)]
    fn next_block(&mut self, buf: &mut [usize; BLOCK]) -> usize {
        let n = self.0.len().min(BLOCK);
        for (b, &j) in buf.iter_mut().zip(&self.0[..n]) {
            *b = j as usize;
        }
        self.0 = &self.0[n..];
        n
    }
}

/// Tokens `start..end`.
pub(crate) struct RangeTokens {
    pub start: usize,
    pub end: usize,
}

impl Tokens for RangeTokens {
    #[inline(always)]
    fn next_block(&mut self, buf: &mut [usize; BLOCK]) -> usize {
        let n = (self.end - self.start).min(BLOCK);
        for (i, b) in buf.iter_mut().enumerate().take(n) {
            *b = self.start + i;
        }
        self.start += n;
        n
    }
}

/// Tokens `j` of `start..end` with `maw[j] > threshold`, selected while
/// scanning (no index list is built first); the chosen ones are recorded.
pub(crate) struct ThresholdTokens<'a> {
    pub maw: &'a [f32],
    pub threshold: f32,
    pub pos: usize,
    pub end: usize,
    pub chosen: &'a mut Vec<u32>,
}

impl Tokens for ThresholdTokens<'_> {
    #[inline(always)]
    fn next_block(&mut self, buf: &mut [usize; BLOCK]) -> usize {
        let mut n = 0;
        while n < BLOCK && self.pos < self.end {
            let j = self.pos;
            self.pos += 1;
            if self.maw[j] > self.threshold {
                buf[n] = j;
                n += 1;
                self.chosen.push(j as u32);
            }
        }
        n
    }
}

/// Where a kernel call writes its raw (scaled) scores, if asked:
/// head `h`'s score of the `i`-th token at `buf[h * stride + i]`.
#[derive(Debug)]
pub(crate) struct ScoreOut<'a> {
    pub buf: &'a mut [f32],
    pub stride: usize,
}

/// Hints the cache to fetch every line of `row`.
#[inline(always)]
pub(crate) fn prefetch_row<S: Kern, T>(s: S, row: &[T]) {
    prefetch_cols(s, row, 0, row.len());
}

/// Hints the cache to fetch every line that holds a byte of `row[a..b]`
/// (indices past the row are clamped to it).
#[inline(always)]
fn prefetch_cols<S: Kern, T>(s: S, row: &[T], a: usize, b: usize) {
    let size = core::mem::size_of::<T>();
    let (a, b) = (a.min(row.len()) * size, b.min(row.len()) * size);
    let p = row.as_ptr().cast::<u8>();
    for off in line_starts(p as usize, a, b) {
        s.prefetch(p.wrapping_offset(off));
    }
}

/// Offsets from `addr` of the 64-byte lines that hold bytes `addr + a ..
/// addr + b`: from the line holding byte `a` (which may start before
/// `addr`) to the one holding byte `b - 1`.
#[inline(always)]
fn line_starts(addr: usize, a: usize, b: usize) -> impl Iterator<Item = isize> {
    let lead = addr.wrapping_add(a) & 63;
    let first = a as isize - lead as isize;
    let end = if a < b { b as isize } else { first };
    (first..end).step_by(64)
}

/// What one kernel call attends for: `heads` query heads (`q`: `[heads,
/// d]`, already multiplied by the score scale) of KV head `g`,
/// accumulating into `o` (`[heads, d]`, unnormalised) and `run` (one per
/// head), with the raw scores written to `scores` if asked.
pub(crate) struct Heads<'a> {
    pub g: usize,
    pub q: &'a [f32],
    pub heads: usize,
    pub d: usize,
    pub o: &'a mut [f32],
    pub run: &'a mut [Run],
    pub scores: Option<ScoreOut<'a>>,
}

/// Attends `h` (see [`Heads`]) to `tokens` of its KV head. Call [`finish`]
/// afterwards.
///
/// Only this loop, which locates the rows, is generic over the source and
/// the token stream. The work on the rows ([`step`]) goes through the
/// ISA's non-generic `step_*` functions ([`Kern`]): it is compiled once, in
/// this crate, for each ISA and dtype, not again in every crate (and for
/// every source and token stream) that calls the backend.
#[inline(always)]
pub(crate) fn attend<S: Kern, T: SimdElem, K: KvSource<T>, I: Tokens>(
    s: S,
    extra: S::Extra,
    kv: &K,
    tokens: I,
    h: Heads<'_>,
) {
    // The rows are viewed as the concrete type that `T` is (a cast that
    // compiles to nothing); only the arm of `T` is ever taken.
    match T::DTYPE {
        DType::F32 => attend_as::<S, T, f32, K, I>(s, extra, kv, tokens, h),
        DType::F16 => attend_as::<S, T, f16, K, I>(s, extra, kv, tokens, h),
        DType::BF16 => attend_as::<S, T, bf16, K, I>(s, extra, kv, tokens, h),
    }
}

/// [`attend`] with the rows viewed as `U`, which is `T`.
#[inline(always)]
fn attend_as<S: Kern, T: SimdElem, U: StepElem, K: KvSource<T>, I: Tokens>(
    s: S,
    extra: S::Extra,
    kv: &K,
    mut tokens: I,
    h: Heads<'_>,
) {
    let Heads {
        g,
        q,
        heads,
        d,
        o,
        run,
        mut scores,
    } = h;
    debug_assert!(heads <= MAX_HEADS && q.len() == heads * d && o.len() == heads * d);
    debug_assert!(T::DTYPE == U::DTYPE);
    let rows = |j: usize| -> (&[U], &[U]) {
        let (k, v) = kv.kv_rows(g, j);
        (bytemuck::cast_slice(k), bytemuck::cast_slice(v))
    };
    // Row slices of this block (`krows[c]`) and of the next (`krows[1 - c]`):
    // each row is located once, when it is first prefetched.
    let empty: &[U] = &[];
    let mut krows = [[empty; BLOCK]; 2];
    let mut vrows = [[empty; BLOCK]; 2];
    let mut idx = [0usize; BLOCK];
    let mut c = 0;
    let mut n = tokens.next_block(&mut idx);
    for (i, &j) in idx[..n].iter().enumerate() {
        (krows[c][i], vrows[c][i]) = rows(j);
    }
    let mut done = 0usize;
    let mut sc = [[0.0f32; BLOCK]; MAX_HEADS];
    while n > 0 {
        let n_next = tokens.next_block(&mut idx);
        for (i, &j) in idx[..n_next].iter().enumerate() {
            (krows[1 - c][i], vrows[1 - c][i]) = rows(j);
        }
        U::step(
            s,
            extra,
            Step {
                krows: &krows[c],
                vrows: &vrows[c],
                n,
                next_k: &krows[1 - c][..n_next],
                next_v: &vrows[1 - c][..n_next],
                q,
                heads,
                d,
                o: &mut *o,
                run: &mut *run,
                sc: &mut sc,
                scores: scores.as_mut().map(|out| ScoreOut {
                    buf: &mut *out.buf,
                    stride: out.stride,
                }),
                done,
            },
        );
        done += n;
        c = 1 - c;
        n = n_next;
    }
}

/// One block's work once its rows are located (see [`step`]).
#[derive(Debug)]
pub struct Step<'a, T> {
    /// The block's K and V rows (the first `n` of each).
    krows: &'a [&'a [T]; BLOCK],
    vrows: &'a [&'a [T]; BLOCK],
    /// Tokens of the block (the first `n` rows).
    n: usize,
    /// The next block's rows, prefetched along the way.
    next_k: &'a [&'a [T]],
    next_v: &'a [&'a [T]],
    /// The call's [`Heads`], less the KV head (the rows are located).
    q: &'a [f32],
    heads: usize,
    d: usize,
    o: &'a mut [f32],
    run: &'a mut [Run],
    /// Scratch for the block's scores, then its weights, one row per head.
    sc: &'a mut [[f32; BLOCK]; MAX_HEADS],
    scores: Option<ScoreOut<'a>>,
    /// Tokens of the call before this block.
    done: usize,
}

/// The three KV types, each bound to its ISA function ([`Kern`]'s `step_*`).
pub trait StepElem: SimdElem {
    /// Runs [`step`] for this type on `s`, with its proof `extra`.
    fn step<S: Kern>(s: S, extra: S::Extra, a: Step<'_, Self>);
}

impl StepElem for f32 {
    #[inline(always)]
    fn step<S: Kern>(s: S, extra: S::Extra, a: Step<'_, Self>) {
        s.step_f32(extra, a)
    }
}

impl StepElem for f16 {
    #[inline(always)]
    fn step<S: Kern>(s: S, extra: S::Extra, a: Step<'_, Self>) {
        s.step_f16(extra, a)
    }
}

impl StepElem for bf16 {
    #[inline(always)]
    fn step<S: Kern>(s: S, extra: S::Extra, a: Step<'_, Self>) {
        s.step_bf16(extra, a)
    }
}

/// One block: the scores of its tokens for every head (prefetching the
/// next block's K rows), the online softmax, then the values (prefetching
/// the next block's V rows). Each ISA's `step_*` runs this inside its
/// target features, with the ISA's proof `extra` ([`Kern::Extra`]), which
/// the loads take.
#[inline(always)]
pub(crate) fn step<S: Kern, T: SimdElem>(s: S, extra: S::Extra, a: Step<'_, T>) {
    let Step {
        krows: kr,
        vrows: vr,
        n,
        next_k,
        next_v,
        q,
        heads,
        d,
        o,
        run,
        sc,
        mut scores,
        done,
    } = a;
    let mut h0 = 0;
    while h0 < heads {
        let q = &q[h0 * d..];
        let sc = &mut sc[h0..];
        let pf: &[&[T]] = if h0 == 0 { next_k } else { &[] };
        by_heads!(heads - h0, H => scores_block::<S, T, H>(s, extra, kr, n, q, d, sc, pf));
        h0 += 4;
    }
    for h in 0..heads {
        let row = &mut sc[h];
        row[n..].fill(f32::NEG_INFINITY);
        if let Some(out) = scores.as_mut() {
            out.buf[h * out.stride + done..h * out.stride + done + n].copy_from_slice(&row[..n]);
        }
        // Block max, vectorised (a scalar fold is a 32-long latency chain;
        // this alone took the kernel from ~62 to ~43 ns per row in L2).
        // `row[n..]` is -inf, so whole vectors can be used. The sum
        // detects a NaN score (max instructions may drop NaN).
        let mut vm = s.splat_f32s(f32::NEG_INFINITY);
        let mut vs = s.splat_f32s(0.0);
        for c in row.chunks_exact(S::F32_LANES) {
            let x = load(s, c);
            vm = s.max_f32s(vm, x);
            vs = s.add_f32s(vs, x);
        }
        let r = &mut run[h];
        if s.reduce_sum_f32s(vs).is_nan() {
            // A NaN score (NaN in q or k) poisons the head, as in the
            // reference: NaN weights, NaN output, NaN lse.
            row.fill(f32::NAN);
            r.l = f32::NAN;
            continue;
        }
        let bm = s.reduce_max_f32s(vm);
        if bm > r.m {
            let alpha = (r.m - bm).exp();
            r.l *= alpha;
            scale_row(s, &mut o[h * d..(h + 1) * d], alpha);
            r.m = bm;
        }
        let m = s.splat_f32s(r.m);
        let mut lsum = 0.0f32;
        for c in row.chunks_exact_mut(S::F32_LANES) {
            let p = exp_neg(s, s.sub_f32s(load(s, c), m));
            lsum += s.reduce_sum_f32s(p);
            store(s, c, p);
        }
        r.l += lsum;
    }
    let mut h0 = 0;
    while h0 < heads {
        let o = &mut o[h0 * d..];
        let p = &sc[h0..];
        let pf: &[&[T]] = if h0 == 0 { next_v } else { &[] };
        by_heads!(heads - h0, H => values_block::<S, T, H>(s, extra, vr, n, p, d, o, pf));
        h0 += 4;
    }
}

#[inline(always)]
fn scale_row<S: Simd>(s: S, o: &mut [f32], alpha: f32) {
    let a = s.splat_f32s(alpha);
    let (head, tail) = S::as_mut_simd_f32s(o);
    for x in head {
        *x = s.mul_f32s(*x, a);
    }
    for x in tail {
        *x *= alpha;
    }
}

/// Scores of `n` tokens for `H` heads: `sc[h][j] = dot(q_h, k_j)`.
/// Two tokens at a time: 2H independent FMA chains for the out-of-order core.
/// The K rows of `pf` (the next block's) are prefetched along the way, an
/// equal share per pair.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scores_block<S: Kern, T: SimdElem, const H: usize>(
    s: S,
    extra: S::Extra,
    krows: &[&[T]; BLOCK],
    n: usize,
    q: &[f32],
    d: usize,
    sc: &mut [[f32; BLOCK]],
    mut pf: &[&[T]],
) {
    let per = pf.len().div_ceil(n.div_ceil(2));
    let lanes = S::F32_LANES;
    let nv = d / lanes;
    let full = nv * lanes;
    let qh: [&[f32]; H] = core::array::from_fn(|h| &q[h * d..(h + 1) * d]);
    // Whole vectors of each head's query, all of length `nv`: with every
    // length known to the loop, its indexing compiles without bounds checks
    // (with them, the scalar instructions limited the loop).
    let qv: [&[S::f32s]; H] = qh.map(|x| &S::as_simd_f32s(x).0[..nv]);
    let sc: &mut [[f32; BLOCK]; H] = (&mut sc[..H]).try_into().unwrap();
    let mut j = 0;
    while j < n {
        let two = j + 1 < n;
        let k0 = &krows[j][..d];
        let k1 = &krows[if two { j + 1 } else { j }][..d];
        let (now, later) = pf.split_at(per.min(pf.len()));
        for r in now {
            prefetch_row(s, r);
        }
        pf = later;
        let mut a0 = [s.splat_f32s(0.0); H];
        let mut a1 = [s.splat_f32s(0.0); H];
        for (i, (c0, c1)) in k0[..full]
            .chunks_exact(lanes)
            .zip(k1[..full].chunks_exact(lanes))
            .enumerate()
        {
            let (x0, x1) = (T::load(s, extra, c0), T::load(s, extra, c1));
            for h in 0..H {
                let qv = qv[h][i];
                a0[h] = s.mul_add_f32s(x0, qv, a0[h]);
                a1[h] = s.mul_add_f32s(x1, qv, a1[h]);
            }
        }
        // The 2H horizontal sums, four at a time (padded with zeros).
        let mut sums = [0.0f32; 8];
        let zero = s.splat_f32s(0.0);
        let mut i = 0;
        while i < 2 * H {
            let pick = |k: usize| {
                let k = i + k;
                if k < H {
                    a0[k]
                } else if k < 2 * H {
                    a1[k - H]
                } else {
                    zero
                }
            };
            let r = s.reduce_sum4([pick(0), pick(1), pick(2), pick(3)]);
            sums[i..i + 4].copy_from_slice(&r);
            i += 4;
        }
        for h in 0..H {
            let (mut x, mut y) = (sums[h], sums[H + h]);
            for t in full..d {
                x += k0[t].to_f32() * qh[h][t];
                y += k1[t].to_f32() * qh[h][t];
            }
            sc[h][j] = x;
            if two {
                sc[h][j + 1] = y;
            }
        }
        j += 2;
    }
}

/// `o_h += sum_j p[h][j] * v_j` for `H` heads: passes over `W` vectors of
/// `d` (4, then 2, then 1), `W * H` independent FMA chains, so an FMA's
/// latency is covered with room to spare; then the scalar tail. Each pass
/// prefetches the lines of its own columns in the V rows of `pf` (the next
/// block's); the last pass also the lines of the scalar tail (with no pass,
/// `d < LANES`, the rows are prefetched whole).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn values_block<S: Kern, T: SimdElem, const H: usize>(
    s: S,
    extra: S::Extra,
    vrows: &[&[T]; BLOCK],
    n: usize,
    p: &[[f32; BLOCK]],
    d: usize,
    o: &mut [f32],
    pf: &[&[T]],
) {
    let lanes = S::F32_LANES;
    // Where the next pass starts: the pass ending the vector part takes
    // the tail's columns into its prefetch range.
    let pf_end = |c: usize| if c + lanes > d { d } else { c };
    let mut c = 0;
    while c + 4 * lanes <= d {
        let e = pf_end(c + 4 * lanes);
        values_pass::<S, T, H, 4>(s, extra, vrows, n, p, d, o, c, (pf, e));
        c += 4 * lanes;
    }
    if c + 2 * lanes <= d {
        let e = pf_end(c + 2 * lanes);
        values_pass::<S, T, H, 2>(s, extra, vrows, n, p, d, o, c, (pf, e));
        c += 2 * lanes;
    }
    if c + lanes <= d {
        values_pass::<S, T, H, 1>(s, extra, vrows, n, p, d, o, c, (pf, d));
        c += lanes;
    }
    if c == 0 {
        // d < LANES: no pass ran to take the prefetches.
        for r in pf {
            prefetch_row(s, r);
        }
    }
    for t in c..d {
        for h in 0..H {
            let mut x = o[h * d + t];
            for (j, v) in vrows.iter().enumerate().take(n) {
                x += p[h][j] * v[t].to_f32();
            }
            o[h * d + t] = x;
        }
    }
}

/// One pass of [`values_block`] over columns `c .. c + W * LANES`,
/// prefetching columns `c .. pf_end` of the rows `pf`, an equal share per
/// token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn values_pass<S: Kern, T: SimdElem, const H: usize, const W: usize>(
    s: S,
    extra: S::Extra,
    vrows: &[&[T]; BLOCK],
    n: usize,
    p: &[[f32; BLOCK]],
    d: usize,
    o: &mut [f32],
    c: usize,
    (mut pf, pf_end): (&[&[T]], usize),
) {
    let lanes = S::F32_LANES;
    let per = pf.len().div_ceil(n.max(1));
    let p: &[[f32; BLOCK]; H] = p[..H].try_into().unwrap();
    let mut acc = [[s.splat_f32s(0.0); W]; H];
    for (h, a) in acc.iter_mut().enumerate() {
        for (w, x) in a.iter_mut().enumerate() {
            *x = load(s, &o[h * d + c + w * lanes..]);
        }
    }
    for (j, v) in vrows.iter().enumerate().take(n) {
        let (now, later) = pf.split_at(per.min(pf.len()));
        for r in now {
            prefetch_cols(s, r, c, pf_end);
        }
        pf = later;
        let v = &v[c..c + W * lanes];
        let mut vv = [s.splat_f32s(0.0); W];
        for (w, x) in vv.iter_mut().enumerate() {
            *x = T::load(s, extra, &v[w * lanes..]);
        }
        for (h, a) in acc.iter_mut().enumerate() {
            let pj = s.splat_f32s(p[h][j]);
            for (x, &y) in a.iter_mut().zip(&vv) {
                *x = s.mul_add_f32s(pj, y, *x);
            }
        }
    }
    for (h, a) in acc.iter().enumerate() {
        for (w, &x) in a.iter().enumerate() {
            store(s, &mut o[h * d + c + w * lanes..], x);
        }
    }
}

/// Normalises: `o_h /= l_h`, `lse_h = m_h + ln l_h`; no token gives `(0, -inf)`.
#[inline(always)]
pub(crate) fn finish(o: &mut [f32], lse: &mut [f32], run: &[Run], d: usize) {
    for (h, r) in run.iter().enumerate() {
        let row = &mut o[h * d..(h + 1) * d];
        if r.l == 0.0 {
            row.fill(0.0);
            lse[h] = f32::NEG_INFINITY;
        } else {
            let inv = 1.0 / r.l;
            row.iter_mut().for_each(|x| *x *= inv);
            lse[h] = r.m + r.l.ln();
        }
    }
}

/// `x[i] = exp(x[i] - shift)`, vectorised.
pub(crate) fn exp_shifted(isa: Isa, x: &mut [f32], shift: f32) {
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

#[cfg(test)]
mod tests {
    use super::line_starts;

    #[test]
    fn prefetched_lines_cover_the_bytes_and_no_more() {
        for addr in (0..192).step_by(4) {
            for a in 0..200 {
                for b in [a, a + 1, a + 63, a + 64, a + 65, a + 130, 300] {
                    let lines: Vec<usize> = line_starts(addr, a, b)
                        .map(|o| (addr as isize + o) as usize)
                        .collect();
                    assert!(lines.iter().all(|l| l % 64 == 0), "{addr} {a} {b}");
                    let want: Vec<usize> = if a < b {
                        ((addr + a) / 64..=(addr + b - 1) / 64)
                            .map(|l| l * 64)
                            .collect()
                    } else {
                        vec![]
                    };
                    assert_eq!(lines, want, "addr {addr}, bytes {a}..{b}");
                }
            }
        }
    }
}
