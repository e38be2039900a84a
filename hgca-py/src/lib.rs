//! The native module `hgca._hgca` behind the Python package `hgca` (see
//! `python/hgca/__init__.py` for the documented surface and `_hgca.pyi`
//! for the types). Arrays come in as numpy arrays, read in place when
//! C-contiguous (anything else is a `ValueError` naming the argument);
//! every kernel call runs with the GIL released.
#![deny(unsafe_op_in_unsafe_fn)]

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use half::{bf16, f16};
use hgca_cpu::{BatchTokens, CpuBackend, Par};
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
use hgca_kernels::{
    AttnShape, BlockTable, Error, KvElem, LseBase, LseFormat, LseLayout, MassTarget, PageBounds,
    PagedBatch, PagedPool, PartialLayout, Selection,
};
use numpy::{
    PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

// ---------------------------------------------------------------- errors

/// hgca's error as the Python exception a caller expects.
fn py_err(e: Error) -> PyErr {
    match e {
        Error::UnsupportedDType { .. } => PyTypeError::new_err(e.to_string()),
        Error::OutOfMemory { .. } => PyMemoryError::new_err(e.to_string()),
        Error::Backend { .. } | Error::Unavailable { .. } | Error::NotCompiledIn { .. } => {
            PyRuntimeError::new_err(e.to_string())
        }
        _ => PyValueError::new_err(e.to_string()),
    }
}

fn value_err(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

trait OrPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> OrPy<T> for Result<T, Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(py_err)
    }
}

// ---------------------------------------------------------------- arrays

/// A C-contiguous slice of `a`, or a `ValueError` naming `what`.
fn contiguous<'a, T: numpy::Element>(
    a: &'a PyReadonlyArrayDyn<'_, T>,
    what: &str,
) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| {
        value_err(format!(
            "{what} must be C-contiguous (pass numpy.ascontiguousarray({what})); found strides {:?}",
            a.strides()
        ))
    })
}

fn dtype_name(obj: &Bound<'_, PyAny>) -> String {
    obj.getattr("dtype")
        .and_then(|d| d.str().map(|s| s.to_string()))
        .unwrap_or_else(|_| {
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        })
}

/// A float32 array argument.
fn f32_arr<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<PyReadonlyArrayDyn<'py, f32>> {
    obj.extract::<PyReadonlyArrayDyn<'py, f32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected a numpy float32 array, found {}",
            dtype_name(obj)
        ))
    })
}

/// An int32 (or uint32) index array argument, as `u32` (negative entries
/// become `>= 2^31` and are refused downstream as out of range).
enum Idx<'py> {
    I32(PyReadonlyArrayDyn<'py, i32>),
    U32(PyReadonlyArrayDyn<'py, u32>),
}

impl<'py> Idx<'py> {
    fn new(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'py, i32>>() {
            return Ok(Idx::I32(a));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'py, u32>>() {
            return Ok(Idx::U32(a));
        }
        Err(PyTypeError::new_err(format!(
            "{what}: expected a numpy int32 array, found {}",
            dtype_name(obj)
        )))
    }
    fn shape(&self) -> &[usize] {
        match self {
            Idx::I32(a) => a.shape(),
            Idx::U32(a) => a.shape(),
        }
    }
    fn slice(&self, what: &str) -> PyResult<&[u32]> {
        Ok(match self {
            Idx::I32(a) => bytemuck::cast_slice(contiguous(a, what)?),
            Idx::U32(a) => contiguous(a, what)?,
        })
    }
}

/// A KV cache array: float32, float16, or bfloat16 given as uint16 bits.
enum KvArr<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    F16(PyReadonlyArrayDyn<'py, f16>),
    Bf16(PyReadonlyArrayDyn<'py, u16>),
}

impl<'py> KvArr<'py> {
    fn new(obj: &Bound<'py, PyAny>, dtype: Option<&str>, what: &str) -> PyResult<Self> {
        match dtype {
            Some("bf16") | Some("bfloat16") => obj
                .extract::<PyReadonlyArrayDyn<'py, u16>>()
                .map(KvArr::Bf16)
                .map_err(|_| {
                    PyTypeError::new_err(format!(
                        "{what}: dtype='bf16' takes the bits as a numpy uint16 array, found {}",
                        dtype_name(obj)
                    ))
                }),
            None | Some("f32") | Some("f16") | Some("float32") | Some("float16") => {
                if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'py, f32>>() {
                    return Ok(KvArr::F32(a));
                }
                if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'py, f16>>() {
                    return Ok(KvArr::F16(a));
                }
                Err(PyTypeError::new_err(format!(
                    "{what}: expected a numpy float32 or float16 array (bfloat16: uint16 bits with dtype='bf16'), found {}",
                    dtype_name(obj)
                )))
            }
            Some(other) => Err(value_err(format!(
                "dtype={other:?}: expected None, 'f32', 'f16' or 'bf16'"
            ))),
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            KvArr::F32(a) => a.shape(),
            KvArr::F16(a) => a.shape(),
            KvArr::Bf16(a) => a.shape(),
        }
    }
    fn kind(&self) -> u8 {
        match self {
            KvArr::F32(_) => 0,
            KvArr::F16(_) => 1,
            KvArr::Bf16(_) => 2,
        }
    }
}

/// The typed slice of a KV array (the caller matched its kind).
trait FromKv: KvElem + hgca_cpu::isa::SimdElem {
    fn of<'a>(a: &'a KvArr<'_>, what: &str) -> PyResult<&'a [Self]>;
}

impl FromKv for f32 {
    fn of<'a>(a: &'a KvArr<'_>, what: &str) -> PyResult<&'a [Self]> {
        match a {
            KvArr::F32(x) => contiguous(x, what),
            _ => Err(PyTypeError::new_err(format!(
                "{what}: K and V dtypes differ"
            ))),
        }
    }
}

impl FromKv for f16 {
    fn of<'a>(a: &'a KvArr<'_>, what: &str) -> PyResult<&'a [Self]> {
        match a {
            KvArr::F16(x) => contiguous(x, what),
            _ => Err(PyTypeError::new_err(format!(
                "{what}: K and V dtypes differ"
            ))),
        }
    }
}

impl FromKv for bf16 {
    fn of<'a>(a: &'a KvArr<'_>, what: &str) -> PyResult<&'a [Self]> {
        match a {
            KvArr::Bf16(x) => Ok(bytemuck::cast_slice(contiguous(x, what)?)),
            _ => Err(PyTypeError::new_err(format!(
                "{what}: K and V dtypes differ"
            ))),
        }
    }
}

/// Runs `$body` with `$t` the element type of the KV array `$kv`.
macro_rules! with_kv {
    ($kv:expr, $t:ident => $body:expr) => {
        match $kv.kind() {
            0 => {
                type $t = f32;
                $body
            }
            1 => {
                type $t = f16;
                $body
            }
            _ => {
                type $t = bf16;
                $body
            }
        }
    };
}

/// A cache argument: one array, or a `(k, v)` tuple for layouts that keep them apart.
struct Cache<'py> {
    k: KvArr<'py>,
    v: Option<KvArr<'py>>,
    layout: String,
}

impl<'py> Cache<'py> {
    fn new(obj: &Bound<'py, PyAny>, layout: &str, dtype: Option<&str>) -> PyResult<Self> {
        let (k, v) = if let Ok(t) = obj.cast::<PyTuple>() {
            if t.len() != 2 {
                return Err(value_err(format!(
                    "kv_cache: a tuple must be (k_cache, v_cache), found {} items",
                    t.len()
                )));
            }
            let k = KvArr::new(&t.get_item(0)?, dtype, "k_cache")?;
            let v = KvArr::new(&t.get_item(1)?, dtype, "v_cache")?;
            if k.kind() != v.kind() {
                return Err(PyTypeError::new_err(
                    "k_cache and v_cache have different dtypes",
                ));
            }
            (k, Some(v))
        } else {
            (KvArr::new(obj, dtype, "kv_cache")?, None)
        };
        Ok(Self {
            k,
            v,
            layout: layout.to_string(),
        })
    }

    /// The pool, with `(num_blocks, block_size, kv_heads, head_dim)` read off the shape.
    fn pool<T: FromKv>(&self) -> PyResult<PagedPool<'_, T>> {
        let dims = |s: &[usize], n: usize, what: &str, expected: &str| -> PyResult<Vec<usize>> {
            if s.len() != n {
                return Err(value_err(format!(
                    "{what} for layout={:?}: expected {n} dimensions {expected}, found shape {s:?}",
                    self.layout
                )));
            }
            Ok(s.to_vec())
        };
        let k = T::of(&self.k, "kv_cache")?;
        // A one-array cache: 5 dimensions, the K/V pair on axis `pair`.
        let one = |expected: &str, pair: usize| -> PyResult<Vec<usize>> {
            let s = dims(self.k.shape(), 5, "kv_cache", expected)?;
            if s[pair] != 2 {
                return Err(value_err(format!(
                    "kv_cache: dimension {pair} must be 2 (K, V) in {expected}, found shape {s:?}"
                )));
            }
            Ok(s)
        };
        let pool = match (self.layout.as_str(), &self.v) {
            ("vllm_cpu", None) => {
                let s = one("(2, num_blocks, kv_heads, block_size, head_size)", 0)?;
                PagedPool::vllm_cpu(k, s[1], s[2], s[3], s[4])
            }
            ("vllm_flash", None) => {
                let s = one("(2, num_blocks, block_size, kv_heads, head_size)", 0)?;
                PagedPool::vllm_flash(k, s[1], s[2], s[3], s[4])
            }
            ("nhd", None) => {
                let s = one("[pages, 2, page_size, kv_heads, d]", 1)?;
                PagedPool::flashinfer_nhd_combined(k, s[0], s[2], s[3], s[4])
            }
            ("hnd", None) => {
                let s = one("[pages, 2, kv_heads, page_size, d]", 1)?;
                PagedPool::flashinfer_hnd_combined(k, s[0], s[3], s[2], s[4])
            }
            ("nhd", Some(v)) | ("hnd", Some(v)) => {
                let s = dims(
                    self.k.shape(),
                    4,
                    "k_cache",
                    "[pages, page_size, kv_heads, d] (NHD) or [pages, kv_heads, page_size, d] (HND)",
                )?;
                if v.shape() != s.as_slice() {
                    return Err(value_err(format!(
                        "v_cache shape {:?} differs from k_cache's {s:?}",
                        v.shape()
                    )));
                }
                let vv = T::of(v, "v_cache")?;
                if self.layout == "nhd" {
                    PagedPool::flashinfer_nhd(k, vv, s[0], s[1], s[2], s[3])
                } else {
                    PagedPool::flashinfer_hnd(k, vv, s[0], s[2], s[1], s[3])
                }
            }
            (l, _) => {
                return Err(value_err(format!(
                    "layout={l:?} with {}: expected 'vllm_cpu' or 'vllm_flash' (one array), or 'nhd' / 'hnd' (one array or a (k, v) tuple)",
                    if self.v.is_some() {
                        "a (k, v) tuple"
                    } else {
                        "one array"
                    }
                )));
            }
        };
        pool.py()
    }
}

/// Block table `[batch, max_blocks]` and `seq_lens [batch]`, int32.
struct Table<'py> {
    table: Idx<'py>,
    lens: Idx<'py>,
}

impl<'py> Table<'py> {
    fn new(table: &Bound<'py, PyAny>, seq_lens: &Bound<'py, PyAny>) -> PyResult<Self> {
        let t = Self {
            table: Idx::new(table, "block_table")?,
            lens: Idx::new(seq_lens, "seq_lens")?,
        };
        if t.table.shape().len() != 2
            || t.lens.shape().len() != 1
            || t.table.shape()[0] != t.lens.shape()[0]
        {
            return Err(value_err(format!(
                "block_table [batch, max_blocks] and seq_lens [batch]: found shapes {:?} and {:?}",
                t.table.shape(),
                t.lens.shape()
            )));
        }
        Ok(t)
    }
    fn batch<'a, T: FromKv>(&'a self, pool: PagedPool<'a, T>) -> PyResult<PagedBatch<'a, T>> {
        let bt = BlockTable::dense(
            self.table.slice("block_table")?,
            self.table.shape()[1],
            self.lens.slice("seq_lens")?,
        )
        .py()?;
        PagedBatch::new(pool, bt).py()
    }
}

fn lse_format(base: &Bound<'_, PyAny>, layout: &str) -> PyResult<LseFormat> {
    let base = if let Ok(s) = base.extract::<String>() {
        match s.as_str() {
            "2" => LseBase::Two,
            "e" => LseBase::E,
            _ => {
                return Err(value_err(format!(
                    "lse_base={s:?}: expected 2 (FlashInfer) or 'e' (natural log, vLLM)"
                )));
            }
        }
    } else if let Ok(n) = base.extract::<i64>() {
        match n {
            2 => LseBase::Two,
            _ => {
                return Err(value_err(format!(
                    "lse_base={n}: expected 2 (FlashInfer) or 'e' (natural log, vLLM)"
                )));
            }
        }
    } else {
        return Err(PyTypeError::new_err("lse_base: expected 2 or 'e'"));
    };
    let layout = match layout {
        "tokens_heads" => LseLayout::TokensHeads,
        "heads_tokens" => LseLayout::HeadsTokens,
        _ => {
            return Err(value_err(format!(
                "lse_layout={layout:?}: expected 'tokens_heads' (FlashInfer) or 'heads_tokens' (vLLM)"
            )));
        }
    };
    Ok(LseFormat { base, layout })
}

fn shape(q_heads: usize, kv_heads: usize, d: usize, scale: Option<f32>) -> PyResult<AttnShape> {
    let s = AttnShape::new(q_heads, kv_heads, d).py()?;
    match scale {
        None => Ok(s),
        Some(x) if x.is_nan() => Err(value_err("scale is NaN")),
        Some(x) => s.with_scale(x).py(),
    }
}

/// The shared backends: one per thread count, made once.
fn backend(threads: usize) -> PyResult<CpuBackend> {
    static POOLS: OnceLock<Mutex<HashMap<usize, CpuBackend>>> = OnceLock::new();
    let m = POOLS.get_or_init(Default::default);
    let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = m.get(&threads) {
        return Ok(b.clone());
    }
    let b = CpuBackend::new()
        .with_par(Par::from_threads(threads))
        .py()?;
    m.insert(threads, b.clone());
    Ok(b)
}

/// Per-sequence selections from a list (batch) of lists (KV heads) of index arrays.
fn selections(obj: &Bound<'_, PyAny>, batch: usize, kv_heads: usize) -> PyResult<Vec<Selection>> {
    let seqs: Vec<Bound<'_, PyAny>> = obj
        .extract()
        .map_err(|_| PyTypeError::new_err("selection: expected a list (one per sequence) of lists (one per KV head) of int arrays"))?;
    if seqs.len() != batch {
        return Err(value_err(format!(
            "selection: expected {batch} sequences, found {}",
            seqs.len()
        )));
    }
    seqs.iter()
        .enumerate()
        .map(|(b, s)| {
            let heads: Vec<Bound<'_, PyAny>> = s.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "selection[{b}]: expected a list of {kv_heads} int arrays"
                ))
            })?;
            if heads.len() != kv_heads {
                return Err(value_err(format!(
                    "selection[{b}]: expected {kv_heads} KV heads, found {}",
                    heads.len()
                )));
            }
            let mut sel = Selection::new();
            for (g, h) in heads.iter().enumerate() {
                if let Ok(a) = h.extract::<PyReadonlyArrayDyn<'_, i32>>() {
                    let x = contiguous(&a, "selection")?;
                    if let Some(&bad) = x.iter().find(|&&j| j < 0) {
                        return Err(value_err(format!(
                            "selection[{b}][{g}]: negative index {bad}"
                        )));
                    }
                    sel.push_head(x.iter().map(|&j| j as u32));
                } else if let Ok(a) = h.extract::<PyReadonlyArrayDyn<'_, i64>>() {
                    let x = contiguous(&a, "selection")?;
                    if let Some(&bad) = x.iter().find(|&&j| !(0..=u32::MAX as i64).contains(&j)) {
                        return Err(value_err(format!(
                            "selection[{b}][{g}]: index {bad} out of range"
                        )));
                    }
                    sel.push_head(x.iter().map(|&j| j as u32));
                } else {
                    let v: Vec<u32> = h.extract().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "selection[{b}][{g}]: expected an int array, found {}",
                            dtype_name(h)
                        ))
                    })?;
                    sel.push_head(v);
                }
            }
            Ok(sel)
        })
        .collect()
}

/// Reads q `[batch, q_heads, d]` and returns (batch, q_heads, d, slice).
fn q3<'a>(q: &'a PyReadonlyArrayDyn<'_, f32>) -> PyResult<(usize, usize, usize, &'a [f32])> {
    let s = q.shape();
    if s.len() != 3 {
        return Err(value_err(format!(
            "q: expected [batch, q_heads, head_dim], found shape {s:?}"
        )));
    }
    Ok((s[0], s[1], s[2], contiguous(q, "q")?))
}

// ---------------------------------------------------------------- merge

/// A merged partial `(v, s)` as numpy arrays.
type State<'py> = (Bound<'py, PyArrayDyn<f32>>, Bound<'py, PyArrayDyn<f32>>);
/// The mass selector's per-head reports.
type Report<'py> = Vec<Bound<'py, PyDict>>;

fn merge_n<'py>(
    py: Python<'py>,
    vs: &[&[f32]],
    ss: &[&[f32]],
    tokens: usize,
    heads: usize,
    d: usize,
    fmt: LseFormat,
) -> PyResult<(Vec<f32>, Vec<f32>)> {
    let layout = PartialLayout {
        n_tokens: tokens,
        q_heads: heads,
        head_dim: d,
    };
    let parts: Vec<(&[f32], &[f32])> = vs.iter().copied().zip(ss.iter().copied()).collect();
    py.detach(|| {
        let (mut o, mut l) = (vec![0.0f32; layout.out_len()], vec![0.0f32; layout.rows()]);
        hgca_kernels::merge_states(layout, fmt, &parts, &mut o, &mut l).map(|()| (o, l))
    })
    .py()
}

/// Checks v `[seq, heads, d]` and s (`[seq, heads]` or `[heads, seq]`).
fn vs_shape(
    v: &[usize],
    s: &[usize],
    fmt: LseFormat,
    what: &str,
) -> PyResult<(usize, usize, usize)> {
    if v.len() != 3 {
        return Err(value_err(format!(
            "{what}: v expected [seq, heads, head_dim], found shape {v:?}"
        )));
    }
    let want = match fmt.layout {
        LseLayout::TokensHeads => [v[0], v[1]],
        LseLayout::HeadsTokens => [v[1], v[0]],
    };
    if s != want {
        return Err(value_err(format!(
            "{what}: s expected shape {want:?} for lse_layout {:?}, found {s:?}",
            fmt.layout
        )));
    }
    Ok((v[0], v[1], v[2]))
}

fn to_py<'py>(
    py: Python<'py>,
    v: Vec<f32>,
    shape: &[usize],
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    PyArray1::from_vec(py, v).reshape(shape.to_vec())
}

#[pyfunction]
#[pyo3(signature = (v_a, s_a, v_b, s_b, *, lse_base = None, lse_layout = "tokens_heads"))]
fn merge_state<'py>(
    py: Python<'py>,
    v_a: &Bound<'py, PyAny>,
    s_a: &Bound<'py, PyAny>,
    v_b: &Bound<'py, PyAny>,
    s_b: &Bound<'py, PyAny>,
    lse_base: Option<&Bound<'py, PyAny>>,
    lse_layout: &str,
) -> PyResult<State<'py>> {
    let fmt = fmt_or_default(py, lse_base, lse_layout)?;
    let (va, sa, vb, sb) = (
        f32_arr(v_a, "v_a")?,
        f32_arr(s_a, "s_a")?,
        f32_arr(v_b, "v_b")?,
        f32_arr(s_b, "s_b")?,
    );
    let (t, h, d) = vs_shape(va.shape(), sa.shape(), fmt, "merge_state (a)")?;
    if vb.shape() != va.shape() || sb.shape() != sa.shape() {
        return Err(value_err(format!(
            "merge_state: b's shapes {:?} / {:?} differ from a's {:?} / {:?}",
            vb.shape(),
            sb.shape(),
            va.shape(),
            sa.shape()
        )));
    }
    let (o, l) = merge_n(
        py,
        &[contiguous(&va, "v_a")?, contiguous(&vb, "v_b")?],
        &[contiguous(&sa, "s_a")?, contiguous(&sb, "s_b")?],
        t,
        h,
        d,
        fmt,
    )?;
    Ok((to_py(py, o, va.shape())?, to_py(py, l, sa.shape())?))
}

fn fmt_or_default(
    py: Python<'_>,
    base: Option<&Bound<'_, PyAny>>,
    layout: &str,
) -> PyResult<LseFormat> {
    match base {
        Some(b) => lse_format(b, layout),
        None => lse_format(&2i64.into_pyobject(py)?.into_any(), layout),
    }
}

#[pyfunction]
#[pyo3(signature = (v, s, v_other, s_other, *, lse_base = None, lse_layout = "tokens_heads"))]
fn merge_state_in_place<'py>(
    py: Python<'py>,
    v: &Bound<'py, PyAny>,
    s: &Bound<'py, PyAny>,
    v_other: &Bound<'py, PyAny>,
    s_other: &Bound<'py, PyAny>,
    lse_base: Option<&Bound<'py, PyAny>>,
    lse_layout: &str,
) -> PyResult<()> {
    let fmt = fmt_or_default(py, lse_base, lse_layout)?;
    let mut va = v.extract::<PyReadwriteArrayDyn<'py, f32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "v: expected a writeable numpy float32 array, found {}",
            dtype_name(v)
        ))
    })?;
    let mut sa = s.extract::<PyReadwriteArrayDyn<'py, f32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "s: expected a writeable numpy float32 array, found {}",
            dtype_name(s)
        ))
    })?;
    let (vb, sb) = (f32_arr(v_other, "v_other")?, f32_arr(s_other, "s_other")?);
    let (t, h, d) = vs_shape(va.shape(), sa.shape(), fmt, "merge_state_in_place")?;
    if vb.shape() != va.shape() || sb.shape() != sa.shape() {
        return Err(value_err(
            "merge_state_in_place: v_other / s_other shapes differ from v / s",
        ));
    }
    let layout = PartialLayout {
        n_tokens: t,
        q_heads: h,
        head_dim: d,
    };
    let (vbs, sbs) = (contiguous(&vb, "v_other")?, contiguous(&sb, "s_other")?);
    let vm = va
        .as_slice_mut()
        .map_err(|_| value_err("v must be C-contiguous"))?;
    let sm = sa
        .as_slice_mut()
        .map_err(|_| value_err("s must be C-contiguous"))?;
    py.detach(|| hgca_kernels::merge_states_into(layout, fmt, vm, sm, vbs, sbs))
        .py()
}

#[pyfunction]
#[pyo3(signature = (v, s, *, lse_base = None, lse_layout = "tokens_heads"))]
fn merge_states<'py>(
    py: Python<'py>,
    v: &Bound<'py, PyAny>,
    s: &Bound<'py, PyAny>,
    lse_base: Option<&Bound<'py, PyAny>>,
    lse_layout: &str,
) -> PyResult<State<'py>> {
    let fmt = fmt_or_default(py, lse_base, lse_layout)?;
    if fmt.layout != LseLayout::TokensHeads {
        return Err(value_err(
            "merge_states: s is [seq, num_states, heads] (FlashInfer's); lse_layout must be 'tokens_heads'",
        ));
    }
    let (va, sa) = (f32_arr(v, "v")?, f32_arr(s, "s")?);
    let (vs, ss) = (va.shape().to_vec(), sa.shape().to_vec());
    if vs.len() != 4 || ss.len() != 3 || ss[..] != vs[..3] {
        return Err(value_err(format!(
            "merge_states: v expected [seq, num_states, heads, head_dim] and s [seq, num_states, heads], found {vs:?} and {ss:?}"
        )));
    }
    let (t, n, h, d) = (vs[0], vs[1], vs[2], vs[3]);
    let (vsl, ssl) = (contiguous(&va, "v")?, contiguous(&sa, "s")?);
    // Each state as its own contiguous partial [seq, heads, d].
    let mut pv = vec![vec![0.0f32; t * h * d]; n];
    let mut ps = vec![vec![0.0f32; t * h]; n];
    for i in 0..t {
        for k in 0..n {
            pv[k][i * h * d..(i + 1) * h * d].copy_from_slice(&vsl[(i * n + k) * h * d..][..h * d]);
            ps[k][i * h..(i + 1) * h].copy_from_slice(&ssl[(i * n + k) * h..][..h]);
        }
    }
    let vr: Vec<&[f32]> = pv.iter().map(Vec::as_slice).collect();
    let sr: Vec<&[f32]> = ps.iter().map(Vec::as_slice).collect();
    let (o, l) = merge_n(py, &vr, &sr, t, h, d, fmt)?;
    Ok((to_py(py, o, &[t, h, d])?, to_py(py, l, &[t, h])?))
}

// ---------------------------------------------------------------- attention

/// Nanoseconds of the last batched decode's Rust work (building the views
/// and the call), for the overhead bench.
static LAST_RUST_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Seconds of the last `sparse_decode` / `dense_decode`'s Rust work: what
/// the same call made from Rust takes (views built, kernel run), without
/// the Python conversions (for `hgca-py/bench_overhead.py`).
#[pyfunction]
fn _last_rust_seconds() -> f64 {
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
fn sparse_decode<'py>(
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
fn dense_decode<'py>(
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
fn append_attention<'py>(
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

// ---------------------------------------------------------------- selection

enum BoundsAny {
    F32(PageBounds<f32>),
    F16(PageBounds<f16>),
    Bf16(PageBounds<bf16>),
}

/// Quest-style key bounds per page and KV head of one cache pool.
#[pyclass(module = "hgca._hgca")]
struct KeyBounds {
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
fn select_top_pages<'py>(
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
fn select_by_mass<'py>(
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

// ---------------------------------------------------------------- hybrid layer

enum LayerAny {
    F32(HybridAttention<CpuBackend, CpuBackend, f32>),
    F16(HybridAttention<CpuBackend, CpuBackend, f16>),
    Bf16(HybridAttention<CpuBackend, CpuBackend, bf16>),
}

macro_rules! with_layer {
    ($l:expr, $x:ident => $body:expr) => {
        match $l {
            LayerAny::F32($x) => $body,
            LayerAny::F16($x) => $body,
            LayerAny::Bf16($x) => $body,
        }
    };
}

/// The hybrid attention layer of one sequence, the CPU in both roles.
#[pyclass(module = "hgca._hgca", name = "HybridAttention")]
struct HybridLayer {
    inner: LayerAny,
    q_len: usize,
    kv_len: usize,
}

fn slice_of<'a>(
    a: &'a PyReadonlyArrayDyn<'_, f32>,
    what: &str,
    width: usize,
) -> PyResult<(usize, &'a [f32])> {
    let s = contiguous(a, what)?;
    if width == 0 || !s.len().is_multiple_of(width) {
        return Err(value_err(format!(
            "{what}: expected [n, heads, head_dim] with heads * head_dim = {width}, found shape {:?}",
            a.shape()
        )));
    }
    Ok((s.len() / width, s))
}

#[pymethods]
impl HybridLayer {
    #[new]
    #[pyo3(signature = (q_heads, kv_heads, head_dim, *, window = 1024, block = 64, sinks = 4, beta = 1.0, alpha = 0.9, recovery = "mass", recovery_param = 32, mass_target = 0.9, mass_max_share = 0.5, refresh_queries = 1, dtype = "f16", threads = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        window: usize,
        block: usize,
        sinks: usize,
        beta: f32,
        alpha: f32,
        recovery: &str,
        recovery_param: usize,
        mass_target: f32,
        mass_max_share: f32,
        refresh_queries: usize,
        dtype: &str,
        threads: usize,
    ) -> PyResult<Self> {
        let shape = shape(q_heads, kv_heads, head_dim, None)?;
        let recovery = match recovery {
            "frozen" => Recovery::Frozen,
            "rescore" => Recovery::Rescore {
                every: recovery_param,
            },
            "bounds" => Recovery::BlockBounds {
                top: recovery_param,
            },
            "mass" => {
                Recovery::Mass(hgca_kernels::MassTarget::new(mass_target, mass_max_share).py()?)
            }
            r => {
                return Err(value_err(format!(
                    "recovery={r:?}: expected 'frozen', 'rescore', 'bounds' or 'mass'"
                )));
            }
        };
        let cfg = HybridConfig {
            window,
            block,
            sinks,
            beta,
            beta_per_head: None,
            alpha,
            recovery,
            refresh_queries,
        };
        let cpu = backend(threads)?;
        let inner = match dtype {
            "f32" => LayerAny::F32(HybridAttention::cpu_on(shape, cfg, cpu).py()?),
            "f16" => LayerAny::F16(HybridAttention::cpu_on(shape, cfg, cpu).py()?),
            "bf16" => LayerAny::Bf16(HybridAttention::cpu_on(shape, cfg, cpu).py()?),
            d => {
                return Err(value_err(format!(
                    "dtype={d:?}: expected 'f32', 'f16' or 'bf16'"
                )));
            }
        };
        Ok(Self {
            inner,
            q_len: shape.q_len(),
            kv_len: shape.kv_token_len(),
        })
    }

    /// `n` tokens: q `[n, q_heads, d]`, k and v `[n, kv_heads, d]`; returns out `[n, q_heads, d]`.
    fn forward<'py>(
        &mut self,
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
        k: &Bound<'py, PyAny>,
        v: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let (qa, ka, va) = (f32_arr(q, "q")?, f32_arr(k, "k")?, f32_arr(v, "v")?);
        let (n, qs) = slice_of(&qa, "q", self.q_len)?;
        let (nk, ks) = slice_of(&ka, "k", self.kv_len)?;
        let (_, vs) = slice_of(&va, "v", self.kv_len)?;
        if nk != n {
            return Err(value_err(format!("q has {n} tokens, k {nk}")));
        }
        let shape_out = qa.shape().to_vec();
        let q_len = self.q_len;
        let inner = &mut self.inner;
        let o = py
            .detach(|| {
                let mut o = vec![0.0f32; n * q_len];
                with_layer!(inner, l => l.forward(qs, ks, vs, n, &mut o)).map(|()| o)
            })
            .py()?;
        to_py(py, o, &shape_out)
    }

    /// Appends `n` tokens (k, v `[n, kv_heads, d]`) without attending.
    fn append(
        &mut self,
        py: Python<'_>,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (ka, va) = (f32_arr(k, "k")?, f32_arr(v, "v")?);
        let (n, ks) = slice_of(&ka, "k", self.kv_len)?;
        let (_, vs) = slice_of(&va, "v", self.kv_len)?;
        let inner = &mut self.inner;
        py.detach(|| with_layer!(inner, l => l.append(ks, vs, n)))
            .py()
    }

    /// One decode query `q [q_heads, d]`; returns out `[q_heads, d]`.
    fn attend<'py>(
        &mut self,
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let qa = f32_arr(q, "q")?;
        let qs = contiguous(&qa, "q")?;
        let shape_out = qa.shape().to_vec();
        let q_len = self.q_len;
        let inner = &mut self.inner;
        let o = py
            .detach(|| {
                let mut o = vec![0.0f32; q_len];
                with_layer!(inner, l => l.attend(qs, &mut o)).map(|()| o)
            })
            .py()?;
        to_py(py, o, &shape_out)
    }

    /// What the last step did: tokens on each side, entries attended, times (seconds).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = with_layer!(&self.inner, l => l.stats().clone());
        let d = PyDict::new(py);
        d.set_item("window_tokens", s.window_tokens)?;
        d.set_item("cpu_tokens", s.cpu_tokens)?;
        d.set_item("selected", s.selected)?;
        d.set_item("full_cpu", s.full_cpu)?;
        d.set_item("dense_s", s.dense.as_secs_f64())?;
        d.set_item("sparse_s", s.sparse.as_secs_f64())?;
        d.set_item("merge_s", s.merge.as_secs_f64())?;
        d.set_item("total_s", s.total.as_secs_f64())?;
        d.set_item("mass_estimated", s.mass_estimated)?;
        d.set_item("dense_heads", s.dense_heads)?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        with_layer!(&self.inner, l => l.len())
    }
}

#[pymodule]
fn _hgca(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(merge_state, m)?)?;
    m.add_function(wrap_pyfunction!(merge_state_in_place, m)?)?;
    m.add_function(wrap_pyfunction!(merge_states, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_decode, m)?)?;
    m.add_function(wrap_pyfunction!(dense_decode, m)?)?;
    m.add_function(wrap_pyfunction!(append_attention, m)?)?;
    m.add_function(wrap_pyfunction!(select_top_pages, m)?)?;
    m.add_function(wrap_pyfunction!(select_by_mass, m)?)?;
    m.add_function(wrap_pyfunction!(_last_rust_seconds, m)?)?;
    m.add_class::<KeyBounds>()?;
    m.add_class::<HybridLayer>()?;
    Ok(())
}
