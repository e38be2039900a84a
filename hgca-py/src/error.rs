//! hgca's errors as the Python exceptions a caller expects.

use hgca_kernels::Error;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

/// hgca's error as the Python exception a caller expects.
fn py_err(e: Error) -> PyErr {
    match e {
        Error::UnsupportedDType { .. } => PyTypeError::new_err(hgca_kernels::report(&e)),
        Error::OutOfMemory { .. } => PyMemoryError::new_err(hgca_kernels::report(&e)),
        Error::Backend { .. } | Error::Unavailable { .. } | Error::NotCompiledIn { .. } => {
            PyRuntimeError::new_err(hgca_kernels::report(&e))
        }
        _ => PyValueError::new_err(hgca_kernels::report(&e)),
    }
}

pub(crate) fn value_err(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

pub(crate) trait OrPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> OrPy<T> for Result<T, Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(py_err)
    }
}
