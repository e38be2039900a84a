//! The quantised matrix-vector product (GGUF weight blocks times Q8_0
//! activations) against an f64 reference over the same values, for every
//! ISA the machine has and every block format: proptest over shapes and
//! tokens, an edge table (with the extreme codes -128 and 127), and typed
//! errors for bad input.

use hgca_cpu::{CpuBackend, DotBlock, DotKind, PackBlock, PackedRows, Par, Q8Acts};
use hgca_kernels::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, Error, WeightElem, f16,
};
use hgca_testkit::Rng;
use hgca_testkit::ffn::TestWeight;
use proptest::prelude::*;

use crate::common::backend;

/// `y[t, r] = Σ_k w[r, k] x[t, k]` in f64 over the dequantised weights and
/// the dequantised activations, and `Σ_k |w[r, k] x[t, k]|` beside it.
fn reference<B: WeightElem>(w: &[B], rows: usize, acts: &Q8Acts) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (acts.tokens(), acts.width());
    let (mut wf, mut xf) = (vec![0.0f32; rows * k], vec![0.0f32; n * k]);
    B::dequant_slice(w, &mut wf);
    BlockQ8_0::dequant_slice(acts.blocks(), &mut xf);
    let (mut y, mut mag) = (vec![0.0; n * rows], vec![0.0; n * rows]);
    for t in 0..n {
        for r in 0..rows {
            let (wr, xt) = (&wf[r * k..(r + 1) * k], &xf[t * k..(t + 1) * k]);
            for (&a, &b) in wr.iter().zip(xt) {
                let p = f64::from(a) * f64::from(b);
                y[t * rows + r] += p;
                mag[t * rows + r] += p.abs();
            }
        }
    }
    (y, mag)
}

/// `Σ_k |o_k x[t, k]|` over the offset `o_k` the kernel subtracts apart
/// from the codes' products: Q4_1's block minimums, Q4_0's `8 d`, Q5_0's
/// `16 d`, Q4_K's sub-block minimums `dmin m_j`, Q6_K's `32 d sc_m` (0 for
/// Q8_0), laid
/// out like [`reference`]'s outputs.
fn min_magnitudes<B: DotBlock>(w: &[B], rows: usize, acts: &Q8Acts) -> Vec<f64> {
    let (n, k) = (acts.tokens(), acts.width());
    let nb = k / B::VALUES;
    let mut out = vec![0.0; n * rows];
    // Per value of a row: the offset's magnitude.
    let offsets = |row: &[B]| -> Vec<f64> {
        let mut o = vec![0.0; k];
        for (j, blk) in row.iter().enumerate() {
            let o = &mut o[j * B::VALUES..(j + 1) * B::VALUES];
            match B::KIND {
                DotKind::Q4_1 => {
                    let b: &BlockQ4_1 = bytemuck::cast_ref(blk);
                    o.fill(f64::from(b.m.to_f32()).abs());
                }
                // The SIMD paths take Q4_0's and Q5_0's codes unsigned,
                // with the offset `-8 d` or `-16 d` as a minimum.
                DotKind::Q4_0 => {
                    let b: &BlockQ4_0 = bytemuck::cast_ref(blk);
                    o.fill(8.0 * f64::from(b.d.to_f32()).abs());
                }
                DotKind::Q5_0 => {
                    let b: &BlockQ5_0 = bytemuck::cast_ref(blk);
                    o.fill(16.0 * f64::from(b.d.to_f32()).abs());
                }
                DotKind::Q4K => {
                    let b: &BlockQ4K = bytemuck::cast_ref(blk);
                    let (_, mn) = b.scales_mins();
                    for (i, v) in o.iter_mut().enumerate() {
                        *v = f64::from(b.dmin.to_f32()) * f64::from(mn[i / 32]);
                    }
                }
                DotKind::Q6K => {
                    let b: &BlockQ6K = bytemuck::cast_ref(blk);
                    for (i, v) in o.iter_mut().enumerate() {
                        *v = 32.0
                            * f64::from(b.d.to_f32()).abs()
                            * f64::from(b.scales[i / 16]).abs();
                    }
                }
                _ => {}
            }
        }
        o
    };
    let mut xf = vec![0.0f32; n * k];
    BlockQ8_0::dequant_slice(acts.blocks(), &mut xf);
    for r in 0..rows {
        let o = offsets(&w[r * nb..(r + 1) * nb]);
        for t in 0..n {
            out[t * rows + r] = o
                .iter()
                .zip(&xf[t * k..(t + 1) * k])
                .map(|(&o, &x)| o * f64::from(x).abs())
                .sum();
        }
    }
    out
}

/// Random weights (a few rows scaled far apart) and activations (one token
/// all zero when there are several: a zero scale), multiplied and checked.
fn case<B: DotBlock + TestWeight>(
    cpu: &CpuBackend,
    rows: usize,
    k: usize,
    n: usize,
    seed: u64,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let mut w = Vec::with_capacity(rows * k / B::VALUES);
    for r in 0..rows {
        let scale = if r % 5 == 3 { 1e-3 } else { 1.0 + r as f32 };
        let row: Vec<f32> = (0..k).map(|_| rng.sym() * scale).collect();
        w.extend(B::from_row(&row));
    }
    let x: Vec<f32> = (0..n * k)
        .map(|i| {
            if n > 1 && i / k == 1 {
                0.0
            } else {
                rng.sym() * 3.0
            }
        })
        .collect();
    check(cpu, &w, rows, &x, n, k)
}

fn check<B: DotBlock>(
    cpu: &CpuBackend,
    w: &[B],
    rows: usize,
    x: &[f32],
    n: usize,
    k: usize,
) -> Result<(), String> {
    let acts = Q8Acts::quantize(x, n, k).map_err(|e| e.to_string())?;
    let mut y = vec![f32::NAN; n * rows];
    cpu.qmatvec(w, rows, &acts, &mut y)
        .map_err(|e| e.to_string())?;
    compare(w, rows, &acts, &y, "qmatvec")?;
    compare(
        w,
        rows,
        &acts,
        &packed(cpu, w, rows, &acts)?,
        "qmatvec_packed",
    )
}

/// The formats through [`PackedRows`] and `qmatvec_packed`.
fn packed<B: DotBlock>(
    cpu: &CpuBackend,
    w: &[B],
    rows: usize,
    acts: &Q8Acts,
) -> Result<Vec<f32>, String> {
    fn run<P: PackBlock>(
        cpu: &CpuBackend,
        w: &[P],
        rows: usize,
        acts: &Q8Acts,
    ) -> Result<Vec<f32>, String> {
        let p = PackedRows::new(w, rows, acts.width()).map_err(|e| e.to_string())?;
        let mut y = vec![f32::NAN; acts.tokens() * rows];
        cpu.qmatvec_packed(&p, acts, &mut y)
            .map_err(|e| e.to_string())?;
        Ok(y)
    }
    match B::KIND {
        DotKind::Q4_0 => run::<BlockQ4_0>(cpu, bytemuck::cast_slice(w), rows, acts),
        DotKind::Q4_1 => run::<BlockQ4_1>(cpu, bytemuck::cast_slice(w), rows, acts),
        DotKind::Q5_0 => run::<BlockQ5_0>(cpu, bytemuck::cast_slice(w), rows, acts),
        DotKind::Q8_0 => run::<BlockQ8_0>(cpu, bytemuck::cast_slice(w), rows, acts),
        DotKind::Q4K => run::<BlockQ4K>(cpu, bytemuck::cast_slice(w), rows, acts),
        DotKind::Q6K => run::<BlockQ6K>(cpu, bytemuck::cast_slice(w), rows, acts),
    }
}

/// `y` (from `what`) against the reference.
fn compare<B: DotBlock>(
    w: &[B],
    rows: usize,
    acts: &Q8Acts,
    y: &[f32],
    what: &str,
) -> Result<(), String> {
    let (n, k) = (acts.tokens(), acts.width());
    let (want, mag) = reference(w, rows, acts);
    // Per block a rounded scale product and a fused add, and for Q4_1 a
    // second fused add of its minimum's term: at most 2 (blocks + 2)
    // roundings of f32, relative to the magnitudes of the terms added
    // (Q4_1's `d q x` and `m x` may each exceed `|w x|`: |d q x| <= |w x| +
    // |m x|, so the terms are bounded by mag + 2 Σ|m x|).
    let tol = 2.0 * (k / 32 + 2) as f64 * f64::from(f32::EPSILON);
    let mins = min_magnitudes(w, rows, acts);
    for (i, ((&g, &e), &m)) in y.iter().zip(&want).zip(&mag).enumerate() {
        let bound = tol * (m + 2.0 * mins[i]) + 1e-30;
        // NaN (an output left unwritten) fails too.
        let err = (f64::from(g) - e).abs();
        if err.is_nan() || err > bound {
            return Err(format!(
                "{what} {}: rows {rows} k {k} n {n}: y[{}, {}] = {g}, reference {e} (magnitude {m})",
                B::NAME,
                i / rows,
                i % rows
            ));
        }
    }
    Ok(())
}

/// Every format whose block divides `k`.
fn all_formats(cpu: &CpuBackend, rows: usize, k: usize, n: usize, seed: u64) -> Result<(), String> {
    case::<BlockQ4_0>(cpu, rows, k, n, seed)?;
    case::<BlockQ4_1>(cpu, rows, k, n, seed)?;
    case::<BlockQ5_0>(cpu, rows, k, n, seed)?;
    case::<BlockQ8_0>(cpu, rows, k, n, seed)?;
    if k.is_multiple_of(256) {
        case::<BlockQ4K>(cpu, rows, k, n, seed)?;
        case::<BlockQ6K>(cpu, rows, k, n, seed)?;
    }
    Ok(())
}

/// (rows, k, tokens): one row, one block, rows around the 64-row unit of
/// work, a long row, several tokens (whole tiles of four and parts).
const EDGE: &[(usize, usize, usize)] = &[
    (1, 32, 1),
    (3, 64, 2),
    (63, 32, 1),
    (64, 96, 3),
    (65, 32, 1),
    (130, 128, 2),
    (7, 2048, 1),
    (200, 64, 5),
    (1, 256, 1),
    (65, 512, 2),
    (3, 4864, 1),
    (130, 1024, 3),
    // Token tiles of four and what is left over.
    (33, 96, 9),
    (17, 64, 4),
    // Prefill chunks: tasks of tokens.
    (19, 64, 16),
    (40, 160, 37),
];

/// Q8_0 weights at the ends of their code range (-128 is a valid code in a
/// file though the quantiser never writes it) against activations at
/// theirs: the products the byte multiply pairs up must not saturate.
fn extreme_codes(cpu: &CpuBackend) {
    let lo = BlockQ8_0 {
        d: hgca_kernels::f16::from_f32(0.5),
        qs: [-128; 32],
    };
    let hi = BlockQ8_0 {
        d: hgca_kernels::f16::from_f32(0.25),
        qs: [127; 32],
    };
    let w = [lo, hi, hi, lo];
    for x in [[1.0f32; 64], [-1.0; 64]] {
        check(cpu, &w, 2, &x, 1, 64).unwrap();
    }
    let mut mixed = [1.0f32; 64];
    mixed.iter_mut().step_by(2).for_each(|v| *v = -1.0);
    check(cpu, &w, 2, &mixed, 1, 64).unwrap();

    // The other 32-value formats' largest codes (Q4_0 and Q4_1 15, Q5_0 31)
    // against activations at the top of their range: the AVX2 kernel's
    // i16 sums of eight registers (four for Q5_0) reach 30480 (31496) here
    // and must not saturate.
    let q4_0 = BlockQ4_0 {
        d: f16::from_f32(0.5),
        qs: [0xFF; 16],
    };
    let q4_1 = BlockQ4_1 {
        d: f16::from_f32(0.5),
        m: f16::from_f32(-3.0),
        qs: [0xFF; 16],
    };
    let q5_0 = BlockQ5_0 {
        d: f16::from_f32(0.25),
        qh: [0xFF; 4],
        qs: [0xFF; 16],
    };
    for x in [[1.0f32; 64], [-1.0; 64], mixed] {
        check(cpu, &[q4_0; 4], 2, &x, 1, 64).unwrap();
        check(cpu, &[q4_1; 4], 2, &x, 1, 64).unwrap();
        check(cpu, &[q5_0; 4], 2, &x, 1, 64).unwrap();
    }

    // The K formats' largest codes (Q4_K 15 with 6-bit scale and min 63;
    // Q6_K 63 with sub-block scales -128 and 127) against activations of
    // either sign at the top of their range: products of the unsigned
    // codes with activation codes must neither saturate nor overflow.
    let q4k = BlockQ4K {
        d: f16::from_f32(0.5),
        dmin: f16::from_f32(0.25),
        scales: [0xFF; 12],
        qs: [0xFF; 128],
    };
    let q6k = BlockQ6K {
        ql: [0xFF; 128],
        qh: [0xFF; 64],
        scales: core::array::from_fn(|i| if i % 3 == 0 { -128 } else { 127 }),
        d: f16::from_f32(0.125),
    };
    let mut signs = [1.0f32; 512];
    signs
        .iter_mut()
        .skip(16)
        .step_by(32)
        .for_each(|v| *v = -1.0);
    for x in [[1.0f32; 512], [-1.0; 512], signs] {
        check(cpu, &[q4k; 4], 2, &x, 1, 512).unwrap();
        check(cpu, &[q6k; 4], 2, &x, 1, 512).unwrap();
    }
}

/// The suites' bodies, compiled once: each ISA's module (below) runs
/// them with its kind (expanded per ISA, the proptests were most of
/// this binary's build).
mod suite {
    use super::*;
    use hgca_cpu::IsaKind;

    pub fn qmatvec_k_formats_match_the_reference(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 48, ..ProptestConfig::default() }, |(
            rows in 1usize..150,
            blocks in 1usize..5,
            n in 1usize..4,
            seed in any::<u64>(),
        )| {
            for par in [Par::Seq, Par::Rayon(3)] {
                if let Some(b) = backend(isa, par) {
                    let (k, mut r) = (256 * blocks, Ok(()));
                    r = r.and_then(|()| case::<BlockQ4K>(&b, rows, k, n, seed));
                    r = r.and_then(|()| case::<BlockQ6K>(&b, rows, k, n, seed));
                    prop_assert!(r.is_ok(), "{par:?}: {}", r.unwrap_err());
                }
            }
        });
    }

    pub fn qmatvec_matches_the_reference(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 48, ..ProptestConfig::default() }, |(
            rows in 1usize..150,
            blocks in 1usize..12,
            n in 1usize..5,
            seed in any::<u64>(),
        )| {
            for par in [Par::Seq, Par::Rayon(3)] {
                if let Some(b) = backend(isa, par) {
                    let r = all_formats(&b, rows, 32 * blocks, n, seed);
                    prop_assert!(r.is_ok(), "{par:?}: {}", r.unwrap_err());
                }
            }
        });
    }

    /// Prefill-sized calls (the packed kernel's token tiles of
    /// four and, from 16 tokens, its tasks of tokens), on
    /// small matrices of the 32-value formats.
    pub fn qmatvec_of_many_tokens_matches_the_reference(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 12, ..ProptestConfig::default() }, |(
            rows in 1usize..40,
            blocks in 1usize..4,
            n in 5usize..40,
            seed in any::<u64>(),
        )| {
            for par in [Par::Seq, Par::Rayon(3)] {
                if let Some(b) = backend(isa, par) {
                    let r = all_formats(&b, rows, 32 * blocks, n, seed);
                    prop_assert!(r.is_ok(), "{par:?}: {}", r.unwrap_err());
                }
            }
        });
    }

    pub fn edge_table(isa: IsaKind) {
        for par in [Par::Seq, Par::Rayon(2)] {
            let Some(b) = backend(isa, par) else { return };
            for (i, &(rows, k, n)) in EDGE.iter().enumerate() {
                all_formats(&b, rows, k, n, i as u64).unwrap_or_else(|e| panic!("{par:?}: {e}"));
            }
            extreme_codes(&b);
        }
    }
}

macro_rules! isa_suite {
    ($name:ident, $kind:expr) => {
        mod $name {
            use hgca_cpu::IsaKind;
            const KIND: IsaKind = $kind;

            #[test]
            fn qmatvec_k_formats_match_the_reference() {
                super::suite::qmatvec_k_formats_match_the_reference(KIND)
            }
            #[test]
            fn qmatvec_matches_the_reference() {
                super::suite::qmatvec_matches_the_reference(KIND)
            }
            #[test]
            fn qmatvec_of_many_tokens_matches_the_reference() {
                super::suite::qmatvec_of_many_tokens_matches_the_reference(KIND)
            }
            #[test]
            fn edge_table() {
                super::suite::edge_table(KIND)
            }
        }
    };
}

every_isa!(isa_suite);

#[test]
fn bad_input_is_a_typed_error_and_writes_nothing() {
    assert!(matches!(
        Q8Acts::quantize(&[0.0; 48], 1, 48),
        Err(Error::Param { .. })
    ));
    assert!(matches!(
        Q8Acts::quantize(&[0.0; 64], 2, 64),
        Err(Error::Length { .. })
    ));
    let cpu = CpuBackend::new();
    let acts = Q8Acts::quantize(&[1.0; 64], 1, 64).unwrap();
    let w = vec![BlockQ8_0::quantize(&[1.0; 32]); 6];
    let mut y = [f32::NAN; 3];
    // 6 blocks are 3 rows of 64 values, not 2 or 4.
    for rows in [2, 4] {
        let r = cpu.qmatvec(&w, rows, &acts, &mut y[..rows.min(3)]);
        assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
    }
    let r = cpu.qmatvec(&w, 3, &acts, &mut y[..2]);
    assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
    assert!(y.iter().all(|v| v.is_nan()));
    // A K format needs whole 256-value blocks along the row.
    let k = vec![BlockQ4K::quantize(&[1.0; 256]); 1];
    let r = cpu.qmatvec(&k, 1, &acts, &mut y[..1]);
    assert!(matches!(r, Err(Error::Param { .. })), "{r:?}");
    assert!(y.iter().all(|v| v.is_nan()));
    // Nothing to do is not an error; an empty inner dimension gives zeros.
    let none = Q8Acts::quantize(&[], 0, 64).unwrap();
    cpu.qmatvec(&w, 3, &none, &mut []).unwrap();
    let empty = Q8Acts::quantize(&[], 2, 0).unwrap();
    let mut z = [f32::NAN; 6];
    cpu.qmatvec::<BlockQ8_0>(&[], 3, &empty, &mut z).unwrap();
    assert_eq!(z, [0.0; 6]);
}

#[test]
fn packed_rows_reject_bad_input_with_typed_errors() {
    let w = vec![BlockQ5_0::quantize(&[1.0; 32]); 6];
    // 6 blocks are 3 rows of 64 values, not 2 or 4; 48 is no whole block.
    for (rows, k) in [(2, 64), (4, 64)] {
        let r = PackedRows::new(&w, rows, k);
        assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
    }
    let r = PackedRows::new(&w, 4, 48);
    assert!(matches!(r, Err(Error::Param { .. })), "{r:?}");
    // A K format needs whole 256-value super-blocks along the row.
    let k = vec![BlockQ6K::quantize(&[1.0; 256]); 1];
    let r = PackedRows::new(&k, 4, 64);
    assert!(matches!(r, Err(Error::Param { .. })), "{r:?}");
    let p = PackedRows::new(&w, 3, 64).unwrap();
    assert_eq!((p.rows(), p.width()), (3, 64));
    let cpu = CpuBackend::new();
    let mut y = [f32::NAN; 4];
    let narrow = Q8Acts::quantize(&[1.0; 32], 1, 32).unwrap();
    let r = cpu.qmatvec_packed(&p, &narrow, &mut y[..3]);
    assert!(matches!(r, Err(Error::Param { .. })), "{r:?}");
    let acts = Q8Acts::quantize(&[1.0; 64], 1, 64).unwrap();
    for len in [2, 4] {
        let r = cpu.qmatvec_packed(&p, &acts, &mut y[..len]);
        assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
    }
    assert!(y.iter().all(|v| v.is_nan()));
    // Row r of the 16-row group holds r's blocks, whatever its neighbours.
    let rows: Vec<BlockQ5_0> = (0..17)
        .flat_map(|r| [BlockQ5_0::quantize(&[r as f32 - 8.0; 32]); 2])
        .collect();
    let p = PackedRows::new(&rows, 17, 64).unwrap();
    // 127 quantises exactly (scale 1, code 127), as r - 8 does in Q5_0.
    let exact = Q8Acts::quantize(&[127.0; 64], 1, 64).unwrap();
    let mut y = [0.0f32; 17];
    cpu.qmatvec_packed(&p, &exact, &mut y).unwrap();
    for (r, &v) in y.iter().enumerate() {
        assert_eq!(v, 64.0 * 127.0 * (r as f32 - 8.0), "row {r}");
    }
}

/// The kernel `qmatvec` runs on each ISA the library detects follows
/// /proc/cpuinfo's flags, read independently of the library's detection:
/// on a machine with AVX-512 VNNI the V4 suite above checks the VNNI path,
/// the V3 suite the AVX2 path.
#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn path_follows_proc_cpuinfo() {
    use hgca_cpu::{Isa, IsaKind, QDotPath};
    let Some(flags) = hgca_testkit::require::cpuinfo_flags() else {
        return;
    };
    let vnni = flags.contains("avx512_vnni");
    for isa in Isa::available() {
        let want = match isa.kind() {
            IsaKind::V4 if vnni => QDotPath::Avx512Vnni,
            IsaKind::V3 | IsaKind::V4 => QDotPath::Avx2,
            _ => QDotPath::Portable,
        };
        assert_eq!(CpuBackend::qmatvec_path(isa), want, "{isa}");
        eprintln!("qmatvec on {isa}: {want:?}");
    }
}
