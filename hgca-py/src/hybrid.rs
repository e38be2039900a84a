//! `HybridAttention`: the hybrid attention layer of one sequence, the CPU
//! in both roles.

use half::{bf16, f16};
use hgca_cpu::CpuBackend;
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
use numpy::{PyArrayDyn, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::{backend, shape};
use crate::arrays::{contiguous, f32_arr, to_py};
use crate::error::{OrPy, value_err};

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
pub(crate) struct HybridLayer {
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
    #[pyo3(signature = (q_heads, kv_heads, head_dim, *, window = 1024, block = 64, sinks = 4, beta = 1.0, alpha = 0.9, recovery = "mass", recovery_param = 32, mass_target = 0.93, mass_max_share = 0.5, refresh_queries = 1, dtype = "f16", threads = 0))]
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
            // The mass selector's key copy: the library's default.
            ..HybridConfig::default()
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
