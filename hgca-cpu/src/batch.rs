//! Batched decode over several sequences in one call (paged or contiguous
//! KV), and its shards for running a call on the caller's own threads.

use hgca_kernels::{
    AttnShape, Error, LseFormat, LseLayout, PagedBatch, Result, Selection, SelectionRef, check_len,
    check_len_of,
};

use crate::backend::{CpuBackend, Par};
use crate::isa::SimdElem;
use crate::plan::{Job, Spec};

/// Which tokens of each sequence a batched decode attends.
#[derive(Debug, Clone, Copy)]
pub enum BatchTokens<'a> {
    /// Every token of every sequence.
    Dense,
    /// Per sequence, its per-KV-head [`Selection`] (indices `< seq_len`).
    Sparse(&'a [Selection]),
    /// The same, as views of the caller's own buffers (no copy: a C or
    /// Python caller's arrays).
    SparseRef(&'a [SelectionRef<'a>]),
}

/// Shard `ith` of `nth` of a call, for running a call on the caller's own
/// thread pool (as ggml runs custom ops): each shard computes a contiguous
/// range of (sequence, KV head) units on the calling thread, without
/// rayon, and the shards `0..nth` together give, bit for bit, the whole
/// call on a sequential backend ([`Par::Seq`]; a threaded whole call may
/// split a long sequence's tokens into chunks merged by LSE, which rounds
/// differently in the last bits). With more shards than units, some
/// shards are empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    ith: usize,
    nth: usize,
}

impl Shard {
    /// Shard `ith` of `nth`.
    ///
    /// # Errors
    /// [`Error::Zero`] for `nth == 0`, [`Error::Index`] for `ith >= nth`.
    pub fn new(ith: usize, nth: usize) -> Result<Self> {
        if nth == 0 {
            return Err(Error::Zero {
                what: "nth (shards)",
            });
        }
        if ith >= nth {
            return Err(Error::Index {
                what: "ith (shard)",
                index: ith,
                len: nth,
            });
        }
        Ok(Self { ith, nth })
    }
    /// The whole call as one shard.
    pub const WHOLE: Shard = Shard { ith: 0, nth: 1 };
    /// This shard's part of `0..units`.
    pub fn units(&self, units: usize) -> std::ops::Range<usize> {
        // In u128: `units * nth` may not fit a usize.
        let at = |i: usize| (units as u128 * i as u128 / self.nth as u128) as usize;
        at(self.ith)..at(self.ith + 1)
    }
}

/// Per-sequence offsets of a batch's weights: sequence `t`'s block starts
/// at `base[t]`; inside it, KV head `g`'s `[group, len]` block.
struct BatchWeights<'a> {
    base: Vec<usize>,
    group: usize,
    /// The selections as views (none for dense).
    sels: Option<Vec<SelectionRef<'a>>>,
    lens: Vec<usize>,
}

impl BatchWeights<'_> {
    /// Offset of unit `u` (`t * kv_heads + g`), for `u <= batch * kv_heads`.
    fn at(&self, kv_heads: usize, u: usize) -> usize {
        let (t, g) = (u / kv_heads, u % kv_heads);
        if t >= self.lens.len() {
            return self.base[self.lens.len()];
        }
        self.base[t]
            + match &self.sels {
                Some(s) => self.group * s[t].offset(g),
                None => g * self.group * self.lens[t],
            }
    }
}

impl CpuBackend {
    /// Batched varlen decode over an engine's paged cache: for each of the
    /// `B = kv.batch()` sequences, its query `q[b] [q_heads, d]` attends
    /// its own tokens (all of them, or its selection), in one call,
    /// parallel over (sequence, KV head, token chunk) with the exact LSE
    /// merge of chunks.
    ///
    /// - `out [B, q_heads, d]`; `lse [B, q_heads]` written in `fmt` (base
    ///   and layout: [`LseFormat::FLASHINFER`], [`LseFormat::VLLM`], ...).
    /// - `weights`, if given, receives the softmax weights of the attended
    ///   entries, sequence after sequence: dense, `[q_heads, seq_len]` per
    ///   sequence; sparse, per KV head `g` the block `[group,
    ///   sel.head(g).len()]` at `group * sel.offset(g)` of the sequence's
    ///   `group * sel.total()` (as [`SparseAttention::sparse_decode`](hgca_kernels::SparseAttention::sparse_decode)).
    ///
    /// ```
    /// use hgca_cpu::{BatchTokens, CpuBackend};
    /// use hgca_kernels::{AttnShape, BlockTable, LseFormat, PagedBatch, PagedPool};
    /// let shape = AttnShape::new(2, 1, 4)?;
    /// // FlashInfer NHD pages: 3 pages of 2 tokens, 1 KV head, d 4
    /// let k = vec![0.25f32; 3 * 2 * 4];
    /// let v: Vec<f32> = (0..3 * 2 * 4).map(|i| (i / 4) as f32).collect();
    /// let pool = PagedPool::flashinfer_nhd(&k, &v, 3, 2, 1, 4)?;
    /// // CSR: sequence 0 = pages [2, 0] (3 tokens), sequence 1 = page [1] (1 token)
    /// let (indptr, indices, last) = ([0u32, 2, 3], [2u32, 0, 1], [1u32, 1]);
    /// let batch = PagedBatch::new(pool, BlockTable::csr(&indptr, &indices, &last)?)?;
    /// let q = vec![1.0f32; 2 * 2 * 4];
    /// let (mut out, mut lse) = (vec![0.0; 2 * 2 * 4], vec![0.0; 2 * 2]);
    /// CpuBackend::new().decode_batch(&shape, &q, &batch, BatchTokens::Dense, &mut out, &mut lse, LseFormat::NATURAL, None)?;
    /// // equal scores: sequence 0 averages the values of tokens 4, 5 (page 2) and 0 (page 0)
    /// assert!((out[0] - (4.0 + 5.0 + 0.0) / 3.0).abs() < 1e-6);
    /// assert_eq!(out[2 * 4], 2.0); // sequence 1: token 0 of page 1
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Length`] naming the buffer that does not fit `B` and
    /// `shape`, [`Error::ShapeMismatch`] for a pool of other heads or head
    /// dim or a selection list count that is not `B`, [`Error::Index`] for a
    /// selected token `>= seq_len`.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_batch<T: SimdElem>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        kv: &PagedBatch<'_, T>,
        tokens: BatchTokens<'_>,
        out: &mut [f32],
        lse: &mut [f32],
        fmt: LseFormat,
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        let rows = kv.batch() * shape.q_heads();
        check_len("lse", rows, lse.len())?;
        let mut natural = if fmt == LseFormat::NATURAL {
            None
        } else {
            Some(vec![0.0f32; rows])
        };
        let l = natural.as_deref_mut().unwrap_or(&mut *lse);
        self.batch_job(
            shape,
            q,
            kv,
            tokens,
            Shard::WHOLE,
            self.par,
            out,
            l,
            weights,
        )?;
        if let Some(n) = natural {
            fmt.write(&n, kv.batch(), shape.q_heads(), lse)?;
        }
        Ok(())
    }

    /// Query rows (`b * q_heads + h`) that `shard` of a batched decode of
    /// `batch` sequences computes: its `out` holds these rows (`rows.len() *
    /// d`), its `lse` one entry each, its `weights` the range
    /// [`CpuBackend::shard_weights`] gives.
    pub fn shard_rows(shape: &AttnShape, batch: usize, shard: Shard) -> std::ops::Range<usize> {
        let u = shard.units(batch * shape.kv_heads());
        u.start * shape.group()..u.end * shape.group()
    }

    /// The part of a batched decode's `weights` (as [`CpuBackend::decode_batch`]
    /// lays them out) that `shard` writes.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the selections are not one per sequence.
    pub fn shard_weights<T: SimdElem>(
        shape: &AttnShape,
        kv: &PagedBatch<'_, T>,
        tokens: BatchTokens<'_>,
        shard: Shard,
    ) -> Result<std::ops::Range<usize>> {
        let hk = shape.kv_heads();
        let u = shard.units(kv.batch() * hk);
        let w = batch_weights(shape, kv, tokens)?;
        Ok(w.at(hk, u.start)..w.at(hk, u.end))
    }

    /// Shard `shard` of [`CpuBackend::decode_batch`], computed on the
    /// calling thread (no rayon, whatever this backend's [`Par`]): `out`,
    /// `lse` and `weights` are this shard's parts only
    /// ([`CpuBackend::shard_rows`], [`CpuBackend::shard_weights`]), so each
    /// thread of the caller's pool writes its own slices. `lse` is in
    /// `fmt.base`, in row order: a shard's rows are not a `[heads,
    /// tokens]` block, so `fmt.layout` must be `TokensHeads`.
    ///
    /// ```
    /// use hgca_cpu::{BatchTokens, CpuBackend, Shard};
    /// use hgca_kernels::{AttnShape, BlockTable, LseFormat, PagedBatch, PagedPool};
    /// let shape = AttnShape::new(4, 2, 8)?;
    /// let kv: Vec<f32> = (0..2 * 4 * 2 * 16 * 8).map(|i| (i % 7) as f32 * 0.1).collect();
    /// let pool = PagedPool::vllm_cpu(&kv, 4, 2, 16, 8)?;
    /// let (table, lens) = ([0u32, 1, 2, 3], [30u32, 20]);
    /// let batch = PagedBatch::new(pool, BlockTable::dense(&table, 2, &lens)?)?;
    /// let q = vec![0.5f32; 2 * 4 * 8];
    /// let (mut out, mut lse) = (vec![0.0; 2 * 4 * 8], vec![0.0; 2 * 4]);
    /// let (o, l) = (out.as_mut_slice(), lse.as_mut_slice());
    /// // three shards on three threads, each writing its own rows
    /// std::thread::scope(|s| {
    ///     let (mut o, mut l) = (o, l);
    ///     for ith in 0..3 {
    ///         let shard = Shard::new(ith, 3).unwrap();
    ///         let rows = CpuBackend::shard_rows(&shape, 2, shard).len();
    ///         let (so, ro) = std::mem::take(&mut o).split_at_mut(rows * 8);
    ///         let (sl, rl) = std::mem::take(&mut l).split_at_mut(rows);
    ///         (o, l) = (ro, rl);
    ///         let (q, batch) = (&q, &batch);
    ///         s.spawn(move || {
    ///             CpuBackend::new().decode_batch_shard(shard, &shape, q, batch, BatchTokens::Dense,
    ///                 so, sl, LseFormat::NATURAL, None).unwrap()
    ///         });
    ///     }
    /// });
    /// let (mut whole, mut wl) = (vec![0.0; 2 * 4 * 8], vec![0.0; 2 * 4]);
    /// CpuBackend::new().decode_batch(&shape, &q, &batch, BatchTokens::Dense, &mut whole, &mut wl, LseFormat::NATURAL, None)?;
    /// assert_eq!((out, lse), (whole, wl));
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`CpuBackend::decode_batch`] (lengths are the shard's);
    /// [`Error::Param`] for a `[heads, tokens]` `fmt`.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_batch_shard<T: SimdElem>(
        &self,
        shard: Shard,
        shape: &AttnShape,
        q: &[f32],
        kv: &PagedBatch<'_, T>,
        tokens: BatchTokens<'_>,
        out: &mut [f32],
        lse: &mut [f32],
        fmt: LseFormat,
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        if fmt.layout != LseLayout::TokensHeads {
            return Err(Error::Param {
                what: "lse layout of a shard",
                value: 0.0,
                expected: "TokensHeads: a shard writes its rows in order",
            });
        }
        self.batch_job(shape, q, kv, tokens, shard, Par::Seq, out, lse, weights)?;
        lse.iter_mut().for_each(|x| *x = fmt.from_natural(*x));
        Ok(())
    }

    /// Checks and runs (a shard of) a batched decode; lse in natural log.
    #[allow(clippy::too_many_arguments)]
    fn batch_job<T: SimdElem>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        kv: &PagedBatch<'_, T>,
        tokens: BatchTokens<'_>,
        shard: Shard,
        par: Par,
        out: &mut [f32],
        lse: &mut [f32],
        weights: Option<&mut [f32]>,
    ) -> Result<()> {
        let b = kv.batch();
        let (hk, d) = (shape.kv_heads(), shape.head_dim());
        kv.check_shape(shape)?;
        check_len_of("q [batch, q_heads, d]", &[b, shape.q_len()], q.len())?;
        let bw = batch_weights(shape, kv, tokens)?;
        if let Some(sels) = &bw.sels {
            for (t, s) in sels.iter().enumerate() {
                s.validate(hk, kv.seq_len(t))?;
            }
        }
        let rows = Self::shard_rows(shape, b, shard);
        check_len_of("out", &[rows.len(), d], out.len())?;
        check_len("lse", rows.len(), lse.len())?;
        let units = shard.units(b * hk);
        if let Some(w) = &weights {
            check_len(
                "weights",
                bw.at(hk, units.end) - bw.at(hk, units.start),
                w.len(),
            )?;
        }
        let seq = |t: usize| kv.seq(t).expect("t < batch: units are inside the batch");
        let job = Job {
            units,
            kv: seq,
            spec: |t: usize, g: usize| match &bw.sels {
                None => Spec::Range(0, kv.seq_len(t)),
                Some(s) => Spec::List(s[t].head(g)),
            },
            weight_offset: |t: usize, g: usize| bw.at(hk, t * hk + g),
            par,
        };
        self.run(shape, q, job, out, lse, weights, None);
        Ok(())
    }
}

/// The batch's weight offsets, its selections checked to be one per sequence.
fn batch_weights<'a, T: SimdElem>(
    shape: &AttnShape,
    kv: &PagedBatch<'_, T>,
    tokens: BatchTokens<'a>,
) -> Result<BatchWeights<'a>> {
    let group = shape.group();
    let lens: Vec<usize> = (0..kv.batch()).map(|t| kv.seq_len(t)).collect();
    let sels = match tokens {
        BatchTokens::Dense => None,
        BatchTokens::Sparse(s) => Some(s.iter().map(Selection::as_view).collect::<Vec<_>>()),
        BatchTokens::SparseRef(s) => Some(s.to_vec()),
    };
    if let Some(s) = &sels
        && s.len() != kv.batch()
    {
        return Err(Error::ShapeMismatch {
            what: "selections (one per sequence)",
            expected: kv.batch().to_string(),
            found: s.len().to_string(),
        });
    }
    let mut base = Vec::with_capacity(lens.len() + 1);
    base.push(0);
    for (t, &len) in lens.iter().enumerate() {
        let n = match &sels {
            Some(s) => group * s[t].total(),
            None => shape.q_heads() * len,
        };
        base.push(base[t] + n);
    }
    Ok(BatchWeights {
        base,
        group,
        sels,
        lens,
    })
}
