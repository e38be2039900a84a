//! GGUF's rows (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) repacked sixteen rows
//! at a time for the matrix-vector product of decoding, and the integer
//! product of prefill chunks, on AVX-512 VNNI and (eight rows to each
//! 256-bit half) on AVX2.
//!
//! In GGUF's layout a block's codes and scales are one row's; the kernel
//! of [`CpuBackend::qmatvec`] works a row at a time and spends most of its
//! instructions per block on putting the block in registers (two blocks'
//! nibbles spread over four lanes, two f16 scales widened and spread over
//! eight lanes each) and on reducing the products of a row: on Zen 5 that
//! made Q5_0 compute-bound near 18 GB/s a thread, half the machine's
//! streaming read. Here the blocks of sixteen rows are stored side by
//! side, one 512-bit lane per row: four codes of each of the sixteen rows
//! make one register, multiplied by four activation codes broadcast to
//! every lane (`vpdpbusd`), so every lane sums one row and a column of 32
//! values ends with one conversion and one fused multiply-add for all
//! sixteen rows' scales. The bytes are GGUF's (a sixteen-row column of
//! Q5_0 is 352 bytes, sixteen blocks of 22; a sixteen-row Q6_K super-block
//! 3360, sixteen of 210; Q4_K takes 2368 for sixteen of 144: its 6-bit
//! sub-block scales and minimums a byte each). Several tokens (a prefill
//! chunk) share a column's unpacked codes four at a time, and from
//! sixteen tokens the threads share out tokens, each writing its rows of
//! the output in place.
//!
//! AVX2 has no `vpdpbusd`: its kernel reads each 64-byte part as two
//! 256-bit registers of eight rows and multiplies with `vpmaddubsw` (codes
//! times activation codes, pairs summed to i16) and `vpmaddwd` against
//! ones (to i32), summing the i16 pairs of several registers first where
//! they cannot overflow (eight for the 4-bit formats, four for Q5_0, two
//! for Q6_K, one for Q8_0). On a Zen 1 decoding's matrices of the 4-, 5-
//! and 6-bit formats ran 1.07-1.29x faster than a row at a time, Q8_0's
//! slower (hgca-llm does not repack Q8_0 there).
//!
//! Rows that cannot be repacked ahead (a sparse FFN's active neurons,
//! wherever they lie) can still be taken sixteen at a time: the 32-value
//! formats' blocks of sixteen rows are loaded column by column and
//! transposed into the same registers, their scales gathered (the sparse
//! FFN's one-token lists use it; a list of scattered Q4_0 neurons ran
//! 1.4x faster than a row at a time on Zen 5).
//!
//! Layout. A row group (`GROUP` rows, those past the matrix's last zero)
//! is its super-blocks in turn (a super-block is one block of the 32-value
//! formats, 256 values of the K formats), each a header (Q4_K: sixteen
//! f16 `d` then sixteen `dmin`; Q6_K: sixteen `d`; none for the others)
//! and its columns of 32 values. Codes: register `c` (of eight) lane `r`
//! holds codes `4 c .. 4 c + 4` of row `r`'s column. A column starts with
//! 256 bytes of nibbles in four 64-byte parts: part `p`'s byte `4 r + j`
//! holds, low, code `8 p + j`'s low four bits (register `2 p`) and, high,
//! code `8 p + 4 + j`'s (register `2 p + 1`). Then: Q5_0 eight 64-bit
//! masks, mask `c` bit `4 r + j` the fifth bit of code `4 c + j`, and
//! sixteen f16 scales; Q4_0 the scales; Q4_1 the scales and sixteen f16
//! minimums; Q4_K sixteen 6-bit sub-block scales and sixteen minimums, a
//! byte each; Q6_K two 64-byte parts of top bits, part `h` byte `4 r + j`
//! bits `2 k, 2 k + 1` the top bits of register `4 h + k`'s code, and
//! the sixteen rows' i8 scales of the column's first 16 values, then of
//! its last 16. Q8_0's column is eight registers of codes and the scales.

use hgca_kernels::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, Error, Result, check_len_of,
    f16,
};

use crate::CpuBackend;
use crate::qdot::{DotBlock, DotKind, Q8Acts, QDotPath, Token, parts};

/// Rows per group of [`PackedRows`]: one per 32-bit lane of a 512-bit register.
pub const GROUP: usize = 16;

/// Tokens from which [`CpuBackend::qmatvec_packed`] shares out tokens
/// (prefill chunks) instead of row groups (decoding).
const TOKEN_SPLIT: usize = 16;

/// A GGUF format that [`PackedRows`] repacks (every [`DotBlock`]; sealed
/// as that trait is).
pub trait PackBlock: DotBlock {
    /// Bytes of one 32-value column of a row group.
    const COLUMN_BYTES: usize;
    /// Bytes of a row group's super-block header.
    const HEADER: usize = 0;
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
impl PackBlock for BlockQ4K {
    const COLUMN_BYTES: usize = 256 + 2 * GROUP;
    const HEADER: usize = 4 * GROUP;
}
impl PackBlock for BlockQ6K {
    const COLUMN_BYTES: usize = 256 + 128 + 2 * GROUP;
    const HEADER: usize = 2 * GROUP;
}

/// Columns of 32 values per super-block.
const fn columns<B: PackBlock>() -> usize {
    B::VALUES / 32
}

/// Bytes of a row group's super-block.
const fn super_bytes<B: PackBlock>() -> usize {
    B::HEADER + columns::<B>() * B::COLUMN_BYTES
}

/// Where a column keeps what follows its nibbles (Q8_0: its codes): the
/// fifth bits or top bits, and its scales (f16 `d`, or the K formats'
/// sub-block bytes).
const fn column_offsets(kind: DotKind) -> (usize, usize) {
    match kind {
        DotKind::Q5_0 => (256, 320),
        DotKind::Q8_0 => (512, 512),
        DotKind::Q6K => (256, 384),
        _ => (256, 256),
    }
}

/// The factor of the offset sum: the values are `d (c - 8)`, `d (c - 16)`,
/// `d c + m`, `d sc c - dmin mn` or `d sc (c - 32)` for unsigned codes
/// `c` (Q8_0's are signed, `d c`: no offset).
const fn offset_factor(kind: DotKind) -> f32 {
    match kind {
        DotKind::Q4_0 => -8.0,
        DotKind::Q5_0 => -16.0,
        DotKind::Q4_1 => 1.0,
        DotKind::Q4K => -1.0,
        DotKind::Q6K => -32.0,
        DotKind::Q8_0 => 0.0,
    }
}

/// One row's super-block, unpacked: its codes (unsigned but for Q8_0's
/// bytes), per column of 32 the f16 scale and minimum (32-value formats),
/// or the sub-block bytes (Q4_K: scale and minimum per column; Q6_K: the
/// scales of each half column), and the K formats' `d` and `dmin`.
struct Unpacked {
    codes: [u8; 256],
    col: [[u16; 2]; 8],
    head: [u16; 2],
}

fn unpack_block<B: PackBlock>(b: &B) -> Unpacked {
    let mut u = Unpacked {
        codes: [0; 256],
        col: [[0; 2]; 8],
        head: [0; 2],
    };
    match B::KIND {
        DotKind::Q4K => {
            let b: &BlockQ4K = bytemuck::cast_ref(b);
            let (sc, mn) = b.scales_mins();
            for j in 0..8 {
                for l in 0..32 {
                    u.codes[32 * j + l] = (b.qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
                }
                u.col[j] = [u16::from(sc[j]), u16::from(mn[j])];
            }
            u.head = [b.d.to_bits(), b.dmin.to_bits()];
        }
        DotKind::Q6K => {
            let b: &BlockQ6K = bytemuck::cast_ref(b);
            for (i, c) in u.codes.iter_mut().enumerate() {
                *c = crate::kdot::q6k_code(b, i);
            }
            for j in 0..8 {
                u.col[j] = [
                    u16::from(b.scales[2 * j] as u8),
                    u16::from(b.scales[2 * j + 1] as u8),
                ];
            }
            u.head = [b.d.to_bits(), 0];
        }
        _ => {
            let (q, _, _) = parts(b);
            let off: i8 = match B::KIND {
                DotKind::Q4_0 => 8,
                DotKind::Q5_0 => 16,
                _ => 0,
            };
            for (c, v) in u.codes.iter_mut().zip(q) {
                *c = (v + off) as u8;
            }
            let (d, m) = match B::KIND {
                DotKind::Q4_1 => {
                    let b: &BlockQ4_1 = bytemuck::cast_ref(b);
                    (b.d, b.m)
                }
                DotKind::Q4_0 => (bytemuck::cast_ref::<B, BlockQ4_0>(b).d, f16::ZERO),
                DotKind::Q8_0 => (bytemuck::cast_ref::<B, BlockQ8_0>(b).d, f16::ZERO),
                _ => (bytemuck::cast_ref::<B, BlockQ5_0>(b).d, f16::ZERO),
            };
            u.col[0] = [d.to_bits(), m.to_bits()];
        }
    }
    u
}

/// A `[rows, k]` matrix of GGUF blocks repacked for
/// [`CpuBackend::qmatvec_packed`] (see the module's layout), rows padded
/// to a multiple of [`GROUP`] with zero blocks.
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
    /// Repacks `w`, `rows` rows of `k / B::VALUES` blocks each (GGUF's
    /// layout of a `[rows, k]` matrix).
    ///
    /// # Errors
    /// [`Error::Param`] when `k` is not a multiple of the block (32, or
    /// 256 for the K formats), [`Error::Length`] when `w` does not hold
    /// `rows * k / B::VALUES` blocks.
    pub fn new(w: &[B], rows: usize, k: usize) -> Result<Self> {
        if !k.is_multiple_of(B::VALUES) {
            return Err(Error::Param {
                what: "row width",
                value: k as f64,
                expected: "a multiple of the format's block (32, 256 for the K formats)",
            });
        }
        let nb = k / B::VALUES;
        check_len_of("weight blocks", &[rows, nb], w.len())?;
        let groups = rows.div_ceil(GROUP);
        let mut bytes = vec![0u8; groups * nb * super_bytes::<B>()];
        let (extra, sc_at) = column_offsets(B::KIND);
        for (g, group) in bytes.chunks_exact_mut(nb * super_bytes::<B>()).enumerate() {
            for (s, sup) in group.chunks_exact_mut(super_bytes::<B>()).enumerate() {
                let (head, cols) = sup.split_at_mut(B::HEADER);
                for r in 0..GROUP.min(rows - g * GROUP) {
                    let u = unpack_block(&w[(g * GROUP + r) * nb + s]);
                    for (h, &v) in u.head.iter().enumerate().take(B::HEADER / (2 * GROUP)) {
                        head[2 * (GROUP * h + r)..][..2].copy_from_slice(&v.to_le_bytes());
                    }
                    for (j, col) in cols.chunks_exact_mut(B::COLUMN_BYTES).enumerate() {
                        write_column::<B>(
                            col,
                            r,
                            &u.codes[32 * j..32 * j + 32],
                            u.col[j],
                            extra,
                            sc_at,
                        );
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

    /// Row group `g`'s super-blocks.
    fn group(&self, g: usize) -> &[u8] {
        let n = self.k / B::VALUES * super_bytes::<B>();
        &self.bytes[g * n..(g + 1) * n]
    }
}

/// Row `r`'s 32 codes and scale fields of one column into `col`.
fn write_column<B: PackBlock>(
    col: &mut [u8],
    r: usize,
    codes: &[u8],
    scales: [u16; 2],
    extra: usize,
    sc_at: usize,
) {
    for (i, &c) in codes.iter().enumerate() {
        let (reg, j) = (i / 4, i % 4);
        if B::KIND == DotKind::Q8_0 {
            col[64 * reg + 4 * r + j] = c;
            continue;
        }
        col[64 * (reg / 2) + 4 * r + j] |= (c & 0x0F) << (4 * (reg % 2));
        if B::KIND == DotKind::Q5_0 && c & 0x10 != 0 {
            col[extra + 8 * reg + (4 * r + j) / 8] |= 1 << ((4 * r + j) % 8);
        }
        if B::KIND == DotKind::Q6K {
            let (h, k) = (reg / 4, reg % 4);
            col[extra + 64 * h + 4 * r + j] |= (c >> 4) << (2 * k);
        }
    }
    match B::KIND {
        DotKind::Q4K | DotKind::Q6K => {
            col[sc_at + r] = scales[0] as u8;
            col[sc_at + GROUP + r] = scales[1] as u8;
        }
        _ => {
            col[sc_at + 2 * r..][..2].copy_from_slice(&scales[0].to_le_bytes());
            if B::KIND == DotKind::Q4_1 {
                col[sc_at + 2 * GROUP + 2 * r..][..2].copy_from_slice(&scales[1].to_le_bytes());
            }
        }
    }
}

/// Row `r`'s code `i` of a column.
fn column_code<B: PackBlock>(col: &[u8], r: usize, i: usize) -> i32 {
    let (extra, _) = column_offsets(B::KIND);
    let (reg, j) = (i / 4, i % 4);
    if B::KIND == DotKind::Q8_0 {
        return i32::from(col[64 * reg + 4 * r + j] as i8);
    }
    let mut c = (col[64 * (reg / 2) + 4 * r + j] >> (4 * (reg % 2))) & 0x0F;
    if B::KIND == DotKind::Q5_0 {
        let bit = 4 * r + j;
        c |= ((col[extra + 8 * reg + bit / 8] >> (bit % 8)) & 1) << 4;
    }
    if B::KIND == DotKind::Q6K {
        let (h, k) = (reg / 4, reg % 4);
        c |= ((col[extra + 64 * h + 4 * r + j] >> (2 * k)) & 3) << 4;
    }
    i32::from(c)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Row `r`'s multipliers of one column: of the integer sums of its first
/// and last 16 values (equal but for Q6_K), and of the offset sum.
fn column_scales<B: PackBlock>(head: &[u8], col: &[u8], r: usize) -> (f32, f32, f32) {
    let (_, at) = column_offsets(B::KIND);
    match B::KIND {
        DotKind::Q4K => {
            let (d, dmin) = (f16_at(head, 2 * r), f16_at(head, 2 * (GROUP + r)));
            let a = d * f32::from(col[at + r]);
            (a, a, dmin * f32::from(col[at + GROUP + r]))
        }
        DotKind::Q6K => {
            let d = f16_at(head, 2 * r);
            let (a0, a1) = (
                d * f32::from(col[at + r] as i8),
                d * f32::from(col[at + GROUP + r] as i8),
            );
            (a0, a1, 0.0)
        }
        DotKind::Q4_1 => {
            let d = f16_at(col, at + 2 * r);
            (d, d, f16_at(col, at + 2 * GROUP + 2 * r))
        }
        _ => {
            let d = f16_at(col, at + 2 * r);
            (d, d, d)
        }
    }
}

/// One row group against one token, portable code: `out[r]` for the
/// group's rows (`out.len()` of them).
fn group_scalar<B: PackBlock>(group: &[u8], x: Token<'_>, out: &mut [f32]) {
    for (r, y) in out.iter_mut().enumerate() {
        let (mut acc, mut off) = (0.0f32, 0.0f32);
        for (s, sup) in group.chunks_exact(super_bytes::<B>()).enumerate() {
            let (head, cols) = sup.split_at(B::HEADER);
            for (j, col) in cols.chunks_exact(B::COLUMN_BYTES).enumerate() {
                let b = columns::<B>() * s + j;
                let half = |h: usize| -> i32 {
                    (16 * h..16 * h + 16)
                        .map(|i| column_code::<B>(col, r, i) * i32::from(x.blocks[b].qs[i]))
                        .sum()
                };
                let (a0, a1, m) = column_scales::<B>(head, col, r);
                acc = (a0 * x.scales[b]).mul_add(half(0) as f32, acc);
                acc = (a1 * x.scales[b]).mul_add(half(1) as f32, acc);
                if B::KIND == DotKind::Q6K {
                    off = a0.mul_add(x.sums16[2 * b], off);
                    off = a1.mul_add(x.sums16[2 * b + 1], off);
                } else {
                    off = m.mul_add(x.sums[b], off);
                }
            }
        }
        *y = offset_factor(B::KIND).mul_add(off, acc);
    }
}

/// Tokens a row group's unpacked codes serve at a time when there are
/// several (prefill chunks): the unpacking is shared, each token adds its
/// products and scales.
const TILE: usize = 4;

/// A row group's kernel: per token of the tile, the sums of the group's
/// sixteen rows (the padding rows' too).
type GroupFn<const T: usize> = for<'a, 'b> unsafe fn(&'a [u8], [Token<'b>; T]) -> [[f32; GROUP]; T];

/// The kernels of one path: for one token and for a tile of them.
#[derive(Clone, Copy)]
struct Kernels {
    one: GroupFn<1>,
    tile: GroupFn<TILE>,
}

/// One row group against `T` tokens, portable code.
fn portable<B: PackBlock, const T: usize>(data: &[u8], x: [Token<'_>; T]) -> [[f32; GROUP]; T] {
    x.map(|x| {
        let mut s = [0.0f32; GROUP];
        group_scalar::<B>(data, x, &mut s);
        s
    })
}

/// The row group kernels of `path` for format `B`.
///
/// # Safety
/// `path` is what [`CpuBackend::qmatvec_path`] returned on this CPU (it
/// detected what the SIMD kernels need).
unsafe fn kernels<B: PackBlock>(path: QDotPath) -> Kernels {
    match path {
        #[cfg(target_arch = "x86_64")]
        QDotPath::Avx512Vnni => Kernels {
            one: x86::sums::<B, 1>,
            tile: x86::sums::<B, TILE>,
        },
        #[cfg(target_arch = "x86_64")]
        QDotPath::Avx2 => Kernels {
            one: avx2::sums::<B, 1>,
            tile: avx2::sums::<B, TILE>,
        },
        _ => Kernels {
            one: portable::<B, 1>,
            tile: portable::<B, TILE>,
        },
    }
}

impl Kernels {
    /// Row group `data` against tokens `first..first + count` of `acts`,
    /// a tile at a time: `put(t, sums)` for each (`t` from 0).
    fn each_token(
        self,
        data: &[u8],
        acts: &Q8Acts,
        first: usize,
        count: usize,
        mut put: impl FnMut(usize, &[f32; GROUP]),
    ) {
        let mut t = 0;
        while t + TILE <= count {
            let x = core::array::from_fn(|j| acts.token(first + t + j));
            // SAFETY: `kernels`' caller vouched for the path.
            let s = unsafe { (self.tile)(data, x) };
            for (j, s) in s.iter().enumerate() {
                put(t + j, s);
            }
            t += TILE;
        }
        for t in t..count {
            // SAFETY: as above.
            let [s] = unsafe { (self.one)(data, [acts.token(first + t)]) };
            put(t, &s);
        }
    }

    /// Every row group against tokens `first..` of `acts` into `out`
    /// (`[tokens, rows]`, as many tokens as it holds): a group's columns
    /// stay in L1 while the tokens pass.
    fn tokens<B: PackBlock>(self, w: &PackedRows<B>, first: usize, acts: &Q8Acts, out: &mut [f32]) {
        let rows = w.rows;
        let count = out.len() / rows;
        for g in 0..rows.div_ceil(GROUP) {
            let (r0, live) = (g * GROUP, GROUP.min(rows - g * GROUP));
            self.each_token(w.group(g), acts, first, count, |t, s| {
                out[t * rows + r0..][..live].copy_from_slice(&s[..live]);
            });
        }
    }

    /// Row groups from `first` against every token of `acts` into `out`
    /// (`[rows, n]` for the groups' rows).
    fn groups<B: PackBlock>(self, w: &PackedRows<B>, first: usize, acts: &Q8Acts, out: &mut [f32]) {
        let n = acts.tokens();
        for (i, o) in out.chunks_mut(GROUP * n).enumerate() {
            let g = first + i;
            // The next group's columns, a cache line at a time: a task's
            // groups are one stream of a few tens of KiB.
            #[cfg(target_arch = "x86_64")]
            if g + 1 < w.rows.div_ceil(GROUP) {
                for line in w.group(g + 1).chunks(64) {
                    // SAFETY: SSE is part of x86-64; a prefetch does not
                    // fault.
                    unsafe {
                        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                            line.as_ptr().cast(),
                        );
                    }
                }
            }
            let live = o.len() / n;
            self.each_token(w.group(g), acts, 0, n, |t, s| {
                for (r, &v) in s[..live].iter().enumerate() {
                    o[r * n + t] = v;
                }
            });
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use core::arch::x86_64::*;

    /// A column's codes in eight registers (register `c` lane `r`: codes
    /// `4 c .. 4 c + 4` of row `r`), unsigned; for Q8_0 their magnitudes,
    /// with the masks of the negative ones.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn unpack<B: PackBlock>(col: &[u8]) -> ([__m512i; 8], [__mmask64; 8]) {
        let (extra, _) = column_offsets(B::KIND);
        let p = col.as_ptr();
        let mut q = [_mm512_setzero_si512(); 8];
        let mut neg = [0; 8];
        if B::KIND == DotKind::Q8_0 {
            for (c, (q, neg)) in q.iter_mut().zip(&mut neg).enumerate() {
                // SAFETY: a Q8_0 column holds 512 bytes of codes.
                let v = unsafe { _mm512_loadu_si512(p.add(64 * c).cast()) };
                *neg = _mm512_movepi8_mask(v);
                *q = _mm512_abs_epi8(v);
            }
            return (q, neg);
        }
        let low = _mm512_set1_epi8(0x0F);
        for part in 0..4 {
            // SAFETY: a column holds 256 bytes of nibbles, Q5_0's eight
            // masks of 8 bytes and Q6_K's two parts of 64 after them.
            let v = unsafe { _mm512_loadu_si512(p.add(64 * part).cast()) };
            q[2 * part] = _mm512_and_si512(v, low);
            q[2 * part + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
        }
        if B::KIND == DotKind::Q5_0 {
            for (c, q) in q.iter_mut().enumerate() {
                // SAFETY: as above.
                let m = unsafe { p.add(extra + 8 * c).cast::<u64>().read_unaligned() };
                *q = _mm512_mask_add_epi8(*q, m, *q, _mm512_set1_epi8(16));
            }
        }
        if B::KIND == DotKind::Q6K {
            let top = _mm512_set1_epi8(0x30);
            for h in 0..2 {
                // SAFETY: as above.
                let v = unsafe { _mm512_loadu_si512(p.add(extra + 64 * h).cast()) };
                // Bits 2k, 2k + 1 of each byte to bits 4, 5 (16-bit
                // shifts: the mask drops what crosses a byte).
                let t = [
                    _mm512_slli_epi16::<4>(v),
                    _mm512_slli_epi16::<2>(v),
                    v,
                    _mm512_srli_epi16::<2>(v),
                ];
                for (k, t) in t.into_iter().enumerate() {
                    let c = 4 * h + k;
                    q[c] = _mm512_or_si512(q[c], _mm512_and_si512(t, top));
                }
            }
        }
        (q, neg)
    }

    /// The first sixteen f16 of `b`, widened.
    #[target_feature(enable = "avx512f,avx2,f16c")]
    #[inline]
    fn f16x16(b: &[u8]) -> __m512 {
        let b = &b[..2 * GROUP];
        // SAFETY: 32 readable bytes.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(b.as_ptr().cast())) }
    }

    /// The first sixteen bytes of `b` (signed or not) as f32.
    #[target_feature(enable = "avx512f,avx2")]
    #[inline]
    fn bytes16(b: &[u8], signed: bool) -> __m512 {
        let b = &b[..GROUP];
        // SAFETY: 16 readable bytes.
        let v = unsafe { _mm_loadu_si128(b.as_ptr().cast()) };
        _mm512_cvtepi32_ps(if signed {
            _mm512_cvtepi8_epi32(v)
        } else {
            _mm512_cvtepu8_epi32(v)
        })
    }

    /// A column's multipliers for the sixteen rows: of the integer sums of
    /// its first and last 16 values, and of the offset sum (as
    /// `column_scales`). `hd` holds the super-block's widened `d` and
    /// `dmin` (the K formats).
    #[target_feature(enable = "avx512f,avx2,f16c")]
    #[inline]
    fn scales<B: PackBlock>(col: &[u8], hd: [__m512; 2]) -> [__m512; 3] {
        let (_, at) = column_offsets(B::KIND);
        let p = &col[at..];
        match B::KIND {
            DotKind::Q4K => {
                let (sc, mn) = (bytes16(p, false), bytes16(&p[GROUP..], false));
                let a = _mm512_mul_ps(hd[0], sc);
                [a, a, _mm512_mul_ps(hd[1], mn)]
            }
            DotKind::Q6K => {
                let (s0, s1) = (bytes16(p, true), bytes16(&p[GROUP..], true));
                let (a0, a1) = (_mm512_mul_ps(hd[0], s0), _mm512_mul_ps(hd[0], s1));
                [a0, a1, _mm512_setzero_ps()]
            }
            DotKind::Q4_1 => {
                let d = f16x16(p);
                [d, d, f16x16(&p[2 * GROUP..])]
            }
            _ => {
                let d = f16x16(p);
                [d, d, d]
            }
        }
    }

    /// Column `b` of sixteen rows (`q`, `neg` as [`unpack`] gives them,
    /// `sc` as [`scales`]) against `T` tokens: the products of its codes
    /// added to `acc`, its offset sums to `off` (per token, a lane a row).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn column<const T: usize>(
        kind: DotKind,
        q: &[__m512i; 8],
        neg: &[__mmask64; 8],
        [a0, a1, m]: [__m512; 3],
        x: &[Token<'_>; T],
        b: usize,
        acc: &mut [__m512; T],
        off: &mut [__m512; T],
    ) {
        let zero = _mm512_setzero_si512();
        for t in 0..T {
            let xq: [i32; 8] = bytemuck::cast(x[t].blocks[b].qs);
            // The sums of the column's first 16 values (registers 0..4) and
            // of its last 16.
            let mut h = [zero; 2];
            for c in 0..8 {
                let mut xb = _mm512_set1_epi32(xq[c]);
                if kind == DotKind::Q8_0 {
                    // The activation codes negated where the weight's is
                    // (they are within ±127).
                    xb = _mm512_mask_sub_epi8(xb, neg[c], zero, xb);
                }
                h[c / 4] = _mm512_dpbusd_epi32(h[c / 4], q[c], xb);
            }
            let sx = _mm512_set1_ps(x[t].scales[b]);
            if kind == DotKind::Q6K {
                let (f0, f1) = (_mm512_cvtepi32_ps(h[0]), _mm512_cvtepi32_ps(h[1]));
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(a0, sx), f0, acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(a1, sx), f1, acc[t]);
                let u = &x[t].sums16[2 * b..2 * b + 2];
                off[t] = _mm512_fmadd_ps(a0, _mm512_set1_ps(u[0]), off[t]);
                off[t] = _mm512_fmadd_ps(a1, _mm512_set1_ps(u[1]), off[t]);
            } else {
                let dot = _mm512_cvtepi32_ps(_mm512_add_epi32(h[0], h[1]));
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(a0, sx), dot, acc[t]);
                if kind != DotKind::Q8_0 {
                    off[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[t].sums[b]), off[t]);
                }
            }
        }
    }

    /// One row group against `T` tokens: per token sixteen sums, each
    /// lane a row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn group<B: PackBlock, const T: usize>(group: &[u8], x: [Token<'_>; T]) -> [__m512; T] {
        let mut acc = [_mm512_setzero_ps(); T];
        let mut off = [_mm512_setzero_ps(); T];
        for (s, sup) in group.chunks_exact(super_bytes::<B>()).enumerate() {
            let (head, cols) = sup.split_at(B::HEADER);
            let hd = match B::KIND {
                DotKind::Q4K => [f16x16(head), f16x16(&head[2 * GROUP..])],
                DotKind::Q6K => [f16x16(head), _mm512_setzero_ps()],
                _ => [_mm512_setzero_ps(); 2],
            };
            for (j, col) in cols.chunks_exact(B::COLUMN_BYTES).enumerate() {
                let b = columns::<B>() * s + j;
                let (q, neg) = unpack::<B>(col);
                let sc = scales::<B>(col, hd);
                column(B::KIND, &q, &neg, sc, &x, b, &mut acc, &mut off);
            }
        }
        let f = _mm512_set1_ps(offset_factor(B::KIND));
        for (a, o) in acc.iter_mut().zip(off) {
            *a = _mm512_fmadd_ps(f, o, *a);
        }
        acc
    }

    /// One row group against `T` tokens: per token the sixteen rows' sums.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn sums<B: PackBlock, const T: usize>(
        data: &[u8],
        x: [Token<'_>; T],
    ) -> [[f32; GROUP]; T] {
        let v = group::<B, T>(data, x);
        let mut out = [[0.0f32; GROUP]; T];
        for (o, v) in out.iter_mut().zip(v) {
            // SAFETY: 16 writable f32.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
        }
        out
    }

    /// Sixteen rows' 16 bytes (row `r`'s at `p[r]`) in the packed layout:
    /// register `j` lane `r` holds bytes `4 j .. 4 j + 4` of row `r`. The rows are loaded four to a register (register `k`
    /// lane `l`: row `4 l + k`) and the 4 x 4 words of each 128-bit lane
    /// transposed.
    ///
    /// # Safety
    /// Each `p[r]` has 16 readable bytes.
    #[target_feature(enable = "avx512f,avx2")]
    #[inline]
    unsafe fn transposed(p: &[*const u8; GROUP]) -> [__m512i; 4] {
        let mut z = [_mm512_setzero_si512(); 4];
        for (k, z) in z.iter_mut().enumerate() {
            // SAFETY: the caller's promise.
            let v = unsafe {
                [
                    _mm_loadu_si128(p[k].cast()),
                    _mm_loadu_si128(p[4 + k].cast()),
                    _mm_loadu_si128(p[8 + k].cast()),
                    _mm_loadu_si128(p[12 + k].cast()),
                ]
            };
            let lo = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(v[0]), v[1]);
            let hi = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(v[2]), v[3]);
            *z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        }
        let t0 = _mm512_unpacklo_epi32(z[0], z[1]);
        let t1 = _mm512_unpackhi_epi32(z[0], z[1]);
        let t2 = _mm512_unpacklo_epi32(z[2], z[3]);
        let t3 = _mm512_unpackhi_epi32(z[2], z[3]);
        [
            _mm512_unpacklo_epi64(t0, t2),
            _mm512_unpackhi_epi64(t0, t2),
            _mm512_unpacklo_epi64(t1, t3),
            _mm512_unpackhi_epi64(t1, t3),
        ]
    }

    /// Sixteen rows of a 32-value format, wherever they lie, against one
    /// token: the packed kernel's column product, each column put in the
    /// packed layout in registers from the rows' blocks (their codes
    /// transposed, their scales, minimums and Q5_0's fifth bits gathered).
    /// `false` (nothing written) where a row's length is not the token's
    /// blocks or a row lies more than 2 GiB from the first (the gathers'
    /// 32-bit offsets).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) fn gathered<B: DotBlock>(
        rows: &[&[B]; GROUP],
        x: Token<'_>,
        out: &mut [f32; GROUP],
    ) -> bool {
        let kind = B::KIND;
        // Where a block's codes start; its f16 scale is its first bytes.
        let codes_at = match kind {
            DotKind::Q4_0 | DotKind::Q8_0 => 2,
            DotKind::Q4_1 => 4,
            DotKind::Q5_0 => 6,
            DotKind::Q4K | DotKind::Q6K => return false,
        };
        let nb = x.blocks.len();
        let base = rows[0].as_ptr().cast::<u8>();
        let mut offs = [0i32; GROUP];
        for (o, r) in offs.iter_mut().zip(rows) {
            let Ok(v) = i32::try_from(r.as_ptr().cast::<u8>() as isize - base as isize) else {
                return false;
            };
            if r.len() != nb {
                return false;
            }
            *o = v;
        }
        // SAFETY: 16 readable i32.
        let offs = unsafe { _mm512_loadu_si512(offs.as_ptr().cast()) };
        // Four bits (Q5_0's fifth bits of four codes) to bit 4 of four
        // bytes, by table: entry n has 16 in byte k where n's bit k is set.
        let spread = _mm512_setr_epi32(
            0,
            0x10,
            0x1000,
            0x1010,
            0x10_0000,
            0x10_0010,
            0x10_1000,
            0x10_1010,
            0x1000_0000,
            0x1000_0010,
            0x1000_1000,
            0x1000_1010,
            0x1010_0000,
            0x1010_0010,
            0x1010_1000,
            0x1010_1010,
        );
        let low = _mm512_set1_epi8(0x0F);
        let (mut acc, mut off) = ([_mm512_setzero_ps()], [_mm512_setzero_ps()]);
        for b in 0..nb {
            let at = b * size_of::<B>();
            // SAFETY: every row holds `nb` blocks, so block `b` of each is
            // readable: its scale (and Q4_1's minimum, Q5_0's fifth bits)
            // in the 4 bytes at its start and at 2, its codes from `codes_at`.
            let (g, p) = unsafe {
                let blk = base.add(at);
                let g = _mm512_i32gather_epi32::<1>(offs, blk.cast());
                let p: [*const u8; GROUP] =
                    core::array::from_fn(|r| rows[r].as_ptr().cast::<u8>().add(at + codes_at));
                (g, p)
            };
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
            let mut q = [_mm512_setzero_si512(); 8];
            let mut neg = [0; 8];
            // SAFETY: 16 code bytes at each `p[r]` (32 for Q8_0).
            let t = unsafe { transposed(&p) };
            if kind == DotKind::Q8_0 {
                // SAFETY: as above.
                let t2 = unsafe { transposed(&p.map(|p| p.wrapping_add(16))) };
                for (c, v) in t.into_iter().chain(t2).enumerate() {
                    neg[c] = _mm512_movepi8_mask(v);
                    q[c] = _mm512_abs_epi8(v);
                }
            } else {
                for (c, v) in t.into_iter().enumerate() {
                    q[c] = _mm512_and_si512(v, low);
                    q[4 + c] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                }
            }
            if kind == DotKind::Q5_0 {
                // SAFETY: as above (the fifth bits at 2..6).
                let h = unsafe { _mm512_i32gather_epi32::<1>(offs, base.add(at + 2).cast()) };
                for (c, q) in q.iter_mut().enumerate() {
                    let bits = _mm512_srlv_epi32(h, _mm512_set1_epi32(4 * c as i32));
                    *q = _mm512_or_si512(*q, _mm512_permutexvar_epi32(bits, spread));
                }
            }
            let m = if kind == DotKind::Q4_1 {
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g)))
            } else {
                d
            };
            column(kind, &q, &neg, [d, d, m], &[x], b, &mut acc, &mut off);
        }
        let v = _mm512_fmadd_ps(_mm512_set1_ps(offset_factor(kind)), off[0], acc[0]);
        // SAFETY: 16 writable f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) };
        true
    }
}

/// The AVX2 kernel over the same layout: a row group is two halves of
/// eight rows, a 256-bit register a half (bytes `32 h .. 32 h + 32` of
/// each 64-byte part are half `h`'s), and `vpmaddubsw` (unsigned codes
/// times signed activation codes, pairs summed to i16) with `vpmaddwd`
/// (pairs of those to i32) stands in for `vpdpbusd`.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use core::arch::x86_64::*;

    /// Rows a register holds, a 32-bit lane each.
    const HALF: usize = GROUP / 2;

    /// Half `h`'s codes of a column in eight registers (register `c` lane
    /// `r`: codes `4 c .. 4 c + 4` of row `8 h + r`), unsigned but for
    /// Q8_0's.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn unpack<B: PackBlock>(col: &[u8], h: usize) -> [__m256i; 8] {
        let (extra, _) = column_offsets(B::KIND);
        let col = &col[..B::COLUMN_BYTES];
        let p = col.as_ptr();
        let mut q = [_mm256_setzero_si256(); 8];
        if B::KIND == DotKind::Q8_0 {
            for (c, q) in q.iter_mut().enumerate() {
                // SAFETY: a Q8_0 column holds 512 bytes of codes.
                *q = unsafe { _mm256_loadu_si256(p.add(64 * c + 32 * h).cast()) };
            }
            return q;
        }
        let low = _mm256_set1_epi8(0x0F);
        for part in 0..4 {
            // SAFETY: a column holds 256 bytes of nibbles, Q5_0's eight
            // masks of 8 bytes and Q6_K's two parts of 64 after them.
            let v = unsafe { _mm256_loadu_si256(p.add(64 * part + 32 * h).cast()) };
            q[2 * part] = _mm256_and_si256(v, low);
            q[2 * part + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
        }
        if B::KIND == DotKind::Q5_0 {
            // Byte `i` takes the mask's byte `i / 8` (the same four bytes
            // in each 128-bit lane) and tests its bit `i % 8`.
            let pick = _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            );
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
            let sixteen = _mm256_set1_epi8(16);
            for (c, q) in q.iter_mut().enumerate() {
                // SAFETY: as above; half `h`'s 32 bits of mask `c`.
                let m = unsafe { p.add(extra + 8 * c + 4 * h).cast::<i32>().read_unaligned() };
                let bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(m), pick), bit);
                let set = _mm256_cmpeq_epi8(bits, bit);
                *q = _mm256_or_si256(*q, _mm256_and_si256(set, sixteen));
            }
        }
        if B::KIND == DotKind::Q6K {
            let top = _mm256_set1_epi8(0x30);
            for part in 0..2 {
                // SAFETY: as above.
                let v = unsafe { _mm256_loadu_si256(p.add(extra + 64 * part + 32 * h).cast()) };
                // Bits 2k, 2k + 1 of each byte to bits 4, 5 (16-bit
                // shifts: the mask drops what crosses a byte).
                let t = [
                    _mm256_slli_epi16::<4>(v),
                    _mm256_slli_epi16::<2>(v),
                    v,
                    _mm256_srli_epi16::<2>(v),
                ];
                for (k, t) in t.into_iter().enumerate() {
                    let c = 4 * part + k;
                    q[c] = _mm256_or_si256(q[c], _mm256_and_si256(t, top));
                }
            }
        }
        q
    }

    /// Eight f16 at the start of `b`, widened.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn f16x8(b: &[u8]) -> __m256 {
        let b = &b[..2 * HALF];
        // SAFETY: 16 readable bytes.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().cast())) }
    }

    /// Eight bytes at the start of `b` (signed or not) as f32.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn bytes8(b: &[u8], signed: bool) -> __m256 {
        let b = &b[..HALF];
        // SAFETY: 8 readable bytes.
        let v = unsafe { _mm_loadl_epi64(b.as_ptr().cast()) };
        _mm256_cvtepi32_ps(if signed {
            _mm256_cvtepi8_epi32(v)
        } else {
            _mm256_cvtepu8_epi32(v)
        })
    }

    /// Half `h`'s multipliers of a column (as the AVX-512 kernel's
    /// `scales`), from the super-block's header `head`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn scales<B: PackBlock>(head: &[u8], col: &[u8], h: usize) -> [__m256; 3] {
        let (_, at) = column_offsets(B::KIND);
        let p = &col[at..];
        let (f, b) = (2 * HALF * h, HALF * h);
        match B::KIND {
            DotKind::Q4K => {
                let (d, dmin) = (f16x8(&head[f..]), f16x8(&head[2 * GROUP + f..]));
                let (sc, mn) = (bytes8(&p[b..], false), bytes8(&p[GROUP + b..], false));
                let a = _mm256_mul_ps(d, sc);
                [a, a, _mm256_mul_ps(dmin, mn)]
            }
            DotKind::Q6K => {
                let d = f16x8(&head[f..]);
                let (s0, s1) = (bytes8(&p[b..], true), bytes8(&p[GROUP + b..], true));
                [
                    _mm256_mul_ps(d, s0),
                    _mm256_mul_ps(d, s1),
                    _mm256_setzero_ps(),
                ]
            }
            DotKind::Q4_1 => {
                let d = f16x8(&p[f..]);
                [d, d, f16x8(&p[2 * GROUP + f..])]
            }
            _ => {
                let d = f16x8(&p[f..]);
                [d, d, d]
            }
        }
    }

    /// Column `b` of a half (`q` as [`unpack`] gives it, multipliers as
    /// [`scales`]) against `T` tokens, added to `acc` and `off` as the
    /// AVX-512 kernel's `column` does.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn column<const T: usize>(
        kind: DotKind,
        q: &[__m256i; 8],
        [a0, a1, m]: [__m256; 3],
        x: &[Token<'_>; T],
        b: usize,
        acc: &mut [__m256; T],
        off: &mut [__m256; T],
    ) {
        let ones = _mm256_set1_epi16(1);
        // Registers whose i16 pair sums are added before widening: none
        // can leave i16 (activation codes are within ±127): eight of 4-bit
        // codes (8 * 2 * 15 * 127 = 30480), four of Q5_0's (31496), two of
        // Q6_K's (32004), one of Q8_0's magnitudes (2 * 128 * 127 = 32512).
        let run = match kind {
            DotKind::Q8_0 => 1,
            DotKind::Q6K => 2,
            DotKind::Q5_0 => 4,
            _ => 8,
        };
        for t in 0..T {
            let xq: [i32; 8] = bytemuck::cast(x[t].blocks[b].qs);
            // The sums of the column's first 16 values (registers 0..4) and
            // of its last 16.
            let mut h = [_mm256_setzero_si256(); 2];
            for c0 in (0..8).step_by(run) {
                let mut s = _mm256_setzero_si256();
                for c in c0..c0 + run {
                    let xb = _mm256_set1_epi32(xq[c]);
                    let p = if kind == DotKind::Q8_0 {
                        // |w| times x with w's sign.
                        _mm256_maddubs_epi16(
                            _mm256_sign_epi8(q[c], q[c]),
                            _mm256_sign_epi8(xb, q[c]),
                        )
                    } else {
                        _mm256_maddubs_epi16(q[c], xb)
                    };
                    s = _mm256_add_epi16(s, p);
                }
                h[c0 / 4] = _mm256_add_epi32(h[c0 / 4], _mm256_madd_epi16(s, ones));
            }
            let sx = _mm256_set1_ps(x[t].scales[b]);
            if kind == DotKind::Q6K {
                let (f0, f1) = (_mm256_cvtepi32_ps(h[0]), _mm256_cvtepi32_ps(h[1]));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(a0, sx), f0, acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(a1, sx), f1, acc[t]);
                let u = &x[t].sums16[2 * b..2 * b + 2];
                off[t] = _mm256_fmadd_ps(a0, _mm256_set1_ps(u[0]), off[t]);
                off[t] = _mm256_fmadd_ps(a1, _mm256_set1_ps(u[1]), off[t]);
            } else {
                let dot = _mm256_cvtepi32_ps(_mm256_add_epi32(h[0], h[1]));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(a0, sx), dot, acc[t]);
                if kind != DotKind::Q8_0 {
                    off[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[t].sums[b]), off[t]);
                }
            }
        }
    }

    /// One row group against `T` tokens: per token the sixteen rows' sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn sums<B: PackBlock, const T: usize>(
        data: &[u8],
        x: [Token<'_>; T],
    ) -> [[f32; GROUP]; T] {
        let mut acc = [[_mm256_setzero_ps(); T]; 2];
        let mut off = [[_mm256_setzero_ps(); T]; 2];
        for (s, sup) in data.chunks_exact(super_bytes::<B>()).enumerate() {
            let (head, cols) = sup.split_at(B::HEADER);
            for (j, col) in cols.chunks_exact(B::COLUMN_BYTES).enumerate() {
                let b = columns::<B>() * s + j;
                for h in 0..2 {
                    let q = unpack::<B>(col, h);
                    let sc = scales::<B>(head, col, h);
                    column(B::KIND, &q, sc, &x, b, &mut acc[h], &mut off[h]);
                }
            }
        }
        let f = _mm256_set1_ps(offset_factor(B::KIND));
        let mut out = [[0.0f32; GROUP]; T];
        for (h, (acc, off)) in acc.iter().zip(&off).enumerate() {
            for (o, (&a, &m)) in out.iter_mut().zip(acc.iter().zip(off)) {
                let o = &mut o[HALF * h..HALF * h + HALF];
                // SAFETY: 8 writable f32.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_fmadd_ps(f, m, a)) };
            }
        }
        out
    }
}

/// Sixteen rows' dot products with the first token of a [`Q8Acts`], the
/// rows anywhere ([`gathered`](x86::gathered)); `false` (nothing written)
/// where it cannot take them (then a row at a time does).
pub(crate) type GroupDot<B> = fn(&[&[B]; GROUP], &Q8Acts, &mut [f32; GROUP]) -> bool;

/// The sixteen-row product for format `B` on `path`: the AVX-512 VNNI
/// path's for the 32-value formats, none elsewhere.
///
/// # Safety
/// `path` is what [`CpuBackend::qmatvec_path`] returned on this CPU.
pub(crate) unsafe fn group_dot_of<B: DotBlock>(path: QDotPath) -> Option<GroupDot<B>> {
    match path {
        #[cfg(target_arch = "x86_64")]
        QDotPath::Avx512Vnni if B::VALUES == 32 => Some(|rows, a, out| {
            // SAFETY: the caller's promise: AVX-512 F/BW/VL and VNNI, AVX2,
            // FMA and F16C were detected.
            unsafe { x86::gathered(rows, a.token(0), out) }
        }),
        _ => None,
    }
}

impl CpuBackend {
    /// [`CpuBackend::qmatvec`] over rows repacked by [`PackedRows::new`]:
    /// `y = x W^T`, `y` `[n, rows]` row-major for the `n` tokens of
    /// `acts`. The same products, summed in another order (each token's
    /// result is the same whatever the threading). The AVX-512 VNNI path
    /// ([`QDotPath::Avx512Vnni`]) is what the layout is for; the AVX2 path
    /// reads each 64-byte part as two registers of eight rows
    /// (`vpmaddubsw`, `vpmaddwd`; faster than `qmatvec` on a Zen 1 for
    /// every format but Q8_0); elsewhere portable code reads it (slower than
    /// `qmatvec` over GGUF's layout: do not repack there).
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
        // SAFETY: `qmatvec_path` detected what its path's kernels need.
        let k = unsafe { kernels::<B>(Self::qmatvec_path(self.isa)) };
        if n >= TOKEN_SPLIT {
            // Tasks of whole tokens (contiguous in y), each over every row
            // group: a group's columns stay in L1 while a task's tokens
            // pass, a tile at a time.
            let per_task = n.div_ceil(2 * self.threads()).next_multiple_of(TILE);
            self.for_chunks(y, per_task * rows, |i, out| {
                k.tokens(w, i * per_task, acts, out);
            });
            return Ok(());
        }
        let part = |first_group: usize, out: &mut [f32]| k.groups(w, first_group, acts, out);
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
