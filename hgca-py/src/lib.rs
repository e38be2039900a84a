//! The native module `hgca._hgca` behind the Python package `hgca` (see
//! `python/hgca/__init__.py` for the documented surface and `_hgca.pyi`
//! for the types). Arrays come in as numpy arrays, read in place when
//! C-contiguous (anything else is a `ValueError` naming the argument);
//! every kernel call runs with the GIL released.
#![deny(unsafe_op_in_unsafe_fn)]

mod args;
mod arrays;
mod attention;
mod error;
mod hybrid;
mod merge;
mod select;

use pyo3::prelude::*;

use crate::attention::{_last_rust_seconds, append_attention, dense_decode, sparse_decode};
use crate::hybrid::HybridLayer;
use crate::merge::{merge_state, merge_state_in_place, merge_states};
use crate::select::{KeyBounds, select_by_mass, select_top_pages};

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
