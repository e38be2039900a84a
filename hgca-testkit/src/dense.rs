//! The checks of [`dense_backend_suite!`](crate::dense_backend_suite) that
//! need no hybrid layer: a window backend's edge table, ring, NaN rows,
//! merges of special values, submissions in flight, error paths, objects
//! of another instance, and prefetches. Each returns `Err(message)` on the
//! first thing that differs from the contract.

use hgca_kernels::{
    AttnShape, DType, DenseAttention, Error, KvWindow, MergeBackend, Partial, PartialLayout,
    WindowSpec, bf16, f16,
};

use crate::conformance::{check_dense, check_merge_partition};
use crate::{EDGE_SHAPES, Rng};

fn shape(qh: usize, kh: usize, d: usize) -> Result<AttnShape, String> {
    AttnShape::new(qh, kh, d).map_err(|e| hgca_kernels::report(&e))
}

fn text<T>(r: hgca_kernels::Result<T>) -> Result<T, String> {
    r.map_err(|e| hgca_kernels::report(&e))
}

/// `r` must be an error matching `ok`; `what` names the call.
fn expect_err<T>(
    what: &str,
    r: hgca_kernels::Result<T>,
    ok: impl FnOnce(&Error) -> bool,
) -> Result<(), String> {
    match r {
        Err(e) if ok(&e) => Ok(()),
        Err(e) => Err(format!("{what}: {e:?} ({})", hgca_kernels::report(&e))),
        Ok(_) => Err(format!("{what}: accepted")),
    }
}

/// Every edge shape in every dtype, with a window that holds all tokens and
/// one that wraps and evicts. A head dim above `max_head_dim` must be
/// refused at `new_window` with [`Error::Capacity`] instead.
///
/// # Errors
/// Every failing case, one per line.
pub fn check_edge_table<B: DenseAttention>(b: &B, max_head_dim: usize) -> Result<(), String> {
    let mut failures = Vec::new();
    for (i, &(qh, kh, d, tokens)) in EDGE_SHAPES.iter().enumerate() {
        let s = shape(qh, kh, d)?;
        for (j, dtype) in DType::ALL.into_iter().enumerate() {
            if d > max_head_dim {
                let spec = text(WindowSpec::new(s, 8, dtype))?;
                if let Err(e) = expect_err("new_window", b.new_window(spec), |e| {
                    matches!(e, Error::Capacity { .. })
                }) {
                    failures.push(format!("{s:?} {dtype}: d above the limit not refused: {e}"));
                }
                continue;
            }
            for (cap, chunk, evict) in [(tokens.max(1), 7, 3), (tokens / 2 + 1, 5, 4)] {
                let spread = [1.0, 10.0, 100.0][(i + j) % 3];
                let seed = 100 + 10 * i as u64 + j as u64;
                if let Err(e) = check_dense(b, s, dtype, cap, tokens, chunk, evict, spread, seed) {
                    failures.push(format!("{s:?} {dtype} tokens {tokens} cap {cap}: {e}"));
                }
            }
        }
    }
    // A finite limit is refused one past it (the table may not reach it).
    if let Some(d) = max_head_dim.checked_add(1).filter(|&d| d <= 1 << 16) {
        let spec = text(WindowSpec::new(shape(1, 1, d)?, 4, DType::F32))?;
        if let Err(e) = expect_err(
            "new_window one past the head-dim limit",
            b.new_window(spec),
            |e| matches!(e, Error::Capacity { .. }),
        ) {
            failures.push(e);
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

/// The ring written past its capacity many times, every dtype, several
/// chunk/evict patterns (single tokens, whole windows, odd sizes).
///
/// # Errors
/// The first failing case.
pub fn check_ring_wraparound<B: DenseAttention>(b: &B) -> Result<(), String> {
    let s = shape(4, 2, 17)?;
    for dt in DType::ALL {
        for (cap, tokens, chunk, evict) in [
            (16, 150, 5, 3),
            (16, 96, 16, 16),
            (5, 40, 1, 1),
            (13, 100, 6, 13),
        ] {
            let seed = cap as u64 * 31 + tokens as u64;
            check_dense(b, s, dt, cap, tokens, chunk, evict, 3.0, seed)
                .map_err(|e| format!("{dt} cap {cap} tokens {tokens}: {e}"))?;
        }
    }
    Ok(())
}

/// NaN in a query or a key makes the affected rows NaN (out and lse); the
/// other rows stay finite: never hidden by a max.
///
/// # Errors
/// The first row that differs.
pub fn check_nan_rows<B: DenseAttention>(b: &B) -> Result<(), String> {
    let s = shape(4, 2, 8)?;
    let mut w = text(b.new_window(text(WindowSpec::new(s, 8, DType::F32))?))?;
    let mut rng = Rng::new(11);
    let mut k: Vec<f32> = (0..6 * s.kv_token_len()).map(|_| rng.sym()).collect();
    let v = k.clone();
    // Token 3, KV head 1, element 2: NaN (rows of query heads 2 and 3).
    k[(3 * 2 + 1) * 8 + 2] = f32::NAN;
    text(b.append(&mut w, 6, &k, &v))?;
    let mut q: Vec<f32> = (0..s.q_len()).map(|_| rng.sym()).collect();
    q[8 + 5] = f32::NAN; // query head 1
    let p = text(b.submit_decode(&w, &q, false))?;
    let mut out = Partial::poisoned(PartialLayout::decode(&s));
    text(b.wait(p, out.as_mut(), None))?;
    for h in 0..4 {
        let nan = h != 0;
        let row = &out.out()[h * 8..(h + 1) * 8];
        if out.lse()[h].is_nan() != nan || row.iter().any(|x| x.is_nan() != nan) {
            return Err(format!(
                "head {h}: lse {} out {row:?}, expected NaN: {nan}",
                out.lse()[h]
            ));
        }
    }
    Ok(())
}

/// The merge on every edge shape, 1, 2 and 5 parts.
///
/// # Errors
/// The first failing case.
pub fn check_merge_edge_table<M: MergeBackend>(m: &M) -> Result<(), String> {
    for (i, &(qh, kh, d, tokens)) in EDGE_SHAPES.iter().enumerate() {
        let s = shape(qh, kh, d)?;
        // 5 parts: more than the CUDA merge keeps in registers.
        for n_parts in [1, 2, 5] {
            for spread in [1.0, 1e3] {
                check_merge_partition(m, s, tokens, spread, n_parts, 300 + i as u64)
                    .map_err(|e| format!("{s:?} tokens {tokens} parts {n_parts}: {e}"))?;
            }
        }
    }
    Ok(())
}

fn same_bits_or_close(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= 1e-6 * (1.0 + w.abs())
        };
        if !ok {
            return Err(format!("{what} element {i}: {g} vs {w}"));
        }
    }
    Ok(())
}

/// -inf, +inf (FlashAttention-2's empty), NaN lse and NaN outputs: the
/// backend's merge follows the scalar merge's contract row by row, n-way
/// and in place; no parts give the empty partial.
///
/// # Errors
/// The first element that differs.
pub fn check_merge_special_values<M: MergeBackend>(m: &M) -> Result<(), String> {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let layout = PartialLayout {
        n_tokens: 1,
        q_heads: 7,
        head_dim: 3,
    };
    // Rows: finite+finite, -inf+-inf, +inf+finite, NaN lse, NaN out at zero
    // weight, NaN out in an all-empty row, far-apart lse.
    let lse_a = vec![0.5, -inf, inf, nan, 1.0, -inf, 80.0];
    let lse_b = vec![-1.0, -inf, 2.0, 0.0, -inf, -inf, -80.0];
    let mut out_a: Vec<f32> = (0..21).map(|x| x as f32 * 0.1 - 1.0).collect();
    let mut out_b: Vec<f32> = (0..21).map(|x| 1.0 - x as f32 * 0.05).collect();
    out_b[4 * 3 + 1] = nan;
    out_a[5 * 3 + 2] = nan;
    let a = text(Partial::from_vecs(layout, out_a, lse_a))?;
    let c = text(Partial::from_vecs(layout, out_b, lse_b))?;
    let mut want = Partial::poisoned(layout);
    text(hgca_kernels::merge(
        &[a.as_ref(), c.as_ref()],
        want.as_mut(),
    ))?;
    let mut got = Partial::poisoned(layout);
    text(m.merge(&[a.as_ref(), c.as_ref()], got.as_mut()))?;
    same_bits_or_close("n-way lse", got.lse(), want.lse())?;
    same_bits_or_close("n-way out", got.out(), want.out())?;
    let mut acc = a.clone();
    text(m.merge_into(acc.as_mut(), c.as_ref()))?;
    same_bits_or_close("2-way lse", acc.lse(), want.lse())?;
    same_bits_or_close("2-way out", acc.out(), want.out())?;
    let mut e = Partial::poisoned(layout);
    text(m.merge(&[], e.as_mut()))?;
    if e != Partial::empty(layout) {
        return Err(format!("no parts: {e:?}"));
    }
    Ok(())
}

/// Several submissions in flight at once, waited for in reverse order:
/// each gives bit for bit its own query's result alone.
///
/// # Errors
/// The first submission whose result differs.
pub fn check_overlap<B: DenseAttention>(b: &B) -> Result<(), String> {
    let s = shape(8, 2, 32)?;
    let mut w = text(b.new_window(text(WindowSpec::new(s, 64, DType::F32))?))?;
    let mut rng = Rng::new(7);
    let kv: Vec<f32> = (0..40 * s.kv_token_len()).map(|_| rng.sym()).collect();
    text(b.append(&mut w, 40, &kv, &kv))?;
    let qs: Vec<Vec<f32>> = (0..3)
        .map(|_| (0..s.q_len()).map(|_| rng.sym()).collect())
        .collect();
    let layout = PartialLayout::decode(&s);
    let mut solo = Vec::new();
    for q in &qs {
        let p = text(b.submit_decode(&w, q, false))?;
        let mut o = Partial::poisoned(layout);
        text(b.wait(p, o.as_mut(), None))?;
        solo.push(o);
    }
    if solo[0] == solo[1] {
        return Err("two different queries gave the same result".into());
    }
    let mut pending = Vec::new();
    for q in &qs {
        pending.push(text(b.submit_decode(&w, q, false))?);
    }
    for (i, p) in pending.into_iter().enumerate().rev() {
        let mut o = Partial::poisoned(layout);
        text(b.wait(p, o.as_mut(), None))?;
        if o != solo[i] {
            return Err(format!(
                "in-flight submission {i} differs from its serial result"
            ));
        }
    }
    Ok(())
}

/// Wrong inputs give the typed errors of the contract, never a panic, and
/// leave the window as it was: lengths, capacity, evictions of more than
/// held, of the wrong dtype or into short buffers, queries of the wrong
/// length, a wait with the wrong layout or unrequested weights, merges of
/// layouts that differ. An append whose queries precede the window's first
/// position gives empty rows.
///
/// # Errors
/// The first call whose result differs.
pub fn check_bad_inputs<B: DenseAttention + MergeBackend>(b: &B) -> Result<(), String> {
    let s = shape(4, 2, 8)?;
    let mut w = text(b.new_window(text(WindowSpec::new(s, 4, DType::F16))?))?;
    let tok = vec![0.5f32; s.kv_token_len()];
    let length = |e: &Error| matches!(e, Error::Length { .. });
    let capacity = |e: &Error| matches!(e, Error::Capacity { .. });
    expect_err(
        "append, short k",
        b.append(&mut w, 1, &tok[1..], &tok),
        length,
    )?;
    expect_err(
        "append, short v",
        b.append(&mut w, 1, &tok, &tok[1..]),
        length,
    )?;
    let five = tok.repeat(5);
    expect_err(
        "append past capacity",
        b.append(&mut w, 5, &five, &five),
        capacity,
    )?;
    if w.len() != 0 {
        return Err(format!(
            "refused appends changed the window: {} held",
            w.len()
        ));
    }
    text(b.append(&mut w, 3, &tok.repeat(3), &tok.repeat(3)))?;
    let mut k16 = vec![f16::ZERO; 2 * 4 * 8];
    let mut v16 = k16.clone();
    expect_err(
        "evict more than held",
        b.evict_oldest(&mut w, 4, &mut k16, &mut v16),
        capacity,
    )?;
    let (mut kb, mut vb) = (vec![bf16::ZERO; 2 * 8], vec![bf16::ZERO; 2 * 8]);
    expect_err(
        "evict into the wrong dtype",
        b.evict_oldest(&mut w, 1, &mut kb, &mut vb),
        |e| matches!(e, Error::UnsupportedDType { .. }),
    )?;
    expect_err(
        "evict into the wrong length",
        b.evict_oldest(&mut w, 1, &mut k16, &mut v16),
        length,
    )?;
    if w.len() != 3 || w.start_pos() != 0 {
        return Err(format!(
            "refused evictions changed the window: {} from {}",
            w.len(),
            w.start_pos()
        ));
    }
    expect_err(
        "decode, short q",
        b.submit_decode(&w, &[0.0; 3], false),
        length,
    )?;
    expect_err(
        "append, short q",
        b.submit_append(&w, &[0.0; 32], 2, 0),
        length,
    )?;
    let q = vec![0.25f32; s.q_len()];
    let p = text(b.submit_decode(&w, &q, false))?;
    let mut wrong = Partial::poisoned(PartialLayout::append(&s, 2));
    expect_err("wait, wrong layout", b.wait(p, wrong.as_mut(), None), |e| {
        matches!(e, Error::ShapeMismatch { .. })
    })?;
    crate::conformance::check_weights_request(b)?;
    // An append before the window's first position: every row empty.
    let mut w2 = text(b.new_window(text(WindowSpec::new(s, 4, DType::F32))?))?;
    text(b.append(&mut w2, 4, &tok.repeat(4), &tok.repeat(4)))?;
    let (mut k32, mut v32) = (vec![0.0f32; 2 * 2 * 8], vec![0.0f32; 2 * 2 * 8]);
    text(b.evict_oldest(&mut w2, 2, &mut k32, &mut v32))?;
    if w2.start_pos() != 2 {
        return Err(format!("start after evicting 2: {}", w2.start_pos()));
    }
    let p = text(b.submit_append(&w2, &vec![1.0; 2 * s.q_len()], 2, 0))?;
    let mut out = Partial::poisoned(PartialLayout::append(&s, 2));
    text(b.wait(p, out.as_mut(), None))?;
    if out != Partial::empty(PartialLayout::append(&s, 2)) {
        return Err(format!("queries before the window: {out:?}"));
    }
    let p1 = Partial::empty(PartialLayout::append(&s, 2));
    let mut d1 = Partial::poisoned(PartialLayout::decode(&s));
    let mismatch = |e: &Error| matches!(e, Error::ShapeMismatch { .. });
    expect_err(
        "merge, layouts differ",
        b.merge(&[p1.as_ref()], d1.as_mut()),
        mismatch,
    )?;
    expect_err(
        "merge_into, layouts differ",
        b.merge_into(d1.as_mut(), p1.as_ref()),
        mismatch,
    )?;
    Ok(())
}

/// A window and a pending result made by `a`, given to `other` (another
/// instance of the same backend): refused with [`Error::ForeignObject`]
/// when `shared` is false (device memory belongs to one instance); when
/// `shared` (host memory any instance reads), the same result as `a`'s.
///
/// # Errors
/// What differed.
pub fn check_foreign<B: DenseAttention>(a: &B, other: &B, shared: bool) -> Result<(), String> {
    let s = shape(4, 2, 8)?;
    let mut w = text(a.new_window(text(WindowSpec::new(s, 8, DType::F32))?))?;
    let mut rng = Rng::new(5);
    let kv: Vec<f32> = (0..5 * s.kv_token_len()).map(|_| rng.sym()).collect();
    text(a.append(&mut w, 5, &kv, &kv))?;
    let q: Vec<f32> = (0..s.q_len()).map(|_| rng.sym()).collect();
    let layout = PartialLayout::decode(&s);
    let mut mine = Partial::poisoned(layout);
    let p = text(a.submit_decode(&w, &q, false))?;
    text(a.wait(p, mine.as_mut(), None))?;
    let foreign = |e: &Error| matches!(e, Error::ForeignObject { .. });
    if shared {
        let mut theirs = Partial::poisoned(layout);
        let p = text(other.submit_decode(&w, &q, false))?;
        text(other.wait(p, theirs.as_mut(), None))?;
        if theirs != mine {
            return Err("another instance's decode of a shared window differs".into());
        }
        return Ok(());
    }
    expect_err(
        "decode of another's window",
        other.submit_decode(&w, &q, false),
        foreign,
    )?;
    expect_err(
        "append attention over another's window",
        other.submit_append(&w, &q, 1, 4),
        foreign,
    )?;
    expect_err(
        "append to another's window",
        other.append(&mut w, 1, &kv[..s.kv_token_len()], &kv[..s.kv_token_len()]),
        foreign,
    )?;
    let (mut k1, mut v1) = (vec![0.0f32; 2 * 8], vec![0.0f32; 2 * 8]);
    expect_err(
        "evict from another's window",
        other.evict_oldest(&mut w, 1, &mut k1, &mut v1),
        foreign,
    )?;
    expect_err(
        "prefetch from another's window",
        other.prefetch_oldest(&mut w, 1),
        foreign,
    )?;
    let p = text(a.submit_decode(&w, &q, false))?;
    let mut out = Partial::poisoned(layout);
    expect_err(
        "wait for another's work",
        other.wait(p, out.as_mut(), None),
        foreign,
    )?;
    if w.len() != 5 {
        return Err(format!(
            "refused calls changed the window: {} held",
            w.len()
        ));
    }
    Ok(())
}

/// An eviction after a prefetch of the same rows gives the rows one without
/// gives; a prefetch of another count, then evictions that do not match it,
/// give the right rows too; a prefetch of more than held is
/// [`Error::Capacity`].
///
/// # Errors
/// What differed.
pub fn check_prefetch<B: DenseAttention>(b: &B) -> Result<(), String> {
    let s = shape(4, 2, 24)?;
    let kl = s.kv_token_len();
    let mut rng = Rng::new(21);
    let kv: Vec<f32> = (0..16 * kl).map(|_| rng.sym()).collect();
    let mut evicted = Vec::new();
    for prefetch in [false, true] {
        let mut w = text(b.new_window(text(WindowSpec::new(s, 16, DType::F16))?))?;
        text(b.append(&mut w, 16, &kv, &kv))?;
        if prefetch {
            text(b.prefetch_oldest(&mut w, 4))?;
            // The same rows again: the first copy stands.
            text(b.prefetch_oldest(&mut w, 4))?;
        }
        let (mut k, mut v) = (vec![f16::ZERO; 2 * 4 * 24], vec![f16::ZERO; 2 * 4 * 24]);
        text(b.evict_oldest(&mut w, 4, &mut k, &mut v))?;
        let mut rows = vec![(k.clone(), v.clone())];
        // Prefetched 4, evicted 2 then 4: neither eviction matches it.
        text(b.prefetch_oldest(&mut w, 4))?;
        let (mut k2, mut v2) = (vec![f16::ZERO; 2 * 2 * 24], vec![f16::ZERO; 2 * 2 * 24]);
        text(b.evict_oldest(&mut w, 2, &mut k2, &mut v2))?;
        text(b.evict_oldest(&mut w, 4, &mut k, &mut v))?;
        rows.push((k2, v2));
        rows.push((k, v));
        expect_err(
            "prefetch of more than held",
            b.prefetch_oldest(&mut w, 7),
            |e| matches!(e, Error::Capacity { .. }),
        )?;
        evicted.push(rows);
    }
    if evicted[0] != evicted[1] {
        return Err("evictions after prefetches differ from evictions without".into());
    }
    // The rows themselves: token t of KV head h is kv[(t * 2 + h) * 24..].
    for (rows, first) in evicted[0].iter().zip([0usize, 4, 6]) {
        let n = rows.0.len() / (2 * 24);
        for h in 0..2 {
            for i in 0..n {
                let src = ((first + i) * 2 + h) * 24;
                let dst = (h * n + i) * 24;
                let want: Vec<f16> = kv[src..src + 24]
                    .iter()
                    .map(|&x| f16::from_f32(x))
                    .collect();
                if rows.0[dst..dst + 24] != want[..] || rows.1[dst..dst + 24] != want[..] {
                    return Err(format!("evicted token {} head {h} differs", first + i));
                }
            }
        }
    }
    Ok(())
}
