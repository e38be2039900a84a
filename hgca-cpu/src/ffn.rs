//! The sparse FFN kernel (PowerInfer's CPU side): a gated FFN over an
//! active neuron set, given as a list or found by a threshold on the gate
//! (CATS), weights neuron-major in floats or GGUF blocks dequantised on the
//! fly (the contract: [`hgca_kernels::ffn`]).
//!
//! The neurons are split into one part per thread; each part reads its
//! neurons' rows once for every token of the call (a prompt chunk shares
//! them) and accumulates into its own output, and the parts are summed in
//! a fixed order, so a call's result does not depend on scheduling.

use hgca_kernels::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8_0, DenseFfnBackend, Error, FfnAct, FfnOwned,
    FfnWeights, Neurons, Result, WeightElem, bf16, check_len_of, check_neurons, f16,
};

use crate::isa::{Kern, dispatch, load, store};
use crate::packed::{GROUP, GroupDot, group_dot_of};
use crate::qdot::{QDotPath, RowDot, row_dot_of};
use crate::{CpuBackend, DotBlock, PackBlock, PackedRows, Q8Acts};

/// What a [`CpuBackend::sparse_ffn`] call computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FfnStats {
    /// (token, neuron) pairs computed (their up and down rows applied).
    pub active: usize,
    /// Weight rows read per token, summed over the tokens of the call
    /// (a neuron's gate, up and down rows count 3; with a threshold, every
    /// neuron's gate row counts, and the up and down rows of those that
    /// pass). Rows shared by the tokens of a chunk are read once from
    /// memory; this counts what a token-by-token run would read.
    pub rows: usize,
}

/// Values dequantised at a time: 32, or one block of a format with larger
/// blocks (the K formats: 256).
const CHUNK: usize = 32;
/// The largest block of a format.
const MAX_BLOCK: usize = 256;

/// Values a block step takes for format `W`.
#[inline(always)]
const fn step_of<W: WeightElem>() -> usize {
    if W::VALUES > CHUNK { W::VALUES } else { CHUNK }
}

/// `Σ_k row[k] x[k]` with `row` dequantised a block at a time, in 16
/// lanes (for the block formats this measured faster than dequantising
/// the whole row first).
#[inline(always)]
fn dot_blocks<W: WeightElem>(row: &[W], x: &[f32]) -> f32 {
    let step = step_of::<W>();
    let per = step / W::VALUES;
    let mut acc = [0.0f32; 16];
    let mut buf = [0.0f32; MAX_BLOCK];
    let full = row.len() / per;
    for (c, xs) in row.chunks_exact(per).zip(x.chunks_exact(step)) {
        for (e, o) in c.iter().zip(buf[..step].chunks_exact_mut(W::VALUES)) {
            e.dequant(o);
        }
        for h in 0..step / 16 {
            for l in 0..16 {
                acc[l] = buf[h * 16 + l].mul_add(xs[h * 16 + l], acc[l]);
            }
        }
    }
    let mut s = acc.iter().sum::<f32>();
    // A tail of floats (the block formats have none: d_model is a multiple
    // of their block).
    let mut one = [0.0f32; MAX_BLOCK];
    for (e, &xv) in row[full * per..].iter().zip(&x[full * step..]) {
        e.dequant(&mut one[..W::VALUES]);
        s = one[0].mul_add(xv, s);
    }
    s
}

/// `y += a * row` with `row` dequantised on the fly.
#[inline(always)]
fn axpy_blocks<W: WeightElem>(row: &[W], a: f32, y: &mut [f32]) {
    let step = step_of::<W>();
    let per = step / W::VALUES;
    let mut buf = [0.0f32; MAX_BLOCK];
    let full = row.len() / per;
    for (c, ys) in row.chunks_exact(per).zip(y.chunks_exact_mut(step)) {
        for (e, o) in c.iter().zip(buf[..step].chunks_exact_mut(W::VALUES)) {
            e.dequant(o);
        }
        for (yv, &b) in ys.iter_mut().zip(&buf[..step]) {
            *yv = b.mul_add(a, *yv);
        }
    }
    let mut one = [0.0f32; MAX_BLOCK];
    for (e, yv) in row[full * per..].iter().zip(&mut y[full * step..]) {
        e.dequant(&mut one[..W::VALUES]);
        *yv = one[0].mul_add(a, *yv);
    }
}

/// Dequantises one row into `out` (`d` values) inside the ISA:
/// half floats widen a vector at a time with the ISA's conversion (F16C,
/// AVX-512, NEON's FCVTL); block formats a block at a time (`dequant_slice`).
#[inline(always)]
fn dequant_row<S: Kern, W: WeightElem>(s: S, extra: S::Extra, row: &[W], out: &mut [f32]) {
    let lanes = S::F32_LANES;
    if is_float::<W>() {
        let full = row.len() / lanes * lanes;
        for (c, o) in row[..full]
            .chunks_exact(lanes)
            .zip(out.chunks_exact_mut(lanes))
        {
            store(s, o, load_row(s, extra, c));
        }
        W::dequant_slice(&row[full..], &mut out[full..row.len()]);
    } else {
        W::dequant_slice(row, out);
    }
}

/// Whether `W` is a float format (f32, f16, bf16), which the kernels
/// widen a vector at a time.
#[inline(always)]
fn is_float<W: WeightElem>() -> bool {
    use core::any::TypeId;
    let id = TypeId::of::<W>();
    id == TypeId::of::<f16>() || id == TypeId::of::<bf16>() || id == TypeId::of::<f32>()
}

/// One vector of a float row (`LANES` elements), widened to f32.
#[inline(always)]
fn load_row<S: Kern, W: WeightElem>(s: S, extra: S::Extra, c: &[W]) -> S::f32s {
    use core::any::TypeId;
    let id = TypeId::of::<W>();
    if id == TypeId::of::<f16>() {
        s.widen_f16(extra, bytemuck::cast_slice::<W, f16>(c))
    } else if id == TypeId::of::<bf16>() {
        s.widen_bf16(bytemuck::cast_slice::<W, bf16>(c))
    } else {
        load(s, bytemuck::cast_slice::<W, f32>(c))
    }
}

/// `Σ_k row[k] x[k]` straight from a float row (widened in registers, not
/// through a buffer: one token reads each row once), four accumulators.
#[inline(always)]
fn dot_row<S: Kern, W: WeightElem>(s: S, extra: S::Extra, row: &[W], x: &[f32]) -> f32 {
    let lanes = S::F32_LANES;
    let mut acc = [s.splat_f32s(0.0); 4];
    let (quads, full) = (row.len() / (4 * lanes), row.len() / lanes);
    for q in 0..quads {
        let k = 4 * q * lanes;
        for (j, a) in acc.iter_mut().enumerate() {
            let o = k + j * lanes;
            let w = load_row(s, extra, &row[o..o + lanes]);
            *a = s.mul_add_f32s(w, load(s, &x[o..o + lanes]), *a);
        }
    }
    for v in 4 * quads..full {
        let o = v * lanes;
        let w = load_row(s, extra, &row[o..o + lanes]);
        acc[0] = s.mul_add_f32s(w, load(s, &x[o..o + lanes]), acc[0]);
    }
    let v = s.add_f32s(s.add_f32s(acc[0], acc[1]), s.add_f32s(acc[2], acc[3]));
    let mut sum = s.reduce_sum_f32s(v);
    let mut one = [0.0f32; 1];
    for (e, &xv) in row[full * lanes..].iter().zip(&x[full * lanes..]) {
        e.dequant(&mut one);
        sum = one[0].mul_add(xv, sum);
    }
    sum
}

/// `y += a * row` straight from a float row.
#[inline(always)]
fn axpy_row<S: Kern, W: WeightElem>(s: S, extra: S::Extra, row: &[W], a: f32, y: &mut [f32]) {
    let lanes = S::F32_LANES;
    let av = s.splat_f32s(a);
    let full = row.len() / lanes;
    for v in 0..full {
        let o = v * lanes;
        let w = load_row(s, extra, &row[o..o + lanes]);
        let r = s.mul_add_f32s(w, av, load(s, &y[o..o + lanes]));
        store(s, &mut y[o..o + lanes], r);
    }
    let mut one = [0.0f32; 1];
    for (e, yv) in row[full * lanes..].iter().zip(&mut y[full * lanes..]) {
        e.dequant(&mut one);
        *yv = one[0].mul_add(a, *yv);
    }
}

/// Whether `W` is GGUF's Q8_0, whose codes the ISAs widen in registers.
#[inline(always)]
fn is_q8<W: WeightElem>() -> bool {
    core::any::TypeId::of::<W>() == core::any::TypeId::of::<BlockQ8_0>()
}

/// A row of `W` read as Q8_0 blocks (`W` is `BlockQ8_0`: [`is_q8`]).
#[inline(always)]
fn q8<W: WeightElem>(m: &[W]) -> &[BlockQ8_0] {
    bytemuck::cast_slice(m)
}

/// `Σ_k row[k] x[k]` over Q8_0 blocks: per block `d Σ q_k x_k`, the codes
/// widened in registers, the blocks' sums into two accumulators taken in
/// turn (one would chain a multiply-add's latency through every block;
/// written out, not indexed: an indexed pair lived on the stack).
#[inline(always)]
fn dot_q8<S: Kern>(s: S, extra: S::Extra, row: &[BlockQ8_0], x: &[f32]) -> f32 {
    let (mut a0, mut a1) = (s.splat_f32s(0.0), s.splat_f32s(0.0));
    let mut it = row.iter().zip(x.chunks_exact(32));
    while let Some((b, xs)) = it.next() {
        a0 = q8_block(s, extra, b, xs, a0);
        let Some((b, xs)) = it.next() else { break };
        a1 = q8_block(s, extra, b, xs, a1);
    }
    s.reduce_sum_f32s(s.add_f32s(a0, a1))
}

/// `acc + d Σ q_k x_k` for one Q8_0 block. (A function, not a closure:
/// see [`RowOps`].)
#[inline(always)]
fn q8_block<S: Kern>(s: S, extra: S::Extra, b: &BlockQ8_0, xs: &[f32], acc: S::f32s) -> S::f32s {
    let lanes = S::F32_LANES;
    let mut blk = s.splat_f32s(0.0);
    for k in (0..32).step_by(lanes) {
        let q = s.widen_i8(&b.qs[k..k + lanes]);
        blk = s.mul_add_f32s(q, load(s, &xs[k..k + lanes]), blk);
    }
    s.mul_add_f32s(blk, s.splat_f32s(s.scale_f16(extra, b.d)), acc)
}

/// `y += Σ_j a[j] rows[j]` over Q8_0 blocks, the codes widened in
/// registers, one pass over `y` for the `R` rows (each row's product added
/// in turn, as one row at a time would).
#[inline(always)]
fn axpy_q8<S: Kern, const R: usize>(
    s: S,
    extra: S::Extra,
    rows: [&[BlockQ8_0]; R],
    a: [f32; R],
    y: &mut [f32],
) {
    let lanes = S::F32_LANES;
    for (bi, ys) in y.chunks_exact_mut(32).enumerate() {
        let mut c = [s.splat_f32s(0.0); R];
        for j in 0..R {
            c[j] = s.splat_f32s(a[j] * s.scale_f16(extra, rows[j][bi].d));
        }
        for k in (0..32).step_by(lanes) {
            let mut v = load(s, &ys[k..k + lanes]);
            for j in 0..R {
                let q = s.widen_i8(&rows[j][bi].qs[k..k + lanes]);
                v = s.mul_add_f32s(q, c[j], v);
            }
            store(s, &mut ys[k..k + lanes], v);
        }
    }
}

/// Whether `W` is one of GGUF's 4- and 5-bit 32-value formats (Q4_0,
/// Q4_1, Q5_0), whose codes are unpacked to bytes and widened in
/// registers like Q8_0's.
#[inline(always)]
fn is_small<W: WeightElem>() -> bool {
    use core::any::TypeId;
    let t = TypeId::of::<W>();
    t == TypeId::of::<BlockQ4_0>()
        || t == TypeId::of::<BlockQ4_1>()
        || t == TypeId::of::<BlockQ5_0>()
}

/// A block of one of [`is_small`]'s formats: its codes, unsigned, a byte
/// each ([`Kern::nibbles`]), its scale and its minimum (the value of code
/// 0: values are `scale * code + min`).
#[inline(always)]
fn small_block<S: Kern, W: WeightElem>(s: S, extra: S::Extra, e: &W) -> ([u8; 32], f32, f32) {
    use core::any::TypeId;
    let t = TypeId::of::<W>();
    if t == TypeId::of::<BlockQ4_0>() {
        let b: &BlockQ4_0 = bytemuck::cast_ref(e);
        let d = s.scale_f16(extra, b.d);
        (s.nibbles(&b.qs, None), d, -8.0 * d)
    } else if t == TypeId::of::<BlockQ4_1>() {
        let b: &BlockQ4_1 = bytemuck::cast_ref(e);
        let (d, m) = (s.scale_f16(extra, b.d), s.scale_f16(extra, b.m));
        (s.nibbles(&b.qs, None), d, m)
    } else {
        let b: &BlockQ5_0 = bytemuck::cast_ref(e);
        let d = s.scale_f16(extra, b.d);
        (s.nibbles(&b.qs, Some(b.qh)), d, -16.0 * d)
    }
}

/// The sums of a token's values over each 32-value block: the minimums'
/// share of a row's dot product is `Σ_b min_b xsum_b`.
fn block_sums(x: &[f32]) -> Vec<f32> {
    x.chunks_exact(32).map(|c| c.iter().sum()).collect()
}

/// `Σ_k row[k] x[k]` over Q4_0, Q4_1 or Q5_0 blocks: per block
/// `d Σ q_k x_k + min xsum` (`xsum`: [`block_sums`] of `x`), the codes
/// unpacked and widened in registers (not dequantised through a buffer),
/// two accumulators taken in turn as in [`dot_q8`].
#[inline(always)]
fn dot_small<S: Kern, W: WeightElem>(
    s: S,
    extra: S::Extra,
    row: &[W],
    x: &[f32],
    xsum: &[f32],
) -> f32 {
    let (mut a0, mut a1) = ((s.splat_f32s(0.0), 0.0), (s.splat_f32s(0.0), 0.0));
    let mut it = row.iter().zip(x.chunks_exact(32)).zip(xsum);
    while let Some(((b, xs), &sx)) = it.next() {
        a0 = small_block_dot(s, extra, b, xs, sx, a0);
        let Some(((b, xs), &sx)) = it.next() else {
            break;
        };
        a1 = small_block_dot(s, extra, b, xs, sx, a1);
    }
    s.reduce_sum_f32s(s.add_f32s(a0.0, a1.0)) + (a0.1 + a1.1)
}

/// One block of [`dot_small`]: `acc + d Σ q_k x_k` and `mins + min xsum`.
#[inline(always)]
fn small_block_dot<S: Kern, W: WeightElem>(
    s: S,
    extra: S::Extra,
    b: &W,
    xs: &[f32],
    sx: f32,
    (acc, mins): (S::f32s, f32),
) -> (S::f32s, f32) {
    let lanes = S::F32_LANES;
    let (q, d, m) = small_block(s, extra, b);
    let mut blk = s.splat_f32s(0.0);
    for k in (0..32).step_by(lanes) {
        let c = s.widen_u8(&q[k..k + lanes]);
        blk = s.mul_add_f32s(c, load(s, &xs[k..k + lanes]), blk);
    }
    (
        s.mul_add_f32s(blk, s.splat_f32s(d), acc),
        m.mul_add(sx, mins),
    )
}

/// `y += Σ_j a[j] rows[j]` over Q4_0, Q4_1 or Q5_0 blocks, the codes
/// unpacked and widened in registers, one pass over `y` for the `R` rows
/// (their minimums' share added first, then each row's codes in turn).
#[inline(always)]
fn axpy_small<S: Kern, W: WeightElem, const R: usize>(
    s: S,
    extra: S::Extra,
    rows: [&[W]; R],
    a: [f32; R],
    y: &mut [f32],
) {
    let lanes = S::F32_LANES;
    for (bi, ys) in y.chunks_exact_mut(32).enumerate() {
        let mut q = [[0u8; 32]; R];
        let mut c = [s.splat_f32s(0.0); R];
        let mut min = 0.0f32;
        for j in 0..R {
            let (codes, d, m) = small_block(s, extra, &rows[j][bi]);
            q[j] = codes;
            c[j] = s.splat_f32s(a[j] * d);
            min = a[j].mul_add(m, min);
        }
        let min = s.splat_f32s(min);
        for k in (0..32).step_by(lanes) {
            let mut v = s.add_f32s(load(s, &ys[k..k + lanes]), min);
            for j in 0..R {
                v = s.mul_add_f32s(s.widen_u8(&q[j][k..k + lanes]), c[j], v);
            }
            store(s, &mut ys[k..k + lanes], v);
        }
    }
}

/// How one path reads a row of `W`: its dot product with a token and its
/// scaled add into an output. Methods, not closures: a closure's body was
/// compiled outside the ISA's target features, its SIMD intrinsics called
/// out of line (the sparse FFN ran 5-10x slower that way); these inline
/// into the kernel's ISA context like the functions they call.
trait RowOps<W> {
    fn dot(&self, row: &[W], x: &[f32]) -> f32;
    fn axpy(&self, row: &[W], a: f32, y: &mut [f32]);
    /// `y += Σ_j a[j] rows[j]`, the rows in order; the fast paths make one
    /// pass over `y` for the four (a quarter of the loads and stores of
    /// `y`; each row's product is added in turn as `axpy` would).
    #[inline(always)]
    fn axpy4(&self, rows: [&[W]; 4], a: [f32; 4], y: &mut [f32]) {
        for (row, a) in rows.into_iter().zip(a) {
            self.axpy(row, a, y);
        }
    }
    /// Whether `axpy4` reads its four rows together (then a queued row is
    /// prefetched as it joins: four rows read side by side are four short
    /// streams, which the hardware prefetchers barely follow: f16 rows fell
    /// from 33 to 8 GB/s that way, one token, from DRAM). Float rows are
    /// bound by memory and keep `axpy`'s one stream.
    #[inline(always)]
    fn fuses_downs(&self) -> bool {
        false
    }
    /// Whether `dot16` takes sixteen rows together (faster than `dot`
    /// sixteen times).
    #[inline(always)]
    fn groups(&self) -> bool {
        false
    }
    /// `dot` of sixteen rows with `x`.
    #[inline(always)]
    fn dot16(&self, rows: &[&[W]; GROUP], x: &[f32], out: &mut [f32; GROUP]) {
        dot_each(self, rows, x, out);
    }
}

/// [`RowOps::dot`] of each of sixteen rows.
#[inline(always)]
fn dot_each<W>(
    ops: &(impl RowOps<W> + ?Sized),
    rows: &[&[W]; GROUP],
    x: &[f32],
    out: &mut [f32; GROUP],
) {
    for (o, r) in out.iter_mut().zip(rows) {
        *o = ops.dot(r, x);
    }
}

/// The integer dot products of a one-token call of
/// [`CpuBackend::sparse_ffn_q8`]: a row's, sixteen rows' where the path has
/// them, and the token quantised.
struct IntDots<'a, W> {
    row: RowDot<W>,
    group: Option<GroupDot<W>>,
    acts: &'a Q8Acts,
}

impl<W> Clone for IntDots<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<W> Copy for IntDots<'_, W> {}

impl<'a, W: DotBlock> IntDots<'a, W> {
    /// The products of `path` against `acts`.
    ///
    /// # Safety
    /// `path` is what [`CpuBackend::qmatvec_path`] returned on this CPU.
    unsafe fn new(path: QDotPath, acts: &'a Q8Acts) -> Self {
        // SAFETY: the caller's promise.
        unsafe {
            Self {
                row: row_dot_of::<W>(path),
                group: group_dot_of::<W>(path),
                acts,
            }
        }
    }
}

/// Q8_0 rows, codes widened in registers.
struct Q8Rows<S: Kern>(S, S::Extra);
impl<S: Kern, W: WeightElem> RowOps<W> for Q8Rows<S> {
    #[inline(always)]
    fn dot(&self, row: &[W], x: &[f32]) -> f32 {
        dot_q8(self.0, self.1, q8(row), x)
    }
    #[inline(always)]
    fn axpy(&self, row: &[W], a: f32, y: &mut [f32]) {
        axpy_q8(self.0, self.1, [q8(row)], [a], y)
    }
    #[inline(always)]
    fn axpy4(&self, rows: [&[W]; 4], a: [f32; 4], y: &mut [f32]) {
        axpy_q8(self.0, self.1, rows.map(q8), a, y)
    }
    #[inline(always)]
    fn fuses_downs(&self) -> bool {
        true
    }
}

/// Q4_0, Q4_1, Q5_0 rows of one token, codes unpacked and widened in
/// registers, with the token's [`block_sums`].
struct SmallRows<'a, S: Kern>(S, S::Extra, &'a [f32]);
impl<S: Kern, W: WeightElem> RowOps<W> for SmallRows<'_, S> {
    #[inline(always)]
    fn dot(&self, row: &[W], x: &[f32]) -> f32 {
        dot_small(self.0, self.1, row, x, self.2)
    }
    #[inline(always)]
    fn axpy(&self, row: &[W], a: f32, y: &mut [f32]) {
        axpy_small(self.0, self.1, [row], [a], y)
    }
    #[inline(always)]
    fn axpy4(&self, rows: [&[W]; 4], a: [f32; 4], y: &mut [f32]) {
        axpy_small(self.0, self.1, rows, a, y)
    }
    #[inline(always)]
    fn fuses_downs(&self) -> bool {
        true
    }
}

/// Gate and up rows against a token quantised to Q8_0 ([`RowDot`]: the
/// quantised matvec's integer dot products); down rows by `axpy`'s ops.
struct IntRows<'a, W, R> {
    dots: IntDots<'a, W>,
    axpy: &'a R,
}
impl<W: WeightElem, R: RowOps<W>> RowOps<W> for IntRows<'_, W, R> {
    #[inline(always)]
    fn dot(&self, row: &[W], _x: &[f32]) -> f32 {
        (self.dots.row)(row, self.dots.acts)
    }
    #[inline(always)]
    fn groups(&self) -> bool {
        self.dots.group.is_some()
    }
    #[inline(always)]
    fn dot16(&self, rows: &[&[W]; GROUP], x: &[f32], out: &mut [f32; GROUP]) {
        // A row at a time where the group's product declines the rows.
        if !self
            .dots
            .group
            .is_some_and(|g| g(rows, self.dots.acts, out))
        {
            dot_each(self, rows, x, out);
        }
    }
    #[inline(always)]
    fn axpy(&self, row: &[W], a: f32, y: &mut [f32]) {
        self.axpy.axpy(row, a, y)
    }
    #[inline(always)]
    fn axpy4(&self, rows: [&[W]; 4], a: [f32; 4], y: &mut [f32]) {
        self.axpy.axpy4(rows, a, y)
    }
    #[inline(always)]
    fn fuses_downs(&self) -> bool {
        self.axpy.fuses_downs()
    }
}

/// Other block formats, dequantised a block at a time.
struct BlockRows;
impl<W: WeightElem> RowOps<W> for BlockRows {
    #[inline(always)]
    fn dot(&self, row: &[W], x: &[f32]) -> f32 {
        dot_blocks(row, x)
    }
    #[inline(always)]
    fn axpy(&self, row: &[W], a: f32, y: &mut [f32]) {
        axpy_blocks(row, a, y)
    }
}

/// Float rows straight from memory.
struct FloatRows<S: Kern>(S, S::Extra);
impl<S: Kern, W: WeightElem> RowOps<W> for FloatRows<S> {
    #[inline(always)]
    fn dot(&self, row: &[W], x: &[f32]) -> f32 {
        dot_row(self.0, self.1, row, x)
    }
    #[inline(always)]
    fn axpy(&self, row: &[W], a: f32, y: &mut [f32]) {
        axpy_row(self.0, self.1, row, a, y)
    }
}

/// Down rows waiting to be added into `y` four at a time
/// ([`RowOps::axpy4`]), in the order their neurons came.
struct Downs<'a, W> {
    rows: [&'a [W]; 4],
    coef: [f32; 4],
    len: usize,
}

impl<'a, W: WeightElem> Downs<'a, W> {
    #[inline(always)]
    fn new() -> Self {
        Self {
            rows: [&[]; 4],
            coef: [0.0; 4],
            len: 0,
        }
    }

    /// Queues `c * row`; the fourth queued row adds all four.
    #[inline(always)]
    fn push(&mut self, row: &'a [W], c: f32, y: &mut [f32], ops: &impl RowOps<W>) {
        self.rows[self.len] = row;
        self.coef[self.len] = c;
        self.len += 1;
        if self.len == 4 {
            ops.axpy4(self.rows, self.coef, y);
            self.len = 0;
        }
    }

    /// Adds the rows still queued.
    #[inline(always)]
    fn flush(&mut self, y: &mut [f32], ops: &impl RowOps<W>) {
        for j in 0..self.len {
            ops.axpy(self.rows[j], self.coef[j], y);
        }
        self.len = 0;
    }
}

/// A part's neurons: a range of all of them, or a piece of an active list.
#[derive(Clone, Copy)]
enum Ids<'a> {
    Range(usize, usize),
    List(&'a [u32]),
}

impl Ids<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        match *self {
            Ids::Range(a, b) => b - a,
            Ids::List(l) => l.len(),
        }
    }

    /// The `k`-th neuron (`k < len`).
    #[inline(always)]
    fn get(&self, k: usize) -> usize {
        match *self {
            Ids::Range(a, _) => a + k,
            Ids::List(l) => l[k] as usize,
        }
    }
}

/// `t` when it is a threshold on `|act|`: finite and `>= 0`.
fn check_threshold(t: f32) -> Result<f32> {
    if t.is_finite() && t >= 0.0 {
        Ok(t)
    } else {
        Err(Error::Param {
            what: "ffn threshold",
            value: f64::from(t),
            expected: "finite and >= 0",
        })
    }
}

/// How a part keeps its neurons.
#[derive(Clone, Copy)]
enum Pick<'a> {
    /// Every one.
    All,
    /// Those whose activation's magnitude exceeds the threshold.
    Threshold(f32),
    /// Every one, with its activation given (the `k`-th neuron's at `k`):
    /// the gate pass ran before, over every neuron.
    Gated(&'a [f32]),
}

impl<'a> Pick<'a> {
    /// The pick of the neurons `start..end` of a list (a thread's part).
    fn part(self, start: usize, end: usize) -> Pick<'a> {
        match self {
            Pick::Gated(a) => Pick::Gated(&a[start..end]),
            other => other,
        }
    }
}

/// Neuron `i`'s gate, up and down rows.
#[inline(always)]
fn rows_of<'a, W: WeightElem>(w: &FfnWeights<'a, W>, i: usize) -> [&'a [W]; 3] {
    w.rows(i)
}

/// Bytes of rows the prefetches run ahead of the computation: a DRAM
/// access's latency times the streaming rate is a few KiB, and the rows of
/// one neuron ahead (1.5 KiB of Q4_0 at Qwen2's width) were not enough.
const PREFETCH_AHEAD: usize = 16 << 10;

/// Neurons of the threshold form's window: their gate rows are read, then
/// the kept ones' up and down rows, fetched meanwhile.
const THRESHOLD_WINDOW: usize = 32;

/// Neurons the prefetches run ahead for weights `w`: [`PREFETCH_AHEAD`]
/// bytes of rows, 1 to 16 neurons.
#[inline(always)]
fn ahead_of<W: WeightElem>(w: &FfnWeights<'_, W>) -> usize {
    (PREFETCH_AHEAD / w.neuron_bytes().max(1)).clamp(1, 16)
}

/// Fetches the rows of the `j`-th neuron (one the computation reaches
/// later) where it does not follow the one before it: an active list skips
/// rows, which the hardware prefetchers do not foresee; consecutive neurons
/// they do. (With a threshold only the gate row is fetched: the up and down
/// rows may not be read; with the activations given, no gate row is.)
#[inline(always)]
fn prefetch_at<S: Kern, W: WeightElem>(
    s: S,
    w: &FfnWeights<'_, W>,
    ids: Ids<'_>,
    j: usize,
    pick: Pick<'_>,
) {
    if j == 0 || j >= ids.len() || ids.get(j) == ids.get(j - 1) + 1 {
        return;
    }
    let [g0, u0, d0] = rows_of(w, ids.get(j));
    if !matches!(pick, Pick::Gated(_)) {
        prefetch_row(s, g0);
    }
    if !matches!(pick, Pick::Threshold(_)) {
        prefetch_row(s, u0);
        prefetch_row(s, d0);
    }
}

/// The prefetches of a walk over `ids`: [`ahead_of`] neurons ahead of the
/// one being computed.
struct Prefetches<'a, 'w, W> {
    w: &'a FfnWeights<'w, W>,
    ids: Ids<'a>,
    pick: Pick<'a>,
    ahead: usize,
}

impl<'a, 'w, W: WeightElem> Prefetches<'a, 'w, W> {
    /// Starts a walk: fetches the neurons before the first `ahead`.
    #[inline(always)]
    fn start<S: Kern>(s: S, w: &'a FfnWeights<'w, W>, ids: Ids<'a>, pick: Pick<'a>) -> Self {
        let ahead = ahead_of(w);
        for j in 1..ahead {
            prefetch_at(s, w, ids, j, pick);
        }
        Self {
            w,
            ids,
            pick,
            ahead,
        }
    }

    /// Before the walk computes its `k`-th neuron.
    #[inline(always)]
    fn before<S: Kern>(&self, s: S, k: usize) {
        prefetch_at(s, self.w, self.ids, k + self.ahead, self.pick);
    }
}

/// [`prefetch_at`] for the neurons `first..first + GROUP`: a sixteen-neuron
/// walk fetches a group's rows while it computes the group before.
#[inline(always)]
fn prefetch_group<S: Kern, W: WeightElem>(
    s: S,
    w: &FfnWeights<'_, W>,
    ids: Ids<'_>,
    first: usize,
    pick: Pick<'_>,
) {
    for j in first..first + GROUP {
        prefetch_at(s, w, ids, j, pick);
    }
}

/// Fetches every cache line of `row`.
#[inline(always)]
fn prefetch_row<S: Kern, W: WeightElem>(s: S, row: &[W]) {
    let bytes: &[u8] = bytemuck::cast_slice(row);
    for off in (0..bytes.len()).step_by(64) {
        s.prefetch(bytes[off..].as_ptr());
    }
}

/// One token's neurons (`ids`; `x`, `y`: `d` values), rows straight from
/// memory, read by `ops`: each neuron's gate row's dot product (or its
/// given activation) decides (with a threshold), then its up row's, and its
/// down row joins the [`Downs`] queue.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn token_part<S: Kern, W: WeightElem>(
    s: S,
    act: FfnAct,
    w: &FfnWeights<'_, W>,
    x: &[f32],
    ids: Ids<'_>,
    pick: Pick<'_>,
    y: &mut [f32],
    ops: &impl RowOps<W>,
) -> FfnStats {
    let mut st = FfnStats::default();
    let mut downs = Downs::new();
    let fetch = Prefetches::start(s, w, ids, pick);
    if let Pick::Threshold(th) = pick {
        // The gate rows of a window of neurons first, each kept neuron's
        // up and down rows fetched as it is found, then the kept neurons in
        // order: their rows' misses overlap instead of each waiting in turn
        // (the same products, added in the same order, as one at a time).
        let mut kept = [(0usize, 0.0f32); THRESHOLD_WINDOW];
        for k0 in (0..ids.len()).step_by(THRESHOLD_WINDOW) {
            let mut n_kept = 0;
            for k in k0..(k0 + THRESHOLD_WINDOW).min(ids.len()) {
                fetch.before(s, k);
                let [gate, up, down] = rows_of(w, ids.get(k));
                let v = act.apply(ops.dot(gate, x));
                st.rows += 1;
                if v.abs() <= th {
                    continue;
                }
                prefetch_row(s, up);
                prefetch_row(s, down);
                kept[n_kept] = (k, v);
                n_kept += 1;
            }
            for &(k, v) in &kept[..n_kept] {
                let [_, up, down] = rows_of(w, ids.get(k));
                downs.push(down, v * ops.dot(up, x), y, ops);
                st.rows += 2;
                st.active += 1;
            }
        }
        downs.flush(y, ops);
        return st;
    }
    let mut k = 0;
    if ops.groups() {
        // Sixteen neurons at a time: their gate rows' products together
        // (unless given), then their up rows'.
        // (The first group's rows: the walk's `fetch` started on them.)
        let (mut g, mut u) = ([0.0f32; GROUP], [0.0f32; GROUP]);
        while k + GROUP <= ids.len() {
            prefetch_group(s, w, ids, k + GROUP, pick);
            let rows: [[&[W]; 3]; GROUP] = core::array::from_fn(|j| rows_of(w, ids.get(k + j)));
            if !matches!(pick, Pick::Gated(_)) {
                ops.dot16(&rows.map(|r| r[0]), x, &mut g);
                st.rows += GROUP;
            }
            ops.dot16(&rows.map(|r| r[1]), x, &mut u);
            for (j, [_, _, down]) in rows.into_iter().enumerate() {
                let v = match pick {
                    Pick::Gated(a) => a[k + j],
                    _ => act.apply(g[j]),
                };
                downs.push(down, v * u[j], y, ops);
            }
            st.rows += 2 * GROUP;
            st.active += GROUP;
            k += GROUP;
        }
    }
    for k in k..ids.len() {
        fetch.before(s, k);
        let [gate, up, down] = rows_of(w, ids.get(k));
        let v = match pick {
            Pick::Gated(a) => a[k],
            _ => {
                st.rows += 1;
                act.apply(ops.dot(gate, x))
            }
        };
        if ops.fuses_downs() {
            prefetch_row(s, down);
        }
        downs.push(down, v * ops.dot(up, x), y, ops);
        st.rows += 2;
        st.active += 1;
    }
    downs.flush(y, ops);
    st
}

/// [`token_part`] with `ops`, or with the gate and up rows' dot products
/// from `int` (a one-token call of [`CpuBackend::sparse_ffn_q8`]).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn token_part_with<S: Kern, W: WeightElem, R: RowOps<W>>(
    s: S,
    act: FfnAct,
    w: &FfnWeights<'_, W>,
    x: &[f32],
    ids: Ids<'_>,
    pick: Pick<'_>,
    y: &mut [f32],
    ops: &R,
    int: Option<IntDots<'_, W>>,
) -> FfnStats {
    match int {
        Some(dots) => {
            let ops = IntRows { dots, axpy: ops };
            token_part(s, act, w, x, ids, pick, y, &ops)
        }
        None => token_part(s, act, w, x, ids, pick, y, ops),
    }
}

/// One part's neurons (`ids`) over the `n` tokens of `x`, added into `y`
/// (`[n, d]`). One token takes [`token_part`]; a chunk dequantises each
/// neuron's rows once into f32 (the up and down rows only when some token
/// needs them), which then serve every token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn ffn_part<S: Kern, W: WeightElem>(
    s: S,
    extra: S::Extra,
    act: FfnAct,
    w: &FfnWeights<'_, W>,
    x: &[f32],
    n: usize,
    ids: Ids<'_>,
    pick: Pick<'_>,
    int: Option<IntDots<'_, W>>,
    y: &mut [f32],
) -> FfnStats {
    if n == 1 {
        return if is_q8::<W>() {
            // Q8_0: codes widened in registers.
            let ops = Q8Rows(s, extra);
            token_part_with(s, act, w, x, ids, pick, y, &ops, int)
        } else if is_small::<W>() {
            // 4- and 5-bit rows: codes unpacked and widened in registers.
            let xsum = block_sums(x);
            let ops = SmallRows(s, extra, &xsum);
            token_part_with(s, act, w, x, ids, pick, y, &ops, int)
        } else if W::VALUES > 1 {
            // Other block formats: dequantised a block at a time.
            token_part_with(s, act, w, x, ids, pick, y, &BlockRows, int)
        } else {
            token_part(s, act, w, x, ids, pick, y, &FloatRows(s, extra))
        };
    }
    let d = w.d_model;
    let mut st = FfnStats::default();
    let (mut g, mut u, mut dn) = (vec![0.0f32; d], vec![0.0f32; d], vec![0.0f32; d]);
    let mut a = vec![0.0f32; n];
    // Given activations are one token's (`sparse_ffn_q8_gated`).
    debug_assert!(!matches!(pick, Pick::Gated(_)));
    let threshold = match pick {
        Pick::Threshold(t) => Some(t),
        _ => None,
    };
    let fetch = Prefetches::start(s, w, ids, pick);
    for k in 0..ids.len() {
        fetch.before(s, k);
        let rows = rows_of(w, ids.get(k));
        // A chunk of tokens: each row dequantised once into a buffer (f32)
        // that serves every token.
        let [gate, up, down] = rows;
        dequant_row(s, extra, gate, &mut g);
        let mut any = false;
        for (t, at) in a.iter_mut().enumerate() {
            let v = act.apply(dot_row(s, extra, &g, &x[t * d..(t + 1) * d]));
            let keep = !threshold.is_some_and(|th| v.abs() <= th);
            *at = if keep { v } else { f32::NAN };
            any |= keep;
        }
        st.rows += n;
        if !any {
            continue;
        }
        dequant_row(s, extra, up, &mut u);
        dequant_row(s, extra, down, &mut dn);
        for (t, &at) in a.iter().enumerate() {
            if at.is_nan() {
                continue;
            }
            let c = at * dot_row(s, extra, &u, &x[t * d..(t + 1) * d]);
            axpy_row(s, extra, &dn, c, &mut y[t * d..(t + 1) * d]);
            st.rows += 2;
            st.active += 1;
        }
    }
    st
}

impl CpuBackend {
    /// The gated FFN of `n` tokens (`x`: `[n, d_model]`) over the active
    /// neurons, written to `out` (`[n, d_model]`, overwritten):
    /// `out_t = Σ_{i active} act(g_i) u_i down_t[i]` (see
    /// [`hgca_kernels::ffn`]). With [`Neurons::List`] every token uses the
    /// list; with [`Neurons::Threshold`] each token keeps the neurons with
    /// `|act(g_i)| > t` (their up and down rows are read; the others' not).
    /// Accumulation is f32 with fused multiply-adds; the parts of the
    /// threads are summed in a fixed order.
    ///
    /// ```
    /// use hgca_cpu::CpuBackend;
    /// use hgca_kernels::{FfnAct, FfnWeights, Neurons};
    /// // d_model 2, 3 neurons; neuron 1 alone: silu(1) * 2 * [1, -1]
    /// let gate = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
    /// let up = [0.0, 0.0, 0.0, 2.0, 0.0, 0.0];
    /// let down_t = [5.0, 5.0, 1.0, -1.0, 5.0, 5.0];
    /// let w = FfnWeights::new(2, 3, &gate, &up, &down_t)?;
    /// let mut out = [0.0f32; 2];
    /// let st = CpuBackend::new().sparse_ffn(FfnAct::Silu, &w, &[1.0, 1.0], 1, Neurons::List(&[1]), &mut out)?;
    /// let a = 2.0 / (1.0 + (-1.0f32).exp());
    /// assert!((out[0] - a).abs() < 1e-6 && (out[1] + a).abs() < 1e-6);
    /// assert_eq!((st.active, st.rows), (1, 3));
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Length`] for `x` or `out`; [`Error::Index`] for a neuron
    /// `>= n_ff`, [`Error::Param`] for a repeated neuron or a threshold
    /// that is NaN, infinite or negative. Nothing is written then.
    pub fn sparse_ffn<W: WeightElem>(
        &self,
        act: FfnAct,
        w: &FfnWeights<'_, W>,
        x: &[f32],
        n: usize,
        neurons: Neurons<'_>,
        out: &mut [f32],
    ) -> Result<FfnStats> {
        self.ffn(act, w, x, n, neurons, out, None)
    }

    /// [`Self::sparse_ffn`] over GGUF block weights with the tokens
    /// quantised to Q8_0 for the gate and up rows, as llama.cpp (and
    /// [`Self::qmatvec`]) multiply quantised weights: a decode step's gate
    /// and up rows take the quantised matvec's integer dot products (AVX-512
    /// VNNI: one `vpdpbusd` per two blocks, where the float path widens and
    /// converts every code and multiplies it in f32; for a list, or the
    /// kept neurons of the gated form, the 32-value formats' gate and up
    /// rows sixteen at a time, put in [`PackedRows`]' layout in registers
    /// as they are read); the down rows are added in f32 as in
    /// `sparse_ffn`. The result
    /// is `sparse_ffn`'s for `x'`, `x` quantised to Q8_0 and dequantised
    /// ([`Q8Acts`]; a prompt chunk computes with `x'` itself), so each value
    /// of `x` moves by up to 1/254 of its block's largest magnitude, and a
    /// threshold compares the gates of `x'`.
    ///
    /// ```
    /// use hgca_cpu::CpuBackend;
    /// use hgca_kernels::{BlockQ8_0, FfnAct, FfnWeights, Neurons, f16};
    /// // d_model 32, 2 neurons: neuron i's gate, up and down rows hold i + 1.
    /// let row = |v: i8| BlockQ8_0 { d: f16::ONE, qs: [v; 32] };
    /// let rows = [row(1), row(2)];
    /// let w = FfnWeights::new(32, 2, &rows, &rows, &rows)?;
    /// // 127/4096 quantises exactly (scale 1/4096, code 127).
    /// let x = [127.0f32 / 4096.0; 32];
    /// let mut out = [0.0f32; 32];
    /// CpuBackend::new().sparse_ffn_q8(FfnAct::Relu, &w, &x, 1, Neurons::List(&[1]), &mut out)?;
    /// // Neuron 1: gate = up = 2 * 32 * 127/4096; relu(gate) * up * 2.
    /// let g = 127.0f32 / 64.0;
    /// assert_eq!(out, [g * g * 2.0; 32]);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Self::sparse_ffn`].
    pub fn sparse_ffn_q8<W: WeightElem + DotBlock>(
        &self,
        act: FfnAct,
        w: &FfnWeights<'_, W>,
        x: &[f32],
        n: usize,
        neurons: Neurons<'_>,
        out: &mut [f32],
    ) -> Result<FfnStats> {
        check_len_of("x", &[n, w.d_model], x.len())?;
        let acts = Q8Acts::quantize(x, n, w.d_model)?;
        if n == 1 {
            // SAFETY: the path is `qmatvec_path`'s on this CPU.
            let dots = unsafe { IntDots::new(Self::qmatvec_path(self.isa()), &acts) };
            return self.ffn(act, w, x, n, neurons, out, Some(dots));
        }
        let mut xq = vec![0.0f32; x.len()];
        for (b, o) in acts.blocks().iter().zip(xq.chunks_exact_mut(32)) {
            b.dequant(o);
        }
        self.ffn(act, w, &xq, n, neurons, out, None)
    }

    /// One token of [`Self::sparse_ffn_q8`]'s threshold form
    /// ([`Neurons::Threshold`]) with the gate pass over `gate`, `w`'s gate
    /// rows repacked ([`PackedRows`]): every gate row's product in one
    /// [`Self::qmatvec_packed`] (with AVX-512 VNNI, sixteen rows at a time
    /// near the memory's rate, where a row at a time is bound by compute),
    /// then the up and down rows of the neurons kept (`|act(g)| > t`) as
    /// `sparse_ffn_q8` reads them. In the threshold form the gate rows are
    /// most of the bytes read (all of them, against the kept neurons' up
    /// and down rows). The result is `sparse_ffn_q8`'s up to the order of
    /// each gate row's sum (the packed kernel adds a row's products in
    /// another order), so a neuron whose activation lies within rounding
    /// of the threshold may fall on the other side.
    ///
    /// ```
    /// use hgca_cpu::{CpuBackend, PackedRows};
    /// use hgca_kernels::{BlockQ8_0, FfnAct, FfnWeights, Neurons, f16};
    /// // d_model 32, 2 neurons: neuron i's gate, up and down rows hold i + 1.
    /// let row = |v: i8| BlockQ8_0 { d: f16::ONE, qs: [v; 32] };
    /// let rows = [row(1), row(2)];
    /// let w = FfnWeights::new(32, 2, &rows, &rows, &rows)?;
    /// let gate = PackedRows::new(&rows, 2, 32)?;
    /// let x = [127.0f32 / 4096.0; 32];
    /// let cpu = CpuBackend::new();
    /// let (mut a, mut b) = ([0.0f32; 32], [0.0f32; 32]);
    /// // ReLU gates 127/128 and 127/64: a threshold of 1.5 keeps neuron 1 alone.
    /// let st = cpu.sparse_ffn_q8_gated(FfnAct::Relu, &w, &gate, &x, 1.5, &mut a)?;
    /// cpu.sparse_ffn_q8(FfnAct::Relu, &w, &x, 1, Neurons::Threshold(1.5), &mut b)?;
    /// assert_eq!((st.active, st.rows), (1, 4));
    /// assert_eq!(a, b);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Self::sparse_ffn`] for `x`, `out` and the threshold;
    /// [`Error::ShapeMismatch`] when `gate` is not `n_ff` rows of
    /// `d_model`. Nothing is written then.
    pub fn sparse_ffn_q8_gated<W: WeightElem + PackBlock>(
        &self,
        act: FfnAct,
        w: &FfnWeights<'_, W>,
        gate: &PackedRows<W>,
        x: &[f32],
        threshold: f32,
        out: &mut [f32],
    ) -> Result<FfnStats> {
        let d = w.d_model;
        check_len_of("x", &[1, d], x.len())?;
        check_len_of("out", &[1, d], out.len())?;
        check_threshold(threshold)?;
        if (gate.rows(), gate.width()) != (w.n_ff, d) {
            return Err(Error::ShapeMismatch {
                what: "packed gate rows",
                expected: format!("{} rows of {d}", w.n_ff),
                found: format!("{} rows of {}", gate.rows(), gate.width()),
            });
        }
        let acts = Q8Acts::quantize(x, 1, d)?;
        let mut g = vec![0.0f32; w.n_ff];
        self.qmatvec_packed(gate, &acts, &mut g)?;
        let (mut list, mut vals) = (Vec::new(), Vec::new());
        for (i, &gi) in g.iter().enumerate() {
            let v = act.apply(gi);
            // As the threshold form: dropped when |v| <= t (a NaN stays).
            if v.abs() <= threshold {
                continue;
            }
            list.push(i as u32);
            vals.push(v);
        }
        // SAFETY: the path is `qmatvec_path`'s on this CPU.
        let dots = unsafe { IntDots::new(Self::qmatvec_path(self.isa()), &acts) };
        let pick = Pick::Gated(&vals);
        let mut st = self.ffn_picked(act, w, x, 1, Some(&list), pick, out, Some(dots))?;
        st.rows += w.n_ff;
        Ok(st)
    }

    /// [`Self::sparse_ffn`], with the gate and up rows' dot products of a
    /// one-token call from `int` where given.
    #[allow(clippy::too_many_arguments)]
    fn ffn<W: WeightElem>(
        &self,
        act: FfnAct,
        w: &FfnWeights<'_, W>,
        x: &[f32],
        n: usize,
        neurons: Neurons<'_>,
        out: &mut [f32],
        int: Option<IntDots<'_, W>>,
    ) -> Result<FfnStats> {
        let d = w.d_model;
        if W::VALUES > MAX_BLOCK {
            return Err(Error::Param {
                what: "weight format block (values)",
                value: W::VALUES as f64,
                expected: "at most 256",
            });
        }
        check_len_of("x", &[n, d], x.len())?;
        check_len_of("out", &[n, d], out.len())?;
        let (list, threshold) = match neurons {
            Neurons::All => (None, None),
            Neurons::List(l) => {
                check_neurons(l, w.n_ff)?;
                (Some(l), None)
            }
            Neurons::Threshold(t) => (None, Some(check_threshold(t)?)),
        };
        let pick = threshold.map_or(Pick::All, Pick::Threshold);
        self.ffn_picked(act, w, x, n, list, pick, out, int)
    }

    /// The threads' parts of [`Self::ffn`] over `list` (every neuron when
    /// `None`), checked.
    #[allow(clippy::too_many_arguments)]
    fn ffn_picked<W: WeightElem>(
        &self,
        act: FfnAct,
        w: &FfnWeights<'_, W>,
        x: &[f32],
        n: usize,
        list: Option<&[u32]>,
        pick: Pick<'_>,
        out: &mut [f32],
        int: Option<IntDots<'_, W>>,
    ) -> Result<FfnStats> {
        let d = w.d_model;
        let count = list.map_or(w.n_ff, <[u32]>::len);
        out.fill(0.0);
        // One part per thread, none smaller than 16 neurons.
        let parts = self.threads().min(count.div_ceil(16)).max(1);
        let per = count.div_ceil(parts);
        let mut acc: Vec<(Vec<f32>, FfnStats)> = (0..parts)
            .map(|p| {
                let y = if p == 0 { Vec::new() } else { vec![0.0; n * d] };
                (y, FfnStats::default())
            })
            .collect();
        let isa = self.isa();
        let first = std::sync::Mutex::new(&mut *out);
        self.for_chunks(&mut acc, 1, |p, part| {
            let (y, st) = &mut part[0];
            let range = (p * per).min(count)..((p + 1) * per).min(count);
            let run = |y: &mut [f32]| {
                dispatch!(isa, s, ex => {
                    let ids = match list {
                        Some(l) => Ids::List(&l[range.clone()]),
                        None => Ids::Range(range.start, range.end),
                    };
                    let pick = pick.part(range.start, range.end);
                    ffn_part(s, ex, act, w, x, n, ids, pick, int, y)
                })
            };
            *st = if p == 0 {
                // The first part writes the output itself.
                let mut o = first.lock().unwrap_or_else(|e| e.into_inner());
                run(&mut o[..])
            } else {
                run(y)
            };
        });
        let mut total = FfnStats::default();
        for (i, (y, st)) in acc.iter().enumerate() {
            if i > 0 {
                for (o, &v) in out.iter_mut().zip(y) {
                    *o += v;
                }
            }
            total.active += st.active;
            total.rows += st.rows;
        }
        Ok(total)
    }
}

/// The CPU standing in for the dense side of a hybrid FFN: the resident
/// weights are an owned copy and a call is [`CpuBackend::sparse_ffn`] over
/// every neuron.
impl DenseFfnBackend for CpuBackend {
    type Resident = FfnOwned<f16>;

    fn upload_ffn(&self, w: &FfnWeights<'_, f16>) -> Result<Self::Resident> {
        let [g, u, d] = w.matrices().map(|m| m.into_owned());
        FfnOwned::new(w.d_model, w.n_ff, g, u, d)
    }

    fn dense_ffn(
        &self,
        act: FfnAct,
        w: &Self::Resident,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        self.sparse_ffn(act, &w.view(), x, n, Neurons::All, out)
            .map(|_| ())
    }
}
