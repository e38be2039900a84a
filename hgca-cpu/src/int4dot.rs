//! The int4 score estimate ([`crate::CpuBackend::int4_max_scores`]) as
//! integer dot products: the query rows quantised to int8 once per call,
//! the keys' 4-bit codes (biased by 8, so unsigned) multiplied with them
//! four at a time into i32 lanes, one lane per key row, and the scales
//! applied once per row at the end. `vpdpbusd` does one tile's 16 rows x
//! 4 dimensions in one instruction on AVX-512 VNNI; AVX2 does the same with
//! `vpmaddubsw` + `vpmaddwd`; portable code is the scalar reference of both.
//! Every path computes the same integers and the same f32 epilogue
//! (`((dot - bias) * q_scale) * k_scale - offset`, no fused multiply-add),
//! so they agree to the bit.

use crate::QDotPath;
use crate::select::{INT4_GROUP, INT8_TILE as T, quantize_i8};

/// Bytes of one group of [`INT4_GROUP`] dimensions of a tile: 16 rows of
/// 4 bytes (each byte two dimensions, `j` low and `j + 4` high).
pub(crate) const GROUP_BYTES: usize = T * INT4_GROUP / 2;

/// The query rows as the integer kernels take them.
pub(crate) struct Queries {
    /// Per head and group, the int8 codes of dimensions `8g..8g+4` and
    /// `8g+4..8g+8`, four bytes each as a little-endian i32.
    pack: Vec<[i32; 2]>,
    /// Per head, the scale of its codes.
    scale: Vec<f32>,
    /// Per head, 8 times the sum of its codes (what the keys' bias adds).
    bias: Vec<i32>,
    groups: usize,
}

impl Queries {
    /// `q` (`[heads, d]`) quantised per row ([`quantize_i8`]); `None` when a
    /// row holds a value that is not finite.
    pub(crate) fn new(q: &[f32], heads: usize, d: usize) -> Option<Self> {
        let groups = d.div_ceil(INT4_GROUP);
        let mut codes = vec![0i8; groups * INT4_GROUP];
        let mut s = Self {
            pack: Vec::with_capacity(heads * groups),
            scale: Vec::with_capacity(heads),
            bias: Vec::with_capacity(heads),
            groups,
        };
        for qh in q.chunks_exact(d).take(heads) {
            let sc = quantize_i8(qh, &mut codes[..d]);
            if !sc.is_finite() {
                return None;
            }
            s.scale.push(sc);
            s.bias
                .push(8 * codes.iter().map(|&c| i32::from(c)).sum::<i32>());
            s.pack.extend(codes.chunks_exact(INT4_GROUP).map(|g| {
                let w =
                    |b: &[i8]| i32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8]);
                [w(&g[..4]), w(&g[4..])]
            }));
        }
        Some(s)
    }

    fn heads(&self) -> usize {
        self.scale.len()
    }
}

/// `out[j] = max_h (((dot_hj - bias_h) * scale_h) * ks[j] - off[h])` over
/// the rows of `keys` (whole tiles, `ks.len()` rows), `+inf` where `ks[j]`
/// is not finite. `off` holds one value per head of `q`.
pub(crate) fn scores(
    path: QDotPath,
    q: &Queries,
    off: &[f32],
    keys: &[u8],
    ks: &[f32],
    out: &mut [f32],
) {
    let tile = q.groups * GROUP_BYTES;
    // At most 8 heads a pass: their accumulators stay in registers.
    for (h0, op) in (0..q.heads()).step_by(8).zip(off.chunks(8)) {
        let part = Part {
            pack: &q.pack[h0 * q.groups..(h0 + op.len()) * q.groups],
            scale: &q.scale[h0..h0 + op.len()],
            bias: &q.bias[h0..h0 + op.len()],
            off: op,
            groups: q.groups,
        };
        let first = h0 == 0;
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))]
        macro_rules! heads {
            ($f:ident $(, $unsafe:tt)?) => {
                match op.len() {
                    1 => $($unsafe)? { $f::<1>(&part, keys, tile, ks, out, first) },
                    2 => $($unsafe)? { $f::<2>(&part, keys, tile, ks, out, first) },
                    3 => $($unsafe)? { $f::<3>(&part, keys, tile, ks, out, first) },
                    4 => $($unsafe)? { $f::<4>(&part, keys, tile, ks, out, first) },
                    5 => $($unsafe)? { $f::<5>(&part, keys, tile, ks, out, first) },
                    6 => $($unsafe)? { $f::<6>(&part, keys, tile, ks, out, first) },
                    7 => $($unsafe)? { $f::<7>(&part, keys, tile, ks, out, first) },
                    8 => $($unsafe)? { $f::<8>(&part, keys, tile, ks, out, first) },
                    _ => unreachable!("parts of at most 8 heads"),
                }
            };
        }
        match path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the path is AVX-512 VNNI only where the CPU has it
            // (`CpuBackend::qmatvec_path`).
            QDotPath::Avx512Vnni => heads!(vnni, unsafe),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the path is AVX2 only where the CPU has it.
            QDotPath::Avx2 => heads!(avx2, unsafe),
            _ => portable(&part, keys, tile, ks, out, first),
        }
    }
}

/// Up to 8 heads of a [`Queries`].
struct Part<'a> {
    pack: &'a [[i32; 2]],
    scale: &'a [f32],
    bias: &'a [i32],
    off: &'a [f32],
    groups: usize,
}

/// One row's estimate from its heads' integer dots (the epilogue every path
/// computes, here in scalar form). `prev` is the row's value from earlier
/// heads (`-inf` for the first part).
#[inline(always)]
fn row_estimate(p: &Part<'_>, dots: impl Iterator<Item = i32>, k_scale: f32, prev: f32) -> f32 {
    if !k_scale.is_finite() {
        return f32::INFINITY;
    }
    dots.zip(p.scale.iter().zip(p.bias).zip(p.off))
        .fold(prev, |m, (dot, ((&s, &b), &o))| {
            m.max(((dot - b) as f32 * s) * k_scale - o)
        })
}

/// The scalar reference.
fn portable(p: &Part<'_>, keys: &[u8], tile: usize, ks: &[f32], out: &mut [f32], first: bool) {
    let heads = p.off.len();
    let mut acc = [[0i32; T]; 8];
    for ((t, s), o) in keys
        .chunks_exact(tile)
        .zip(ks.chunks(T))
        .zip(out.chunks_mut(T))
    {
        for a in &mut acc[..heads] {
            *a = [0; T];
        }
        for (g, grp) in t.chunks_exact(GROUP_BYTES).enumerate() {
            for (h, a) in acc[..heads].iter_mut().enumerate() {
                let [lo, hi] = p.pack[h * p.groups + g].map(i32::to_le_bytes);
                for (r, b) in grp.chunks_exact(4).enumerate() {
                    a[r] += (0..4)
                        .map(|j| {
                            i32::from(b[j] & 15) * i32::from(lo[j] as i8)
                                + i32::from(b[j] >> 4) * i32::from(hi[j] as i8)
                        })
                        .sum::<i32>();
                }
            }
        }
        for (r, (o, &sc)) in o.iter_mut().zip(s).enumerate() {
            let prev = if first { f32::NEG_INFINITY } else { *o };
            *o = row_estimate(p, acc[..heads].iter().map(|a| a[r]), sc, prev);
        }
    }
}

#[cfg(target_arch = "x86_64")]
use core::arch::x86_64::*;

/// One tile a step: per group of 8 dimensions one 64-byte load, its low
/// and high nibbles, and two `vpdpbusd` per head.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn vnni<const H: usize>(
    p: &Part<'_>,
    keys: &[u8],
    tile: usize,
    ks: &[f32],
    out: &mut [f32],
    first: bool,
) {
    let m4 = _mm512_set1_epi8(0x0F);
    for ((t, s), o) in keys
        .chunks_exact(tile)
        .zip(ks.chunks(T))
        .zip(out.chunks_mut(T))
    {
        let mut acc = [_mm512_setzero_si512(); H];
        for (g, grp) in t.chunks_exact(GROUP_BYTES).enumerate() {
            // SAFETY: a group is 64 bytes.
            let v = unsafe { _mm512_loadu_si512(grp.as_ptr().cast()) };
            let lo = _mm512_and_si512(v, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            for (h, a) in acc.iter_mut().enumerate() {
                let [ql, qh] = p.pack[h * p.groups + g];
                *a = _mm512_dpbusd_epi32(*a, lo, _mm512_set1_epi32(ql));
                *a = _mm512_dpbusd_epi32(*a, hi, _mm512_set1_epi32(qh));
            }
        }
        let n = s.len();
        let mask: u16 = if n == T { u16::MAX } else { (1u16 << n) - 1 };
        // SAFETY: masked lanes `< n` only, within `s` and `o`.
        let ksv = unsafe { _mm512_maskz_loadu_ps(mask, s.as_ptr()) };
        let mut m = if first {
            _mm512_set1_ps(f32::NEG_INFINITY)
        } else {
            // SAFETY: as above.
            unsafe { _mm512_maskz_loadu_ps(mask, o.as_ptr()) }
        };
        for (h, a) in acc.iter().enumerate() {
            let x = _mm512_cvtepi32_ps(_mm512_sub_epi32(*a, _mm512_set1_epi32(p.bias[h])));
            let x = _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(p.scale[h])), ksv);
            m = _mm512_max_ps(m, _mm512_sub_ps(x, _mm512_set1_ps(p.off[h])));
        }
        let inf = _mm512_set1_ps(f32::INFINITY);
        let finite = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(ksv), inf);
        // SAFETY: as above.
        unsafe {
            _mm512_mask_storeu_ps(o.as_mut_ptr(), mask, _mm512_mask_blend_ps(finite, inf, m))
        };
    }
}

/// Half a tile (8 rows, 32 bytes of each group) a step, `vpmaddubsw`
/// (pairs into i16: at most 2 x 15 x 127, no saturation) and `vpmaddwd`
/// by ones (into i32).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn avx2<const H: usize>(
    p: &Part<'_>,
    keys: &[u8],
    tile: usize,
    ks: &[f32],
    out: &mut [f32],
    first: bool,
) {
    let (m4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    for ((t, s), o) in keys
        .chunks_exact(tile)
        .zip(ks.chunks(T))
        .zip(out.chunks_mut(T))
    {
        for (half, (s, o)) in s.chunks(8).zip(o.chunks_mut(8)).enumerate() {
            let mut acc = [_mm256_setzero_si256(); H];
            for (g, grp) in t.chunks_exact(GROUP_BYTES).enumerate() {
                // SAFETY: 32 bytes from offset 0 or 32 of a 64-byte group.
                let v = unsafe { _mm256_loadu_si256(grp[half * 32..].as_ptr().cast()) };
                let lo = _mm256_and_si256(v, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                for (h, a) in acc.iter_mut().enumerate() {
                    let [ql, qh] = p.pack[h * p.groups + g];
                    let pairs = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_set1_epi32(ql)),
                        _mm256_maddubs_epi16(hi, _mm256_set1_epi32(qh)),
                    );
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs, ones));
                }
            }
            let mut dots = [[0i32; 8]; H];
            for (d, a) in dots.iter_mut().zip(&acc) {
                // SAFETY: 8 i32 lanes into an array of 8.
                unsafe { _mm256_storeu_si256(d.as_mut_ptr().cast(), *a) };
            }
            for (r, (o, &sc)) in o.iter_mut().zip(s).enumerate() {
                let prev = if first { f32::NEG_INFINITY } else { *o };
                *o = row_estimate(p, dots.iter().map(|d| d[r]), sc, prev);
            }
        }
    }
}
