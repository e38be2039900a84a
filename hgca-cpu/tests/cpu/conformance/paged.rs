//! Engine-owned caches: every paged layout constructor, dense and CSR block
//! tables with shuffled pages, batched decode (dense and sparse, with
//! weights) against hgca-ref per sequence, every LSE format, shards, the
//! bad-input table and page selection.

use hgca_cpu::{BatchTokens, CpuBackend, Par, Shard};
use hgca_kernels::{
    AttnShape, BlockTable, Error, KvElem, LseBase, LseFormat, LseLayout, PageBounds, PagedBatch,
    PagedLayout, PagedPool, PagedSeq, Selection, bf16, f16,
};
use hgca_testkit::{Problem, Rng, Tolerance, check_rows, within};

use super::selection;

/// The layouts engines keep (see `hgca_kernels::PagedPool`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    VllmCpu,
    VllmFlash,
    NhdSeparate,
    HndSeparate,
    NhdCombined,
    HndCombined,
    /// ggml token-major rows with padding (one sequence, one page).
    TokenMajor,
    /// hgca head-major (one sequence, one page).
    HeadMajor,
}

pub const KINDS: [Kind; 8] = [
    Kind::VllmCpu,
    Kind::VllmFlash,
    Kind::NhdSeparate,
    Kind::HndSeparate,
    Kind::NhdCombined,
    Kind::HndCombined,
    Kind::TokenMajor,
    Kind::HeadMajor,
];

impl Kind {
    fn one_page(self) -> bool {
        matches!(self, Kind::TokenMajor | Kind::HeadMajor)
    }
}

/// A cache in an engine's layout holding the sequences of `probs`, pages
/// shuffled over a pool with spare pages; every element no sequence owns
/// is NaN, so a wrong row shows.
pub struct Cache<T> {
    pub kind: Kind,
    pub bs: usize,
    pub nb: usize,
    pub k: Vec<T>,
    pub v: Vec<T>,
    /// Page list per sequence.
    pub pages: Vec<Vec<u32>>,
    pub lens: Vec<usize>,
    pub hk: usize,
    pub d: usize,
    pub row_stride: usize,
}

impl<T: KvElem> Cache<T> {
    /// Element offsets of `(page, i, h)` in K and in V, by the engines'
    /// formulas written out here (not the library's strides).
    fn at(&self, p: usize, i: usize, h: usize) -> (usize, usize) {
        let (nb, bs, hk, d) = (self.nb, self.bs, self.hk, self.d);
        let page = bs * hk * d;
        match self.kind {
            Kind::VllmCpu => {
                let o = p * page + h * bs * d + i * d;
                (o, nb * page + o)
            }
            Kind::VllmFlash => {
                let o = p * page + i * hk * d + h * d;
                (o, nb * page + o)
            }
            Kind::NhdSeparate => {
                let o = p * page + i * hk * d + h * d;
                (o, o)
            }
            Kind::HndSeparate => {
                let o = p * page + h * bs * d + i * d;
                (o, o)
            }
            Kind::NhdCombined => {
                let o = p * 2 * page + i * hk * d + h * d;
                (o, o + page)
            }
            Kind::HndCombined => {
                let o = p * 2 * page + h * bs * d + i * d;
                (o, o + page)
            }
            Kind::TokenMajor => {
                let o = i * self.row_stride + h * d;
                (o, o)
            }
            Kind::HeadMajor => {
                let o = h * bs * d + i * d;
                (o, o)
            }
        }
    }

    pub fn build(kind: Kind, bs: usize, probs: &[Problem<T>], rng: &mut Rng) -> Self {
        let shape = probs[0].shape;
        let (hk, d) = (shape.kv_heads(), shape.head_dim());
        let lens: Vec<usize> = probs.iter().map(|p| p.tokens).collect();
        let (bs, nb) = if kind.one_page() {
            assert_eq!(probs.len(), 1);
            (lens[0].max(1), 1)
        } else {
            let need: usize = lens.iter().map(|l| l.div_ceil(bs)).sum();
            (bs, need + 1 + rng.below(3))
        };
        let row_stride = hk * d + rng.below(3);
        let mut order: Vec<u32> = (0..nb as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut next = order.into_iter();
        let pages: Vec<Vec<u32>> = lens
            .iter()
            .map(|l| (0..l.div_ceil(bs)).map(|_| next.next().unwrap()).collect())
            .collect();
        let len = match kind {
            Kind::VllmCpu | Kind::VllmFlash | Kind::NhdCombined | Kind::HndCombined => {
                2 * nb * bs * hk * d
            }
            Kind::NhdSeparate | Kind::HndSeparate | Kind::HeadMajor => nb * bs * hk * d,
            Kind::TokenMajor => bs * row_stride,
        };
        let nan = T::from_f32(f32::NAN);
        let mut c = Cache {
            kind,
            bs,
            nb,
            k: vec![nan; len],
            v: vec![nan; len],
            pages,
            lens,
            hk,
            d,
            row_stride,
        };
        let one = matches!(
            kind,
            Kind::VllmCpu | Kind::VllmFlash | Kind::NhdCombined | Kind::HndCombined
        );
        for (b, p) in probs.iter().enumerate() {
            for j in 0..p.tokens {
                let page = c.pages[b][j / bs] as usize;
                for h in 0..hk {
                    let (ko, vo) = c.at(page, j % bs, h);
                    let src = (h * p.tokens + j) * d;
                    c.k[ko..ko + d].copy_from_slice(&p.k[src..src + d]);
                    let vbuf = if one { &mut c.k } else { &mut c.v };
                    vbuf[vo..vo + d].copy_from_slice(&p.v[src..src + d]);
                }
            }
        }
        c
    }

    pub fn pool(&self) -> PagedPool<'_, T> {
        let (nb, bs, hk, d) = (self.nb, self.bs, self.hk, self.d);
        match self.kind {
            Kind::VllmCpu => PagedPool::vllm_cpu(&self.k, nb, hk, bs, d),
            Kind::VllmFlash => PagedPool::vllm_flash(&self.k, nb, bs, hk, d),
            Kind::NhdSeparate => PagedPool::flashinfer_nhd(&self.k, &self.v, nb, bs, hk, d),
            Kind::HndSeparate => PagedPool::flashinfer_hnd(&self.k, &self.v, nb, bs, hk, d),
            Kind::NhdCombined => PagedPool::flashinfer_nhd_combined(&self.k, nb, bs, hk, d),
            Kind::HndCombined => PagedPool::flashinfer_hnd_combined(&self.k, nb, bs, hk, d),
            Kind::TokenMajor => {
                PagedPool::token_major(&self.k, &self.v, bs, hk, d, self.row_stride)
            }
            Kind::HeadMajor => PagedPool::head_major(&self.k, &self.v, hk, bs, d),
        }
        .expect("the cache fits its layout by construction")
    }

    /// Tables in both conventions: dense (with padding columns holding a
    /// page index out of range, which must never be read) and CSR.
    pub fn tables(&self) -> Tables {
        let max_blocks = self.pages.iter().map(Vec::len).max().unwrap_or(0) + 1;
        let mut dense = Vec::new();
        for p in &self.pages {
            dense.extend(p.iter().copied());
            dense.extend(std::iter::repeat_n(u32::MAX, max_blocks - p.len()));
        }
        let lens: Vec<u32> = self.lens.iter().map(|&l| l as u32).collect();
        let mut indptr = vec![0u32];
        let mut indices = Vec::new();
        let mut last = Vec::new();
        for (p, &l) in self.pages.iter().zip(&self.lens) {
            indices.extend(p.iter().copied());
            indptr.push(indices.len() as u32);
            last.push(if l == 0 { 0 } else { (l - 1) % self.bs + 1 } as u32);
        }
        Tables {
            dense,
            max_blocks,
            lens,
            indptr,
            indices,
            last,
        }
    }
}

/// A cache's block tables: dense `[batch, max_blocks]` + lengths, and CSR.
pub struct Tables {
    pub dense: Vec<u32>,
    pub max_blocks: usize,
    pub lens: Vec<u32>,
    pub indptr: Vec<u32>,
    pub indices: Vec<u32>,
    pub last: Vec<u32>,
}

/// Weights of the reference, per sequence, in the batch's layout.
fn check_weights<T: KvElem>(
    probs: &[Problem<T>],
    sels: Option<&[Selection]>,
    w: &[f32],
) -> Result<(), String> {
    let shape = probs[0].shape;
    let (d, group) = (shape.head_dim(), shape.group());
    let tol = Tolerance::of(T::DTYPE);
    let mut base = 0;
    for (b, p) in probs.iter().enumerate() {
        let sets: Vec<Vec<usize>> = match sels {
            Some(s) => (0..shape.kv_heads())
                .map(|g| s[b].head(g).iter().map(|&j| j as usize).collect())
                .collect(),
            None => vec![(0..p.tokens).collect(); shape.kv_heads()],
        };
        let refs = p.reference(&sets);
        for (g, set) in sets.iter().enumerate() {
            let k = &p.k32[g * p.tokens * d..(g + 1) * p.tokens * d];
            for i in 0..group {
                let h = g * group + i;
                let rw = hgca_ref::weights_row(
                    &p.q[h * d..(h + 1) * d],
                    k,
                    d,
                    shape.scale() as f64,
                    set,
                );
                let at = match sels {
                    Some(s) => base + group * s[b].offset(g) + i * set.len(),
                    None => base + h * p.tokens,
                };
                for (j, &r) in rw.iter().enumerate() {
                    let got = w[at + j] as f64;
                    let bound = tol.abs + tol.rel * refs[h].score_mag;
                    if !within((got - r).abs(), bound.max(r * 1e-3)) {
                        return Err(format!("seq {b} weight head {h} entry {j}: {got} vs {r}"));
                    }
                }
            }
        }
        base += match sels {
            Some(s) => group * s[b].total(),
            None => shape.q_heads() * p.tokens,
        };
    }
    if base != w.len() {
        return Err(format!("weights: {} expected, {} given", base, w.len()));
    }
    Ok(())
}

/// One case: `lens.len()` sequences in layout `kind` with pages of `bs`,
/// decoded as one batch (dense or sparse), against the reference per
/// sequence; both table conventions; the lse in `fmt`.
#[allow(clippy::too_many_arguments)]
pub fn batch_case<T: KvElem + hgca_cpu::isa::SimdElem>(
    cpu: &CpuBackend,
    kind: Kind,
    bs: usize,
    shape: AttnShape,
    lens: &[usize],
    sparse: bool,
    fmt: LseFormat,
    spread: f32,
    seed: u64,
) -> Result<(), String> {
    let lens = if kind.one_page() { &lens[..1] } else { lens };
    let mut rng = Rng::new(seed);
    let probs: Vec<Problem<T>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| Problem::random(shape, n, spread, seed.wrapping_add(i as u64 * 7919)))
        .collect();
    let cache = Cache::build(kind, bs, &probs, &mut rng);
    let Tables {
        dense,
        max_blocks,
        lens: seq_lens,
        indptr,
        indices,
        last,
    } = cache.tables();
    let sels: Vec<Selection> = probs
        .iter()
        .map(|p| selection(&mut rng, shape.kv_heads(), p.tokens))
        .collect();
    // Owned selections and borrowed views of them, taken in turn.
    let views: Vec<hgca_kernels::SelectionRef<'_>> = sels.iter().map(Selection::as_view).collect();
    let tokens = match (sparse, seed % 2) {
        (false, _) => BatchTokens::Dense,
        (true, 0) => BatchTokens::Sparse(&sels),
        (true, _) => BatchTokens::SparseRef(&views),
    };
    let b = lens.len();
    let (qh, d) = (shape.q_heads(), shape.head_dim());
    let q: Vec<f32> = probs.iter().flat_map(|p| p.q.iter().copied()).collect();
    let wlen: usize = if sparse {
        sels.iter().map(|s| shape.group() * s.total()).sum()
    } else {
        lens.iter().map(|l| qh * l).sum()
    };
    let tables = [
        BlockTable::dense(&dense, max_blocks, &seq_lens).map_err(|e| e.to_string())?,
        BlockTable::csr(&indptr, &indices, &last).map_err(|e| e.to_string())?,
    ];
    let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
    for table in tables {
        let batch = PagedBatch::new(cache.pool(), table).map_err(|e| e.to_string())?;
        let mut out = vec![f32::NAN; b * qh * d];
        let mut lse = vec![f32::NAN; b * qh];
        let mut w = vec![f32::NAN; wlen];
        cpu.decode_batch(
            &shape,
            &q,
            &batch,
            tokens,
            &mut out,
            &mut lse,
            fmt,
            Some(&mut w),
        )
        .map_err(|e| e.to_string())?;
        let mut natural = vec![0.0f32; b * qh];
        fmt.read(&lse, b, qh, &mut natural)
            .map_err(|e| e.to_string())?;
        for (i, p) in probs.iter().enumerate() {
            let sets: Vec<Vec<usize>> = if sparse {
                (0..shape.kv_heads())
                    .map(|g| sels[i].head(g).iter().map(|&j| j as usize).collect())
                    .collect()
            } else {
                vec![(0..p.tokens).collect(); shape.kv_heads()]
            };
            check_rows(
                hgca_kernels::PartialLayout::decode(&shape),
                &out[i * qh * d..(i + 1) * qh * d],
                &natural[i * qh..(i + 1) * qh],
                &p.reference(&sets),
                p.vmax,
                Tolerance::of(T::DTYPE),
            )
            .map_err(|e| format!("{kind:?} bs {bs} seq {i} ({table:?}): {e}"))?;
        }
        check_weights(&probs, sparse.then_some(&sels[..]), &w)
            .map_err(|e| format!("{kind:?} bs {bs}: {e}"))?;
        // The lse in `fmt` is exactly the natural one converted.
        for t in 0..b {
            for h in 0..qh {
                let want = fmt.from_natural(natural[t * qh + h]);
                let got = lse[fmt.index(t, h, b, qh)];
                if !(got == want || got.is_nan() && want.is_nan()) {
                    return Err(format!("lse format {fmt:?}: ({t}, {h}) {got} vs {want}"));
                }
            }
        }
        // Both table conventions give the same bits.
        match &first {
            None => first = Some((out, lse)),
            Some((o, l)) => {
                if o.iter().zip(&out).any(|(a, b)| a.to_bits() != b.to_bits())
                    || l.iter().zip(&lse).any(|(a, b)| a.to_bits() != b.to_bits())
                {
                    return Err("dense and CSR tables differ".into());
                }
            }
        }
    }
    Ok(())
}

/// The four LSE conventions.
pub const FORMATS: [LseFormat; 4] = [
    LseFormat::NATURAL,
    LseFormat::FLASHINFER,
    LseFormat::VLLM,
    LseFormat {
        base: LseBase::Two,
        layout: LseLayout::HeadsTokens,
    },
];

#[allow(clippy::too_many_arguments)]
pub fn dispatch_case(
    cpu: &CpuBackend,
    dtype: hgca_kernels::DType,
    kind: Kind,
    bs: usize,
    shape: AttnShape,
    lens: &[usize],
    sparse: bool,
    fmt: LseFormat,
    seed: u64,
) -> Result<(), String> {
    use hgca_kernels::DType;
    match dtype {
        DType::F32 => batch_case::<f32>(cpu, kind, bs, shape, lens, sparse, fmt, 10.0, seed),
        DType::F16 => batch_case::<f16>(cpu, kind, bs, shape, lens, sparse, fmt, 10.0, seed),
        DType::BF16 => batch_case::<bf16>(cpu, kind, bs, shape, lens, sparse, fmt, 10.0, seed),
    }
}

/// The edge table: every layout x block sizes 1, 3, 16, 64 x a few shapes
/// and lengths (0, 1, a page, a page + 1, many pages), dense and sparse.
pub fn edge_table(cpu: &CpuBackend) {
    let shapes = [(1, 1, 1), (4, 2, 16), (8, 2, 17), (32, 8, 128), (12, 4, 96)];
    let mut seed = 1u64;
    for kind in KINDS {
        for bs in [1usize, 3, 16, 64] {
            for &(qh, hk, d) in &shapes {
                let shape = AttnShape::new(qh, hk, d).unwrap();
                for lens in [&[0usize, 1][..], &[bs, bs + 1, 3 * bs + 2], &[130, 0, 17]] {
                    for sparse in [false, true] {
                        seed += 1;
                        let fmt = FORMATS[seed as usize % 4];
                        let dtype = hgca_kernels::DType::ALL[seed as usize % 3];
                        let r = dispatch_case(cpu, dtype, kind, bs, shape, lens, sparse, fmt, seed);
                        assert!(
                            r.is_ok(),
                            "{kind:?} bs {bs} {shape:?} {lens:?}: {}",
                            r.unwrap_err()
                        );
                    }
                }
            }
        }
    }
}

/// An empty batch (no sequences) and sequences of no tokens are valid:
/// nothing to write, no error, on every parallelism (a threaded plan over
/// zero units must not divide by zero).
pub fn empty_batch(cpu: &CpuBackend) {
    let shape = AttnShape::new(4, 2, 8).unwrap();
    let k = vec![0.5f32; 2 * 3 * 2 * 4 * 8];
    let pool = PagedPool::vllm_cpu(&k, 3, 2, 4, 8).unwrap();
    let none = PagedBatch::new(pool, BlockTable::dense(&[], 2, &[]).unwrap()).unwrap();
    let (mut o, mut l) = (Vec::<f32>::new(), Vec::<f32>::new());
    for tokens in [BatchTokens::Dense, BatchTokens::Sparse(&[])] {
        cpu.decode_batch(
            &shape,
            &[],
            &none,
            tokens,
            &mut o,
            &mut l,
            LseFormat::VLLM,
            Some(&mut []),
        )
        .unwrap();
        cpu.decode_batch_shard(
            Shard::new(1, 3).unwrap(),
            &shape,
            &[],
            &none,
            tokens,
            &mut o,
            &mut l,
            LseFormat::NATURAL,
            None,
        )
        .unwrap();
    }
    let zero = PagedBatch::new(pool, BlockTable::dense(&[0, 0], 1, &[0, 0]).unwrap()).unwrap();
    let (mut o, mut l) = (vec![f32::NAN; 2 * 4 * 8], vec![f32::NAN; 2 * 4]);
    cpu.decode_batch(
        &shape,
        &[1.0; 64],
        &zero,
        BatchTokens::Dense,
        &mut o,
        &mut l,
        LseFormat::NATURAL,
        None,
    )
    .unwrap();
    assert!(o.iter().all(|&x| x == 0.0) && l.iter().all(|&x| x == f32::NEG_INFINITY));
    let seq = zero.seq(0).unwrap();
    let mut out = hgca_kernels::Partial::poisoned(hgca_kernels::PartialLayout::append(&shape, 0));
    cpu.dense_append(&shape, &[], 0, 1, &seq, out.as_mut())
        .unwrap();
}

/// A page handed to another owner and filled to as many tokens as before:
/// the bounds cannot see it (the count is equal), `reset` makes them follow
/// the new keys.
pub fn page_reuse(cpu: &CpuBackend) {
    let shape = AttnShape::new(2, 1, 4).unwrap();
    let mut k = vec![0.0f32; 2 * 2 * 4 * 4]; // (2, pages 2, heads 1, block 4, d 4)
    let mut q = [0.0f32; 8];
    q[0] = 1.0;
    let q = q;
    let ub_of = |k: &[f32], bounds: &mut PageBounds<f32>, reset: bool| {
        let pool = PagedPool::vllm_cpu(k, 2, 1, 4, 4).unwrap();
        let seq = PagedSeq::new(pool, &[1], 4).unwrap();
        if reset {
            bounds.reset(1);
        }
        bounds.update_seq(&seq).unwrap();
        let mut ub = [0.0f32; 1];
        cpu.page_upper_bounds(&shape, &q, &seq, bounds, &mut ub)
            .unwrap();
        ub[0]
    };
    let pool = PagedPool::vllm_cpu(&k, 2, 1, 4, 4).unwrap();
    let mut bounds = PageBounds::new(pool.layout()).unwrap();
    assert_eq!(ub_of(&k, &mut bounds, false), 0.0);
    k[(4 + 1) * 4] = 9.0; // page 1, token 1, dim 0: the new owner's key
    assert_eq!(
        ub_of(&k, &mut bounds, false),
        0.0,
        "equal fill: the stale bound stays"
    );
    assert_eq!(
        ub_of(&k, &mut bounds, true),
        9.0 * shape.scale(),
        "after reset"
    );
}
/// Shards `0..nth`, each computed alone into its own slices, concatenated,
/// are bit for bit the whole call (sequential), weights included.
pub fn shards_case(cpu: &CpuBackend, nth: usize, sparse: bool, seed: u64) -> Result<(), String> {
    let shape = AttnShape::new(12, 4, 32).unwrap();
    let lens = [300usize, 0, 77, 1];
    let mut rng = Rng::new(seed);
    let probs: Vec<Problem<f16>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| Problem::random(shape, n, 5.0, seed + i as u64))
        .collect();
    let cache = Cache::build(Kind::VllmFlash, 16, &probs, &mut rng);
    let t = cache.tables();
    let batch = PagedBatch::new(
        cache.pool(),
        BlockTable::dense(&t.dense, t.max_blocks, &t.lens).unwrap(),
    )
    .unwrap();
    let sels: Vec<Selection> = probs
        .iter()
        .map(|p| selection(&mut rng, 4, p.tokens))
        .collect();
    let tokens = if sparse {
        BatchTokens::Sparse(&sels)
    } else {
        BatchTokens::Dense
    };
    let q: Vec<f32> = probs.iter().flat_map(|p| p.q.iter().copied()).collect();
    let (qh, d, b) = (12, 32, lens.len());
    let whole_cpu = cpu.clone().with_par(Par::Seq).unwrap();
    let wlen = CpuBackend::shard_weights(&shape, &batch, tokens, Shard::WHOLE)
        .unwrap()
        .len();
    let (mut o, mut l, mut w) = (vec![0.0; b * qh * d], vec![0.0; b * qh], vec![0.0; wlen]);
    whole_cpu
        .decode_batch(
            &shape,
            &q,
            &batch,
            tokens,
            &mut o,
            &mut l,
            LseFormat::FLASHINFER,
            Some(&mut w),
        )
        .map_err(|e| e.to_string())?;
    let (mut so, mut sl2, mut sw) = (Vec::new(), Vec::new(), Vec::new());
    for ith in 0..nth {
        let shard = Shard::new(ith, nth).unwrap();
        let rows = CpuBackend::shard_rows(&shape, b, shard);
        let wr = CpuBackend::shard_weights(&shape, &batch, tokens, shard).unwrap();
        let (mut a, mut c, mut e) = (
            vec![f32::NAN; rows.len() * d],
            vec![f32::NAN; rows.len()],
            vec![f32::NAN; wr.len()],
        );
        cpu.decode_batch_shard(
            shard,
            &shape,
            &q,
            &batch,
            tokens,
            &mut a,
            &mut c,
            LseFormat::FLASHINFER,
            Some(&mut e),
        )
        .map_err(|e| e.to_string())?;
        so.extend(a);
        sl2.extend(c);
        sw.extend(e);
    }
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    if bits(&so) != bits(&o) || bits(&sl2) != bits(&l) || bits(&sw) != bits(&w) {
        return Err(format!(
            "nth {nth} sparse {sparse}: shards differ from the whole call"
        ));
    }
    Ok(())
}

/// Page bounds bound every key of their page, incrementally as pages
/// fill (and after a page is reused), and the selectors pick what their
/// rules say.
pub fn page_selection_case(cpu: &CpuBackend, seed: u64) -> Result<(), String> {
    let shape = AttnShape::new(8, 2, 24).unwrap();
    let mut rng = Rng::new(seed);
    let bs = 16;
    let full = Problem::<bf16>::random(shape, 200, 20.0, seed);
    let cache = Cache::build(Kind::NhdSeparate, bs, std::slice::from_ref(&full), &mut rng);
    let pool = cache.pool();
    let mut bounds = PageBounds::new(pool.layout()).unwrap();
    // Grow the sequence in uneven steps, updating the bounds each time.
    let mut len = 0;
    while len < 200 {
        len = (len + 1 + rng.below(40)).min(200);
        let seq = PagedSeq::new(pool, &cache.pages[0], len).unwrap();
        bounds.update_seq(&seq).map_err(|e| e.to_string())?;
        let pages = seq.pages().len();
        let mut ub = vec![0.0f32; 2 * pages];
        cpu.page_upper_bounds(&shape, &full.q, &seq, &bounds, &mut ub)
            .map_err(|e| e.to_string())?;
        let d = 24;
        for g in 0..2 {
            for slot in 0..pages {
                for j in slot * bs..((slot + 1) * bs).min(len) {
                    let k = &full.k32[(g * 200 + j) * d..][..d];
                    for h in g * 4..(g + 1) * 4 {
                        let s =
                            hgca_ref::dot(&full.q[h * d..(h + 1) * d], k) * shape.scale() as f64;
                        let bound = ub[g * pages + slot] as f64;
                        if s > bound + 1e-4 * (1.0 + s.abs()) {
                            return Err(format!(
                                "len {len} head {h} token {j}: score {s} above {bound}"
                            ));
                        }
                    }
                }
            }
        }
        // Top-k pages: the k pages of highest bound, every token of them.
        let k = 1 + rng.below(pages);
        let mut sel = Selection::new();
        hgca_kernels::select_top_pages(&ub, 2, pages, bs, len, k, &mut sel)
            .map_err(|e| e.to_string())?;
        for g in 0..2 {
            let row = &ub[g * pages..(g + 1) * pages];
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let kth = sorted[k - 1];
            let picked: Vec<usize> = (0..pages)
                .filter(|&p| sel.head(g).contains(&((p * bs) as u32)))
                .collect();
            if picked.len() != k || picked.iter().any(|&p| row[p] < kth) {
                return Err(format!("top-{k} pages of head {g}: {picked:?} of {row:?}"));
            }
            let want: Vec<u32> = picked
                .iter()
                .flat_map(|&p| (p * bs) as u32..((p + 1) * bs).min(len) as u32)
                .collect();
            if sel.head(g) != want.as_slice() {
                return Err("top pages: tokens not those of the pages, in order".into());
            }
        }
        // Mass target 1.0 with max share 1.0 takes every page; a share too
        // small for the target falls back to dense, visibly.
        let mut report = Vec::new();
        let t = hgca_kernels::MassTarget::new(1.0, 1.0).unwrap();
        hgca_kernels::select_by_mass(&ub, 2, pages, bs, len, t, &mut sel, &mut report)
            .map_err(|e| e.to_string())?;
        if sel.total() != 2 * len || report.iter().any(|r| r.pages != pages) {
            return Err(format!("mass 1.0 took {} of {}", sel.total(), 2 * len));
        }
        let t = hgca_kernels::MassTarget::new(0.5, 1e-6).unwrap();
        hgca_kernels::select_by_mass(&ub, 2, pages, bs, len, t, &mut sel, &mut report)
            .map_err(|e| e.to_string())?;
        for (g, r) in report.iter().enumerate() {
            // One page is the most a share of 1e-6 allows: a head that
            // needs more takes all of them and says so.
            let ok = if r.dense {
                r.pages == pages && r.estimated == 1.0
            } else {
                r.pages == 1 && r.estimated >= 0.5
            };
            let tokens_of_pick = sel.head(g).first().map_or(0, |&j| {
                let p = j as usize / bs;
                ((p + 1) * bs).min(len) - p * bs
            });
            if !ok || sel.head(g).len() != if r.dense { len } else { tokens_of_pick } {
                return Err(format!("head {g}: {r:?} of {pages} pages"));
            }
        }
    }
    // A reused page (fewer tokens than the bounds cover) is rebuilt.
    let seq = PagedSeq::new(pool, &cache.pages[0], 5).unwrap();
    bounds.update_seq(&seq).map_err(|e| e.to_string())?;
    if bounds.filled(cache.pages[0][0] as usize) != 5 {
        return Err("reused page not rebuilt".into());
    }
    Ok(())
}

/// Bad input: a typed error naming the field, never a panic.
pub fn bad_input_table() {
    let k = vec![0.0f32; 2 * 4 * 2 * 16 * 8];
    let shape = AttnShape::new(4, 2, 8).unwrap();
    let cpu = CpuBackend::new();
    let layout = PagedLayout {
        num_blocks: 4,
        block_size: 16,
        kv_heads: 2,
        head_dim: 8,
        block_stride: 2 * 16 * 8,
        token_stride: 8,
        head_stride: 16 * 8,
    };
    // Strides that reach past the slice.
    let far = PagedLayout {
        block_stride: 2 * 16 * 8 + 1,
        ..layout
    };
    let short = &k[..4 * 2 * 16 * 8];
    assert!(matches!(
        PagedPool::strided(short, 0, short, 0, far, 1),
        Err(Error::Length { what: "k", .. })
    ));
    assert!(matches!(
        PagedPool::strided(&k, 0, &k, 4 * 2 * 16 * 8 + 1, layout, 1),
        Err(Error::Length { what: "v", .. })
    ));
    // Non-contiguous head_dim.
    assert!(matches!(
        PagedPool::strided(&k, 0, &k, 0, layout, 2),
        Err(Error::Param {
            what: "dim_stride",
            ..
        })
    ));
    // Zero block size, zero pages.
    assert!(matches!(
        PagedPool::strided(
            &k,
            0,
            &k,
            0,
            PagedLayout {
                block_size: 0,
                ..layout
            },
            1
        ),
        Err(Error::Zero { what: "block_size" })
    ));
    assert!(matches!(
        PagedPool::vllm_cpu(&k, 0, 2, 16, 8),
        Err(Error::Zero { .. } | Error::Length { .. })
    ));
    // Overflowing size arithmetic.
    assert!(matches!(
        PagedPool::strided(
            &k,
            0,
            &k,
            0,
            PagedLayout {
                num_blocks: usize::MAX,
                ..layout
            },
            1
        ),
        Err(Error::Capacity { .. })
    ));
    assert!(matches!(
        PagedPool::vllm_cpu(&k, usize::MAX / 2, 2, 16, 8),
        Err(Error::Capacity { .. })
    ));
    // A tensor of the wrong size for its named layout.
    assert!(matches!(
        PagedPool::vllm_cpu(&k[1..], 4, 2, 16, 8),
        Err(Error::Length {
            what: "kv_cache",
            ..
        })
    ));
    let pool = PagedPool::vllm_cpu(&k, 4, 2, 16, 8).unwrap();
    // Block index out of range (dense and CSR).
    let lens = [20u32];
    let bad = [1u32, 4];
    assert!(matches!(
        PagedBatch::new(pool, BlockTable::dense(&bad, 2, &lens).unwrap()),
        Err(Error::Index {
            what: "block_table page",
            index: 4,
            len: 4
        })
    ));
    assert!(matches!(
        PagedBatch::new(pool, BlockTable::csr(&[0, 2], &bad, &[4]).unwrap()),
        Err(Error::Index {
            what: "block_table page",
            ..
        })
    ));
    // seq_len beyond its table row.
    let long = [33u32];
    assert!(matches!(
        PagedBatch::new(pool, BlockTable::dense(&[0, 1], 2, &long).unwrap()),
        Err(Error::Capacity { .. })
    ));
    // Arrays of different lengths.
    assert!(matches!(
        BlockTable::dense(&[0, 1, 2], 2, &[3, 4]),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        BlockTable::csr(&[0, 1, 2], &[0, 1], &[3]),
        Err(Error::Length {
            what: "last_page_len (batch)",
            ..
        })
    ));
    assert!(matches!(
        BlockTable::csr(&[], &[], &[]),
        Err(Error::Zero { .. })
    ));
    // CSR: decreasing indptr, indptr past indices, bad last_page_len.
    assert!(matches!(
        PagedBatch::new(pool, BlockTable::csr(&[0, 2, 1], &[0, 1], &[3, 3]).unwrap()),
        Err(Error::Param { .. })
    ));
    assert!(matches!(
        PagedBatch::new(pool, BlockTable::csr(&[0, 3], &[0, 1], &[3]).unwrap()),
        Err(Error::Index { .. })
    ));
    for last in [0u32, 17] {
        assert!(matches!(
            PagedBatch::new(pool, BlockTable::csr(&[0, 2], &[0, 1], &[last]).unwrap()),
            Err(Error::Param {
                what: "last_page_len",
                ..
            })
        ));
    }
    let batch = PagedBatch::new(pool, BlockTable::dense(&[2, 0], 2, &lens).unwrap()).unwrap();
    let q = vec![0.5f32; 4 * 8];
    let (mut o, mut l) = (vec![0.0f32; 4 * 8], vec![0.0f32; 4]);
    let f = LseFormat::NATURAL;
    // Selection index >= seq_len, wrong count of selections.
    let sel = [Selection::from_heads(&[vec![3u32], vec![20]])];
    assert!(matches!(
        cpu.decode_batch(
            &shape,
            &q,
            &batch,
            BatchTokens::Sparse(&sel),
            &mut o,
            &mut l,
            f,
            None
        ),
        Err(Error::Index {
            what: "selected token",
            index: 20,
            len: 20
        })
    ));
    assert!(matches!(
        cpu.decode_batch(
            &shape,
            &q,
            &batch,
            BatchTokens::Sparse(&[]),
            &mut o,
            &mut l,
            f,
            None
        ),
        Err(Error::ShapeMismatch { .. })
    ));
    // Buffers that do not fit the batch; a shape of other heads.
    assert!(matches!(
        cpu.decode_batch(
            &shape,
            &q[1..],
            &batch,
            BatchTokens::Dense,
            &mut o,
            &mut l,
            f,
            None
        ),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        cpu.decode_batch(
            &shape,
            &q,
            &batch,
            BatchTokens::Dense,
            &mut o[1..],
            &mut l,
            f,
            None
        ),
        Err(Error::Length { what: "out", .. })
    ));
    assert!(matches!(
        cpu.decode_batch(
            &shape,
            &q,
            &batch,
            BatchTokens::Dense,
            &mut o,
            &mut l[1..],
            f,
            None
        ),
        Err(Error::Length { what: "lse", .. })
    ));
    assert!(matches!(
        cpu.decode_batch(
            &shape,
            &q,
            &batch,
            BatchTokens::Dense,
            &mut o,
            &mut l,
            f,
            Some(&mut [0.0; 3])
        ),
        Err(Error::Length {
            what: "weights",
            ..
        })
    ));
    let other = AttnShape::new(4, 4, 8).unwrap();
    assert!(matches!(
        cpu.decode_batch(
            &other,
            &q,
            &batch,
            BatchTokens::Dense,
            &mut o,
            &mut l,
            f,
            None
        ),
        Err(Error::ShapeMismatch { .. })
    ));
    // Shards: bad (ith, nth), and a [heads, tokens] lse for a shard.
    assert!(matches!(Shard::new(0, 0), Err(Error::Zero { .. })));
    assert!(matches!(Shard::new(3, 3), Err(Error::Index { .. })));
    assert!(matches!(
        cpu.decode_batch_shard(
            Shard::WHOLE,
            &shape,
            &q,
            &batch,
            BatchTokens::Dense,
            &mut o,
            &mut l,
            LseFormat::VLLM,
            None
        ),
        Err(Error::Param { .. })
    ));
    // Token-major rows that would overlap.
    assert!(matches!(
        PagedPool::token_major(&k, &k, 4, 2, 8, 15),
        Err(Error::Param {
            what: "row_stride",
            ..
        })
    ));
    // Page bounds: a slot the sequence does not have, bounds not updated.
    let seq = batch.seq(0).unwrap();
    let mut bounds = PageBounds::new(pool.layout()).unwrap();
    assert!(matches!(
        bounds.update(&seq, 2, 1),
        Err(Error::Index { .. })
    ));
    assert!(matches!(
        bounds.update(&seq, 1, 5),
        Err(Error::Capacity { .. })
    ));
    let mut ub = vec![0.0f32; 4];
    assert!(matches!(
        cpu.page_upper_bounds(&shape, &q, &seq, &bounds, &mut ub),
        Err(Error::Param { .. })
    ));
    // Bounds of another pool's geometry are refused, not trusted.
    let other = PagedPool::vllm_cpu(&k[..2 * 4 * 2 * 8 * 8], 4, 2, 8, 8).unwrap();
    let alien = PageBounds::<f32>::new(other.layout()).unwrap();
    assert!(matches!(
        cpu.page_upper_bounds(&shape, &q, &seq, &alien, &mut ub),
        Err(Error::ShapeMismatch { .. })
    ));
    // Weight ranges of a shard need one selection per sequence.
    assert!(matches!(
        CpuBackend::shard_weights(&shape, &batch, BatchTokens::Sparse(&[]), Shard::WHOLE),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        hgca_kernels::MassTarget::new(0.0, 1.0),
        Err(Error::Param {
            what: "mass target",
            ..
        })
    ));
    assert!(matches!(
        hgca_kernels::MassTarget::new(0.9, f32::NAN),
        Err(Error::Param {
            what: "max page share",
            ..
        })
    ));
}
