//! `zrs._core`: PyO3 glue over zrs-core. Each submodule wraps one part of the core and adds its
//! classes and functions to the module through its own `register`.

use pyo3::prelude::*;

mod eager;
mod error;
mod optim;
mod plan;
mod registry;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    registry::register(m)?;
    plan::register(m)?;
    eager::register(m)?;
    optim::register(m)?;
    Ok(())
}
