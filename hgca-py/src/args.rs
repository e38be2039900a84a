//! The other arguments read as hgca's types: LSE formats, shapes, the
//! shared CPU backends, selections and the query batch.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use hgca_cpu::{CpuBackend, Par};
use hgca_kernels::{AttnShape, LseBase, LseFormat, LseLayout, Selection};
use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::arrays::{contiguous, dtype_name};
use crate::error::{OrPy, value_err};

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

pub(crate) fn fmt_or_default(
    py: Python<'_>,
    base: Option<&Bound<'_, PyAny>>,
    layout: &str,
) -> PyResult<LseFormat> {
    match base {
        Some(b) => lse_format(b, layout),
        None => lse_format(&2i64.into_pyobject(py)?.into_any(), layout),
    }
}

pub(crate) fn shape(
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    scale: Option<f32>,
) -> PyResult<AttnShape> {
    let s = AttnShape::new(q_heads, kv_heads, d).py()?;
    match scale {
        None => Ok(s),
        Some(x) if x.is_nan() => Err(value_err("scale is NaN")),
        Some(x) => s.with_scale(x).py(),
    }
}

/// The shared backends: one per thread count, made once.
pub(crate) fn backend(threads: usize) -> PyResult<CpuBackend> {
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
pub(crate) fn selections(
    obj: &Bound<'_, PyAny>,
    batch: usize,
    kv_heads: usize,
) -> PyResult<Vec<Selection>> {
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
pub(crate) fn q3<'a>(
    q: &'a PyReadonlyArrayDyn<'_, f32>,
) -> PyResult<(usize, usize, usize, &'a [f32])> {
    let s = q.shape();
    if s.len() != 3 {
        return Err(value_err(format!(
            "q: expected [batch, q_heads, head_dim], found shape {s:?}"
        )));
    }
    Ok((s[0], s[1], s[2], contiguous(q, "q")?))
}
