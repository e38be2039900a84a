//! Sparse selection: `KeyBounds` (per-page key bounds and their score
//! upper bounds) and the top-page and mass-targeted selectors.

use half::{bf16, f16};
use hgca_kernels::{MassTarget, PageBounds, Selection};
use numpy::{PyArray1, PyArrayDyn, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::{backend, shape};
use crate::arrays::{Cache, Table, contiguous, f32_arr, to_py};
use crate::error::{OrPy, value_err};

/// The mass selector's per-head reports.
type Report<'py> = Vec<Bound<'py, PyDict>>;

enum BoundsAny {
    F32(PageBounds<f32>),
    F16(PageBounds<f16>),
    Bf16(PageBounds<bf16>),
}

/// Quest-style key bounds per page and KV head of one cache pool.
#[pyclass(module = "hgca._hgca")]
pub(crate) struct KeyBounds {
    inner: BoundsAny,
    layout: String,
}

#[pymethods]
impl KeyBounds {
    #[new]
    #[pyo3(signature = (kv_cache, *, layout = "vllm_cpu", dtype = None))]
    fn new(kv_cache: &Bound<'_, PyAny>, layout: &str, dtype: Option<&str>) -> PyResult<Self> {
        let cache = Cache::new(kv_cache, layout, dtype)?;
        let inner = match cache.k.kind() {
            0 => BoundsAny::F32(PageBounds::new(cache.pool::<f32>()?.layout()).py()?),
            1 => BoundsAny::F16(PageBounds::new(cache.pool::<f16>()?.layout()).py()?),
            _ => BoundsAny::Bf16(PageBounds::new(cache.pool::<bf16>()?.layout()).py()?),
        };
        Ok(Self {
            inner,
            layout: layout.to_string(),
        })
    }

    /// Brings the bounds of sequence `seq`'s pages up to its tokens.
    #[pyo3(signature = (kv_cache, block_table, seq_lens, seq, *, dtype = None))]
    fn update(
        &mut self,
        py: Python<'_>,
        kv_cache: &Bound<'_, PyAny>,
        block_table: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        seq: usize,
        dtype: Option<&str>,
    ) -> PyResult<()> {
        let cache = Cache::new(kv_cache, &self.layout, dtype)?;
        let table = Table::new(block_table, seq_lens)?;
        macro_rules! go {
            ($b:expr, $t:ty) => {{
                let batch = table.batch(cache.pool::<$t>()?)?;
                let s = batch.seq(seq).ok_or_else(|| {
                    value_err(format!("seq {seq}: the batch has {}", batch.batch()))
                })?;
                let b = $b;
                py.detach(|| b.update_seq(&s)).py()
            }};
        }
        match (&mut self.inner, cache.k.kind()) {
            (BoundsAny::F32(b), 0) => go!(b, f32),
            (BoundsAny::F16(b), 1) => go!(b, f16),
            (BoundsAny::Bf16(b), 2) => go!(b, bf16),
            _ => Err(PyTypeError::new_err(
                "kv_cache dtype differs from the one the bounds were made for",
            )),
        }
    }

    /// Forgets page `page`'s bounds (a page given to another sequence).
    fn reset(&mut self, page: usize) {
        match &mut self.inner {
            BoundsAny::F32(b) => b.reset(page),
            BoundsAny::F16(b) => b.reset(page),
            BoundsAny::Bf16(b) => b.reset(page),
        }
    }

    /// Upper bounds of the scores of sequence `seq`'s pages for `q [q_heads, d]`: `[kv_heads, pages]`.
    #[pyo3(signature = (q, kv_cache, block_table, seq_lens, seq, *, dtype = None, scale = None, threads = 0))]
    #[allow(clippy::too_many_arguments)]
    fn upper_bounds<'py>(
        &self,
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
        kv_cache: &Bound<'py, PyAny>,
        block_table: &Bound<'py, PyAny>,
        seq_lens: &Bound<'py, PyAny>,
        seq: usize,
        dtype: Option<&str>,
        scale: Option<f32>,
        threads: usize,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let qa = f32_arr(q, "q")?;
        let qsh = qa.shape().to_vec();
        if qsh.len() != 2 {
            return Err(value_err(format!(
                "q: expected [q_heads, head_dim], found shape {qsh:?}"
            )));
        }
        let qs = contiguous(&qa, "q")?;
        let cache = Cache::new(kv_cache, &self.layout, dtype)?;
        let table = Table::new(block_table, seq_lens)?;
        let cpu = backend(threads)?;
        macro_rules! go {
            ($b:expr, $t:ty) => {{
                let batch = table.batch(cache.pool::<$t>()?)?;
                let s = batch.seq(seq).ok_or_else(|| {
                    value_err(format!("seq {seq}: the batch has {}", batch.batch()))
                })?;
                let hk = batch.pool().layout().kv_heads;
                let shape = shape(qsh[0], hk, qsh[1], scale)?;
                let pages = s.pages().len();
                let b = $b;
                let ub = py
                    .detach(|| {
                        let mut ub = vec![0.0f32; hk * pages];
                        cpu.page_upper_bounds(&shape, qs, &s, b, &mut ub)
                            .map(|()| ub)
                    })
                    .py()?;
                to_py(py, ub, &[hk, pages])
            }};
        }
        match (&self.inner, cache.k.kind()) {
            (BoundsAny::F32(b), 0) => go!(b, f32),
            (BoundsAny::F16(b), 1) => go!(b, f16),
            (BoundsAny::Bf16(b), 2) => go!(b, bf16),
            _ => Err(PyTypeError::new_err(
                "kv_cache dtype differs from the one the bounds were made for",
            )),
        }
    }
}

fn ub_arr<'py>(ub: &Bound<'py, PyAny>) -> PyResult<(PyReadonlyArrayDyn<'py, f32>, usize, usize)> {
    let a = f32_arr(ub, "ub")?;
    let s = a.shape().to_vec();
    if s.len() != 2 {
        return Err(value_err(format!(
            "ub: expected [kv_heads, pages], found shape {s:?}"
        )));
    }
    Ok((a, s[0], s[1]))
}

fn sel_to_py<'py>(py: Python<'py>, sel: &Selection) -> PyResult<Vec<Bound<'py, PyArray1<i32>>>> {
    Ok((0..sel.kv_heads())
        .map(|g| PyArray1::from_vec(py, sel.head(g).iter().map(|&j| j as i32).collect()))
        .collect())
}

/// Top-`k` pages per KV head: a list of `kv_heads` int32 token arrays.
#[pyfunction]
pub(crate) fn select_top_pages<'py>(
    py: Python<'py>,
    ub: &Bound<'py, PyAny>,
    block_size: usize,
    seq_len: usize,
    k: usize,
) -> PyResult<Vec<Bound<'py, PyArray1<i32>>>> {
    let (a, hk, pages) = ub_arr(ub)?;
    let mut sel = Selection::new();
    hgca_kernels::select_top_pages(
        contiguous(&a, "ub")?,
        hk,
        pages,
        block_size,
        seq_len,
        k,
        &mut sel,
    )
    .py()?;
    sel_to_py(py, &sel)
}

/// Pages by estimated attention mass: (selection, report).
#[pyfunction]
#[pyo3(signature = (ub, block_size, seq_len, target, *, max_share = 1.0))]
pub(crate) fn select_by_mass<'py>(
    py: Python<'py>,
    ub: &Bound<'py, PyAny>,
    block_size: usize,
    seq_len: usize,
    target: f32,
    max_share: f32,
) -> PyResult<(Vec<Bound<'py, PyArray1<i32>>>, Report<'py>)> {
    let (a, hk, pages) = ub_arr(ub)?;
    let (mut sel, mut rep) = (Selection::new(), Vec::new());
    let t = MassTarget::new(target, max_share).py()?;
    hgca_kernels::select_by_mass(
        contiguous(&a, "ub")?,
        hk,
        pages,
        block_size,
        seq_len,
        t,
        &mut sel,
        &mut rep,
    )
    .py()?;
    let report = rep
        .iter()
        .map(|r| {
            let d = PyDict::new(py);
            d.set_item("pages", r.pages)?;
            d.set_item("estimated", r.estimated)?;
            d.set_item("dense", r.dense)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok((sel_to_py(py, &sel)?, report))
}
