//! numpy arrays in and out: contiguous slices, float32 and index arrays,
//! KV arrays of any dtype, and the paged cache and block table they make.

use half::{bf16, f16};
use hgca_kernels::{BlockTable, KvElem, PagedBatch, PagedPool};
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::error::{OrPy, value_err};

/// A C-contiguous slice of `a`, or a `ValueError` naming `what`.
pub(crate) fn contiguous<'a, T: numpy::Element>(
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

pub(crate) fn dtype_name(obj: &Bound<'_, PyAny>) -> String {
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
pub(crate) fn f32_arr<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, f32>> {
    obj.extract::<PyReadonlyArrayDyn<'py, f32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected a numpy float32 array, found {}",
            dtype_name(obj)
        ))
    })
}

/// An int32 (or uint32) index array argument, as `u32` (negative entries
/// become `>= 2^31` and are refused downstream as out of range).
pub(crate) enum Idx<'py> {
    I32(PyReadonlyArrayDyn<'py, i32>),
    U32(PyReadonlyArrayDyn<'py, u32>),
}

impl<'py> Idx<'py> {
    pub(crate) fn new(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
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
    pub(crate) fn shape(&self) -> &[usize] {
        match self {
            Idx::I32(a) => a.shape(),
            Idx::U32(a) => a.shape(),
        }
    }
    pub(crate) fn slice(&self, what: &str) -> PyResult<&[u32]> {
        Ok(match self {
            Idx::I32(a) => bytemuck::cast_slice(contiguous(a, what)?),
            Idx::U32(a) => contiguous(a, what)?,
        })
    }
}

/// A KV cache array: float32, float16, or bfloat16 given as uint16 bits.
pub(crate) enum KvArr<'py> {
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
    pub(crate) fn kind(&self) -> u8 {
        match self {
            KvArr::F32(_) => 0,
            KvArr::F16(_) => 1,
            KvArr::Bf16(_) => 2,
        }
    }
}

/// The typed slice of a KV array (the caller matched its kind).
pub(crate) trait FromKv: KvElem + hgca_cpu::isa::SimdElem {
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
pub(crate) use with_kv;

/// A cache argument: one array, or a `(k, v)` tuple for layouts that keep them apart.
pub(crate) struct Cache<'py> {
    pub(crate) k: KvArr<'py>,
    v: Option<KvArr<'py>>,
    layout: String,
}

impl<'py> Cache<'py> {
    pub(crate) fn new(
        obj: &Bound<'py, PyAny>,
        layout: &str,
        dtype: Option<&str>,
    ) -> PyResult<Self> {
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
    pub(crate) fn pool<T: FromKv>(&self) -> PyResult<PagedPool<'_, T>> {
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
pub(crate) struct Table<'py> {
    table: Idx<'py>,
    lens: Idx<'py>,
}

impl<'py> Table<'py> {
    pub(crate) fn new(table: &Bound<'py, PyAny>, seq_lens: &Bound<'py, PyAny>) -> PyResult<Self> {
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
    pub(crate) fn batch<'a, T: FromKv>(
        &'a self,
        pool: PagedPool<'a, T>,
    ) -> PyResult<PagedBatch<'a, T>> {
        let bt = BlockTable::dense(
            self.table.slice("block_table")?,
            self.table.shape()[1],
            self.lens.slice("seq_lens")?,
        )
        .py()?;
        PagedBatch::new(pool, bt).py()
    }
}

pub(crate) fn to_py<'py>(
    py: Python<'py>,
    v: Vec<f32>,
    shape: &[usize],
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    PyArray1::from_vec(py, v).reshape(shape.to_vec())
}
