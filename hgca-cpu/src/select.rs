//! The selection helpers of the hybrid layer and of engines' own page
//! selection: Quest key bounds of blocks and pages, the MAW rule's scan
//! ([`CpuBackend::indices_above`]), the MAW update
//! ([`CpuBackend::decay_accumulate`]) and the int8 score estimate of the
//! mass-targeted selector ([`CpuBackend::int8_max_scores`]).

use hgca_kernels::{
    AttnShape, Error, KvSource, PageBounds, PagedSeq, Result, check_len, check_len_of,
};
use pulp::Simd;

use crate::CpuBackend;
use crate::isa::{Kern, SimdElem, dispatch, load, store};
use crate::kernel::{by_heads, prefetch_row};

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
        check_len_of("q", &[heads, d], q.len())?;
        if d == 0 || !bounds.len().is_multiple_of(2 * d) {
            return Err(Error::Length {
                what: "bounds (a multiple of 2 * d)",
                expected: (bounds.len() / (2 * d).max(1)) * 2 * d,
                found: bounds.len(),
            });
        }
        let nb = bounds.len() / (2 * d);
        check_len_of("out", &[nb, heads], out.len())?;
        dispatch!(self.isa(), s, x => bounds_simd(s, x, q, heads, d, bounds, out));
        Ok(())
    }

    /// Estimated scores from an int8 copy of the keys, the largest over
    /// the query rows: with `heads = offset.len()` query rows `q`
    /// (`[heads, d]`) and `n = k_scale.len()` int8 key rows,
    ///
    /// `out[j] = max_h (k_scale[j] * Σ_i q[h, i] keys(j, i) - offset[h])`.
    ///
    /// `keys` is tiled for vector loads: tiles of [`INT8_TILE`] rows, each
    /// dimension-major, so that row `j`'s element `i` is at
    /// `(j / INT8_TILE) * INT8_TILE * d + i * INT8_TILE + j % INT8_TILE`
    /// (the last tile padded; [`Int8Keys`] keeps that layout). With codes
    /// and scales from [`quantize_i8`], each estimate is within
    /// `|q_h|_1 k_scale[j] / 2` (plus f32 rounding) of the exact `q_h·k_j`:
    /// the cheap first look of the mass-targeted selector, a quarter of an
    /// f32 key's bytes and half an f16 key's. A key row whose scale is not
    /// finite (it held an infinity or a NaN) gets `+inf`, so that a selector
    /// admits it and the exact kernel decides.
    ///
    /// ```
    /// use hgca_cpu::{CpuBackend, Int8Keys};
    /// let mut keys = Int8Keys::new(4);
    /// keys.push(&[2.0, 0.0, 0.0, 0.0]);
    /// keys.push(&[0.0, 1.0, 0.0, 4.0]);
    /// let mut out = [0.0; 2];
    /// let q = [1.0, 0.0, 0.0, 0.5];
    /// CpuBackend::new().int8_max_scores(&q, &[0.5], 4, keys.codes(), keys.scales(), &mut out)?;
    /// assert!((out[0] - 1.5).abs() < 1e-2 && (out[1] - 1.5).abs() < 2e-2);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Length`] when `q`, `keys` or `out` do not fit `heads`, `n`
    /// and `d`; [`Error::Zero`] for `d == 0`.
    pub fn int8_max_scores(
        &self,
        q: &[f32],
        offset: &[f32],
        d: usize,
        keys: &[i8],
        k_scale: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        if d == 0 {
            return Err(Error::Zero { what: "head dim" });
        }
        let (heads, n) = (offset.len(), k_scale.len());
        check_len_of("q", &[heads, d], q.len())?;
        check_len_of(
            "keys (whole tiles)",
            &[n.div_ceil(INT8_TILE), INT8_TILE, d],
            keys.len(),
        )?;
        check_len("out (one per key row)", n, out.len())?;
        out.fill(f32::NEG_INFINITY);
        // Up to 8 rows a pass: their accumulators and the widened keys fit
        // the 32 vector registers of AVX-512 (16 of AVX2 spill a little).
        for (qp, op) in q.chunks(8 * d).zip(offset.chunks(8)) {
            macro_rules! rows {
                ($($h:literal)*) => {
                    match op.len() {
                        $($h => dispatch!(self.isa(), _s => int8_scores::<$h>(qp, op, d, keys, k_scale, out)),)*
                        _ => unreachable!("chunks of at most 8 rows"),
                    }
                };
            }
            rows!(1 2 3 4 5 6 7 8);
        }
        Ok(())
    }

    /// Estimated scores from an int4 copy of the keys ([`Int4Keys`], codes
    /// `c` from [`quantize_i4`], scales `k_scale`), the largest over the
    /// query rows, as integer dot products: each query row is first
    /// quantised to int8 ([`quantize_i8`]: codes `qc_h`, scale `s_h`), and
    ///
    /// `out[j] = max_h (((Σ_i qc[h, i] c(j, i)) * s_h) * k_scale[j] - offset[h])`
    ///
    /// (f32 products in that order). `keys` holds tiles of [`INT8_TILE`]
    /// rows, each of `d.div_ceil(8)` groups of 8 dimensions, each group 64
    /// bytes: byte `4 r + m` of group `g` holds row `r`'s dimension `8 g + m`
    /// in its low nibble and `8 g + 4 + m` in its high one, as `c + 8`
    /// (`1..=15`; padding dimensions hold 8). That is the operand layout of
    /// `vpdpbusd`, which multiplies one group of 16 rows by four query
    /// codes in one instruction (AVX-512 VNNI; AVX2 uses `vpmaddubsw`; every
    /// path gives the same bits). Each estimate is within
    /// `|q_h|_1 k_scale[j] / 2 + s_h (|k_j|_1 + d k_scale[j] / 2) / 2` (plus
    /// f32 rounding) of the exact `q_h·k_j`, with key scales of `max |k| /
    /// 7`: an eighth of an f32 key's bytes and a quarter of an f16 key's.
    /// Non-finite key scales give `+inf`, and so does every row when a
    /// query row is not finite.
    ///
    /// ```
    /// use hgca_cpu::{CpuBackend, Int4Keys};
    /// let mut keys = Int4Keys::new(4);
    /// keys.push(&[2.0, 0.0, 0.0, 0.0]);
    /// keys.push(&[0.0, 1.0, 0.0, 4.0]);
    /// let mut out = [0.0; 2];
    /// let q = [1.0, 0.0, 0.0, 0.5];
    /// CpuBackend::new().int4_max_scores(&q, &[0.5], 4, keys.codes(), keys.scales(), &mut out)?;
    /// assert!((out[0] - 1.5).abs() < 0.2 && (out[1] - 1.5).abs() < 0.5);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Length`] when `q`, `keys` or `out` do not fit `heads`, `n`
    /// and `d`; [`Error::Zero`] for `d == 0`.
    pub fn int4_max_scores(
        &self,
        q: &[f32],
        offset: &[f32],
        d: usize,
        keys: &[u8],
        k_scale: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        if d == 0 {
            return Err(Error::Zero { what: "head dim" });
        }
        let (heads, n) = (offset.len(), k_scale.len());
        check_len_of("q", &[heads, d], q.len())?;
        check_len_of(
            "keys (whole tiles)",
            &[
                n.div_ceil(INT8_TILE),
                d.div_ceil(INT4_GROUP),
                crate::int4dot::GROUP_BYTES,
            ],
            keys.len(),
        )?;
        check_len("out (one per key row)", n, out.len())?;
        if heads == 0 {
            out.fill(f32::NEG_INFINITY);
            return Ok(());
        }
        match crate::int4dot::Queries::new(q, heads, d) {
            Some(qs) => {
                let path = Self::qmatvec_path(self.isa());
                crate::int4dot::scores(path, &qs, offset, keys, k_scale, out);
            }
            None => out.fill(f32::INFINITY),
        }
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
        dispatch!(self.isa(), s => above_simd(s, values, threshold, base, out))
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
        dispatch!(self.isa(), s => decay_simd(s, avg, at, a, w, stride, c));
        Ok(())
    }

    /// Upper bounds of the scores of each of `seq`'s pages, per KV head:
    /// `out [kv_heads, pages]` (pages in `seq.pages()` order) gets, for KV
    /// head `g` and page slot `p`, the largest over `g`'s query heads of
    /// `scale * Σ_i max(q_i lo_i, q_i hi_i)` with the page's key bounds:
    /// no score of a key of the page exceeds it. Feed it to
    /// [`hgca_kernels::select_top_pages`] or [`hgca_kernels::select_by_mass`].
    ///
    /// # Errors
    /// [`Error::Length`] for `q` or `out`, [`Error::ShapeMismatch`] for a
    /// sequence of other heads, [`Error::Param`] when the bounds of a page
    /// cover fewer tokens than the sequence holds there (update them first).
    pub fn page_upper_bounds<T: SimdElem>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        seq: &PagedSeq<'_, T>,
        bounds: &PageBounds<T>,
        out: &mut [f32],
    ) -> Result<()> {
        seq.check_shape(shape)?;
        bounds.check_pool(seq.pool().layout())?;
        check_len("q", shape.q_len(), q.len())?;
        let pages = seq.pages();
        let (hk, d, group) = (shape.kv_heads(), shape.head_dim(), shape.group());
        check_len(
            "page upper bounds (kv_heads * pages)",
            hk * pages.len(),
            out.len(),
        )?;
        for (slot, &p) in pages.iter().enumerate() {
            if bounds.filled(p as usize) < seq.page_tokens(slot) {
                return Err(Error::Param {
                    what: "page bounds (tokens covered)",
                    value: bounds.filled(p as usize) as f64,
                    expected: "at least the tokens the sequence holds in the page: update the bounds",
                });
            }
        }
        let mut ub = vec![0.0f32; group];
        let scale = shape.scale();
        for g in 0..hk {
            let qg = &q[g * group * d..(g + 1) * group * d];
            for (slot, &p) in pages.iter().enumerate() {
                let b = bounds
                    .page(p as usize, g)
                    .expect("checked: the page holds tokens");
                self.block_upper_bounds(qg, group, d, b, &mut ub)?;
                out[g * pages.len() + slot] =
                    ub.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) * scale;
            }
        }
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

/// The constructor and accessors [`Int8Keys`] and [`Int4Keys`] share: `$code` is the
/// element type of the codes, `$per_tile` the codes' elements per tile and
/// dimension.
macro_rules! tiled_accessors {
    ($name:literal, $code:ty) => {
        /// An empty copy of rows of `d` elements.
        pub fn new(d: usize) -> Self {
            Self {
                d,
                ..Self::default()
            }
        }

        /// Rows held.
        pub fn len(&self) -> usize {
            self.scales.len()
        }

        /// Whether no row is held.
        pub fn is_empty(&self) -> bool {
            self.scales.is_empty()
        }

        /// Removes every row (the capacity stays).
        pub fn clear(&mut self) {
            self.codes.clear();
            self.scales.clear();
        }

        /// The codes, tiled (whole tiles).
        pub fn codes(&self) -> &[$code] {
            &self.codes
        }

        /// One scale per row.
        pub fn scales(&self) -> &[f32] {
            &self.scales
        }

        /// The codes and scales of rows `range`, which must start at a tile
        /// boundary (a multiple of [`INT8_TILE`]).
        ///
        /// # Panics
        /// When `range` is out of bounds or does not start at a tile boundary.
        pub fn rows(&self, range: std::ops::Range<usize>) -> (&[$code], &[f32]) {
            assert!(
                range.start.is_multiple_of(INT8_TILE),
                concat!($name, "::rows: a tile boundary")
            );
            let t = self.tile_len();
            let tiles = range.start / INT8_TILE..range.end.div_ceil(INT8_TILE);
            (
                &self.codes[tiles.start * t..tiles.end * t],
                &self.scales[range],
            )
        }
    };
}

/// Rows per tile of the int8 key layout of [`CpuBackend::int8_max_scores`].
pub const INT8_TILE: usize = 16;

/// An int8 copy of key rows in the tiled layout of
/// [`CpuBackend::int8_max_scores`], one scale per row ([`quantize_i8`]).
#[derive(Debug, Clone, Default)]
pub struct Int8Keys {
    d: usize,
    codes: Vec<i8>,
    scales: Vec<f32>,
    row: Vec<i8>,
}

impl Int8Keys {
    /// Appends one key row (`d` elements).
    ///
    /// # Panics
    /// When `k` is not `d` long.
    pub fn push(&mut self, k: &[f32]) {
        let (d, j) = (self.d, self.scales.len());
        assert_eq!(k.len(), d, "Int8Keys::push: a row of d elements");
        self.row.resize(d, 0);
        self.scales.push(quantize_i8(k, &mut self.row));
        if j % INT8_TILE == 0 {
            self.codes.resize(self.codes.len() + INT8_TILE * d, 0);
        }
        let tile = &mut self.codes[(j / INT8_TILE) * INT8_TILE * d..][..INT8_TILE * d];
        for (i, &c) in self.row.iter().enumerate() {
            tile[i * INT8_TILE + j % INT8_TILE] = c;
        }
    }

    tiled_accessors!("Int8Keys", i8);

    /// Codes per tile.
    fn tile_len(&self) -> usize {
        INT8_TILE * self.d
    }
}

/// Dimensions per group of the int4 layout of
/// [`CpuBackend::int4_max_scores`] (a group of a tile is 64 bytes).
pub const INT4_GROUP: usize = 8;

/// An int4 copy of key rows in the tiled layout of
/// [`CpuBackend::int4_max_scores`] (two codes per byte, biased by 8), one
/// scale per row ([`quantize_i4`]).
#[derive(Debug, Clone, Default)]
pub struct Int4Keys {
    d: usize,
    codes: Vec<u8>,
    scales: Vec<f32>,
    row: Vec<i8>,
}

impl Int4Keys {
    /// Appends one key row (`d` elements).
    ///
    /// # Panics
    /// When `k` is not `d` long.
    pub fn push(&mut self, k: &[f32]) {
        let (d, j) = (self.d, self.scales.len());
        assert_eq!(k.len(), d, "Int4Keys::push: a row of d elements");
        self.row.clear();
        self.row.resize(d.div_ceil(INT4_GROUP) * INT4_GROUP, 0);
        self.scales.push(quantize_i4(k, &mut self.row[..d]));
        let t = self.tile_len();
        if j % INT8_TILE == 0 {
            self.codes.resize(self.codes.len() + t, 0);
        }
        let tile = &mut self.codes[(j / INT8_TILE) * t..][..t];
        let r = j % INT8_TILE;
        for (grp, c) in tile
            .chunks_exact_mut(INT8_TILE * INT4_GROUP / 2)
            .zip(self.row.chunks_exact(INT4_GROUP))
        {
            for m in 0..INT4_GROUP / 2 {
                let (lo, hi) = ((c[m] + 8) as u8, (c[m + INT4_GROUP / 2] + 8) as u8);
                grp[4 * r + m] = lo | (hi << 4);
            }
        }
    }

    tiled_accessors!("Int4Keys", u8);

    /// Bytes per tile.
    fn tile_len(&self) -> usize {
        INT8_TILE * self.d.div_ceil(INT4_GROUP) * INT4_GROUP / 2
    }

    /// Row `j`'s element `i` as its code (`-7..=7`).
    ///
    /// # Panics
    /// When `j` or `i` is out of range.
    pub fn code(&self, j: usize, i: usize) -> i8 {
        assert!(j < self.len() && i < self.d, "Int4Keys::code: out of range");
        let g = (j / INT8_TILE) * self.tile_len() + (i / INT4_GROUP) * INT8_TILE * INT4_GROUP / 2;
        let b = self.codes[g + 4 * (j % INT8_TILE) + i % 4];
        let nib = if i % INT4_GROUP < 4 { b & 15 } else { b >> 4 };
        nib as i8 - 8
    }
}

/// Symmetric int4 quantisation of one row, as [`quantize_i8`] with codes in
/// `-7..=7` (`scale = max |x| / 7`): each element is within `scale / 2` of
/// `scale * out[i]`.
///
/// # Panics
/// When `out` is not as long as `x`.
pub fn quantize_i4(x: &[f32], out: &mut [i8]) -> f32 {
    quantize_sym(x, out, 7)
}

/// Symmetric int8 quantisation of one row: `out[i] = round(x[i] / scale)`
/// with `scale = max |x| / 127`, returned (0 for a row of zeros; `+inf`,
/// codes 0, for a row holding an infinity or a NaN). Each element is then
/// within `scale / 2` of `scale * out[i]`.
///
/// # Panics
/// When `out` is not as long as `x`.
pub fn quantize_i8(x: &[f32], out: &mut [i8]) -> f32 {
    quantize_sym(x, out, 127)
}

/// Symmetric quantisation to codes in `-top..=top`, the scale returned.
fn quantize_sym(x: &[f32], out: &mut [i8], top: i8) -> f32 {
    assert_eq!(x.len(), out.len(), "quantize: one code per element");
    let amax = x.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
    if !amax.is_finite() || x.iter().any(|v| v.is_nan()) {
        out.fill(0);
        return f32::INFINITY;
    }
    if amax == 0.0 {
        out.fill(0);
        return 0.0;
    }
    let top = f32::from(top);
    let inv = top / amax;
    for (o, &v) in out.iter_mut().zip(x) {
        // |v * inv| <= top up to rounding; the clamp keeps it a code.
        *o = (v * inv).round().clamp(-top, top) as i8;
    }
    amax / top
}

/// [`CpuBackend::int8_max_scores`] for `H` query rows.
#[inline(always)]
fn int8_scores<const H: usize>(
    q: &[f32],
    off: &[f32],
    d: usize,
    keys: &[i8],
    ks: &[f32],
    out: &mut [f32],
) {
    tile_scores::<H, i8>(q, off, d, keys, INT8_TILE, ks, out, |col, k| {
        for (x, &c) in k.iter_mut().zip(col) {
            *x = f32::from(c);
        }
    });
}

/// The score estimate over tiled codes for `H` query rows: per tile, `H`
/// accumulators of [`INT8_TILE`] lanes, one key vector per dimension
/// (`unpack` widens a dimension's `per_dim` codes to it) shared by the
/// rows (vertical FMAs, no horizontal sums).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile_scores<const H: usize, C: Copy>(
    q: &[f32],
    off: &[f32],
    d: usize,
    keys: &[C],
    per_dim: usize,
    ks: &[f32],
    out: &mut [f32],
    unpack: impl Fn(&[C], &mut [f32; INT8_TILE]),
) {
    const T: usize = INT8_TILE;
    for ((tile, s), o) in keys
        .chunks_exact(per_dim * d)
        .zip(ks.chunks(T))
        .zip(out.chunks_mut(T))
    {
        let mut acc = [[0.0f32; T]; H];
        for (i, col) in tile.chunks_exact(per_dim).enumerate() {
            let mut k = [0.0f32; T];
            unpack(col, &mut k);
            for (a, qh) in acc.iter_mut().zip(q.chunks_exact(d)) {
                let qi = qh[i];
                for (x, &y) in a.iter_mut().zip(&k) {
                    *x = qi.mul_add(y, *x);
                }
            }
        }
        for (l, (o, &sc)) in o.iter_mut().zip(s).enumerate() {
            *o = if sc.is_finite() {
                acc.iter()
                    .zip(off)
                    .fold(*o, |m, (a, &c)| m.max(a[l] * sc - c))
            } else {
                f32::INFINITY
            };
        }
    }
}
