//! The conformance suite of the CPU backend, instantiated for every ISA the
//! machine has (and for sequential and threaded runs), against hgca-ref.

use hgca_cpu::{CpuBackend, IsaKind, Par};
use hgca_kernels::{
    AttnShape, DType, Error, KvElem, KvSource, KvStore, Partial, PartialLayout, Selection,
    SparseAttention, bf16, f16,
};
use hgca_testkit::stress::within_secs;
use hgca_testkit::{
    EDGE_SHAPES, Problem, Rng, Tolerance, arb_shape, arb_spread, check_rows,
    conformance::{check_dense, check_merge_partition, check_sparse, random_sets},
};
use proptest::prelude::*;

#[path = "conformance/paged.rs"]
mod paged;

use crate::common::{Threads, backend};

fn selection(rng: &mut Rng, kv_heads: usize, tokens: usize) -> Selection {
    let sets = random_sets(rng, kv_heads, tokens);
    let mut sel = Selection::new();
    for s in sets {
        // Shuffled order: the kernel must not rely on sorted indices.
        let mut s: Vec<u32> = s.into_iter().map(|j| j as u32).collect();
        for i in (1..s.len()).rev() {
            s.swap(i, rng.below(i + 1));
        }
        sel.push_head(s);
    }
    sel
}

fn sparse_case(
    b: &CpuBackend,
    dtype: DType,
    shape: AttnShape,
    tokens: usize,
    spread: f32,
    seed: u64,
) -> Result<(), String> {
    fn go<T: KvElem>(
        b: &CpuBackend,
        shape: AttnShape,
        tokens: usize,
        spread: f32,
        seed: u64,
    ) -> Result<(), String> {
        let p = Problem::<T>::random(shape, tokens, spread, seed);
        let sel = selection(&mut Rng::new(seed ^ 0x5E1), shape.kv_heads(), tokens);
        check_sparse(b, &p, &sel)
    }
    match dtype {
        DType::F32 => go::<f32>(b, shape, tokens, spread, seed),
        DType::F16 => go::<f16>(b, shape, tokens, spread, seed),
        DType::BF16 => go::<bf16>(b, shape, tokens, spread, seed),
    }
}

/// Dense decode over all tokens equals sparse over all tokens equals the reference; weights too.
fn dense_all_case<T: KvElem>(
    b: &CpuBackend,
    shape: AttnShape,
    tokens: usize,
    spread: f32,
    seed: u64,
) -> Result<(), String> {
    let p = Problem::<T>::random(shape, tokens, spread, seed);
    let layout = PartialLayout::decode(&shape);
    let mut dense = Partial::poisoned(layout);
    let mut w = vec![f32::NAN; shape.q_heads() * tokens];
    b.dense_decode(&shape, &p.q, &p.kv(), dense.as_mut(), Some(&mut w))
        .map_err(|e| e.to_string())?;
    let all: Vec<Vec<usize>> = vec![(0..tokens).collect(); shape.kv_heads()];
    check_rows(
        layout,
        dense.out(),
        dense.lse(),
        &p.reference(&all),
        p.vmax,
        Tolerance::of(T::DTYPE),
    )?;
    let mut sparse = Partial::poisoned(layout);
    let mut ws = vec![f32::NAN; shape.q_heads() * tokens];
    b.sparse_decode(
        &shape,
        &p.q,
        &p.kv(),
        &Selection::all(shape.kv_heads(), tokens),
        sparse.as_mut(),
        Some(&mut ws),
    )
    .map_err(|e| e.to_string())?;
    if dense != sparse || w != ws {
        return Err("dense and all-selected sparse differ".into());
    }
    Ok(())
}

/// Causal append against the reference: query i sees tokens
/// 0..visible0+i, or with a sliding `window` only the last `window` of
/// them. From `MIN_QUERIES` (8) queries the backend takes the tiled prefill
/// kernel, below it the decode kernel per query: the cases cover both,
/// every KV dtype, and a first query that sees `lag` fewer tokens than the
/// chunk's own (a window's view).
fn append_case(
    b: &CpuBackend,
    dtype: DType,
    shape: AttnShape,
    tokens: usize,
    n_q: usize,
    seed: u64,
) -> Result<(), String> {
    append_window_case(b, dtype, shape, tokens, n_q, None, seed)
}

/// [`append_case`] with an optional sliding window.
fn append_window_case(
    b: &CpuBackend,
    dtype: DType,
    shape: AttnShape,
    tokens: usize,
    n_q: usize,
    window: Option<usize>,
    seed: u64,
) -> Result<(), String> {
    fn go<T: KvElem>(
        b: &CpuBackend,
        shape: AttnShape,
        tokens: usize,
        n_q: usize,
        window: Option<usize>,
        seed: u64,
    ) -> Result<(), String> {
        let p = Problem::<T>::random(shape, tokens, 10.0, seed);
        let mut rng = Rng::new(seed);
        let q: Vec<f32> = (0..n_q * shape.q_len()).map(|_| 2.0 * rng.sym()).collect();
        // Usually the chunk's own tokens are the last n_q; sometimes the
        // first query sees fewer (down to none) or all of them.
        let visible0 = match seed % 4 {
            0 => rng.below(tokens + 1),
            _ => tokens.saturating_sub(n_q) + 1,
        };
        let layout = PartialLayout::append(&shape, n_q);
        let mut out = Partial::poisoned(layout);
        match window {
            None => b.dense_append(&shape, &q, n_q, visible0, &p.kv(), out.as_mut()),
            Some(w) => b.dense_append_window(&shape, &q, n_q, visible0, w, &p.kv(), out.as_mut()),
        }
        .map_err(|e| e.to_string())?;
        let mut want = Vec::new();
        for i in 0..n_q {
            let end = (visible0 + i).min(tokens);
            let start = window.map_or(0, |w| end.saturating_sub(w));
            let sets = vec![(start..end).collect::<Vec<_>>(); shape.kv_heads()];
            let s = &shape;
            want.extend(hgca_ref::attend(
                &q[i * s.q_len()..(i + 1) * s.q_len()],
                &p.k32,
                &p.v32,
                s.q_heads(),
                s.kv_heads(),
                s.head_dim(),
                tokens,
                s.scale() as f64,
                &sets,
            ));
        }
        check_rows(
            layout,
            out.out(),
            out.lse(),
            &want,
            p.vmax,
            Tolerance::of(T::DTYPE),
        )
    }
    match dtype {
        DType::F32 => go::<f32>(b, shape, tokens, n_q, window, seed),
        DType::F16 => go::<f16>(b, shape, tokens, n_q, window, seed),
        DType::BF16 => go::<bf16>(b, shape, tokens, n_q, window, seed),
    }
}

/// The fused threshold form selects exactly `maw > t` and equals the list form.
fn threshold_case(
    b: &CpuBackend,
    shape: AttnShape,
    tokens: usize,
    seed: u64,
) -> Result<(), String> {
    let p = Problem::<bf16>::random(shape, tokens, 5.0, seed);
    let mut rng = Rng::new(seed);
    let maw: Vec<f32> = (0..shape.kv_heads() * tokens)
        .map(|_| rng.sym().abs())
        .collect();
    let t: Vec<f32> = (0..shape.kv_heads())
        .map(|_| [0.0, 0.5, 0.9, 2.0][rng.below(4)])
        .collect();
    let layout = PartialLayout::decode(&shape);
    let mut out = Partial::poisoned(layout);
    let mut chosen = Selection::new();
    b.sparse_decode_threshold(&shape, &p.q, &p.kv(), &maw, &t, out.as_mut(), &mut chosen)
        .map_err(|e| e.to_string())?;
    let want_sel = Selection::from_heads(
        &(0..shape.kv_heads())
            .map(|g| {
                (0..tokens as u32)
                    .filter(|&j| maw[g * tokens + j as usize] > t[g])
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>(),
    );
    if chosen != want_sel {
        return Err(format!(
            "threshold selection differs: {chosen:?} vs {want_sel:?}"
        ));
    }
    let sets: Vec<Vec<usize>> = (0..shape.kv_heads())
        .map(|g| want_sel.head(g).iter().map(|&j| j as usize).collect())
        .collect();
    check_rows(
        layout,
        out.out(),
        out.lse(),
        &p.reference(&sets),
        p.vmax,
        Tolerance::of(DType::BF16),
    )
}

/// A NaN in one key of KV head 1: every query head of that group gets a
/// NaN output and lse when the token is attended (sparse and dense), and
/// nothing changes when it is not; the other group stays exact.
fn nan_case(b: &CpuBackend) {
    let shape = AttnShape::new(8, 2, 20).unwrap();
    let tokens = 70;
    let mut p = Problem::<f32>::random(shape, tokens, 2.0, 11);
    let clean = Problem::<f32>::random(shape, tokens, 2.0, 11);
    let bad = tokens * 20 + 7 * 20 + 3; // KV head 1, token 7, element 3
    p.k[bad] = f32::NAN;
    let layout = PartialLayout::decode(&shape);
    let all = Selection::all(2, tokens);
    let without: Vec<u32> = (0..tokens as u32).filter(|&j| j != 7).collect();
    let skip = Selection::from_heads(&[(0..tokens as u32).collect(), without.clone()]);
    let clean_skip = Selection::from_heads(&[(0..tokens as u32).collect(), without]);
    let mut out = Partial::poisoned(layout);
    let mut reference = Partial::poisoned(layout);
    for dense in [false, true] {
        if dense {
            b.dense_decode(&shape, &p.q, &p.kv(), out.as_mut(), None)
                .unwrap();
        } else {
            b.sparse_decode(&shape, &p.q, &p.kv(), &all, out.as_mut(), None)
                .unwrap();
        }
        b.sparse_decode(
            &shape,
            &clean.q,
            &clean.kv(),
            &all,
            reference.as_mut(),
            None,
        )
        .unwrap();
        for h in 0..8 {
            let row = &out.out()[h * 20..(h + 1) * 20];
            if h < 4 {
                assert_eq!(row, &reference.out()[h * 20..(h + 1) * 20], "head {h}");
                assert_eq!(out.lse()[h], reference.lse()[h]);
            } else {
                assert!(
                    row.iter().all(|x| x.is_nan()),
                    "dense {dense} head {h}: {row:?}"
                );
                assert!(out.lse()[h].is_nan(), "dense {dense} head {h}");
            }
        }
    }
    b.sparse_decode(&shape, &p.q, &p.kv(), &skip, out.as_mut(), None)
        .unwrap();
    b.sparse_decode(
        &shape,
        &clean.q,
        &clean.kv(),
        &clean_skip,
        reference.as_mut(),
        None,
    )
    .unwrap();
    assert_eq!(out.out(), reference.out());
    assert_eq!(out.lse(), reference.lse());
}

/// The MAW scan: the indices of the values above a threshold, in order, as
/// a plain filter finds them (NaN never passes; lengths around the lanes).
fn above_case(b: &CpuBackend, len: usize, threshold: f32, seed: u64) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let values: Vec<f32> = (0..len)
        .map(|_| match rng.below(20) {
            0 => f32::NAN,
            1 => threshold,
            _ => rng.sym(),
        })
        .collect();
    let mut got = vec![u32::MAX];
    b.indices_above(&values, threshold, 1000, &mut got);
    let want: Vec<u32> = std::iter::once(u32::MAX)
        .chain(
            (0..len)
                .filter(|&i| values[i] > threshold)
                .map(|i| 1000 + i as u32),
        )
        .collect();
    if got == want {
        Ok(())
    } else {
        Err(format!("len {len} t {threshold}: {got:?} != {want:?}"))
    }
}

/// The MAW update, contiguous and gathered: every entry is the formula in
/// f64 up to f32 rounding, entries outside the gathered set keep their
/// bits, and the weight rows are read at their stride (lengths around the
/// lanes, 0 to 5 rows).
fn decay_case(
    b: &CpuBackend,
    len: usize,
    rows: usize,
    gather: bool,
    seed: u64,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let n_avg = if gather { len + rng.below(40) } else { len };
    let stride = len + rng.below(5);
    let avg0: Vec<f32> = (0..n_avg).map(|_| rng.sym().abs()).collect();
    let w: Vec<f32> = (0..rows.max(1) * stride).map(|_| rng.sym().abs()).collect();
    let c: Vec<f32> = (0..rows).map(|_| rng.sym()).collect();
    let a = rng.sym().abs();
    // A random distinct subset of 0..n_avg, shuffled.
    let mut all: Vec<u32> = (0..n_avg as u32).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i + 1));
    }
    let idx = &all[..len];
    let mut got = avg0.clone();
    b.decay_accumulate(&mut got, gather.then_some(idx), a, &w, stride, &c)
        .map_err(|e| e.to_string())?;
    let mut want: Vec<f64> = avg0.iter().map(|&x| f64::from(x)).collect();
    let mut touched = vec![false; n_avg];
    for k in 0..len {
        let j = if gather { idx[k] as usize } else { k };
        touched[j] = true;
        want[j] = f64::from(a) * want[j]
            + (0..rows)
                .map(|i| f64::from(c[i]) * f64::from(w[i * stride + k]))
                .sum::<f64>();
    }
    for j in 0..n_avg {
        let ok = if touched[j] {
            (f64::from(got[j]) - want[j]).abs() <= 1e-6 * (1.0 + rows as f64)
        } else {
            got[j].to_bits() == avg0[j].to_bits()
        };
        if !ok {
            return Err(format!(
                "len {len} rows {rows} gather {gather}: [{j}] {} vs {}",
                got[j], want[j]
            ));
        }
    }
    Ok(())
}

/// Quest block bounds kept in the KV dtype: each bound is at least the
/// score of every key of its block, and it is the bound formula (computed
/// in f64) up to f32 rounding.
fn bounds_case<T: KvElem>(
    b: &CpuBackend,
    heads: usize,
    d: usize,
    blocks: usize,
    seed: u64,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let per = 1 + rng.below(9);
    let keys: Vec<T> = (0..blocks * per * d)
        .map(|_| T::from_f32(4.0 * rng.sym()))
        .collect();
    let q: Vec<f32> = (0..heads * d).map(|_| 2.0 * rng.sym()).collect();
    let mut bounds = Vec::with_capacity(blocks * 2 * d);
    for blk in keys.chunks(per * d) {
        for pick in [f32::min, f32::max] {
            bounds.extend(
                (0..d).map(|i| {
                    T::from_f32(blk.chunks(d).map(|k| k[i].to_f32()).reduce(pick).unwrap())
                }),
            );
        }
    }
    let mut out = vec![f32::NAN; blocks * heads];
    b.block_upper_bounds(&q, heads, d, &bounds, &mut out)
        .map_err(|e| e.to_string())?;
    for blk in 0..blocks {
        let (lo, hi) = bounds[blk * 2 * d..(blk + 1) * 2 * d].split_at(d);
        for h in 0..heads {
            let qh = &q[h * d..(h + 1) * d];
            let (mut exact, mut scale) = (0.0f64, 0.0f64);
            for i in 0..d {
                let (a, c) = (
                    f64::from(qh[i]) * f64::from(lo[i].to_f32()),
                    f64::from(qh[i]) * f64::from(hi[i].to_f32()),
                );
                exact += a.max(c);
                scale += a.abs().max(c.abs());
            }
            let got = f64::from(out[blk * heads + h]);
            let tol = 1e-5 * scale + 1e-30;
            if (got - exact).abs() > tol {
                return Err(format!("block {blk} head {h}: {got} vs {exact}"));
            }
            for k in keys[blk * per * d..(blk + 1) * per * d].chunks(d) {
                let dot: f64 = qh
                    .iter()
                    .zip(k)
                    .map(|(&x, y)| f64::from(x) * f64::from(y.to_f32()))
                    .sum();
                if dot > got + tol {
                    return Err(format!(
                        "block {blk} head {h}: key score {dot} above bound {got}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The int8 and int4 score estimates: against the formula in f64 over the
/// same codes (an exact integer dot product, so only f32 rounding differs),
/// and within the quantisation bound of the exact score; rows holding an
/// infinity or a NaN give `+inf`.
fn quant_case(b: &CpuBackend, heads: usize, d: usize, n: usize, seed: u64) -> Result<(), String> {
    codes_case(b, heads, d, n, seed, 8)?;
    codes_case(b, heads, d, n, seed, 4)
}

fn codes_case(
    b: &CpuBackend,
    heads: usize,
    d: usize,
    n: usize,
    seed: u64,
    bits: u8,
) -> Result<(), String> {
    use hgca_cpu::{INT8_TILE, Int4Keys, Int8Keys};
    let mut rng = Rng::new(seed);
    let (mut k8, mut k4) = (Int8Keys::new(d), Int4Keys::new(d));
    let mut rows = Vec::new();
    for j in 0..n {
        let mut k: Vec<f32> = (0..d).map(|_| 3.0 * rng.sym()).collect();
        if j % 13 == 5 {
            k[j % d] = if j % 2 == 0 { f32::INFINITY } else { f32::NAN };
        }
        if j % 17 == 3 {
            k.fill(0.0);
        }
        k8.push(&k);
        k4.push(&k);
        rows.push(k);
    }
    let q: Vec<f32> = (0..heads * d).map(|_| 2.0 * rng.sym()).collect();
    let off: Vec<f32> = (0..heads).map(|_| 5.0 * rng.sym()).collect();
    let mut out = vec![f32::NAN; n];
    let tile = INT8_TILE;
    let (scales, top): (&[f32], f64) = if bits == 8 {
        b.int8_max_scores(&q, &off, d, k8.codes(), k8.scales(), &mut out)
            .map_err(|e| e.to_string())?;
        (k8.scales(), 127.0)
    } else {
        b.int4_max_scores(&q, &off, d, k4.codes(), k4.scales(), &mut out)
            .map_err(|e| e.to_string())?;
        (k4.scales(), 7.0)
    };
    for (j, k) in rows.iter().enumerate() {
        let sc = scales[j];
        if k.iter().any(|x| !x.is_finite()) {
            if out[j] != f32::INFINITY {
                return Err(format!(
                    "int{bits}: row {j} holds a non-finite key: {} (want +inf)",
                    out[j]
                ));
            }
            continue;
        }
        let code = |i: usize| {
            f64::from(if bits == 8 {
                k8.codes()[(j / tile) * tile * d + i * tile + j % tile]
            } else {
                k4.code(j, i)
            })
        };
        let (mut want, mut exact, mut slack) = (f64::NEG_INFINITY, f64::NEG_INFINITY, 0.0f64);
        for h in 0..heads {
            let qh = &q[h * d..(h + 1) * d];
            let l1: f64 = qh.iter().map(|x| f64::from(x.abs())).sum();
            let e: f64 = (0..d).map(|i| f64::from(qh[i]) * f64::from(k[i])).sum();
            exact = exact.max(e - f64::from(off[h]));
            if bits == 8 {
                let dot: f64 = (0..d).map(|i| f64::from(qh[i]) * code(i)).sum();
                want = want.max(dot * f64::from(sc) - f64::from(off[h]));
                slack = slack.max(l1 * f64::from(sc) / 2.0);
            } else {
                // The int4 kernel's integer dot: the query row quantised to
                // int8 first, its rounding added to the bound.
                let mut qc = vec![0i8; d];
                let qs = f64::from(hgca_cpu::quantize_i8(qh, &mut qc));
                let dot: f64 = (0..d).map(|i| f64::from(qc[i]) * code(i)).sum();
                want = want.max(dot * qs * f64::from(sc) - f64::from(off[h]));
                let k1: f64 = k.iter().map(|x| f64::from(x.abs())).sum();
                let bound =
                    l1 * f64::from(sc) / 2.0 + qs * (k1 + d as f64 * f64::from(sc) / 2.0) / 2.0;
                slack = slack.max(bound);
            }
        }
        let got = f64::from(out[j]);
        let mag: f64 = (0..heads)
            .map(|h| {
                let l1: f64 = q[h * d..(h + 1) * d]
                    .iter()
                    .map(|x| f64::from(x.abs()))
                    .sum();
                l1 * top * f64::from(sc) + f64::from(off[h].abs())
            })
            .fold(0.0, f64::max);
        if (got - want).abs() > 1e-5 * mag + 1e-30 {
            return Err(format!("int{bits}: row {j}: {got} vs the formula's {want}"));
        }
        if (got - exact).abs() > slack * (1.0 + 1e-4) + 1e-5 * mag {
            return Err(format!(
                "int{bits}: row {j}: {got} vs exact {exact}, beyond the bound {slack}"
            ));
        }
    }
    Ok(())
}

/// The suites' bodies, compiled once: each ISA's module (below) runs
/// them with its kind (expanded per ISA, the proptests were most of
/// this binary's build).
mod suite {
    use super::*;
    use hgca_cpu::IsaKind;

    /// Sequential, a rayon pool of 2 threads, and a caller's
    /// executor of 3 threads (no rayon).
    pub fn pars() -> Vec<Threads> {
        vec![Par::Seq.into(), Par::Rayon(2).into(), Threads::Exec(3)]
    }

    pub fn nan_key_poisons_only_its_group_when_attended(isa: IsaKind) {
        for par in pars() {
            if let Some(b) = backend(isa, par) {
                nan_case(&b);
            }
        }
    }

    // Two tests, so the harness's threads share the table (under
    // qemu it is the longest test of the NEON run).
    pub fn paged_layouts_edge_table(isa: IsaKind) {
        if let Some(b) = backend(isa, Par::Seq) {
            paged::edge_table(&b);
        }
    }

    pub fn paged_layouts_edge_table_threaded(isa: IsaKind) {
        if let Some(b) = backend(isa, Par::Rayon(3)) {
            paged::edge_table(&b);
        }
    }

    pub fn paged_empty_batches_and_page_reuse(isa: IsaKind) {
        for par in [Par::Seq, Par::Rayon(3)] {
            if let Some(b) = backend(isa, par) {
                paged::empty_batch(&b);
                paged::page_reuse(&b);
            }
        }
    }

    pub fn paged_shards_equal_the_whole_call(isa: IsaKind) {
        let Some(b) = backend(isa, Par::Rayon(2)) else {
            return;
        };
        for nth in [1, 2, 3, 5, 16, 40] {
            for sparse in [false, true] {
                let r = paged::shards_case(&b, nth, sparse, nth as u64);
                assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        }
    }

    pub fn paged_page_bounds_and_selectors(isa: IsaKind) {
        let Some(b) = backend(isa, Par::Seq) else {
            return;
        };
        for seed in 0..6 {
            let r = paged::page_selection_case(&b, seed);
            assert!(r.is_ok(), "{}", r.unwrap_err());
        }
    }

    pub fn sparse_matches_reference(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 160, ..ProptestConfig::default() }, |(
            shape in arb_shape(),
            tokens in prop::sample::select(vec![0usize, 1, 2, 15, 16, 17, 33, 100, 700]),
            dtype in prop::sample::select(DType::ALL.to_vec()),
            spread in arb_spread(),
            par in prop::sample::select(vec![0usize, 1, 2]),
            seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, pars()[par]) {
                let r = sparse_case(&b, dtype, shape, tokens, spread, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn paged_batch_matches_reference(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 160, ..ProptestConfig::default() }, |(
            shape in arb_shape(),
            kind in prop::sample::select(paged::KINDS.to_vec()),
            bs in prop::sample::select(vec![1usize, 3, 16, 64]),
            lens in prop::collection::vec(0usize..200, 1..5),
            dtype in prop::sample::select(DType::ALL.to_vec()),
            sparse in any::<bool>(),
            fmt in prop::sample::select(paged::FORMATS.to_vec()),
            par in prop::sample::select(vec![0usize, 1, 2]),
            seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, pars()[par]) {
                let r = paged::dispatch_case(&b, dtype, kind, bs, shape, &lens, sparse, fmt, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn dense_equals_all_selected(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 160, ..ProptestConfig::default() }, |(
            shape in arb_shape(),
            tokens in 0usize..600,
            spread in arb_spread(),
            par in prop::sample::select(vec![0usize, 1, 2]),
            seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, pars()[par]) {
                let r = dense_all_case::<f16>(&b, shape, tokens, spread, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn append_is_causal(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            shape in arb_shape(),
            dtype in prop::sample::select(DType::ALL.to_vec()),
            tokens in 1usize..300,
            n_q in prop_oneof![1usize..8, 8usize..48],
            par in 0usize..3,
            seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, pars()[par]) {
                let r = append_case(&b, dtype, shape, tokens, n_q.min(tokens), seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn append_over_a_sliding_window(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            shape in arb_shape(),
            dtype in prop::sample::select(DType::ALL.to_vec()),
            tokens in 1usize..300,
            n_q in prop_oneof![1usize..8, 8usize..80],
            window in prop_oneof![1usize..40, 40usize..300],
            par in 0usize..3,
            seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, pars()[par]) {
                let r = append_window_case(&b, dtype, shape, tokens, n_q.min(tokens), Some(window), seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn threshold_form_selects_while_scanning(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            shape in arb_shape(), tokens in 0usize..900, par in 0usize..3, seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, pars()[par]) {
                let r = threshold_case(&b, shape, tokens, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn window_dense_backend(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            shape in arb_shape(),
            dtype in prop::sample::select(DType::ALL.to_vec()),
            capacity in 1usize..80,
            tokens in 0usize..300,
            chunk in 1usize..40,
            evict in 1usize..40,
            seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, Par::Rayon(2)) {
                let r = check_dense(&b, shape, dtype, capacity, tokens, chunk, evict, 10.0, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn indices_above_is_a_filter(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            len in 0usize..300, t in -1.0f32..1.0, seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, Par::Seq) {
                let r = above_case(&b, len, t, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn decay_accumulate_matches_formula(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            len in 0usize..100, rows in 0usize..6, gather in any::<bool>(), seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, Par::Seq) {
                let r = decay_case(&b, len, rows, gather, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn block_bounds_bound_every_key(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            heads in 1usize..10,
            d in 1usize..140,
            blocks in 0usize..6,
            dtype in prop::sample::select(DType::ALL.to_vec()),
            seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, Par::Seq) {
                let r = match dtype {
                    DType::F32 => bounds_case::<f32>(&b, heads, d, blocks, seed),
                    DType::F16 => bounds_case::<f16>(&b, heads, d, blocks, seed),
                    DType::BF16 => bounds_case::<bf16>(&b, heads, d, blocks, seed),
                };
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn quantized_scores_match_their_formula(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            heads in 1usize..12,
            d in 1usize..140,
            n in 0usize..70,
            seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, Par::Seq) {
                let r = quant_case(&b, heads, d, n, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn merge_backend(isa: IsaKind) {
        proptest!(ProptestConfig { cases: 40, ..ProptestConfig::default() }, |(
            shape in arb_shape(), tokens in 0usize..64, n_parts in 1usize..8, seed in any::<u64>(),
        )| {
            if let Some(b) = backend(isa, Par::Seq) {
                let r = check_merge_partition(&b, shape, tokens, 10.0, n_parts, seed);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            }
        });
    }

    pub fn block_bounds_with_infinite_keys(isa: IsaKind) {
        // hi = +inf where q < 0 and lo = -inf where q > 0: the bound
        // is finite (sum of |q|), but the split-sign sum meets
        // 0 * inf there and must fall back, never give NaN. Lengths
        // cover the vector body and the tail.
        let Some(b) = backend(isa, Par::Seq) else {
            return;
        };
        for d in [1usize, 7, 16, 33, 64] {
            let qh: Vec<f32> = (0..d)
                .map(|i| if i % 2 == 0 { -2.0 } else { 1.5 })
                .collect();
            let q = [qh.clone(), qh.clone()].concat();
            let mut lo = vec![f16::from_f32(-1.0); d];
            let mut hi = vec![f16::from_f32(1.0); d];
            hi[0] = f16::INFINITY;
            if d > 1 {
                lo[d - 1 - (d % 2 == 1) as usize] = f16::NEG_INFINITY;
            }
            let bounds: Vec<f16> = lo.iter().chain(&hi).copied().collect();
            let mut out = vec![f32::NAN; 2];
            b.block_upper_bounds(&q, 2, d, &bounds, &mut out).unwrap();
            let want: f32 = qh.iter().map(|x| x.abs()).sum();
            for &got in &out {
                assert!((got - want).abs() <= 1e-5 * want, "d {d}: {got} vs {want}");
            }
        }
    }

    /// Prompt chunks of a model's shape: many query tiles and key
    /// tiles, the causal edge inside most of them (sizes kept small
    /// enough for the f64 reference under qemu).
    pub fn append_long_chunks(isa: IsaKind) {
        let Some(b) = backend(isa, Par::Rayon(2)) else {
            return;
        };
        for (qh, kvh, d, tokens, n_q) in [
            (9, 3, 64, 700, 200),
            (14, 2, 64, 400, 130),
            (4, 4, 40, 300, 300),
        ] {
            let shape = AttnShape::new(qh, kvh, d).unwrap();
            for dtype in [DType::F32, DType::F16] {
                append_case(&b, dtype, shape, tokens, n_q, 5)
                    .unwrap_or_else(|e| panic!("{shape:?} n={tokens} n_q={n_q} {dtype}: {e}"));
            }
        }
        // Gemma 3's local layers: 4 query heads on one KV head of
        // 256, a window shorter than the chunk (scaled down from 512).
        let shape = AttnShape::new(4, 1, 256).unwrap();
        append_window_case(&b, DType::F16, shape, 360, 200, Some(96), 7)
            .unwrap_or_else(|e| panic!("sliding window: {e}"));
    }

    /// The edge table on one thread.
    pub fn edge_table(isa: IsaKind) {
        edge_table_on(isa, &pars()[..1]);
    }

    /// The same on a rayon pool and on a caller's executor: a test of its
    /// own, as the paged table's (the split across threads is the same code
    /// on every ISA; under qemu only the sequential table runs).
    pub fn edge_table_threaded(isa: IsaKind) {
        edge_table_on(isa, &pars()[1..]);
    }

    fn edge_table_on(isa: IsaKind, pars: &[Threads]) {
        for &par in pars {
            let Some(b) = backend(isa, par) else { return };
            for (i, &(qh, kvh, d, n)) in EDGE_SHAPES.iter().enumerate() {
                let shape = AttnShape::new(qh, kvh, d).unwrap();
                for dtype in DType::ALL {
                    for spread in [0.01, 1e4] {
                        sparse_case(&b, dtype, shape, n, spread, i as u64)
                            .unwrap_or_else(|e| panic!("{shape:?} n={n} {dtype}: {e}"));
                    }
                }
                dense_all_case::<f32>(&b, shape, n, 30.0, i as u64).unwrap();
                if n > 0 {
                    // One KV dtype per shape, in turn (proptest covers the rest).
                    let dtype = DType::ALL[i % DType::ALL.len()];
                    for n_q in [4, 33] {
                        append_case(&b, dtype, shape, n, n.min(n_q), i as u64)
                            .unwrap_or_else(|e| panic!("{shape:?} n={n} n_q={n_q} {dtype}: {e}"));
                        // Windows of one token, shorter than a key
                        // tile, across tiles, and past every token.
                        for w in [1, 5, 40, n + 1] {
                            append_window_case(&b, dtype, shape, n, n.min(n_q), Some(w), i as u64)
                                .unwrap_or_else(|e| {
                                    panic!("{shape:?} n={n} n_q={n_q} window {w} {dtype}: {e}")
                                });
                        }
                    }
                }
            }
        }
    }

    /// Long rows split across threads: chunk merges must be exact.
    pub fn long_context_split_across_threads(isa: IsaKind) {
        let Some(b) = backend(isa, Par::Rayon(2)) else {
            return;
        };
        let shape = AttnShape::new(4, 1, 64).unwrap();
        dense_all_case::<bf16>(&b, shape, 5000, 20.0, 99).unwrap();
        sparse_case(&b, DType::F16, shape, 5000, 20.0, 98).unwrap();
    }

    /// The paged CPU store works as a source, exactly like contiguous slices.
    pub fn paged_store_source(isa: IsaKind) {
        let Some(b) = backend(isa, Par::Rayon(2)) else {
            return;
        };
        let shape = AttnShape::new(8, 2, 96).unwrap();
        let p = Problem::<f16>::random(shape, 333, 10.0, 5);
        let mut store = KvStore::<f16>::new(2, 96, 64).unwrap();
        store.push_head_major(333, &p.k, &p.v).unwrap();
        let sel = selection(&mut Rng::new(3), 2, 333);
        let layout = PartialLayout::decode(&shape);
        let (mut a, mut c) = (Partial::poisoned(layout), Partial::poisoned(layout));
        b.sparse_decode(&shape, &p.q, &store, &sel, a.as_mut(), None)
            .unwrap();
        b.sparse_decode(&shape, &p.q, &p.kv(), &sel, c.as_mut(), None)
            .unwrap();
        assert_eq!(a, c);
        assert_eq!(store.tokens(), 333);
    }
}

macro_rules! isa_suite {
    ($name:ident, $kind:expr) => {
        mod $name {
            use hgca_cpu::IsaKind;
            const KIND: IsaKind = $kind;

            #[test]
            fn nan_key_poisons_only_its_group_when_attended() {
                super::suite::nan_key_poisons_only_its_group_when_attended(KIND)
            }
            #[test]
            fn paged_layouts_edge_table() {
                super::suite::paged_layouts_edge_table(KIND)
            }
            #[test]
            fn paged_layouts_edge_table_threaded() {
                super::suite::paged_layouts_edge_table_threaded(KIND)
            }
            #[test]
            fn paged_empty_batches_and_page_reuse() {
                super::suite::paged_empty_batches_and_page_reuse(KIND)
            }
            #[test]
            fn paged_shards_equal_the_whole_call() {
                super::suite::paged_shards_equal_the_whole_call(KIND)
            }
            #[test]
            fn paged_page_bounds_and_selectors() {
                super::suite::paged_page_bounds_and_selectors(KIND)
            }
            #[test]
            fn sparse_matches_reference() {
                super::suite::sparse_matches_reference(KIND)
            }
            #[test]
            fn paged_batch_matches_reference() {
                super::suite::paged_batch_matches_reference(KIND)
            }
            #[test]
            fn dense_equals_all_selected() {
                super::suite::dense_equals_all_selected(KIND)
            }
            #[test]
            fn append_is_causal() {
                super::suite::append_is_causal(KIND)
            }
            #[test]
            fn append_over_a_sliding_window() {
                super::suite::append_over_a_sliding_window(KIND)
            }
            #[test]
            fn threshold_form_selects_while_scanning() {
                super::suite::threshold_form_selects_while_scanning(KIND)
            }
            #[test]
            fn window_dense_backend() {
                super::suite::window_dense_backend(KIND)
            }
            #[test]
            fn indices_above_is_a_filter() {
                super::suite::indices_above_is_a_filter(KIND)
            }
            #[test]
            fn decay_accumulate_matches_formula() {
                super::suite::decay_accumulate_matches_formula(KIND)
            }
            #[test]
            fn block_bounds_bound_every_key() {
                super::suite::block_bounds_bound_every_key(KIND)
            }
            #[test]
            fn quantized_scores_match_their_formula() {
                super::suite::quantized_scores_match_their_formula(KIND)
            }
            #[test]
            fn merge_backend() {
                super::suite::merge_backend(KIND)
            }
            #[test]
            fn block_bounds_with_infinite_keys() {
                super::suite::block_bounds_with_infinite_keys(KIND)
            }
            #[test]
            fn append_long_chunks() {
                super::suite::append_long_chunks(KIND)
            }
            #[test]
            fn edge_table() {
                super::suite::edge_table(KIND)
            }
            #[test]
            fn edge_table_threaded() {
                super::suite::edge_table_threaded(KIND)
            }
            #[test]
            fn long_context_split_across_threads() {
                super::suite::long_context_split_across_threads(KIND)
            }
            #[test]
            fn paged_store_source() {
                super::suite::paged_store_source(KIND)
            }
        }
    };
}

every_isa!(isa_suite);

/// Under qemu the NEON path must be the one taken (on an ARMv8.0 CPU model
/// without FEAT_FP16: f16 widens with base AdvSIMD's FCVTL).
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_path_is_taken() {
    let b = CpuBackend::new();
    assert_eq!(b.isa().kind(), IsaKind::Neon, "detected {:?}", b.isa());
    eprintln!("NEON path taken");
}

#[test]
fn bad_decay_input_is_a_typed_error_and_writes_nothing() {
    let b = CpuBackend::new();
    let mut avg = vec![1.0f32; 8];
    let w = vec![0.5f32; 16];
    let e = b
        .decay_accumulate(&mut avg, Some(&[1, 8]), 0.5, &w, 2, &[1.0])
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Index {
                index: 8,
                len: 8,
                ..
            }
        ),
        "{e}"
    );
    // Two rows of 8 at stride 8 need 16 weights; at stride 9, 17.
    assert!(
        b.decay_accumulate(&mut avg, None, 0.5, &w, 8, &[1.0, 1.0])
            .is_ok()
    );
    let e = b
        .decay_accumulate(&mut avg, None, 0.5, &w, 9, &[1.0, 1.0])
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Length {
                expected: 17,
                found: 16,
                ..
            }
        ),
        "{e}"
    );
    // Rows that would overlap (stride below the row length).
    let e = b
        .decay_accumulate(&mut avg, None, 0.5, &w, 4, &[1.0, 1.0])
        .unwrap_err();
    assert!(matches!(e, Error::Length { .. }), "{e}");
    let e = b
        .decay_accumulate(&mut avg, None, 0.5, &w, usize::MAX, &[1.0, 1.0])
        .unwrap_err();
    assert!(matches!(e, Error::Length { .. }), "{e}");
    assert_eq!(avg, [1.5; 8], "only the one good call wrote");
}

#[test]
fn bad_input_is_a_typed_error() {
    let b = CpuBackend::new();
    let shape = AttnShape::new(4, 2, 8).unwrap();
    let p = Problem::<f32>::random(shape, 10, 1.0, 1);
    let layout = PartialLayout::decode(&shape);
    let mut out = Partial::poisoned(layout);
    let sel = Selection::from_heads(&[vec![0u32], vec![10]]);
    let e = b
        .sparse_decode(&shape, &p.q, &p.kv(), &sel, out.as_mut(), None)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Index {
                index: 10,
                len: 10,
                ..
            }
        ),
        "{e}"
    );
    let sel3 = Selection::from_heads(&[vec![0u32], vec![1], vec![2]]);
    assert!(matches!(
        b.sparse_decode(&shape, &p.q, &p.kv(), &sel3, out.as_mut(), None),
        Err(Error::ShapeMismatch { .. })
    ));
    let ok = Selection::from_heads(&[vec![0u32], vec![1]]);
    assert!(matches!(
        b.sparse_decode(&shape, &p.q[1..], &p.kv(), &ok, out.as_mut(), None),
        Err(Error::Length { .. })
    ));
    let mut w = vec![0.0; 3];
    assert!(
        b.sparse_decode(&shape, &p.q, &p.kv(), &ok, out.as_mut(), Some(&mut w))
            .is_err_and(|e| matches!(e, Error::Length { .. }))
    );
    let other = AttnShape::new(4, 1, 8).unwrap();
    assert!(
        b.sparse_decode(
            &other,
            &p.q,
            &p.kv(),
            &Selection::from_heads(&[vec![0u32]]),
            out.as_mut(),
            None
        )
        .is_err_and(|e| matches!(
            e,
            Error::ShapeMismatch {
                what: "kv source (kv_heads, head_dim)",
                ..
            }
        ))
    );
    let mut wrong = Partial::poisoned(PartialLayout::append(&shape, 2));
    assert!(
        b.dense_decode(&shape, &p.q, &p.kv(), wrong.as_mut(), None)
            .is_err_and(|e| matches!(
                e,
                Error::ShapeMismatch {
                    what: "output partial",
                    ..
                }
            ))
    );
    let mut chosen = Selection::new();
    let e = b
        .sparse_decode_threshold(
            &shape,
            &p.q,
            &p.kv(),
            &[0.0; 20],
            &[f32::NAN, 0.0],
            out.as_mut(),
            &mut chosen,
        )
        .unwrap_err();
    assert!(matches!(e, Error::Param { .. }), "{e}");
    assert!(
        b.sparse_decode_threshold(
            &shape,
            &p.q,
            &p.kv(),
            &[0.0; 19],
            &[0.0, 0.0],
            out.as_mut(),
            &mut chosen
        )
        .is_err_and(|e| matches!(
            e,
            Error::Length {
                what: "maw",
                expected: 20,
                found: 19
            }
        ))
    );
}

#[test]
fn paged_bad_input_is_a_typed_error() {
    paged::bad_input_table();
}

/// A fixed batched decode (4 sequences, f16, vLLM/FlashAttention layout)
/// and the closure that runs it on a backend.
struct SharedCase {
    shape: AttnShape,
    cache: paged::Cache<f16>,
    q: Vec<f32>,
    sels: Vec<Selection>,
}

impl SharedCase {
    fn new() -> Self {
        let shape = AttnShape::new(8, 2, 64).unwrap();
        let mut rng = Rng::new(77);
        let probs: Vec<Problem<f16>> = [700usize, 300, 1, 520]
            .iter()
            .enumerate()
            .map(|(i, &n)| Problem::random(shape, n, 8.0, 100 + i as u64))
            .collect();
        let cache = paged::Cache::build(paged::Kind::VllmFlash, 16, &probs, &mut rng);
        let sels = probs
            .iter()
            .map(|p| selection(&mut rng, 2, p.tokens))
            .collect();
        let q = probs.iter().flat_map(|p| p.q.iter().copied()).collect();
        Self {
            shape,
            cache,
            q,
            sels,
        }
    }
    /// `(out, lse)` of call `i` (dense for even `i`, sparse for odd).
    fn call(&self, cpu: &CpuBackend, i: usize) -> (Vec<f32>, Vec<f32>) {
        let t = self.cache.tables();
        let table = hgca_kernels::BlockTable::dense(&t.dense, t.max_blocks, &t.lens).unwrap();
        let batch = hgca_kernels::PagedBatch::new(self.cache.pool(), table).unwrap();
        let tokens = if i.is_multiple_of(2) {
            hgca_cpu::BatchTokens::Dense
        } else {
            hgca_cpu::BatchTokens::Sparse(&self.sels)
        };
        let (mut o, mut l) = (vec![f32::NAN; 4 * 8 * 64], vec![f32::NAN; 4 * 8]);
        cpu.decode_batch(
            &self.shape,
            &self.q,
            &batch,
            tokens,
            &mut o,
            &mut l,
            hgca_kernels::LseFormat::NATURAL,
            None,
        )
        .unwrap();
        (o, l)
    }
}

/// 8 threads x 200 calls on one shared backend (sequential calls and
/// calls on the backend's own 2-thread pool) all finish and give, bit for
/// bit, what one thread gives.
#[test]
fn shared_backend_from_8_threads_matches_one_thread() {
    within_secs(600, || {
        let case = std::sync::Arc::new(SharedCase::new());
        for par in [Par::Seq, Par::Rayon(2)] {
            let cpu = CpuBackend::new().with_par(par).unwrap();
            let want: Vec<_> = (0..2).map(|i| case.call(&cpu, i)).collect();
            std::thread::scope(|s| {
                for t in 0..8 {
                    let (cpu, case, want) = (&cpu, &case, &want);
                    s.spawn(move || {
                        for i in 0..200 {
                            let got = case.call(cpu, t + i);
                            assert!(
                                got == want[(t + i) % 2],
                                "{par:?} thread {t} call {i} differs"
                            );
                        }
                    });
                }
            });
        }
    });
}

/// Calls made from inside the backend's own pool (its tasks, through
/// `for_chunks`) and from inside `rayon::scope` on the global pool that a
/// `Par::Rayon(0)` backend uses: they finish (no lock is held across the
/// parallel work) and match the calls made outside.
#[test]
fn calls_from_inside_the_backends_pool_finish() {
    within_secs(600, || {
        let case = SharedCase::new();
        let own = CpuBackend::new().with_par(Par::Rayon(2)).unwrap();
        let want = [case.call(&own, 0), case.call(&own, 1)];
        let mut slots = vec![0usize; 16];
        own.for_chunks(&mut slots, 1, |i, _| {
            assert!(case.call(&own, i) == want[i % 2], "own pool task {i}");
        });
        let global = CpuBackend::new().with_par(Par::Rayon(0)).unwrap();
        let want = [case.call(&global, 0), case.call(&global, 1)];
        rayon::scope(|s| {
            for i in 0..16 {
                let (case, global, want) = (&case, &global, &want);
                s.spawn(move |_| {
                    assert!(case.call(global, i) == want[i % 2], "rayon::scope task {i}");
                });
            }
        });
    });
}

/// The ISAs the library detects are exactly those /proc/cpuinfo's flags
/// allow (V3: pulp's x86-64-v3 features and F16C; V4: those and AVX-512
/// F/BW/CD/DQ/VL), read independently of the library's detection.
#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detected_isas_match_proc_cpuinfo() {
    let Some(flags) = hgca_testkit::require::cpuinfo_flags() else {
        return;
    };
    let has = |fs: &[&str]| fs.iter().all(|&f| flags.contains(f));
    // pulp's x86-64-v3 token (`pni` is SSE3, `abm` LZCNT), plus F16C for V3.
    let base = has(&[
        "sse", "sse2", "fxsr", "pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "bmi1",
        "bmi2", "fma", "abm",
    ]);
    let v3 = base && has(&["f16c"]);
    let v4 = base && has(&["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]);
    let mut want = vec![IsaKind::Scalar];
    if v3 {
        want.push(IsaKind::V3);
    }
    if v4 {
        want.push(IsaKind::V4);
    }
    let got: Vec<IsaKind> = hgca_cpu::Isa::available()
        .iter()
        .map(|i| i.kind())
        .collect();
    assert_eq!(got, want, "the library's ISAs against /proc/cpuinfo");
    eprintln!("ISAs detected, as /proc/cpuinfo allows: {got:?}");
}

/// The backend on the best ISA here, as an engine would build it.
fn best() -> Option<&'static CpuBackend> {
    static B: std::sync::OnceLock<CpuBackend> = std::sync::OnceLock::new();
    Some(B.get_or_init(CpuBackend::new))
}

/// A second instance: CPU windows are host memory any instance reads.
fn other() -> Option<&'static CpuBackend> {
    static B: std::sync::OnceLock<CpuBackend> = std::sync::OnceLock::new();
    Some(B.get_or_init(|| CpuBackend::new().with_par(Par::Seq).expect("sequential")))
}

// The window role (the same suite as wgpu's and CUDA's); the per-ISA
// suites above check the kernels under it on every ISA.
hgca_testkit::dense_backend_suite! {
    mod window_suite;
    backend: best,
    other: other,
    shared_windows: true,
    max_head_dim: usize::MAX,
    cases: 64,
    stress_steps: 1000,
}

#[test]
fn int8_scores_reject_bad_lengths_with_typed_errors() {
    use hgca_cpu::Int8Keys;
    let b = CpuBackend::new();
    let mut keys = Int8Keys::new(4);
    keys.push(&[1.0, -2.0, 0.5, 0.0]);
    let (codes, scales) = (keys.codes(), keys.scales());
    let mut out = [0.0f32; 1];
    let len = |r: Result<(), Error>, want: &str| match r {
        Err(Error::Length { what, .. }) => assert_eq!(what, want),
        other => panic!("{want}: {other:?}"),
    };
    len(
        b.int8_max_scores(&[0.0; 3], &[0.0], 4, codes, scales, &mut out),
        "q",
    );
    len(
        b.int8_max_scores(&[0.0; 4], &[0.0], 4, &codes[..8], scales, &mut out),
        "keys (whole tiles)",
    );
    len(
        b.int8_max_scores(&[0.0; 4], &[0.0], 4, codes, scales, &mut [0.0; 2]),
        "out (one per key row)",
    );
    assert!(matches!(
        b.int8_max_scores(&[], &[0.0], 0, codes, scales, &mut out),
        Err(Error::Zero { .. })
    ));
    b.int8_max_scores(&[1.0, 0.0, 0.0, 0.0], &[0.0], 4, codes, scales, &mut out)
        .unwrap();
    assert!((out[0] - 1.0).abs() < 2.0 / 127.0, "{}", out[0]);
}

#[test]
fn int4_scores_reject_bad_lengths_with_typed_errors() {
    use hgca_cpu::Int4Keys;
    let b = CpuBackend::new();
    let mut keys = Int4Keys::new(4);
    keys.push(&[1.0, -2.0, 0.5, 0.0]);
    assert_eq!(
        (0..4).map(|i| keys.code(0, i)).collect::<Vec<_>>(),
        [4, -7, 2, 0],
        "codes round to the nearest of -7..=7 (0.5 * 3.5 = 1.75 -> 2)"
    );
    let (codes, scales) = (keys.codes(), keys.scales());
    let mut out = [0.0f32; 1];
    let len = |r: Result<(), Error>, want: &str| match r {
        Err(Error::Length { what, .. }) => assert_eq!(what, want),
        other => panic!("{want}: {other:?}"),
    };
    len(
        b.int4_max_scores(&[0.0; 3], &[0.0], 4, codes, scales, &mut out),
        "q",
    );
    len(
        b.int4_max_scores(&[0.0; 4], &[0.0], 4, &codes[..8], scales, &mut out),
        "keys (whole tiles)",
    );
    len(
        b.int4_max_scores(&[0.0; 4], &[0.0], 4, codes, scales, &mut [0.0; 2]),
        "out (one per key row)",
    );
    assert!(matches!(
        b.int4_max_scores(&[], &[0.0], 0, codes, scales, &mut out),
        Err(Error::Zero { .. })
    ));
    b.int4_max_scores(&[0.0, 1.0, 0.0, 0.0], &[0.0], 4, codes, scales, &mut out)
        .unwrap();
    assert!(
        (out[0] + 2.0).abs() < 1e-6,
        "code -7 times the scale 2/7: {}",
        out[0]
    );
}

/// The int4 estimate's paths (portable, AVX2, AVX-512 VNNI: one per ISA of
/// the machine) compute the same integers and the same f32 epilogue, so
/// they agree to the bit, over partial tiles, padded groups, more than 8
/// query rows and non-finite key rows.
#[test]
fn int4_scores_agree_to_the_bit_on_every_path() {
    use hgca_cpu::Int4Keys;
    let mut rng = Rng::new(41);
    for (heads, d, n) in [
        (1, 64, 16),
        (7, 64, 300),
        (3, 13, 37),
        (11, 128, 45),
        (2, 256, 5),
    ] {
        let mut keys = Int4Keys::new(d);
        for j in 0..n {
            let mut k: Vec<f32> = (0..d).map(|_| 4.0 * rng.sym()).collect();
            if j % 11 == 7 {
                k[0] = f32::INFINITY;
            }
            keys.push(&k);
        }
        let q: Vec<f32> = (0..heads * d).map(|_| rng.sym()).collect();
        let off: Vec<f32> = (0..heads).map(|_| rng.sym()).collect();
        let mut runs = Vec::new();
        // The ISAs this machine runs (the per-ISA suites check that the
        // ones CI requires are here).
        for isa in hgca_cpu::Isa::available() {
            let kind = isa.kind();
            let b = CpuBackend::new()
                .with_isa(kind)
                .and_then(|b| b.with_par(Par::Seq))
                .unwrap();
            let mut out = vec![f32::NAN; n];
            b.int4_max_scores(&q, &off, d, keys.codes(), keys.scales(), &mut out)
                .unwrap();
            runs.push((kind, CpuBackend::qmatvec_path(b.isa()), out));
        }
        let (k0, p0, first) = &runs[0];
        for (kind, path, out) in &runs[1..] {
            for (j, (a, b)) in first.iter().zip(out).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "heads {heads} d {d} row {j}: {k0:?}/{p0:?} {a} vs {kind:?}/{path:?} {b}"
                );
            }
        }
    }
}
