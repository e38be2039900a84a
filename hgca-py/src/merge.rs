//! `merge_state`, `merge_state_in_place` and `merge_states`: merging
//! attention partials, with FlashInfer's names.

use hgca_kernels::{LseFormat, LseLayout, PartialLayout};
use numpy::{PyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::args::fmt_or_default;
use crate::arrays::{contiguous, dtype_name, f32_arr, to_py};
use crate::error::{OrPy, value_err};

/// A merged partial `(v, s)` as numpy arrays.
type State<'py> = (Bound<'py, PyArrayDyn<f32>>, Bound<'py, PyArrayDyn<f32>>);

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

#[pyfunction]
#[pyo3(signature = (v_a, s_a, v_b, s_b, *, lse_base = None, lse_layout = "tokens_heads"))]
pub(crate) fn merge_state<'py>(
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

#[pyfunction]
#[pyo3(signature = (v, s, v_other, s_other, *, lse_base = None, lse_layout = "tokens_heads"))]
pub(crate) fn merge_state_in_place<'py>(
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
pub(crate) fn merge_states<'py>(
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
