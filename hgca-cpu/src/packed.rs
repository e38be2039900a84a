//! GGUF's 32-value rows (Q4_0, Q4_1, Q5_0, Q8_0) repacked sixteen rows at
//! a time for the decode matrix-vector product on AVX-512 VNNI.
//!
//! In GGUF's layout a block's 32 codes, its scale and its fifth bits are
//! one row's; the kernel of [`CpuBackend::qmatvec`] works a row at a time
//! and spends most of its instructions per block on putting the block in
//! registers (two blocks' nibbles spread over four lanes, two f16 scales
//! widened and spread over eight lanes each) and on reducing the
//! products of a row: on Zen 5 that made Q5_0 compute-bound near 18 GB/s a
//! thread, half the machine's streaming read. Here the same blocks of
//! sixteen rows are stored side by side, one 512-bit lane per row: four
//! codes of each of the sixteen rows make one register, multiplied by four
//! activation codes broadcast to every lane (`vpdpbusd`), so every lane
//! sums one row and a block column ends with one conversion and one fused
//! multiply-add for all sixteen rows' scales. The bytes are GGUF's (a
//! sixteen-row block column of Q5_0 is 352 bytes, sixteen blocks of 22).
//! Several tokens (a prefill chunk) share a block column's unpacked codes
//! four at a time, and from sixteen tokens the threads share out tokens,
//! each writing its rows of the output in place.
//!
//! Layout of one block column of a row group (`GROUP` rows, the rows past
//! the matrix's last zero): 256 bytes of nibbles, in four 64-byte parts;
//! part `p`'s byte `4 r + j` holds, in its low four bits, code `8 p + j`
//! of row `r`'s block and, in its high four bits, code `8 p + 4 + j`. For
//! Q5_0, eight 64-bit masks follow, mask `c` bit `4 r + j` the fifth bit
//! of code `4 c + j` of row `r` (the codes in the order of the registers
//! the nibbles unpack to: low half of part `p` is register `2 p`, high
//! half register `2 p + 1`); then sixteen f16 scales, and for Q4_1 sixteen
//! f16 minimums. Q8_0's column is eight registers of codes (register `c`
//! byte `4 r + j` code `4 c + j` of row `r`) and the scales. A row group's
//! block columns follow one another.

use hgca_kernels::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8_0, Error, Result, check_len_of, f16};

use crate::CpuBackend;
use crate::qdot::{DotBlock, DotKind, Q8Acts, QDotPath, Token, parts};

/// Rows per group of [`PackedRows`]: one per 32-bit lane of a 512-bit register.
pub const GROUP: usize = 16;

/// Tokens from which [`CpuBackend::qmatvec_packed`] shares out tokens
/// (prefill chunks) instead of row groups (decoding).
const TOKEN_SPLIT: usize = 16;

mod sealed {
    pub trait Sealed {}
    impl Sealed for hgca_kernels::BlockQ4_0 {}
    impl Sealed for hgca_kernels::BlockQ4_1 {}
    impl Sealed for hgca_kernels::BlockQ5_0 {}
    impl Sealed for hgca_kernels::BlockQ8_0 {}
}

/// A 32-value GGUF format that [`PackedRows`] repacks: 4-bit codes (and
/// Q5_0's fifth bit), or Q8_0's bytes.
pub trait PackBlock: DotBlock + sealed::Sealed {
    /// Bytes of one block column of a row group.
    const COLUMN_BYTES: usize;
}

impl PackBlock for BlockQ4_0 {
    const COLUMN_BYTES: usize = 256 + 2 * GROUP;
}
impl PackBlock for BlockQ4_1 {
    const COLUMN_BYTES: usize = 256 + 4 * GROUP;
}
impl PackBlock for BlockQ5_0 {
    const COLUMN_BYTES: usize = 256 + 64 + 2 * GROUP;
}
impl PackBlock for BlockQ8_0 {
    const COLUMN_BYTES: usize = 512 + 2 * GROUP;
}

/// Offsets within a block column: the fifth bits' masks (Q5_0), the
/// scales, the minimums (Q4_1).
const fn offsets(kind: DotKind) -> (usize, usize, usize) {
    let qh = 256;
    let d = match kind {
        DotKind::Q5_0 => qh + 64,
        DotKind::Q8_0 => 512,
        _ => qh,
    };
    (qh, d, d + 2 * GROUP)
}

/// The code a block stores for value `i` (Q4_0 and Q4_1: 0..16; Q5_0:
/// 0..32; Q8_0: its signed byte), its scale and its minimum's f16 (zero
/// but for Q4_1).
fn codes<B: PackBlock>(b: &B) -> ([u8; 32], f16, f16) {
    let (q, _, _) = parts(b);
    let off: i8 = match B::KIND {
        DotKind::Q4_0 => 8,
        DotKind::Q5_0 => 16,
        _ => 0,
    };
    let u = q.map(|v| (v + off) as u8);
    match B::KIND {
        DotKind::Q4_1 => {
            let b: &BlockQ4_1 = bytemuck::cast_ref(b);
            (u, b.d, b.m)
        }
        DotKind::Q4_0 => (u, bytemuck::cast_ref::<B, BlockQ4_0>(b).d, f16::ZERO),
        DotKind::Q8_0 => (u, bytemuck::cast_ref::<B, BlockQ8_0>(b).d, f16::ZERO),
        _ => (u, bytemuck::cast_ref::<B, BlockQ5_0>(b).d, f16::ZERO),
    }
}

/// A `[rows, k]` matrix of GGUF blocks repacked for
/// [`CpuBackend::qmatvec_packed`] (see the module's layout): the same
/// bytes per block, rows padded to a multiple of [`GROUP`] with zero
/// blocks.
///
/// ```
/// use hgca_cpu::{CpuBackend, PackedRows, Q8Acts};
/// use hgca_kernels::BlockQ5_0;
/// // Three rows of 64 values: row r is all r + 1.
/// let w: Vec<BlockQ5_0> = (0..3)
///     .flat_map(|r| [BlockQ5_0::quantize(&[r as f32 + 1.0; 32]); 2])
///     .collect();
/// let packed = PackedRows::new(&w, 3, 64).unwrap();
/// let x = Q8Acts::quantize(&[1.0f32; 64], 1, 64).unwrap();
/// let (mut y, mut z) = ([0.0f32; 3], [0.0f32; 3]);
/// let cpu = CpuBackend::new();
/// cpu.qmatvec_packed(&packed, &x, &mut y).unwrap();
/// cpu.qmatvec(&w, 3, &x, &mut z).unwrap();
/// for (a, b) in y.iter().zip(&z) {
///     assert!((a - b).abs() <= 1e-4 * b.abs());
/// }
/// ```
#[derive(Clone)]
pub struct PackedRows<B: PackBlock> {
    bytes: Vec<u8>,
    rows: usize,
    k: usize,
    _format: std::marker::PhantomData<B>,
}

impl<B: PackBlock> std::fmt::Debug for PackedRows<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedRows")
            .field("format", &B::NAME)
            .field("rows", &self.rows)
            .field("k", &self.k)
            .finish_non_exhaustive()
    }
}

impl<B: PackBlock> PackedRows<B> {
    /// Repacks `w`, `rows` rows of `k / 32` blocks each (GGUF's layout of
    /// a `[rows, k]` matrix).
    ///
    /// # Errors
    /// [`Error::Param`] when `k` is not a multiple of 32, [`Error::Length`]
    /// when `w` does not hold `rows * k / 32` blocks.
    pub fn new(w: &[B], rows: usize, k: usize) -> Result<Self> {
        if !k.is_multiple_of(32) {
            return Err(Error::Param {
                what: "row width",
                value: k as f64,
                expected: "a multiple of 32 (the block)",
            });
        }
        let nb = k / 32;
        check_len_of("weight blocks", &[rows, nb], w.len())?;
        let groups = rows.div_ceil(GROUP);
        let mut bytes = vec![0u8; groups * nb * B::COLUMN_BYTES];
        let (qh_at, d_at, m_at) = offsets(B::KIND);
        for (g, group) in bytes.chunks_exact_mut(nb * B::COLUMN_BYTES).enumerate() {
            for (b, col) in group.chunks_exact_mut(B::COLUMN_BYTES).enumerate() {
                for r in 0..GROUP.min(rows - g * GROUP) {
                    let (u, d, m) = codes(&w[(g * GROUP + r) * nb + b]);
                    for (i, &c) in u.iter().enumerate() {
                        let (reg, j) = (i / 4, i % 4);
                        if B::KIND == DotKind::Q8_0 {
                            // Register `i / 4`, lane r, byte i % 4.
                            col[64 * reg + 4 * r + j] = c;
                            continue;
                        }
                        // Register `i / 4` (part `i / 8`, its high half
                        // for odd registers), lane r, byte i % 4.
                        let byte = 64 * (reg / 2) + 4 * r + j;
                        col[byte] |= (c & 0x0F) << (4 * (reg % 2));
                        if B::KIND == DotKind::Q5_0 && c & 0x10 != 0 {
                            col[qh_at + 8 * reg + (4 * r + j) / 8] |= 1 << ((4 * r + j) % 8);
                        }
                    }
                    col[d_at + 2 * r..d_at + 2 * r + 2].copy_from_slice(&d.to_le_bytes());
                    if B::KIND == DotKind::Q4_1 {
                        col[m_at + 2 * r..m_at + 2 * r + 2].copy_from_slice(&m.to_le_bytes());
                    }
                }
            }
        }
        Ok(Self {
            bytes,
            rows,
            k,
            _format: std::marker::PhantomData,
        })
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn width(&self) -> usize {
        self.k
    }

    /// Bytes held (the padding rows' too).
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Row group `g`'s block columns.
    fn group(&self, g: usize) -> &[u8] {
        let n = self.k / 32 * B::COLUMN_BYTES;
        &self.bytes[g * n..(g + 1) * n]
    }
}

/// Row `r`'s code `i` of a block column.
fn column_code<B: PackBlock>(col: &[u8], r: usize, i: usize) -> i32 {
    let (qh_at, _, _) = offsets(B::KIND);
    let (reg, j) = (i / 4, i % 4);
    if B::KIND == DotKind::Q8_0 {
        return i32::from(col[64 * reg + 4 * r + j] as i8);
    }
    let mut c = (col[64 * (reg / 2) + 4 * r + j] >> (4 * (reg % 2))) & 0x0F;
    if B::KIND == DotKind::Q5_0 {
        let bit = 4 * r + j;
        c |= ((col[qh_at + 8 * reg + bit / 8] >> (bit % 8)) & 1) << 4;
    }
    i32::from(c)
}

fn column_f16(col: &[u8], at: usize, r: usize) -> f32 {
    f16::from_le_bytes([col[at + 2 * r], col[at + 2 * r + 1]]).to_f32()
}

/// The factor of a block column's offset sum (`Σ_b d u_b`, or `Σ_b m
/// u_b` for Q4_1): the codes are unsigned, the values `d (c - 8)`,
/// `d (c - 16)` or `d c + m` (Q8_0's are signed, `d c`: no offset).
const fn offset_factor(kind: DotKind) -> f32 {
    match kind {
        DotKind::Q4_0 => -8.0,
        DotKind::Q5_0 => -16.0,
        DotKind::Q8_0 => 0.0,
        _ => 1.0,
    }
}

/// One row group against one token, portable code: `out[r]` for the
/// group's rows (`out.len()` of them).
fn group_scalar<B: PackBlock>(group: &[u8], x: Token<'_>, out: &mut [f32]) {
    let (_, d_at, m_at) = offsets(B::KIND);
    for (r, y) in out.iter_mut().enumerate() {
        let (mut acc, mut off) = (0.0f32, 0.0f32);
        for (b, col) in group.chunks_exact(B::COLUMN_BYTES).enumerate() {
            let dot: i32 = (0..32)
                .map(|i| column_code::<B>(col, r, i) * i32::from(x.blocks[b].qs[i]))
                .sum();
            let d = column_f16(col, d_at, r);
            acc = (d * x.scales[b]).mul_add(dot as f32, acc);
            let o = if B::KIND == DotKind::Q4_1 {
                column_f16(col, m_at, r)
            } else {
                d
            };
            off = o.mul_add(x.sums[b], off);
        }
        *y = offset_factor(B::KIND).mul_add(off, acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use core::arch::x86_64::*;

    /// Tokens a row group's unpacked codes serve at a time when there are
    /// several (prefill chunks): the unpacking is shared, each token adds
    /// eight `vpdpbusd` and its scales.
    const TILE: usize = 4;

    /// A block column's codes in eight registers (register `c` lane `r`:
    /// codes `4 c .. 4 c + 4` of row `r`), unsigned; for Q8_0 their
    /// magnitudes, with the masks of the negative ones.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn unpack<B: PackBlock>(col: &[u8]) -> ([__m512i; 8], [__mmask64; 8]) {
        let (qh_at, _, _) = offsets(B::KIND);
        let p = col.as_ptr();
        let mut q = [_mm512_setzero_si512(); 8];
        let mut neg = [0; 8];
        if B::KIND == DotKind::Q8_0 {
            for (c, (q, neg)) in q.iter_mut().zip(&mut neg).enumerate() {
                // SAFETY: a Q8_0 block column holds 512 bytes of codes.
                let v = unsafe { _mm512_loadu_si512(p.add(64 * c).cast()) };
                *neg = _mm512_movepi8_mask(v);
                *q = _mm512_abs_epi8(v);
            }
            return (q, neg);
        }
        let low = _mm512_set1_epi8(0x0F);
        for part in 0..4 {
            // SAFETY: a block column holds 256 bytes of nibbles, and for
            // Q5_0 eight masks of 8 bytes from `qh_at`.
            let v = unsafe { _mm512_loadu_si512(p.add(64 * part).cast()) };
            q[2 * part] = _mm512_and_si512(v, low);
            q[2 * part + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
        }
        if B::KIND == DotKind::Q5_0 {
            for (c, q) in q.iter_mut().enumerate() {
                // SAFETY: as above.
                let m = unsafe { p.add(qh_at + 8 * c).cast::<u64>().read_unaligned() };
                *q = _mm512_mask_add_epi8(*q, m, *q, _mm512_set1_epi8(16));
            }
        }
        (q, neg)
    }

    /// One row group against `T` tokens: per token sixteen sums, each
    /// lane a row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn group<B: PackBlock, const T: usize>(group: &[u8], x: [Token<'_>; T]) -> [__m512; T] {
        let (_, d_at, m_at) = offsets(B::KIND);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); T];
        let mut off = [_mm512_setzero_ps(); T];
        for (b, col) in group.chunks_exact(B::COLUMN_BYTES).enumerate() {
            let (q, neg) = unpack::<B>(col);
            let p = col.as_ptr();
            // SAFETY: sixteen f16 scales (and minimums) in the column.
            let d = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.add(d_at).cast())) };
            let o = if B::KIND == DotKind::Q4_1 {
                // SAFETY: as above.
                unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.add(m_at).cast())) }
            } else {
                d
            };
            for t in 0..T {
                let xq: [i32; 8] = bytemuck::cast(x[t].blocks[b].qs);
                let (mut s0, mut s1) = (zero, zero);
                for c in 0..8 {
                    let mut xb = _mm512_set1_epi32(xq[c]);
                    if B::KIND == DotKind::Q8_0 {
                        // The activation codes negated where the weight's
                        // is (they are within ±127).
                        xb = _mm512_mask_sub_epi8(xb, neg[c], zero, xb);
                    }
                    if c % 2 == 0 {
                        s0 = _mm512_dpbusd_epi32(s0, q[c], xb);
                    } else {
                        s1 = _mm512_dpbusd_epi32(s1, q[c], xb);
                    }
                }
                let dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                let ds = _mm512_mul_ps(d, _mm512_set1_ps(x[t].scales[b]));
                acc[t] = _mm512_fmadd_ps(ds, dot, acc[t]);
                if B::KIND != DotKind::Q8_0 {
                    off[t] = _mm512_fmadd_ps(o, _mm512_set1_ps(x[t].sums[b]), off[t]);
                }
            }
        }
        let f = _mm512_set1_ps(offset_factor(B::KIND));
        core::array::from_fn(|t| _mm512_fmadd_ps(f, off[t], acc[t]))
    }

    /// Token `t`'s sums `v` of a row group into `o` (`[rows, n]` for the
    /// group's rows, as many as it holds).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn store(o: &mut [f32], n: usize, t: usize, v: __m512) {
        let mut sums = [0.0f32; GROUP];
        // SAFETY: 16 writable f32.
        unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), v) };
        for (r, &s) in sums[..o.len() / n].iter().enumerate() {
            o[r * n + t] = s;
        }
    }

    /// A row group's sums `v` into `o[r0..]`, lanes `live`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn put(o: &mut [f32], r0: usize, live: __mmask16, v: __m512) {
        let end = o.len().min(r0 + GROUP);
        let o = &mut o[r0..end];
        // SAFETY: `live` masks the lanes past `o`'s end.
        unsafe { _mm512_mask_storeu_ps(o.as_mut_ptr(), live, v) };
    }

    /// Every row group against tokens `first..` of `acts` into `out`
    /// (`[tokens, rows]`, as many tokens as it holds).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn tokens<B: PackBlock>(
        w: &PackedRows<B>,
        first: usize,
        acts: &Q8Acts,
        out: &mut [f32],
    ) {
        let rows = w.rows;
        let tn = out.len() / rows;
        for g in 0..rows.div_ceil(GROUP) {
            let data = w.group(g);
            let r0 = g * GROUP;
            let live: __mmask16 = if rows - r0 >= GROUP {
                0xFFFF
            } else {
                (1 << (rows - r0)) - 1
            };
            let mut t = 0;
            while t + TILE <= tn {
                let x = core::array::from_fn(|j| acts.token(first + t + j));
                for (j, v) in group::<B, TILE>(data, x).into_iter().enumerate() {
                    put(&mut out[(t + j) * rows..][..rows], r0, live, v);
                }
                t += TILE;
            }
            for t in t..tn {
                let v = group::<B, 1>(data, [acts.token(first + t)])[0];
                put(&mut out[t * rows..][..rows], r0, live, v);
            }
        }
    }

    /// Row groups from `first` against every token of `acts` into `out`
    /// (`[rows, n]` for the groups' rows).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn groups<B: PackBlock>(
        w: &PackedRows<B>,
        first: usize,
        acts: &Q8Acts,
        out: &mut [f32],
    ) {
        let n = acts.tokens();
        for (i, o) in out.chunks_mut(GROUP * n).enumerate() {
            let g = first + i;
            let data = w.group(g);
            // The next group's columns, a cache line at a time: a task's
            // groups are one stream of a few tens of KiB.
            if g + 1 < w.rows.div_ceil(GROUP) {
                for line in w.group(g + 1).chunks(64) {
                    _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
                }
            }
            let mut t = 0;
            while t + TILE <= n {
                let x = core::array::from_fn(|j| acts.token(t + j));
                for (j, v) in group::<B, TILE>(data, x).into_iter().enumerate() {
                    store(o, n, t + j, v);
                }
                t += TILE;
            }
            for t in t..n {
                store(o, n, t, group::<B, 1>(data, [acts.token(t)])[0]);
            }
        }
    }
}

impl CpuBackend {
    /// [`CpuBackend::qmatvec`] over rows repacked by [`PackedRows::new`]:
    /// `y = x W^T`, `y` `[n, rows]` row-major for the `n` tokens of
    /// `acts`. The same products, summed in another order (each token's
    /// result is the same whatever the threading). The AVX-512 VNNI path
    /// ([`QDotPath::Avx512Vnni`]) is what the layout is for; elsewhere
    /// portable code reads it (slower than `qmatvec`'s SIMD paths over
    /// GGUF's layout: repack only where the VNNI path runs).
    ///
    /// # Errors
    /// [`Error::Param`] when `acts` has another width than the rows,
    /// [`Error::Length`] when `y` does not hold `n * rows` values.
    pub fn qmatvec_packed<B: PackBlock>(
        &self,
        w: &PackedRows<B>,
        acts: &Q8Acts,
        y: &mut [f32],
    ) -> Result<()> {
        if acts.width() != w.k {
            return Err(Error::Param {
                what: "activation width",
                value: acts.width() as f64,
                expected: "the packed rows' width",
            });
        }
        let (n, rows) = (acts.tokens(), w.rows);
        check_len_of("output", &[n, rows], y.len())?;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        if w.k == 0 {
            y.fill(0.0);
            return Ok(());
        }
        let path = Self::qmatvec_path(self.isa);
        let part = |first_group: usize, out: &mut [f32]| match path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `qmatvec_path` detected AVX-512 F/BW/VL, VNNI, AVX2,
            // FMA and F16C for this path.
            QDotPath::Avx512Vnni => unsafe { x86::groups(w, first_group, acts, out) },
            _ => {
                for (i, o) in out.chunks_mut(GROUP * n).enumerate() {
                    let mut sums = [0.0f32; GROUP];
                    let live = o.len() / n;
                    for t in 0..n {
                        group_scalar::<B>(
                            w.group(first_group + i),
                            acts.token(t),
                            &mut sums[..live],
                        );
                        for (r, &s) in sums[..live].iter().enumerate() {
                            o[r * n + t] = s;
                        }
                    }
                }
            }
        };
        if n >= TOKEN_SPLIT {
            // Tasks of whole tokens (contiguous in y), each over every row
            // group: a group's columns stay in L1 while a task's tokens
            // pass, four at a time.
            let per_task = n.div_ceil(2 * self.threads()).next_multiple_of(4);
            self.for_chunks(y, per_task * rows, |i, out| match path {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                QDotPath::Avx512Vnni => unsafe { x86::tokens(w, i * per_task, acts, out) },
                _ => {
                    for g in 0..rows.div_ceil(GROUP) {
                        let r0 = g * GROUP;
                        let live = GROUP.min(rows - r0);
                        for (j, o) in out.chunks_exact_mut(rows).enumerate() {
                            let x = acts.token(i * per_task + j);
                            group_scalar::<B>(w.group(g), x, &mut o[r0..r0 + live]);
                        }
                    }
                }
            });
            return Ok(());
        }
        let per_task = crate::qdot::rows_per_task(rows, self.threads()).next_multiple_of(GROUP);
        let groups_per_task = per_task / GROUP;
        if n == 1 {
            self.for_chunks(y, per_task, |i, out| part(i * groups_per_task, out));
        } else {
            let mut t = vec![0.0f32; rows * n];
            self.for_chunks(&mut t, per_task * n, |i, out| {
                part(i * groups_per_task, out)
            });
            for (r, vals) in t.chunks_exact(n).enumerate() {
                for (tok, &v) in vals.iter().enumerate() {
                    y[tok * rows + r] = v;
                }
            }
        }
        Ok(())
    }
}
