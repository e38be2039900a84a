//! Matrix-vector products over GGUF's weight blocks (the 32-value Q4_0,
//! Q4_1, Q5_0, Q8_0 here; the 256-value K formats Q4_K and Q6_K in
//! `kdot`) with the activations quantised to Q8_0 blocks: the decode
//! path of a quantised model as llama.cpp computes it. Per block, the
//! weight codes and the activation codes meet in an integer dot product,
//! scaled by both blocks' scales (Q4_1 adds its minimum times the
//! activation block's sum).
//!
//! The integer part is exact; the scaled sums are accumulated in f32. The
//! AVX2 path unpacks a block's codes into one 256-bit register and
//! multiplies them with `vpmaddubsw`; the AVX-512 VNNI path takes two
//! blocks per 512-bit register and `vpdpbusd`; other machines run the same
//! arithmetic in portable code ([`QDotPath`]). Both SIMD paths keep the 4-
//! and 5-bit codes unsigned, as stored, and take Q4_0's and Q5_0's offset
//! (`-8 d`, `-16 d`) like Q4_1's minimum, from the activation block's sum:
//! the unsigned-times-signed byte products need no sign moved (the form
//! the K formats take too), fewer instructions per block.

use hgca_kernels::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, Error, Result, WeightElem,
    check_len_of,
};

use crate::CpuBackend;
use crate::isa::Isa;

/// Which block format a [`DotBlock`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotKind {
    /// [`BlockQ4_0`]: `d (q - 8)`, 4-bit codes.
    Q4_0,
    /// [`BlockQ4_1`]: `d q + m`, 4-bit codes.
    Q4_1,
    /// [`BlockQ5_0`]: `d (q - 16)`, 5-bit codes.
    Q5_0,
    /// [`BlockQ8_0`]: `d q`, 8-bit codes.
    Q8_0,
    /// [`BlockQ4K`]: 256 values, `d sc_j q - dmin m_j` per sub-block of 32.
    Q4K,
    /// [`BlockQ6K`]: 256 values, `d sc_m (q - 32)` per sub-block of 16.
    Q6K,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for hgca_kernels::BlockQ4_0 {}
    impl Sealed for hgca_kernels::BlockQ4_1 {}
    impl Sealed for hgca_kernels::BlockQ5_0 {}
    impl Sealed for hgca_kernels::BlockQ8_0 {}
    impl Sealed for hgca_kernels::BlockQ4K {}
    impl Sealed for hgca_kernels::BlockQ6K {}
}

/// A GGUF weight block (32 values, or 256 for the K formats) that
/// [`CpuBackend::qmatvec`] multiplies with Q8_0 activations.
pub trait DotBlock: WeightElem + bytemuck::Pod + Sync + sealed::Sealed {
    /// The format.
    const KIND: DotKind;
}

impl DotBlock for BlockQ4_0 {
    const KIND: DotKind = DotKind::Q4_0;
}
impl DotBlock for BlockQ4_1 {
    const KIND: DotKind = DotKind::Q4_1;
}
impl DotBlock for BlockQ5_0 {
    const KIND: DotKind = DotKind::Q5_0;
}
impl DotBlock for BlockQ8_0 {
    const KIND: DotKind = DotKind::Q8_0;
}
impl DotBlock for BlockQ4K {
    const KIND: DotKind = DotKind::Q4K;
}
impl DotBlock for BlockQ6K {
    const KIND: DotKind = DotKind::Q6K;
}

impl DotKind {
    /// Whether the SIMD paths multiply this format's codes unsigned (Q4_0,
    /// Q4_1, Q5_0: the nibbles, and the fifth bit, as stored), with the
    /// offset (`-8 d`, `m`, `-16 d`) taken as a minimum times the
    /// activation block's sum; Q8_0's codes are signed.
    const fn unsigned(self) -> bool {
        matches!(self, DotKind::Q4_0 | DotKind::Q4_1 | DotKind::Q5_0)
    }
}

/// A block's signed codes, scale and minimum (0 but for Q4_1): its values
/// are `scale * code + min`.
#[inline(always)]
pub(crate) fn parts<B: DotBlock>(b: &B) -> ([i8; 32], f32, f32) {
    let mut q = [0i8; 32];
    let nibbles = |qs: &[u8; 16], q: &mut [i8; 32], off: i8| {
        for (i, &v) in qs.iter().enumerate() {
            q[i] = (v & 0x0F) as i8 - off;
            q[i + 16] = (v >> 4) as i8 - off;
        }
    };
    match B::KIND {
        DotKind::Q4_0 => {
            let b: &BlockQ4_0 = bytemuck::cast_ref(b);
            nibbles(&b.qs, &mut q, 8);
            (q, b.d.to_f32(), 0.0)
        }
        DotKind::Q4_1 => {
            let b: &BlockQ4_1 = bytemuck::cast_ref(b);
            nibbles(&b.qs, &mut q, 0);
            (q, b.d.to_f32(), b.m.to_f32())
        }
        DotKind::Q5_0 => {
            let b: &BlockQ5_0 = bytemuck::cast_ref(b);
            let qh = u32::from_le_bytes(b.qh);
            nibbles(&b.qs, &mut q, 16);
            for (i, v) in q.iter_mut().enumerate() {
                *v += (((qh >> i) & 1) << 4) as i8;
            }
            (q, b.d.to_f32(), 0.0)
        }
        DotKind::Q8_0 => {
            let b: &BlockQ8_0 = bytemuck::cast_ref(b);
            (b.qs, b.d.to_f32(), 0.0)
        }
        DotKind::Q4K | DotKind::Q6K => unreachable!("K formats take kdot's paths"),
    }
}

/// Activations quantised to Q8_0 blocks for [`CpuBackend::qmatvec`]:
/// `n` tokens of `k` values each (`k` a multiple of 32), each block's
/// scale the block's largest magnitude over 127, codes rounded to nearest
/// (as [`BlockQ8_0::quantize`]; llama.cpp and candle quantise the same way).
///
/// Every code lies in `-127..=127` (never -128): the AVX2 kernels' i16
/// sums rely on it (Q8_0 weights' `|w| * a` pairs reach 2 * 128 * 127 =
/// 32512), so a constructor added here must keep it.
#[derive(Debug, Clone, Default)]
pub struct Q8Acts {
    n: usize,
    k: usize,
    blocks: Vec<BlockQ8_0>,
    /// Per block, the scale `d` widened to f32.
    scales: Vec<f32>,
    /// Per block, `d Σ q` (what Q4_1's minimum multiplies).
    sums: Vec<f32>,
    /// Per half block (16 values), `d Σ q` (what Q6_K's offset multiplies).
    sums16: Vec<f32>,
}

/// `x`'s blocks of 32 quantised by [`BlockQ8_0::quantize`]'s rule, with
/// AVX-512 where the machine has it (the same codes and scales, bit for
/// bit): one thread's serial share of every decode step's matrix-vector
/// products.
fn quantize_blocks(x: &[f32]) -> Vec<BlockQ8_0> {
    #[cfg(target_arch = "x86_64")]
    {
        // std caches the detection: two loads of a static.
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
            let zero = BlockQ8_0 {
                d: hgca_kernels::f16::ZERO,
                qs: [0; 32],
            };
            let mut blocks = vec![zero; x.len() / 32];
            // SAFETY: AVX-512 F and BW were detected.
            unsafe { x86::quantize_avx512(x, &mut blocks) };
            return blocks;
        }
    }
    x.chunks_exact(32)
        .map(|c| BlockQ8_0::quantize(c.try_into().expect("32 values")))
        .collect()
}

impl Q8Acts {
    /// Quantises `x` (`[n, k]` row-major).
    ///
    /// # Errors
    /// [`Error::Length`] when `x` does not hold `n * k` values,
    /// [`Error::Param`] when `k` is not a multiple of 32.
    ///
    /// ```
    /// let x: Vec<f32> = (0..64).map(|i| i as f32 / 8.0).collect();
    /// let a = hgca_cpu::Q8Acts::quantize(&x, 1, 64).unwrap();
    /// assert_eq!((a.tokens(), a.width()), (1, 64));
    /// ```
    pub fn quantize(x: &[f32], n: usize, k: usize) -> Result<Self> {
        check_len_of("activations", &[n, k], x.len())?;
        if !k.is_multiple_of(32) {
            return Err(Error::Param {
                what: "activation width",
                value: k as f64,
                expected: "a multiple of 32 (the block)",
            });
        }
        let blocks = quantize_blocks(x);
        let scales: Vec<f32> = blocks.iter().map(|b| b.d.to_f32()).collect();
        let sum = |q: &[i8]| q.iter().map(|&q| i32::from(q)).sum::<i32>();
        let sums = blocks
            .iter()
            .zip(&scales)
            .map(|(b, d)| d * sum(&b.qs) as f32)
            .collect();
        let sums16 = blocks
            .iter()
            .zip(&scales)
            .flat_map(|(b, d)| [d * sum(&b.qs[..16]) as f32, d * sum(&b.qs[16..]) as f32])
            .collect();
        Ok(Self {
            n,
            k,
            blocks,
            scales,
            sums,
            sums16,
        })
    }

    /// Tokens (rows of activations).
    pub fn tokens(&self) -> usize {
        self.n
    }

    /// Values per token.
    pub fn width(&self) -> usize {
        self.k
    }

    /// The quantised blocks, token-major.
    pub fn blocks(&self) -> &[BlockQ8_0] {
        &self.blocks
    }

    /// Token `t`'s blocks, scales and sums.
    #[inline(always)]
    pub(crate) fn token(&self, t: usize) -> Token<'_> {
        let r = t * self.k / 32..(t + 1) * self.k / 32;
        Token {
            blocks: &self.blocks[r.clone()],
            scales: &self.scales[r.clone()],
            sums16: &self.sums16[2 * r.start..2 * r.end],
            sums: &self.sums[r],
        }
    }
}

/// One token of [`Q8Acts`].
#[derive(Clone, Copy)]
pub(crate) struct Token<'a> {
    pub(crate) blocks: &'a [BlockQ8_0],
    pub(crate) scales: &'a [f32],
    pub(crate) sums: &'a [f32],
    pub(crate) sums16: &'a [f32],
}

/// One row's dot product with one token's activations, portable code.
#[inline(always)]
fn row_dot_scalar<B: DotBlock>(row: &[B], x: Token<'_>) -> f32 {
    if B::VALUES != 32 {
        return crate::kdot::row_dot_scalar(row, x);
    }
    let mut acc = 0.0f32;
    for (i, b) in row.iter().enumerate() {
        let (q, d, m) = parts(b);
        let dot: i32 = q
            .iter()
            .zip(&x.blocks[i].qs)
            .map(|(&a, &b)| i32::from(a) * i32::from(b))
            .sum();
        acc = (d * x.scales[i]).mul_add(dot as f32, acc);
        if B::KIND == DotKind::Q4_1 {
            acc = m.mul_add(x.sums[i], acc);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{DotBlock, DotKind, Token};
    use core::arch::x86_64::*;
    use hgca_kernels::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8_0};

    pub(crate) use crate::isa::x86_h2f as h2f;
    use crate::isa::{x86_fifth_bits, x86_nibbles as nibbles};

    /// How far ahead of the row being multiplied [`rows`] prefetches.
    const PREFETCH_BYTES: usize = 4096;

    /// [`BlockQ8_0::quantize`] of each block of 32 of `x` into `out`: the
    /// largest magnitude (NaN left out, as the scalar fold does), the
    /// values times the inverse scale, rounded halves away from zero
    /// (truncation, then the fraction left), NaN to 0, clamped to ±127.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn quantize_avx512(x: &[f32], out: &mut [BlockQ8_0]) {
        let (one, half) = (_mm512_set1_ps(1.0), _mm512_set1_ps(0.5));
        let lim = _mm512_set1_ps(127.0);
        for (c, b) in x.chunks_exact(32).zip(out) {
            // SAFETY: 32 readable values.
            let v = unsafe {
                [
                    _mm512_loadu_ps(c.as_ptr()),
                    _mm512_loadu_ps(c.as_ptr().add(16)),
                ]
            };
            // vmaxps gives its second operand where either is NaN.
            let m = _mm512_max_ps(
                _mm512_abs_ps(v[1]),
                _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps()),
            );
            let amax = _mm512_reduce_max_ps(m);
            let d = amax / 127.0;
            let inv = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let mut q = [0i8; 32];
            for (h, qh) in q.chunks_exact_mut(16).enumerate() {
                let y = _mm512_mul_ps(v[h], inv);
                let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(y, y);
                let t = _mm512_cvtepi32_ps(_mm512_maskz_cvttps_epi32(ordered, y));
                let f = _mm512_maskz_sub_ps(ordered, y, t);
                let r = _mm512_mask_add_ps(t, _mm512_cmp_ps_mask::<_CMP_GE_OQ>(f, half), t, one);
                let r = _mm512_mask_sub_ps(
                    r,
                    _mm512_cmp_ps_mask::<_CMP_LE_OQ>(f, _mm512_sub_ps(_mm512_setzero_ps(), half)),
                    r,
                    one,
                );
                let r = _mm512_min_ps(
                    _mm512_max_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), lim)),
                    lim,
                );
                let bytes = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r));
                // SAFETY: 16 writable bytes.
                unsafe { _mm_storeu_si128(qh.as_mut_ptr().cast(), bytes) };
            }
            *b = BlockQ8_0 {
                d: hgca_kernels::f16::from_f32(d),
                qs: q,
            };
        }
    }

    /// The 32 codes of a block in one register (unsigned for the formats
    /// [`DotKind::unsigned`] names, signed for Q8_0), its scale and its
    /// minimum (the value of code 0).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn codes<B: DotBlock>(b: &B) -> (__m256i, f32, f32) {
        match B::KIND {
            DotKind::Q4_0 => {
                let b: &BlockQ4_0 = bytemuck::cast_ref(b);
                let d = h2f(b.d);
                (nibbles(&b.qs), d, -8.0 * d)
            }
            DotKind::Q4_1 => {
                let b: &BlockQ4_1 = bytemuck::cast_ref(b);
                (nibbles(&b.qs), h2f(b.d), h2f(b.m))
            }
            DotKind::Q5_0 => {
                let b: &BlockQ5_0 = bytemuck::cast_ref(b);
                // The code is the nibble plus 16 where the fifth bit is set.
                let q = _mm256_or_si256(nibbles(&b.qs), x86_fifth_bits(b.qh));
                let d = h2f(b.d);
                (q, d, -16.0 * d)
            }
            DotKind::Q8_0 => {
                let b: &BlockQ8_0 = bytemuck::cast_ref(b);
                // SAFETY: 32 readable bytes.
                let q = unsafe { _mm256_loadu_si256(b.qs.as_ptr().cast()) };
                (q, h2f(b.d), 0.0)
            }
            DotKind::Q4K | DotKind::Q6K => unreachable!("K formats take kdot's paths"),
        }
    }

    /// Eight i32 partial sums of `Σ a_k b_k` over 32 signed bytes. `vpmaddubsw`
    /// takes unsigned times signed: |a| times b with a's sign. No pair can
    /// saturate: |a| <= 128 and |b| <= 127 (activation codes are clamped).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn dot_i8(a: __m256i, b: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// One block's contribution added to `acc` (the minimum's part to `min`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn step<B: DotBlock>(
        b: &B,
        x: &BlockQ8_0,
        scale: f32,
        sum: f32,
        acc: __m256,
        min: &mut f32,
    ) -> __m256 {
        let (q, d, m) = codes(b);
        // SAFETY: 32 readable bytes.
        let p = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
        let v = if B::KIND.unsigned() {
            // Codes below 32: no pair of products can saturate.
            *min = m.mul_add(sum, *min);
            _mm256_madd_epi16(_mm256_maddubs_epi16(q, p), _mm256_set1_epi16(1))
        } else {
            dot_i8(q, p)
        };
        let v = _mm256_cvtepi32_ps(v);
        _mm256_fmadd_ps(_mm256_set1_ps(d * scale), v, acc)
    }

    /// One row's dot product with one token's activations; two accumulators
    /// in registers (even and odd blocks) so consecutive blocks do not wait
    /// on each other.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn row_dot<B: DotBlock>(row: &[B], x: Token<'_>) -> f32 {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (mut min, mut min1) = (0.0f32, 0.0f32);
        let pairs = row
            .chunks_exact(2)
            .zip(x.blocks.chunks_exact(2))
            .zip(x.scales.chunks_exact(2).zip(x.sums.chunks_exact(2)));
        for ((b, xb), (sc, su)) in pairs {
            a0 = step(&b[0], &xb[0], sc[0], su[0], a0, &mut min);
            a1 = step(&b[1], &xb[1], sc[1], su[1], a1, &mut min1);
        }
        if !row.len().is_multiple_of(2) {
            let i = row.len() - 1;
            a0 = step(&row[i], &x.blocks[i], x.scales[i], x.sums[i], a0, &mut min);
        }
        hsum(_mm256_add_ps(a0, a1)) + (min + min1)
    }

    /// Rows `rows` (each `nb` blocks) against every token of `acts`, into
    /// `out` (`[rows, n]`), on the AVX-512 VNNI path where `vnni`.
    ///
    /// # Safety
    /// Where `vnni`, the CPU has AVX-512 F/BW/VL and VNNI.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows<B: DotBlock>(
        w: &[B],
        nb: usize,
        acts: &super::Q8Acts,
        out: &mut [f32],
        vnni: bool,
    ) {
        let n = acts.tokens();
        let row_bytes = nb * size_of::<B>();
        let end = w.as_ptr_range().end.cast::<u8>();
        for (row, o) in w.chunks_exact(nb).zip(out.chunks_exact_mut(n)) {
            // The rows PREFETCH_BYTES ahead, a cache line at a time: a task's
            // rows are one stream, but short enough (tens of KiB) that the
            // hardware prefetcher is still ramping up when it ends.
            let ahead = row.as_ptr().cast::<u8>().wrapping_add(PREFETCH_BYTES);
            let mut line = 0;
            while line < row_bytes && ahead.wrapping_add(line) < end {
                // A prefetch has no side effect and does not fault.
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
                line += 64;
            }
            for (t, y) in o.iter_mut().enumerate() {
                *y = if B::VALUES != 32 {
                    if vnni {
                        // SAFETY: the caller's promise.
                        unsafe { crate::kdot::x86::vnni::row_dot(row, acts.token(t)) }
                    } else {
                        // SAFETY: this function's features.
                        unsafe { crate::kdot::x86::row_dot(row, acts.token(t)) }
                    }
                } else if vnni {
                    // SAFETY: the caller's promise.
                    unsafe { vnni::row_dot(row, acts.token(t)) }
                } else {
                    row_dot(row, acts.token(t))
                };
            }
        }
    }

    /// Two blocks per 512-bit register, multiplied by `vpdpbusd` (unsigned
    /// bytes times signed bytes, four products summed into each i32 lane):
    /// the signed formats give it their codes' magnitudes and move their
    /// signs onto the activations, as the AVX2 path does for `vpmaddubsw`.
    pub(crate) mod vnni {
        use super::*;

        /// Two blocks' nibbles: 128-bit lanes 0 and 1 hold the first
        /// block's values 0..16 and 16..32, lanes 2 and 3 the second's.
        #[target_feature(enable = "avx512f,avx512bw,avx2")]
        #[inline]
        fn nibbles2(q0: &[u8; 16], q1: &[u8; 16]) -> __m512i {
            // SAFETY: 16 readable bytes each.
            let (a, b) = unsafe {
                (
                    _mm_loadu_si128(q0.as_ptr().cast()),
                    _mm_loadu_si128(q1.as_ptr().cast()),
                )
            };
            let v = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_broadcastsi128_si256(a)),
                _mm256_broadcastsi128_si256(b),
            );
            let v = _mm512_mask_blend_epi64(0b1100_1100, v, _mm512_srli_epi16::<4>(v));
            _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
        }

        /// Two f16 widened, in lanes 0 and 1 (2 and 3 zero).
        #[target_feature(enable = "avx2,f16c")]
        #[inline]
        fn h2f2(a: hgca_kernels::f16, b: hgca_kernels::f16) -> __m128 {
            let bits = u32::from(a.to_bits()) | (u32::from(b.to_bits()) << 16);
            _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
        }

        /// Two blocks' 64 codes (unsigned but for Q8_0), their two scales
        /// and their two minimums (the values of code 0; zero for Q8_0).
        #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
        #[inline]
        fn codes2<B: DotBlock>(b0: &B, b1: &B) -> (__m512i, __m128, __m128) {
            match B::KIND {
                DotKind::Q4_0 => {
                    let (b0, b1): (&BlockQ4_0, &BlockQ4_0) =
                        (bytemuck::cast_ref(b0), bytemuck::cast_ref(b1));
                    let d = h2f2(b0.d, b1.d);
                    (
                        nibbles2(&b0.qs, &b1.qs),
                        d,
                        _mm_mul_ps(d, _mm_set1_ps(-8.0)),
                    )
                }
                DotKind::Q4_1 => {
                    let (b0, b1): (&BlockQ4_1, &BlockQ4_1) =
                        (bytemuck::cast_ref(b0), bytemuck::cast_ref(b1));
                    (nibbles2(&b0.qs, &b1.qs), h2f2(b0.d, b1.d), h2f2(b0.m, b1.m))
                }
                DotKind::Q5_0 => {
                    let (b0, b1): (&BlockQ5_0, &BlockQ5_0) =
                        (bytemuck::cast_ref(b0), bytemuck::cast_ref(b1));
                    // Bit j of the mask is the fifth bit of byte j's code.
                    let high = u64::from(u32::from_le_bytes(b0.qh))
                        | (u64::from(u32::from_le_bytes(b1.qh)) << 32);
                    let nib = nibbles2(&b0.qs, &b1.qs);
                    let q = _mm512_mask_add_epi8(nib, high, nib, _mm512_set1_epi8(16));
                    let d = h2f2(b0.d, b1.d);
                    (q, d, _mm_mul_ps(d, _mm_set1_ps(-16.0)))
                }
                DotKind::Q8_0 => {
                    let (b0, b1): (&BlockQ8_0, &BlockQ8_0) =
                        (bytemuck::cast_ref(b0), bytemuck::cast_ref(b1));
                    (codes64(&b0.qs, &b1.qs), h2f2(b0.d, b1.d), _mm_setzero_ps())
                }
                DotKind::Q4K | DotKind::Q6K => unreachable!("K formats take kdot's paths"),
            }
        }

        /// Two 32-byte code arrays in one register.
        #[target_feature(enable = "avx512f,avx2")]
        #[inline]
        pub(crate) fn codes64(a: &[i8; 32], b: &[i8; 32]) -> __m512i {
            // SAFETY: 32 readable bytes each.
            unsafe {
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(a.as_ptr().cast())),
                    _mm256_loadu_si256(b.as_ptr().cast()),
                )
            }
        }

        /// Sixteen i32 partial sums of two blocks' integer dot products
        /// (lanes 0..8 the first block's).
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
        #[inline]
        fn dot2<B: DotBlock>(q: __m512i, x: __m512i) -> __m512i {
            let zero = _mm512_setzero_si512();
            if B::KIND.unsigned() {
                return _mm512_dpbusd_epi32(zero, q, x);
            }
            // |q| (128 for -128, as an unsigned byte), and x negated where
            // q is negative (activation codes are within ±127).
            let negative = _mm512_movepi8_mask(q);
            let xs = _mm512_mask_sub_epi8(x, negative, zero, x);
            _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(q), xs)
        }

        /// Two weight blocks against the token's two, with the token's
        /// scales `s` and sums `u`, added to `acc` (the minimums' part to
        /// `min`).
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        #[inline]
        fn step2<B: DotBlock>(
            w: [&B; 2],
            x: [&BlockQ8_0; 2],
            s: [f32; 2],
            u: [f32; 2],
            acc: __m512,
            min: &mut __m128,
        ) -> __m512 {
            let (q, d, m) = codes2(w[0], w[1]);
            let v = _mm512_cvtepi32_ps(dot2::<B>(q, codes64(&x[0].qs, &x[1].qs)));
            if B::KIND.unsigned() {
                *min = _mm_fmadd_ps(m, _mm_setr_ps(u[0], u[1], 0.0, 0.0), *min);
            }
            // Lanes 0..8 take the first block's scale product, 8..16 the second's.
            let pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            let ds = _mm_mul_ps(d, _mm_setr_ps(s[0], s[1], 0.0, 0.0));
            _mm512_fmadd_ps(
                _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(ds)),
                v,
                acc,
            )
        }

        /// One row's dot product with one token's activations: four blocks
        /// per iteration into two accumulators, the last one to three
        /// blocks as a pair and, for an odd count, one on the AVX2 path.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        pub(crate) fn row_dot<B: DotBlock>(row: &[B], x: Token<'_>) -> f32 {
            let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let (mut m0, mut m1) = (_mm_setzero_ps(), _mm_setzero_ps());
            let (w4, wr) = row.as_chunks::<4>();
            let (x4, xr) = x.blocks.as_chunks::<4>();
            let (s4, sr) = x.scales.as_chunks::<4>();
            let (u4, ur) = x.sums.as_chunks::<4>();
            for (((w, xb), s), u) in w4.iter().zip(x4).zip(s4).zip(u4) {
                a0 = step2(
                    [&w[0], &w[1]],
                    [&xb[0], &xb[1]],
                    [s[0], s[1]],
                    [u[0], u[1]],
                    a0,
                    &mut m0,
                );
                a1 = step2(
                    [&w[2], &w[3]],
                    [&xb[2], &xb[3]],
                    [s[2], s[3]],
                    [u[2], u[3]],
                    a1,
                    &mut m1,
                );
            }
            if wr.len() >= 2 {
                a0 = step2(
                    [&wr[0], &wr[1]],
                    [&xr[0], &xr[1]],
                    [sr[0], sr[1]],
                    [ur[0], ur[1]],
                    a0,
                    &mut m0,
                );
            }
            let mut min = 0.0;
            let mut tail = _mm256_setzero_ps();
            if wr.len() % 2 == 1 {
                let i = wr.len() - 1;
                tail = step(&wr[i], &xr[i], sr[i], ur[i], tail, &mut min);
            }
            let m = _mm_add_ps(m0, m1);
            let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_add_ss(m, _mm_movehdup_ps(m));
            _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + hsum(tail) + (_mm_cvtss_f32(m) + min)
        }
    }
}

/// Output rows per unit of work of [`CpuBackend::qmatvec`], at least.
const ROWS_PER_TASK: usize = 64;
/// Units of work per thread of [`CpuBackend::qmatvec`], at most: enough
/// to even out the threads, few enough that handing them out costs little
/// (an LM head of 262,144 rows was 4096 units of 64, each a lock and an
/// allocation's slot on an executor).
const TASKS_PER_THREAD: usize = 16;

/// Rows per unit of work of a matrix-vector product of `rows` rows on
/// `threads` threads.
pub(crate) fn rows_per_task(rows: usize, threads: usize) -> usize {
    ROWS_PER_TASK.max(rows.div_ceil(threads * TASKS_PER_THREAD))
}

/// The kernel [`CpuBackend::qmatvec`] runs on an ISA
/// ([`CpuBackend::qmatvec_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QDotPath {
    /// Portable code (no NEON path yet): a caller with another fast kernel
    /// may prefer it.
    Portable,
    /// One block per 256-bit register, `vpmaddubsw`.
    Avx2,
    /// Two blocks per 512-bit register, `vpdpbusd`.
    Avx512Vnni,
}

/// One row's dot product with the first token of a [`Q8Acts`].
pub(crate) type RowDot<B> = fn(&[B], &Q8Acts) -> f32;

/// The row dot product of `path` for format `B`, as a function pointer (the
/// SIMD paths are functions of their own target features, called out of
/// line once per row).
///
/// # Safety
/// `path` is what [`CpuBackend::qmatvec_path`] returned on this CPU (it
/// detected what the SIMD paths need).
pub(crate) unsafe fn row_dot_of<B: DotBlock>(path: QDotPath) -> RowDot<B> {
    match path {
        #[cfg(target_arch = "x86_64")]
        QDotPath::Avx512Vnni => |row: &[B], a: &Q8Acts| {
            if B::VALUES != 32 {
                // SAFETY: the caller's promise: AVX-512 F/BW/VL and VNNI,
                // AVX2, FMA and F16C were detected.
                unsafe { crate::kdot::x86::vnni::row_dot(row, a.token(0)) }
            } else {
                // SAFETY: as above.
                unsafe { x86::vnni::row_dot(row, a.token(0)) }
            }
        },
        #[cfg(target_arch = "x86_64")]
        QDotPath::Avx2 => |row: &[B], a: &Q8Acts| {
            if B::VALUES != 32 {
                // SAFETY: the caller's promise: AVX2, FMA and F16C were
                // detected.
                unsafe { crate::kdot::x86::row_dot(row, a.token(0)) }
            } else {
                // SAFETY: as above.
                unsafe { x86::row_dot(row, a.token(0)) }
            }
        },
        _ => |row: &[B], a: &Q8Acts| row_dot_scalar(row, a.token(0)),
    }
}

impl CpuBackend {
    /// The kernel [`CpuBackend::qmatvec`] runs for this ISA: on x86-64-v4
    /// with AVX-512 VNNI (and F16C, FMA) detected, the AVX-512 VNNI path;
    /// on v3 or v4 otherwise, with AVX2, FMA and F16C detected (pulp's
    /// tokens do not prove F16C), the AVX2 path; elsewhere portable code.
    ///
    /// ```
    /// use hgca_cpu::{CpuBackend, QDotPath};
    /// let cpu = CpuBackend::new();
    /// let path = CpuBackend::qmatvec_path(cpu.isa());
    /// assert!(matches!(path, QDotPath::Portable | QDotPath::Avx2 | QDotPath::Avx512Vnni));
    /// ```
    pub fn qmatvec_path(isa: Isa) -> QDotPath {
        #[cfg(target_arch = "x86_64")]
        if matches!(isa, Isa::V3(_) | Isa::V4(_))
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            return if matches!(isa, Isa::V4(_)) && std::is_x86_feature_detected!("avx512vnni") {
                QDotPath::Avx512Vnni
            } else {
                QDotPath::Avx2
            };
        }
        let _ = isa;
        QDotPath::Portable
    }

    /// `y = x W^T` for quantised activations `acts` (`n` tokens of `k`
    /// values) and weight rows `w` (`rows` rows of `k / B::VALUES` blocks
    /// each, the GGUF layout of a `[rows, k]` matrix): `y` is `[n, rows]`
    /// row-major.
    /// Rows are shared out over the backend's threads; each token's result
    /// is the same whatever the threading.
    ///
    /// This is the decode path of a quantised model (llama.cpp multiplies
    /// the same way); it is not exact in `x`, which is rounded to 8 bits per
    /// value with a scale per 32 stored as f16: an error of up to 1/254 of
    /// the block's largest magnitude per value, plus the scale's f16
    /// rounding (more where the scale is subnormal: blocks of magnitude
    /// below about 8e-3).
    ///
    /// # Errors
    /// [`Error::Length`] when `w` does not hold `rows * k / B::VALUES`
    /// blocks or `y` does not hold `n * rows` values, [`Error::Param`] when
    /// `k` is not a multiple of `B::VALUES` (256 for the K formats).
    ///
    /// ```
    /// use hgca_cpu::{CpuBackend, Q8Acts};
    /// use hgca_kernels::{BlockQ8_0, f16};
    /// // Two rows of 64 values: all 1 in the first, all -2 in the second.
    /// let row = |v: i8| [BlockQ8_0 { d: f16::ONE, qs: [v; 32] }; 2];
    /// let w = [row(1), row(-2)].concat();
    /// // 127 quantises exactly (scale 1, code 127).
    /// let x = Q8Acts::quantize(&[127.0f32; 64], 1, 64).unwrap();
    /// let mut y = [0.0f32; 2];
    /// CpuBackend::new().qmatvec(&w, 2, &x, &mut y).unwrap();
    /// assert_eq!(y, [64.0 * 127.0, -128.0 * 127.0]);
    /// ```
    pub fn qmatvec<B: DotBlock>(
        &self,
        w: &[B],
        rows: usize,
        acts: &Q8Acts,
        y: &mut [f32],
    ) -> Result<()> {
        let (n, nb) = (acts.tokens(), acts.width() / B::VALUES);
        if !acts.width().is_multiple_of(B::VALUES) {
            return Err(Error::Param {
                what: "activation width",
                value: acts.width() as f64,
                expected: "a multiple of the weight format's block (256 for the K formats)",
            });
        }
        check_len_of("weight blocks", &[rows, nb], w.len())?;
        check_len_of("output", &[n, rows], y.len())?;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        if nb == 0 {
            // An empty inner dimension: every sum is empty.
            y.fill(0.0);
            return Ok(());
        }
        let path = Self::qmatvec_path(self.isa);
        let part = |first: usize, out: &mut [f32]| {
            let ws = &w[first * nb..(first + out.len() / n) * nb];
            match path {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `qmatvec_path` detected AVX2, FMA and F16C, and
                // for its VNNI path AVX-512 F/BW/VL (the V4 token) and VNNI.
                QDotPath::Avx2 | QDotPath::Avx512Vnni => unsafe {
                    x86::rows(ws, nb, acts, out, path == QDotPath::Avx512Vnni)
                },
                _ => {
                    for (row, o) in ws.chunks_exact(nb).zip(out.chunks_exact_mut(n)) {
                        for (t, v) in o.iter_mut().enumerate() {
                            *v = row_dot_scalar(row, acts.token(t));
                        }
                    }
                }
            }
        };
        let per_task = rows_per_task(rows, self.threads());
        if n == 1 {
            self.for_chunks(y, per_task, |i, out| part(i * per_task, out));
        } else {
            // [rows, n] in pieces of whole rows, then transposed into y.
            let mut t = vec![0.0f32; rows * n];
            self.for_chunks(&mut t, per_task * n, |i, out| part(i * per_task, out));
            for (r, vals) in t.chunks_exact(n).enumerate() {
                for (tok, &v) in vals.iter().enumerate() {
                    y[tok * rows + r] = v;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The activations' blocks (AVX-512 where the machine has it; without
    /// it both sides are the scalar code) are `BlockQ8_0::quantize`'s bit
    /// for bit: random blocks of several magnitudes, halves of a code,
    /// zeros, and NaN and infinities.
    #[test]
    fn activations_quantise_as_the_block_does() {
        let mut x = Vec::new();
        let mut r = 0x2545_F491_4F6C_DD1Du64;
        for b in 0..64 {
            let scale = [1e-6f32, 1e-2, 1.0, 37.0, 1e4][b % 5];
            for _ in 0..32 {
                r ^= r << 13;
                r ^= r >> 7;
                r ^= r << 17;
                x.push(((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale);
            }
        }
        // A scale of 1 (largest magnitude 127) and the rest on halves of a
        // code, where rounding modes differ.
        x.extend((0..32).map(|i| {
            if i == 0 {
                127.0
            } else {
                i as f32 * 4.0 + 0.5 - 64.0
            }
        }));
        x.extend([0.0f32; 32]);
        let mut odd = [1.0f32; 32];
        (odd[3], odd[7], odd[9]) = (f32::NAN, f32::INFINITY, f32::NEG_INFINITY);
        x.extend(odd);
        let a = Q8Acts::quantize(&x, 1, x.len()).unwrap();
        for (i, c) in x.chunks_exact(32).enumerate() {
            let want = BlockQ8_0::quantize(c.try_into().unwrap());
            let got = a.blocks[i];
            assert_eq!(
                (got.d.to_bits(), got.qs),
                (want.d.to_bits(), want.qs),
                "block {i}"
            );
        }
    }

    #[test]
    fn scalar_codes_are_the_dequantised_values() {
        let x: [f32; 32] = core::array::from_fn(|i| (i as f32 - 13.0) * 0.37);
        fn check<B: DotBlock>(b: B) {
            let mut want = [0.0f32; 32];
            b.dequant(&mut want);
            let (q, d, m) = parts(&b);
            for (k, (&c, &w)) in q.iter().zip(&want).enumerate() {
                assert_eq!(d.mul_add(f32::from(c), m), w, "{} value {k}", B::NAME);
            }
        }
        check(BlockQ4_0::quantize(&x));
        check(BlockQ4_1::quantize(&x));
        check(BlockQ5_0::quantize(&x));
        check(BlockQ8_0::quantize(&x));
    }
}
