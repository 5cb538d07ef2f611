//! Python wrappers for `zrs_core::registry`.

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use zrs_core::registry::{self, Slot};

use crate::error::ToPyResult;

/// Read-only snapshot of one registered parameter.
#[pyclass(frozen, module = "zrs._core")]
pub struct ParamInfo {
    #[pyo3(get)]
    slot: Slot,
    shape: Vec<usize>,
    #[pyo3(get)]
    numel: usize,
    #[pyo3(get)]
    shard_rows: usize,
    #[pyo3(get)]
    padded_numel: usize,
    #[pyo3(get)]
    shard_numel: usize,
    #[pyo3(get)]
    dtype: String,
    #[pyo3(get)]
    requires_grad: bool,
    #[pyo3(get)]
    status: &'static str,
    #[pyo3(get)]
    holders: usize,
}

impl From<&registry::ParamInfo> for ParamInfo {
    fn from(p: &registry::ParamInfo) -> Self {
        Self {
            slot: p.slot,
            shape: p.shape.clone(),
            numel: p.numel,
            shard_rows: p.shard_rows,
            padded_numel: p.padded_numel,
            shard_numel: p.shard_numel,
            dtype: p.dtype.clone(),
            requires_grad: p.requires_grad,
            status: p.status.as_str(),
            holders: p.holders,
        }
    }
}

#[pymethods]
impl ParamInfo {
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let shape = self.shape(py)?.repr()?;
        Ok(format!(
            "ParamInfo(slot={}, shape={shape}, dtype='{}', status='{}', holders={})",
            self.slot, self.dtype, self.status, self.holders
        ))
    }
}

/// Sizes and gather state of every sharded parameter of one model, keyed by slot.
#[pyclass(name = "Registry", module = "zrs._core")]
pub struct PyRegistry(registry::Registry);

#[pymethods]
impl PyRegistry {
    #[new]
    fn new(world_size: usize) -> PyResult<Self> {
        ToPyResult(registry::Registry::new(world_size).map(Self)).into_py()
    }

    #[pyo3(signature = (shape, dtype, requires_grad = true))]
    fn register(
        &mut self,
        shape: Vec<usize>,
        dtype: String,
        requires_grad: bool,
    ) -> PyResult<Slot> {
        ToPyResult(self.0.register(shape, dtype, requires_grad)).into_py()
    }

    fn info(&self, slot: Slot) -> PyResult<ParamInfo> {
        ToPyResult(self.0.info(slot).map(ParamInfo::from)).into_py()
    }

    fn local_rows(&self, slot: Slot, rank: usize) -> PyResult<usize> {
        ToPyResult(self.0.local_rows(slot, rank)).into_py()
    }

    fn start_gather(&mut self, slot: Slot) -> PyResult<bool> {
        ToPyResult(self.0.start_gather(slot)).into_py()
    }

    fn finish_gather(&mut self, slot: Slot) -> PyResult<()> {
        ToPyResult(self.0.finish_gather(slot)).into_py()
    }

    fn release(&mut self, slot: Slot) -> PyResult<bool> {
        ToPyResult(self.0.release(slot)).into_py()
    }

    fn drop_all_gathers(&mut self) -> usize {
        self.0.drop_all_gathers()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ParamInfo>()?;
    m.add_class::<PyRegistry>()?;
    Ok(())
}
