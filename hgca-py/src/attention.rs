//! Attention over a paged cache: batched sparse and dense decode, causal
//! append, and the timer of the Rust side for the overhead bench.

use half::{bf16, f16};
use hgca_cpu::{BatchTokens, CpuBackend};
use hgca_kernels::{Error, LseLayout, PartialLayout};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::args::{backend, fmt_or_default, q3, selections, shape};
use crate::arrays::{Cache, Idx, Table, f32_arr, to_py, with_kv};
use crate::error::{OrPy, value_err};

/// Nanoseconds of the last batched decode's Rust work (building the views
/// and the call), for the overhead bench.
static LAST_RUST_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Seconds of the last `sparse_decode` / `dense_decode`'s Rust work: what
/// the same call made from Rust takes (views built, kernel run), without
/// the Python conversions (for `hgca-py/bench_overhead.py`).
#[pyfunction]
pub(crate) fn _last_rust_seconds() -> f64 {
    LAST_RUST_NS.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
}

type Out<'py> = Bound<'py, PyTuple>;

#[allow(clippy::too_many_arguments)]
fn decode<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    kv_cache: &Bound<'py, PyAny>,
    block_table: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    selection: Option<&Bound<'py, PyAny>>,
    layout: &str,
    dtype: Option<&str>,
    scale: Option<f32>,
    lse_base: Option<&Bound<'py, PyAny>>,
    lse_layout: &str,
    return_weights: bool,
    threads: usize,
) -> PyResult<Out<'py>> {
    let fmt = fmt_or_default(py, lse_base, lse_layout)?;
    let qa = f32_arr(q, "q")?;
    let (b, qh, d, qs) = q3(&qa)?;
    let cache = Cache::new(kv_cache, layout, dtype)?;
    let table = Table::new(block_table, seq_lens)?;
    let cpu = backend(threads)?;
    with_kv!(cache.k, T => {
        // What a Rust caller would do too (views, then the call) is timed
        // for `_last_rust_seconds`, the Python overhead bench's yardstick.
        let t0 = std::time::Instant::now();
        let pool = cache.pool::<T>()?;
        let hk = pool.layout().kv_heads;
        if pool.layout().head_dim != d {
            return Err(value_err(format!("q head_dim {d} differs from the cache's {}", pool.layout().head_dim)));
        }
        let batch = table.batch(pool)?;
        if batch.batch() != b {
            return Err(value_err(format!("q has {b} sequences, block_table {}", batch.batch())));
        }
        let shape = shape(qh, hk, d, scale)?;
        let rust_views = t0.elapsed();
        let sels = match selection {
            Some(s) => Some(selections(s, b, hk)?),
            None => None,
        };
        let tokens = match &sels {
            Some(s) => BatchTokens::Sparse(s),
            None => BatchTokens::Dense,
        };
        let wlen = if return_weights {
            Some(CpuBackend::shard_weights(&shape, &batch, tokens, hgca_cpu::Shard::WHOLE).py()?.len())
        } else {
            None
        };
        let (o, l, w) = py.detach(|| {
            let t1 = std::time::Instant::now();
            let (mut o, mut l) = (vec![0.0f32; b * qh * d], vec![0.0f32; b * qh]);
            let mut w = wlen.map(|n| vec![0.0f32; n]);
            let r = cpu.decode_batch(&shape, qs, &batch, tokens, &mut o, &mut l, fmt, w.as_deref_mut()).map(|()| (o, l, w));
            LAST_RUST_NS.store((rust_views + t1.elapsed()).as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
            r
        }).py()?;
        let lshape = match fmt.layout {
            LseLayout::TokensHeads => [b, qh],
            LseLayout::HeadsTokens => [qh, b],
        };
        let o = to_py(py, o, &[b, qh, d])?.into_any();
        let l = to_py(py, l, &lshape)?.into_any();
        match w {
            Some(w) => PyTuple::new(py, [o, l, PyArray1::from_vec(py, w).into_any()]),
            None => PyTuple::new(py, [o, l]),
        }
    })
}

/// Sparse decode of a batch over a paged cache; see the Python docs.
#[pyfunction]
#[pyo3(signature = (q, kv_cache, block_table, seq_lens, selection, *, layout = "vllm_cpu", dtype = None, scale = None, lse_base = None, lse_layout = "tokens_heads", return_weights = false, threads = 0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sparse_decode<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    kv_cache: &Bound<'py, PyAny>,
    block_table: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    selection: &Bound<'py, PyAny>,
    layout: &str,
    dtype: Option<&str>,
    scale: Option<f32>,
    lse_base: Option<&Bound<'py, PyAny>>,
    lse_layout: &str,
    return_weights: bool,
    threads: usize,
) -> PyResult<Out<'py>> {
    decode(
        py,
        q,
        kv_cache,
        block_table,
        seq_lens,
        Some(selection),
        layout,
        dtype,
        scale,
        lse_base,
        lse_layout,
        return_weights,
        threads,
    )
}

/// Dense decode of a batch over a paged cache; see the Python docs.
#[pyfunction]
#[pyo3(signature = (q, kv_cache, block_table, seq_lens, *, layout = "vllm_cpu", dtype = None, scale = None, lse_base = None, lse_layout = "tokens_heads", return_weights = false, threads = 0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_decode<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    kv_cache: &Bound<'py, PyAny>,
    block_table: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    layout: &str,
    dtype: Option<&str>,
    scale: Option<f32>,
    lse_base: Option<&Bound<'py, PyAny>>,
    lse_layout: &str,
    return_weights: bool,
    threads: usize,
) -> PyResult<Out<'py>> {
    decode(
        py,
        q,
        kv_cache,
        block_table,
        seq_lens,
        None,
        layout,
        dtype,
        scale,
        lse_base,
        lse_layout,
        return_weights,
        threads,
    )
}

/// Causal append attention of one sequence's chunk; see the Python docs.
#[pyfunction]
#[pyo3(signature = (q, kv_cache, block_table, seq_len, *, visible0 = None, layout = "vllm_cpu", dtype = None, scale = None, lse_base = None, lse_layout = "tokens_heads", threads = 0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn append_attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    kv_cache: &Bound<'py, PyAny>,
    block_table: &Bound<'py, PyAny>,
    seq_len: usize,
    visible0: Option<usize>,
    layout: &str,
    dtype: Option<&str>,
    scale: Option<f32>,
    lse_base: Option<&Bound<'py, PyAny>>,
    lse_layout: &str,
    threads: usize,
) -> PyResult<Out<'py>> {
    let fmt = fmt_or_default(py, lse_base, lse_layout)?;
    let qa = f32_arr(q, "q")?;
    let (n_q, qh, d, qs) = q3(&qa)?;
    let cache = Cache::new(kv_cache, layout, dtype)?;
    let pages = Idx::new(block_table, "block_table")?;
    if pages.shape().len() != 1 {
        return Err(value_err(format!(
            "block_table: expected the sequence's pages [num_pages], found shape {:?}",
            pages.shape()
        )));
    }
    let cpu = backend(threads)?;
    let visible0 = visible0.unwrap_or((seq_len + 1).saturating_sub(n_q));
    with_kv!(cache.k, T => {
        let pool = cache.pool::<T>()?;
        let hk = pool.layout().kv_heads;
        let shape = shape(qh, hk, d, scale)?;
        let seq = hgca_kernels::PagedSeq::new(pool, pages.slice("block_table")?, seq_len).py()?;
        let layout = PartialLayout::append(&shape, n_q);
        let (o, l) = py.detach(|| {
            let (mut o, mut n) = (vec![0.0f32; layout.out_len()], vec![0.0f32; layout.rows()]);
            cpu.dense_append(&shape, qs, n_q, visible0, &seq, hgca_kernels::PartialMut::new(layout, &mut o, &mut n)?)?;
            let mut l = vec![0.0f32; layout.rows()];
            fmt.write(&n, n_q, qh, &mut l)?;
            Ok::<_, Error>((o, l))
        }).py()?;
        let lshape = match fmt.layout {
            LseLayout::TokensHeads => [n_q, qh],
            LseLayout::HeadsTokens => [qh, n_q],
        };
        PyTuple::new(py, [to_py(py, o, &[n_q, qh, d])?.into_any(), to_py(py, l, &lshape)?.into_any()])
    })
}
