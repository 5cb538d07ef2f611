//! The one place where `zrs_core::Error` becomes a Python exception.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

create_exception!(
    zrs._core,
    ZrsError,
    PyRuntimeError,
    "Raised for every error reported by the zrs core; the message says what to do."
);

/// Wraps a core result so that `?` in a `#[pymethods]` body turns it into a `PyResult`
/// (the orphan rule forbids `From<zrs_core::Error> for PyErr`).
pub struct ToPyResult<T>(pub zrs_core::Result<T>);

impl<T> From<ToPyResult<T>> for PyResult<T> {
    fn from(r: ToPyResult<T>) -> Self {
        r.0.map_err(|e| ZrsError::new_err(e.to_string()))
    }
}

impl<T> ToPyResult<T> {
    pub fn into_py(self) -> PyResult<T> {
        self.into()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ZrsError", m.py().get_type::<ZrsError>())
}
