//! Generic checks that every backend runs against `hgca-ref`.
//!
//! Each function takes a backend and a case and returns `Err(message)` on
//! the first mismatch, so a backend's tests can call them from proptest
//! (`prop_assert!(r.is_ok(), ...)`) and from a table of edge cases alike.
//! Outputs are poisoned with NaN before every call.

use hgca_kernels::{
    AttnShape, DType, DenseAttention, KvElem, KvWindow, MergeBackend, Partial, PartialLayout,
    PartialRef, Selection, SparseAttention, WindowSpec, bf16, f16,
};
use hgca_ref::RefRow;

use crate::{Problem, Rng, Tolerance, check_rows, within};

/// Rounds reference rows to an f32 partial (what a perfect kernel returns).
pub fn rows_to_partial(layout: PartialLayout, rows: &[RefRow]) -> Partial {
    let out = rows
        .iter()
        .flat_map(|r| r.out.iter().map(|&x| x as f32))
        .collect();
    let lse = rows.iter().map(|r| r.lse as f32).collect();
    Partial::from_vecs(layout, out, lse).expect("rows match the layout")
}

/// Random token sets per KV head: each token kept with a probability drawn
/// per head from {0, 0.1, 0.5, 1} (so empty and full sets occur).
pub fn random_sets(rng: &mut Rng, kv_heads: usize, tokens: usize) -> Vec<Vec<usize>> {
    (0..kv_heads)
        .map(|_| {
            let p = [0u64, 10, 50, 100][rng.below(4)];
            (0..tokens).filter(|_| rng.next_u64() % 100 < p).collect()
        })
        .collect()
}

/// The merge property: the partials of a random partition of random token
/// sets into `n_parts` parts (some empty), merged by `m`, equal the reference
/// over the union.
///
/// # Errors
/// A message on the first mismatch.
pub fn check_merge_partition<M: MergeBackend>(
    m: &M,
    shape: AttnShape,
    tokens: usize,
    spread: f32,
    n_parts: usize,
    seed: u64,
) -> Result<(), String> {
    let p = Problem::<f32>::random(shape, tokens, spread, seed);
    let mut rng = Rng::new(seed.wrapping_add(1));
    let sets = random_sets(&mut rng, shape.kv_heads(), tokens);
    let mut part_sets = vec![vec![Vec::new(); shape.kv_heads()]; n_parts];
    for (g, set) in sets.iter().enumerate() {
        for &j in set {
            part_sets[rng.below(n_parts)][g].push(j);
        }
    }
    let layout = PartialLayout::decode(&shape);
    let parts: Vec<Partial> = part_sets
        .iter()
        .map(|s| rows_to_partial(layout, &p.reference(s)))
        .collect();
    let refs: Vec<PartialRef<'_>> = parts.iter().map(Partial::as_ref).collect();
    let mut out = Partial::poisoned(layout);
    m.merge(&refs, out.as_mut())
        .map_err(|e| hgca_kernels::report(&e))?;
    let want = p.reference(&sets);
    check_rows(
        layout,
        out.out(),
        out.lse(),
        &want,
        p.vmax,
        Tolerance::of(DType::F32),
    )
    .map_err(|e| format!("n-way merge: {e}"))?;
    // The two-way in-place form, folding left, must agree too.
    let mut acc = Partial::empty(layout);
    for part in &refs {
        m.merge_into(acc.as_mut(), *part)
            .map_err(|e| hgca_kernels::report(&e))?;
    }
    check_rows(
        layout,
        acc.out(),
        acc.lse(),
        &want,
        p.vmax,
        Tolerance::of(DType::F32),
    )
    .map_err(|e| format!("2-way merge fold: {e}"))
}

fn sets_from_selection(sel: &Selection) -> Vec<Vec<usize>> {
    (0..sel.kv_heads())
        .map(|g| sel.head(g).iter().map(|&j| j as usize).collect())
        .collect()
}

/// Sparse decode of `b` over `sets` (per KV head, any order, no duplicates)
/// against the reference, with the attended entries' weights.
///
/// # Errors
/// A message on the first mismatch.
pub fn check_sparse<B: SparseAttention, T: KvElem>(
    b: &B,
    p: &Problem<T>,
    sel: &Selection,
) -> Result<(), String> {
    let shape = p.shape;
    let layout = PartialLayout::decode(&shape);
    let group = shape.group();
    let mut out = Partial::poisoned(layout);
    let mut w = vec![f32::NAN; group * sel.total()];
    b.sparse_decode(&shape, &p.q, &p.kv(), sel, out.as_mut(), Some(&mut w))
        .map_err(|e| hgca_kernels::report(&e))?;
    let sets = sets_from_selection(sel);
    let want = p.reference(&sets);
    check_rows(
        layout,
        out.out(),
        out.lse(),
        &want,
        p.vmax,
        Tolerance::of(T::DTYPE),
    )?;
    let tol = Tolerance::of(T::DTYPE);
    let d = shape.head_dim();
    for (g, set) in sets.iter().enumerate() {
        let k = &p.k32[g * p.tokens * d..(g + 1) * p.tokens * d];
        for i in 0..group {
            let h = g * group + i;
            let rw =
                hgca_ref::weights_row(&p.q[h * d..(h + 1) * d], k, d, shape.scale() as f64, set);
            let base = group * sel.offset(g) + i * set.len();
            for (j, &r) in rw.iter().enumerate() {
                let got = w[base + j] as f64;
                let bound = tol.abs + tol.rel * want[h].score_mag;
                if !within((got - r).abs(), bound.max(r * 1e-3)) {
                    return Err(format!("weight head {h} entry {j}: {got} vs {r}"));
                }
            }
        }
    }
    Ok(())
}

/// Token-major `[n, kv_heads, d]` copy of tokens `from..from+n` of a head-major cache.
pub fn token_major(
    src: &[f32],
    kv_heads: usize,
    tokens: usize,
    d: usize,
    from: usize,
    n: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * kv_heads * d);
    for j in from..from + n {
        for h in 0..kv_heads {
            let o = (h * tokens + j) * d;
            out.extend_from_slice(&src[o..o + d]);
        }
    }
    out
}

/// Drives a window through `tokens` appends in chunks of `chunk`, evicting
/// `evict` tokens whenever the next chunk does not fit (checking that the
/// evicted rows are exactly the oldest ones, with and without prefetches of
/// them), then checks decode attention
/// (and its weights) over what the window holds, and causal append
/// attention of the last `min(len, 5)` tokens' queries.
///
/// # Errors
/// A message on the first mismatch.
#[allow(clippy::too_many_arguments)]
pub fn check_dense<B: DenseAttention>(
    b: &B,
    shape: AttnShape,
    dtype: DType,
    capacity: usize,
    tokens: usize,
    chunk: usize,
    evict: usize,
    spread: f32,
    seed: u64,
) -> Result<(), String> {
    match dtype {
        DType::F32 => dense_typed::<B, f32>(b, shape, capacity, tokens, chunk, evict, spread, seed),
        DType::F16 => dense_typed::<B, f16>(b, shape, capacity, tokens, chunk, evict, spread, seed),
        DType::BF16 => {
            dense_typed::<B, bf16>(b, shape, capacity, tokens, chunk, evict, spread, seed)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn dense_typed<B: DenseAttention, T: KvElem>(
    b: &B,
    shape: AttnShape,
    capacity: usize,
    tokens: usize,
    chunk: usize,
    evict: usize,
    spread: f32,
    seed: u64,
) -> Result<(), String> {
    let p = Problem::<T>::random(shape, tokens, spread, seed);
    let (hk, d) = (shape.kv_heads(), shape.head_dim());
    let spec = WindowSpec::new(shape, capacity, T::DTYPE).map_err(|e| hgca_kernels::report(&e))?;
    let mut w = b.new_window(spec).map_err(|e| hgca_kernels::report(&e))?;
    let (mut start, mut written, mut appends) = (0usize, 0usize, 0usize);
    let (chunk, evict) = (chunk.clamp(1, capacity), evict.clamp(1, capacity));
    while written < tokens {
        let n = chunk.min(tokens - written);
        while w.free() < n {
            let e = evict.min(w.len());
            let mut ko = vec![T::from_f32(f32::NAN); hk * e * d];
            let mut vo = ko.clone();
            b.evict_oldest(&mut w, e, &mut ko, &mut vo)
                .map_err(|e| hgca_kernels::report(&e))?;
            for h in 0..hk {
                for i in 0..e {
                    let src = (h * tokens + start + i) * d;
                    let dst = (h * e + i) * d;
                    if bytes_of(&ko[dst..dst + d]) != bytes_of(&p.k[src..src + d])
                        || bytes_of(&vo[dst..dst + d]) != bytes_of(&p.v[src..src + d])
                    {
                        return Err(format!("evicted row head {h} token {} differs", start + i));
                    }
                }
            }
            start += e;
        }
        let k = token_major(&p.k32, hk, tokens, d, written, n);
        let v = token_major(&p.v32, hk, tokens, d, written, n);
        b.append(&mut w, n, &k, &v)
            .map_err(|e| hgca_kernels::report(&e))?;
        written += n;
        appends += 1;
        // Prefetches of the oldest rows: of the count the next eviction
        // takes, of another count (an eviction must then ignore it), or
        // none; appends may follow before the eviction.
        let e = evict.min(w.len());
        let ahead = match appends % 3 {
            0 => e,
            1 => e - 1,
            _ => 0,
        };
        if ahead > 0 {
            b.prefetch_oldest(&mut w, ahead)
                .map_err(|e| format!("prefetch {ahead}: {e}"))?;
        }
    }
    let more = w.len() + 1;
    if b.prefetch_oldest(&mut w, more).is_ok() {
        return Err("a prefetch of more tokens than held was accepted".into());
    }
    if w.len() != written - start || w.start_pos() != start as u64 {
        return Err(format!(
            "window holds {} tokens from {}, expected {} from {start}",
            w.len(),
            w.start_pos(),
            written - start
        ));
    }
    let tol = Tolerance::of(T::DTYPE);
    let set: Vec<usize> = (start..written).collect();
    let sets = vec![set.clone(); hk];
    let layout = PartialLayout::decode(&shape);
    let pending = b
        .submit_decode(&w, &p.q, true)
        .map_err(|e| hgca_kernels::report(&e))?;
    let mut out = Partial::poisoned(layout);
    let mut weights = vec![f32::NAN; shape.q_heads() * set.len()];
    b.wait(pending, out.as_mut(), Some(&mut weights))
        .map_err(|e| hgca_kernels::report(&e))?;
    let want = p.reference(&sets);
    check_rows(layout, out.out(), out.lse(), &want, p.vmax, tol)
        .map_err(|e| format!("decode: {e}"))?;
    let group = shape.group();
    for h in 0..shape.q_heads() {
        let g = h / group;
        let k = &p.k32[g * tokens * d..(g + 1) * tokens * d];
        let rw = hgca_ref::weights_row(&p.q[h * d..(h + 1) * d], k, d, shape.scale() as f64, &set);
        for (j, &r) in rw.iter().enumerate() {
            let got = weights[h * set.len() + j] as f64;
            if !within(
                (got - r).abs(),
                (tol.abs + tol.rel * want[h].score_mag).max(r * 1e-3),
            ) {
                return Err(format!("decode weight head {h} token {j}: {got} vs {r}"));
            }
        }
    }
    // The handing-over wait gives the same partial and weights, twice (a
    // backend that swaps buffers gets its own back the second time).
    for _ in 0..2 {
        let pending = b
            .submit_decode(&w, &p.q, true)
            .map_err(|e| hgca_kernels::report(&e))?;
        let mut again = Partial::poisoned(layout);
        let mut handed = vec![f32::NAN; weights.len()];
        b.wait_weights(pending, again.as_mut(), &mut handed)
            .map_err(|e| hgca_kernels::report(&e))?;
        if again != out
            || handed
                .iter()
                .zip(&weights)
                .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            return Err("wait_weights differs from wait".into());
        }
    }
    // Causal append: the last n_q window tokens' positions, queries drawn anew.
    let n_q = set.len().min(5);
    if n_q > 0 {
        let mut rng = Rng::new(seed ^ 0xA99E);
        let a = p.q.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-3);
        let qs: Vec<f32> = (0..n_q * shape.q_len()).map(|_| a * rng.sym()).collect();
        let p0 = written - n_q;
        let layout = PartialLayout::append(&shape, n_q);
        let pending = b
            .submit_append(&w, &qs, n_q, p0 as u64)
            .map_err(|e| hgca_kernels::report(&e))?;
        let mut out = Partial::poisoned(layout);
        b.wait(pending, out.as_mut(), None)
            .map_err(|e| hgca_kernels::report(&e))?;
        let mut want = Vec::new();
        for i in 0..n_q {
            let sets = vec![(start..=p0 + i).collect::<Vec<_>>(); hk];
            let q = &qs[i * shape.q_len()..(i + 1) * shape.q_len()];
            want.extend(hgca_ref::attend(
                q,
                &p.k32,
                &p.v32,
                shape.q_heads(),
                hk,
                d,
                tokens,
                shape.scale() as f64,
                &sets,
            ));
        }
        check_rows(layout, out.out(), out.lse(), &want, p.vmax, tol)
            .map_err(|e| format!("append: {e}"))?;
    }
    Ok(())
}

fn bytes_of<T: KvElem>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

/// A backend's `wait` given a weights buffer for a decode submitted without
/// `want_weights` returns [`hgca_kernels::weights_not_requested`]'s error,
/// the same variant on every backend, and a decode submitted with them
/// refuses a buffer of the wrong length with [`hgca_kernels::Error::Length`].
///
/// # Errors
/// A message naming what differed.
pub fn check_weights_request<B: DenseAttention>(b: &B) -> Result<(), String> {
    use hgca_kernels::{Error, Partial, PartialLayout};
    let shape = AttnShape::new(4, 2, 8).map_err(|e| hgca_kernels::report(&e))?;
    let spec = WindowSpec::new(shape, 16, DType::F32).map_err(|e| hgca_kernels::report(&e))?;
    let mut w = b.new_window(spec).map_err(|e| hgca_kernels::report(&e))?;
    let row = vec![0.5f32; 3 * shape.kv_token_len()];
    b.append(&mut w, 3, &row, &row)
        .map_err(|e| hgca_kernels::report(&e))?;
    let q = vec![0.25f32; shape.q_len()];
    let layout = PartialLayout::decode(&shape);
    let mut out = Partial::empty(layout);
    let mut weights = vec![0.0f32; shape.q_heads() * 3];
    let p = b
        .submit_decode(&w, &q, false)
        .map_err(|e| hgca_kernels::report(&e))?;
    match b.wait(p, out.as_mut(), Some(&mut weights)) {
        Err(e) if e.to_string() == hgca_kernels::weights_not_requested().to_string() => {}
        other => return Err(format!("weights not requested at submit: {other:?}")),
    }
    let p = b
        .submit_decode(&w, &q, true)
        .map_err(|e| hgca_kernels::report(&e))?;
    match b.wait(p, out.as_mut(), Some(&mut weights[1..])) {
        Err(Error::Length {
            what: "weights", ..
        }) => Ok(()),
        other => Err(format!("a short weights buffer: {other:?}")),
    }
}
