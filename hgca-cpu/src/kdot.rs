//! GGUF's K formats (256-value super-blocks) times Q8_0 activations: the
//! other half of [`crate::qdot`]. A Q4_K super-block is eight sub-blocks of
//! 32 with value `d sc_j q - dmin m_j` (4-bit `q`); a Q6_K one is sixteen
//! sub-blocks of 16 with value `d sc_m (q - 32)` (6-bit `q`). Each 32-value
//! sub-block lines up with one activation block (scale `s_b`), so a row's
//! dot product is, over the super-blocks and their activation blocks `b`:
//!
//! - Q4_K: `Σ_b d sc_b s_b (Σ q a) - Σ_b dmin m_b (s_b Σ a)`,
//! - Q6_K: `Σ_b d s_b (sc_2b Σ_lo q a + sc_2b+1 Σ_hi q a) - 32 d Σ_m sc_m (s Σ a)_m`
//!   (`lo`, `hi`: the block's two halves of 16, `m` the 16 sub-blocks).
//!
//! The codes stay unsigned (0..16, 0..64), so they meet the signed
//! activation codes in `vpmaddubsw` (AVX2) or `vpdpbusd` (AVX-512 VNNI)
//! directly; the minimums and Q6_K's offset of 32 are the second sums,
//! taken over the activation sums [`crate::Q8Acts`] keeps per block and
//! per half block. The integer parts are exact, the rest f32.

use hgca_kernels::{BlockQ4K, BlockQ6K};

use crate::qdot::{DotBlock, DotKind, Token};

/// Code `i` (0..256) of a Q6_K block, 0..64.
#[inline(always)]
pub(crate) fn q6k_code(b: &BlockQ6K, i: usize) -> u8 {
    let (h, r) = (i / 128, i % 128);
    let (k, l) = (r / 32, r % 32);
    let ql = b.ql[64 * h + 32 * (k % 2) + l];
    let low = if k < 2 { ql & 0x0F } else { ql >> 4 };
    low | (((b.qh[32 * h + l] >> (2 * k)) & 3) << 4)
}

/// One row's dot product with one token, portable code.
pub(crate) fn row_dot_scalar<B: DotBlock>(row: &[B], x: Token<'_>) -> f32 {
    let (mut acc, mut off) = (0.0f32, 0.0f32);
    match B::KIND {
        DotKind::Q4K => {
            for (s, b) in bytemuck::cast_slice::<B, BlockQ4K>(row).iter().enumerate() {
                let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
                let (sc, mn) = b.scales_mins();
                for j in 0..8 {
                    let a = &x.blocks[8 * s + j].qs;
                    let codes = &b.qs[32 * (j / 2)..32 * (j / 2) + 32];
                    let shift = 4 * (j % 2);
                    let dot: i32 = codes
                        .iter()
                        .zip(a)
                        .map(|(&q, &v)| i32::from((q >> shift) & 0x0F) * i32::from(v))
                        .sum();
                    acc = (d * f32::from(sc[j]) * x.scales[8 * s + j]).mul_add(dot as f32, acc);
                    off = (dmin * f32::from(mn[j])).mul_add(x.sums[8 * s + j], off);
                }
            }
        }
        DotKind::Q6K => {
            for (s, b) in bytemuck::cast_slice::<B, BlockQ6K>(row).iter().enumerate() {
                let d = b.d.to_f32();
                for j in 0..8 {
                    let a = &x.blocks[8 * s + j].qs;
                    let half = |h: usize| -> i32 {
                        (16 * h..16 * h + 16)
                            .map(|l| i32::from(q6k_code(b, 32 * j + l)) * i32::from(a[l]))
                            .sum()
                    };
                    let (sl, sh) = (i32::from(b.scales[2 * j]), i32::from(b.scales[2 * j + 1]));
                    let int = sl * half(0) + sh * half(1);
                    acc = (d * x.scales[8 * s + j]).mul_add(int as f32, acc);
                    for m in [2 * j, 2 * j + 1] {
                        let k = 32.0 * d * f32::from(b.scales[m]);
                        off = k.mul_add(x.sums16[16 * s + m], off);
                    }
                }
            }
        }
        _ => unreachable!("32-value formats take qdot's paths"),
    }
    acc - off
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::*;
    use crate::qdot::x86::{h2f, hsum};
    use core::arch::x86_64::*;

    /// Eight bytes widened to eight f32 (`signed`: as i8, else as u8).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn bytes8(b: &[u8; 8], signed: bool) -> __m256 {
        let v = _mm_cvtsi64_si128(i64::from_le_bytes(*b));
        _mm256_cvtepi32_ps(if signed {
            _mm256_cvtepi8_epi32(v)
        } else {
            _mm256_cvtepu8_epi32(v)
        })
    }

    /// Eight contiguous f32.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn load8(v: &[f32]) -> __m256 {
        let v: &[f32; 8] = v[..8].try_into().expect("8 values");
        // SAFETY: 8 readable f32.
        unsafe { _mm256_loadu_ps(v.as_ptr()) }
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn load32(v: &[u8]) -> __m256i {
        let v: &[u8; 32] = v[..32].try_into().expect("32 bytes");
        // SAFETY: 32 readable bytes.
        unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
    }

    /// Q6_K's 32 codes of value rows `32 k .. 32 k + 32` of half `h`
    /// (unsigned, 0..64), from the half's `ql` registers and its `qh`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn q6k_codes(ql0: __m256i, ql1: __m256i, qh: __m256i, k: usize) -> __m256i {
        let nib = _mm256_set1_epi8(0x0F);
        let top = _mm256_set1_epi8(0x30);
        // The 16-bit shifts move bits across bytes only where the mask drops them.
        let (low, high) = match k {
            0 => (_mm256_and_si256(ql0, nib), _mm256_slli_epi16::<4>(qh)),
            1 => (_mm256_and_si256(ql1, nib), _mm256_slli_epi16::<2>(qh)),
            2 => (_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), nib), qh),
            _ => (
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), nib),
                _mm256_srli_epi16::<2>(qh),
            ),
        };
        _mm256_or_si256(low, _mm256_and_si256(high, top))
    }

    /// Eight i32 sums of four products each: unsigned codes times signed
    /// activation codes (`vpmaddubsw` cannot saturate: 2 * 63 * 128 < 2^15).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn dot_u8i8(q: __m256i, a: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1))
    }

    /// One row's dot product with one token, AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn row_dot<B: DotBlock>(row: &[B], x: Token<'_>) -> f32 {
        let (mut a0, mut a1, mut off) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        match B::KIND {
            DotKind::Q4K => {
                for (s, b) in bytemuck::cast_slice::<B, BlockQ4K>(row).iter().enumerate() {
                    let (sc, mn) = b.scales_mins();
                    let sb = load8(&x.scales[8 * s..]);
                    let mut g = [0.0f32; 8];
                    let gv = _mm256_mul_ps(
                        _mm256_mul_ps(bytes8(&sc, false), sb),
                        _mm256_set1_ps(h2f(b.d)),
                    );
                    // SAFETY: 8 writable f32.
                    unsafe { _mm256_storeu_ps(g.as_mut_ptr(), gv) };
                    let dm = _mm256_mul_ps(bytes8(&mn, false), _mm256_set1_ps(h2f(b.dmin)));
                    off = _mm256_fmadd_ps(dm, load8(&x.sums[8 * s..]), off);
                    for p in 0..4 {
                        let v = load32(&b.qs[32 * p..]);
                        let lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
                        let hi =
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(0x0F));
                        let (j0, j1) = (8 * s + 2 * p, 8 * s + 2 * p + 1);
                        let i0 = dot_u8i8(lo, load32(bytemuck::cast_slice(&x.blocks[j0].qs)));
                        let i1 = dot_u8i8(hi, load32(bytemuck::cast_slice(&x.blocks[j1].qs)));
                        a0 = _mm256_fmadd_ps(_mm256_set1_ps(g[2 * p]), _mm256_cvtepi32_ps(i0), a0);
                        a1 = _mm256_fmadd_ps(
                            _mm256_set1_ps(g[2 * p + 1]),
                            _mm256_cvtepi32_ps(i1),
                            a1,
                        );
                    }
                }
            }
            DotKind::Q6K => {
                for (s, b) in bytemuck::cast_slice::<B, BlockQ6K>(row).iter().enumerate() {
                    let d = h2f(b.d);
                    let sc: &[u8; 16] = bytemuck::cast_ref(&b.scales);
                    let (lo8, hi8): (&[u8; 8], &[u8; 8]) = (
                        sc[..8].try_into().expect("8"),
                        sc[8..].try_into().expect("8"),
                    );
                    let d32 = _mm256_set1_ps(32.0 * d);
                    off = _mm256_fmadd_ps(
                        _mm256_mul_ps(bytes8(lo8, true), d32),
                        load8(&x.sums16[16 * s..]),
                        off,
                    );
                    off = _mm256_fmadd_ps(
                        _mm256_mul_ps(bytes8(hi8, true), d32),
                        load8(&x.sums16[16 * s + 8..]),
                        off,
                    );
                    // Per 32-value block j, its two sub-block scales four
                    // lanes each (as i32), in the order of `dot_u8i8`'s lanes.
                    let sci = [
                        _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(*lo8))),
                        _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(*hi8))),
                    ];
                    for h in 0..2 {
                        let ql0 = load32(&b.ql[64 * h..]);
                        let ql1 = load32(&b.ql[64 * h + 32..]);
                        let qh = load32(&b.qh[32 * h..]);
                        for k in 0..4 {
                            let j = 4 * h + k;
                            let a = load32(bytemuck::cast_slice(&x.blocks[8 * s + j].qs));
                            let i = dot_u8i8(q6k_codes(ql0, ql1, qh, k), a);
                            let m = 2 * (j % 4) as i32;
                            let pick = _mm256_setr_epi32(m, m, m, m, m + 1, m + 1, m + 1, m + 1);
                            let scl = _mm256_permutevar8x32_epi32(sci[j / 4], pick);
                            let v = _mm256_cvtepi32_ps(_mm256_mullo_epi32(i, scl));
                            let f = _mm256_set1_ps(d * x.scales[8 * s + j]);
                            if k % 2 == 0 {
                                a0 = _mm256_fmadd_ps(f, v, a0);
                            } else {
                                a1 = _mm256_fmadd_ps(f, v, a1);
                            }
                        }
                    }
                }
            }
            _ => unreachable!("32-value formats take qdot's paths"),
        }
        hsum(_mm256_add_ps(a0, a1)) - hsum(off)
    }

    /// The AVX-512 VNNI path: two 32-value blocks per 512-bit register,
    /// `vpdpbusd`.
    pub(crate) mod vnni {
        use super::*;

        /// Activation blocks `i` and `j`'s codes in one register.
        #[target_feature(enable = "avx512f,avx2")]
        #[inline]
        fn acts2(x: &Token<'_>, i: usize, j: usize) -> __m512i {
            crate::qdot::x86::vnni::codes64(&x.blocks[i].qs, &x.blocks[j].qs)
        }

        #[target_feature(enable = "avx512f")]
        #[inline]
        fn load64(v: &[u8]) -> __m512i {
            let v: &[u8; 64] = v[..64].try_into().expect("64 bytes");
            // SAFETY: 64 readable bytes.
            unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
        }

        /// Lanes 0..8 pick element `a` of a per-block vector, 8..16 `b`.
        #[target_feature(enable = "avx512f")]
        #[inline]
        fn pick8(a: i32, b: i32) -> __m512i {
            _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
        }

        /// Four lanes each of elements `4 r .. 4 r + 4`.
        #[target_feature(enable = "avx512f")]
        #[inline]
        fn pick4(r: i32) -> __m512i {
            let m = 4 * r;
            _mm512_setr_epi32(
                m,
                m,
                m,
                m,
                m + 1,
                m + 1,
                m + 1,
                m + 1,
                m + 2,
                m + 2,
                m + 2,
                m + 2,
                m + 3,
                m + 3,
                m + 3,
                m + 3,
            )
        }

        /// One row's dot product with one token, AVX-512 VNNI.
        ///
        /// # Safety
        /// The CPU has AVX-512 F/BW/VL and VNNI, AVX2, FMA and F16C.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        pub(crate) unsafe fn row_dot<B: DotBlock>(row: &[B], x: Token<'_>) -> f32 {
            let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let zero = _mm512_setzero_si512();
            let nib = _mm512_set1_epi8(0x0F);
            match B::KIND {
                DotKind::Q4K => {
                    let mut off = _mm256_setzero_ps();
                    for (s, b) in bytemuck::cast_slice::<B, BlockQ4K>(row).iter().enumerate() {
                        let (sc, mn) = b.scales_mins();
                        let sb = load8(&x.scales[8 * s..]);
                        let g = _mm256_mul_ps(
                            _mm256_mul_ps(bytes8(&sc, false), sb),
                            _mm256_set1_ps(h2f(b.d)),
                        );
                        let g = _mm512_castps256_ps512(g);
                        let dm = _mm256_mul_ps(bytes8(&mn, false), _mm256_set1_ps(h2f(b.dmin)));
                        off = _mm256_fmadd_ps(dm, load8(&x.sums[8 * s..]), off);
                        for h in 0..2 {
                            // Bytes 0..32: sub-blocks 4h (low nibbles) and
                            // 4h+1 (high); bytes 32..64: 4h+2 and 4h+3.
                            let v = load64(&b.qs[64 * h..]);
                            let lo = _mm512_and_si512(v, nib);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
                            let j = 4 * h;
                            let base = 8 * s + j;
                            let i0 = _mm512_dpbusd_epi32(zero, lo, acts2(&x, base, base + 2));
                            let i1 = _mm512_dpbusd_epi32(zero, hi, acts2(&x, base + 1, base + 3));
                            let (j0, j1) = (j as i32, j as i32 + 1);
                            a0 = _mm512_fmadd_ps(
                                _mm512_permutexvar_ps(pick8(j0, j0 + 2), g),
                                _mm512_cvtepi32_ps(i0),
                                a0,
                            );
                            a1 = _mm512_fmadd_ps(
                                _mm512_permutexvar_ps(pick8(j1, j1 + 2), g),
                                _mm512_cvtepi32_ps(i1),
                                a1,
                            );
                        }
                    }
                    _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) - hsum(off)
                }
                DotKind::Q6K => {
                    let mut off = _mm512_setzero_ps();
                    let top = _mm512_set1_epi8(0x30);
                    // Per 16-bit lane: the first 256 bits take shift `a`, the rest `b`.
                    let shifts = |a: i16, b: i16| {
                        _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(_mm256_set1_epi16(a)),
                            _mm256_set1_epi16(b),
                        )
                    };
                    let (left_lo, right_hi) = (shifts(4, 2), shifts(0, 2));
                    // Each block scale twice: per 16-value sub-block.
                    let twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
                    for (s, b) in bytemuck::cast_slice::<B, BlockQ6K>(row).iter().enumerate() {
                        let d = h2f(b.d);
                        let sc: &[u8; 16] = bytemuck::cast_ref(&b.scales);
                        // SAFETY: 16 readable bytes.
                        let scv = unsafe { _mm_loadu_si128(sc.as_ptr().cast()) };
                        let scf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scv));
                        let s16: &[f32; 16] = x.sums16[16 * s..16 * s + 16].try_into().expect("16");
                        // SAFETY: 16 readable f32.
                        let su = unsafe { _mm512_loadu_ps(s16.as_ptr()) };
                        off =
                            _mm512_fmadd_ps(_mm512_mul_ps(scf, _mm512_set1_ps(32.0 * d)), su, off);
                        let sb = _mm512_permutexvar_ps(
                            twice,
                            _mm512_castps256_ps512(load8(&x.scales[8 * s..])),
                        );
                        // Per 16-value sub-block m: d sc_m s_(m / 2).
                        let g = _mm512_mul_ps(_mm512_mul_ps(scf, sb), _mm512_set1_ps(d));
                        for h in 0..2 {
                            // Bytes 0..32 hold rows 32 k + l for k = 0 (low
                            // nibbles) and 2 (high), bytes 32..64 for k = 1 and 3.
                            let ql = load64(&b.ql[64 * h..]);
                            let qh: &[u8; 32] = b.qh[32 * h..32 * h + 32].try_into().expect("32");
                            // SAFETY: 32 readable bytes.
                            let qh = _mm512_broadcast_i64x4(unsafe {
                                _mm256_loadu_si256(qh.as_ptr().cast())
                            });
                            // Rows k = 0, 1 (top bits at 0 and 2 of qh) and k = 2, 3 (at 4 and 6).
                            let c01 = _mm512_or_si512(
                                _mm512_and_si512(ql, nib),
                                _mm512_and_si512(_mm512_sllv_epi16(qh, left_lo), top),
                            );
                            let c23 = _mm512_or_si512(
                                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), nib),
                                _mm512_and_si512(_mm512_srlv_epi16(qh, right_hi), top),
                            );
                            let base = 8 * s + 4 * h;
                            let i01 = _mm512_dpbusd_epi32(zero, c01, acts2(&x, base, base + 1));
                            let i23 = _mm512_dpbusd_epi32(zero, c23, acts2(&x, base + 2, base + 3));
                            let r = 2 * h as i32;
                            a0 = _mm512_fmadd_ps(
                                _mm512_permutexvar_ps(pick4(r), g),
                                _mm512_cvtepi32_ps(i01),
                                a0,
                            );
                            a1 = _mm512_fmadd_ps(
                                _mm512_permutexvar_ps(pick4(r + 1), g),
                                _mm512_cvtepi32_ps(i23),
                                a1,
                            );
                        }
                    }
                    _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) - _mm512_reduce_add_ps(off)
                }
                _ => unreachable!("32-value formats take qdot's paths"),
            }
        }
    }
}
