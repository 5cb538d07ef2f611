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

create_exception!(
    zrs._core,
    BudgetInfeasibleError,
    ZrsError,
    "No plan fits the memory budget. Attributes (bytes): `budget`, `minimal` (the least \
     feasible budget) and `base` (bytes live at the graph's start, which `budget` and `minimal` \
     exclude when it is not 0)."
);

fn to_py_err(e: zrs_core::Error) -> PyErr {
    match e {
        zrs_core::Error::BudgetInfeasible {
            budget,
            minimal,
            base,
        } => Python::with_gil(|py| {
            let err = BudgetInfeasibleError::new_err(e.to_string());
            let value = err.value(py);
            let set = value
                .setattr("budget", budget)
                .and_then(|()| value.setattr("minimal", minimal))
                .and_then(|()| value.setattr("base", base));
            match set {
                Ok(()) => err,
                Err(failed) => failed,
            }
        }),
        e => ZrsError::new_err(e.to_string()),
    }
}

/// Wraps a core result so that `?` in a `#[pymethods]` body turns it into a `PyResult`
/// (the orphan rule forbids `From<zrs_core::Error> for PyErr`).
pub struct ToPyResult<T>(pub zrs_core::Result<T>);

impl<T> From<ToPyResult<T>> for PyResult<T> {
    fn from(r: ToPyResult<T>) -> Self {
        r.0.map_err(to_py_err)
    }
}

impl<T> ToPyResult<T> {
    pub fn into_py(self) -> PyResult<T> {
        self.into()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ZrsError", m.py().get_type::<ZrsError>())?;
    m.add(
        "BudgetInfeasibleError",
        m.py().get_type::<BudgetInfeasibleError>(),
    )
}
