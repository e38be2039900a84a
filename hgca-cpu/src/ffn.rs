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

use crate::CpuBackend;
use crate::isa::{Kern, dispatch, load, store};

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

/// Dequantises one row of floats into `out` (`d` values) inside the ISA:
/// half floats widen a vector at a time with the ISA's conversion (F16C,
/// AVX-512, NEON's FCVTL). The block formats take [`dot_blocks`] instead.
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
/// widened in registers.
#[inline(always)]
fn dot_q8<S: Kern>(s: S, row: &[BlockQ8_0], x: &[f32]) -> f32 {
    let lanes = S::F32_LANES;
    let mut acc = s.splat_f32s(0.0);
    for (b, xs) in row.iter().zip(x.chunks_exact(32)) {
        let mut blk = s.splat_f32s(0.0);
        for k in (0..32).step_by(lanes) {
            let q = s.widen_i8(&b.qs[k..k + lanes]);
            blk = s.mul_add_f32s(q, load(s, &xs[k..k + lanes]), blk);
        }
        acc = s.mul_add_f32s(blk, s.splat_f32s(b.d.to_f32()), acc);
    }
    s.reduce_sum_f32s(acc)
}

/// `y += a * row` over Q8_0 blocks, the codes widened in registers.
#[inline(always)]
fn axpy_q8<S: Kern>(s: S, row: &[BlockQ8_0], a: f32, y: &mut [f32]) {
    let lanes = S::F32_LANES;
    for (b, ys) in row.iter().zip(y.chunks_exact_mut(32)) {
        let c = s.splat_f32s(a * b.d.to_f32());
        for k in (0..32).step_by(lanes) {
            let q = s.widen_i8(&b.qs[k..k + lanes]);
            let r = s.mul_add_f32s(q, c, load(s, &ys[k..k + lanes]));
            store(s, &mut ys[k..k + lanes], r);
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

/// A block of one of [`is_small`]'s formats: its codes as signed bytes,
/// its scale and its minimum (values `scale * code + min`).
#[inline(always)]
fn small_codes<W: WeightElem>(e: &W) -> ([i8; 32], f32, f32) {
    use core::any::TypeId;
    let t = TypeId::of::<W>();
    if t == TypeId::of::<BlockQ4_0>() {
        crate::qdot::parts::<BlockQ4_0>(bytemuck::cast_ref(e))
    } else if t == TypeId::of::<BlockQ4_1>() {
        crate::qdot::parts::<BlockQ4_1>(bytemuck::cast_ref(e))
    } else {
        crate::qdot::parts::<BlockQ5_0>(bytemuck::cast_ref(e))
    }
}

/// `Σ_k row[k] x[k]` over Q4_0, Q4_1 or Q5_0 blocks: per block
/// `d Σ q_k x_k + m Σ x_k`, the codes unpacked to bytes and widened in
/// registers (not dequantised through a buffer).
#[inline(always)]
fn dot_small<S: Kern, W: WeightElem>(s: S, row: &[W], x: &[f32]) -> f32 {
    let lanes = S::F32_LANES;
    let min = core::any::TypeId::of::<W>() == core::any::TypeId::of::<BlockQ4_1>();
    let mut acc = s.splat_f32s(0.0);
    for (b, xs) in row.iter().zip(x.chunks_exact(32)) {
        let (q, d, m) = small_codes(b);
        let (mut blk, mut sum) = (s.splat_f32s(0.0), s.splat_f32s(0.0));
        for k in (0..32).step_by(lanes) {
            let xv = load(s, &xs[k..k + lanes]);
            blk = s.mul_add_f32s(s.widen_i8(&q[k..k + lanes]), xv, blk);
            if min {
                sum = s.add_f32s(sum, xv);
            }
        }
        acc = s.mul_add_f32s(blk, s.splat_f32s(d), acc);
        if min {
            acc = s.mul_add_f32s(sum, s.splat_f32s(m), acc);
        }
    }
    s.reduce_sum_f32s(acc)
}

/// `y += a * row` over Q4_0, Q4_1 or Q5_0 blocks, the codes widened in
/// registers.
#[inline(always)]
fn axpy_small<S: Kern, W: WeightElem>(s: S, row: &[W], a: f32, y: &mut [f32]) {
    let lanes = S::F32_LANES;
    for (b, ys) in row.iter().zip(y.chunks_exact_mut(32)) {
        let (q, d, m) = small_codes(b);
        let (c, cm) = (s.splat_f32s(a * d), s.splat_f32s(a * m));
        for k in (0..32).step_by(lanes) {
            let r = s.mul_add_f32s(s.widen_i8(&q[k..k + lanes]), c, load(s, &ys[k..k + lanes]));
            store(s, &mut ys[k..k + lanes], s.add_f32s(r, cm));
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
}

/// Q8_0 rows, codes widened in registers.
struct Q8Rows<S>(S);
impl<S: Kern, W: WeightElem> RowOps<W> for Q8Rows<S> {
    #[inline(always)]
    fn dot(&self, row: &[W], x: &[f32]) -> f32 {
        dot_q8(self.0, q8(row), x)
    }
    #[inline(always)]
    fn axpy(&self, row: &[W], a: f32, y: &mut [f32]) {
        axpy_q8(self.0, q8(row), a, y)
    }
}

/// Q4_0, Q4_1, Q5_0 rows, codes unpacked and widened in registers.
struct SmallRows<S>(S);
impl<S: Kern, W: WeightElem> RowOps<W> for SmallRows<S> {
    #[inline(always)]
    fn dot(&self, row: &[W], x: &[f32]) -> f32 {
        dot_small(self.0, row, x)
    }
    #[inline(always)]
    fn axpy(&self, row: &[W], a: f32, y: &mut [f32]) {
        axpy_small(self.0, row, a, y)
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

/// One neuron for one token (`x`, `y`: `d` values): its gate row's dot
/// product decides (with a threshold), then its up row's, then its down
/// row is added into `y`, each row read by `ops`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn neuron<W: WeightElem>(
    st: &mut FfnStats,
    act: FfnAct,
    threshold: Option<f32>,
    [gate, up, down]: [&[W]; 3],
    x: &[f32],
    y: &mut [f32],
    ops: &impl RowOps<W>,
) {
    let v = act.apply(ops.dot(gate, x));
    st.rows += 1;
    if threshold.is_some_and(|th| v.abs() <= th) {
        return;
    }
    ops.axpy(down, v * ops.dot(up, x), y);
    st.rows += 2;
    st.active += 1;
}

/// One part's neurons (`ids`) over the `n` tokens of `x`, added into `y`
/// (`[n, d]`). Each neuron's rows are dequantised once into f32 (the up
/// and down rows only when some token needs them), then serve every token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn ffn_part<S: Kern, W: WeightElem>(
    s: S,
    extra: S::Extra,
    act: FfnAct,
    w: &FfnWeights<'_, W>,
    x: &[f32],
    n: usize,
    ids: &mut dyn Iterator<Item = usize>,
    threshold: Option<f32>,
    y: &mut [f32],
) -> FfnStats {
    let (d, r) = (w.d_model, w.row_len());
    let mut st = FfnStats::default();
    let (mut g, mut u, mut dn) = (vec![0.0f32; d], vec![0.0f32; d], vec![0.0f32; d]);
    let mut a = vec![0.0f32; n];
    let blocks = W::VALUES > 1;
    let mut ids = ids.peekable();
    let rows_of = |i: usize| {
        [
            &w.gate[i * r..(i + 1) * r],
            &w.up[i * r..(i + 1) * r],
            &w.down_t[i * r..(i + 1) * r],
        ]
    };
    while let Some(i) = ids.next() {
        // The next neuron's rows are fetched while this one computes: an
        // active list skips rows, which the hardware prefetchers do not
        // foresee; consecutive neurons they do. (With a threshold the next
        // gate row is always read; its up and down rows may not be.)
        if let Some(&next) = ids.peek().filter(|&&j| j != i + 1) {
            let [g0, u0, d0] = rows_of(next);
            let parts: &[&[W]] = if threshold.is_some() {
                &[g0]
            } else {
                &[g0, u0, d0]
            };
            for row in parts {
                let bytes: &[u8] = bytemuck::cast_slice(row);
                for off in (0..bytes.len()).step_by(64) {
                    s.prefetch(bytes[off..].as_ptr());
                }
            }
        }
        let rows = rows_of(i);
        if n == 1 && is_q8::<W>() {
            // One token over Q8_0 rows: codes widened in registers.
            neuron(&mut st, act, threshold, rows, x, y, &Q8Rows(s));
            continue;
        }
        if n == 1 && is_small::<W>() {
            // One token over 4- and 5-bit rows: codes widened in registers.
            neuron(&mut st, act, threshold, rows, x, y, &SmallRows(s));
            continue;
        }
        if blocks {
            // Block formats: dequantised a block at a time inside each pass.
            for t in 0..n {
                neuron(
                    &mut st,
                    act,
                    threshold,
                    rows,
                    &x[t * d..(t + 1) * d],
                    &mut y[t * d..(t + 1) * d],
                    &BlockRows,
                );
            }
            continue;
        }
        if n == 1 && is_float::<W>() {
            // One float token (a decode step): rows straight from memory.
            neuron(&mut st, act, threshold, rows, x, y, &FloatRows(s, extra));
            continue;
        }
        // Floats, a chunk of tokens: each row widened once into a buffer
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
            Neurons::Threshold(t) => {
                if !(t.is_finite() && t >= 0.0) {
                    return Err(Error::Param {
                        what: "ffn threshold",
                        value: f64::from(t),
                        expected: "finite and >= 0",
                    });
                }
                (None, Some(t))
            }
        };
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
                    let mut ids: Box<dyn Iterator<Item = usize>> = match list {
                        Some(l) => Box::new(l[range.clone()].iter().map(|&i| i as usize)),
                        None => Box::new(range.clone()),
                    };
                    ffn_part(s, ex, act, w, x, n, &mut *ids, threshold, y)
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
        FfnOwned::new(
            w.d_model,
            w.n_ff,
            w.gate.to_vec(),
            w.up.to_vec(),
            w.down_t.to_vec(),
        )
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
