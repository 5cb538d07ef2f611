//! Python wrappers for `zrs_core::registry`.

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use zrs_core::registry::{self, ParamId};

use crate::error::ToPyResult;

/// Read-only snapshot of one registered parameter.
#[pyclass(frozen, module = "zrs._core")]
pub struct ParamInfo {
    #[pyo3(get)]
    ds_id: ParamId,
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
    persistent: bool,
    #[pyo3(get)]
    requires_grad: bool,
    #[pyo3(get)]
    status: &'static str,
    #[pyo3(get)]
    gathered_valid: bool,
    #[pyo3(get)]
    holders: usize,
}

impl From<&registry::ParamInfo> for ParamInfo {
    fn from(p: &registry::ParamInfo) -> Self {
        Self {
            ds_id: p.ds_id,
            shape: p.shape.clone(),
            numel: p.numel,
            shard_rows: p.shard_rows,
            padded_numel: p.padded_numel,
            shard_numel: p.shard_numel,
            dtype: p.dtype.clone(),
            persistent: p.persistent,
            requires_grad: p.requires_grad,
            status: p.status.as_str(),
            gathered_valid: p.gathered_valid,
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
            "ParamInfo(ds_id={}, shape={shape}, dtype='{}', status='{}', holders={})",
            self.ds_id, self.dtype, self.status, self.holders
        ))
    }
}

/// Sizes and gather state of every sharded parameter, keyed by ds_id.
#[pyclass(name = "Registry", module = "zrs._core")]
pub struct PyRegistry(registry::Registry);

#[pymethods]
impl PyRegistry {
    #[new]
    fn new(world_size: usize) -> PyResult<Self> {
        ToPyResult(registry::Registry::new(world_size).map(Self)).into_py()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    #[pyo3(signature = (shape, dtype, persistent = false, requires_grad = true))]
    fn register(
        &mut self,
        shape: Vec<usize>,
        dtype: String,
        persistent: bool,
        requires_grad: bool,
    ) -> PyResult<ParamId> {
        ToPyResult(self.0.register(shape, dtype, persistent, requires_grad)).into_py()
    }

    fn info(&self, ds_id: ParamId) -> PyResult<ParamInfo> {
        ToPyResult(self.0.info(ds_id).map(ParamInfo::from)).into_py()
    }

    fn local_rows(&self, ds_id: ParamId, rank: usize) -> PyResult<usize> {
        ToPyResult(self.0.local_rows(ds_id, rank)).into_py()
    }

    fn start_gather(&mut self, ds_id: ParamId) -> PyResult<bool> {
        ToPyResult(self.0.start_gather(ds_id)).into_py()
    }

    fn finish_gather(&mut self, ds_id: ParamId) -> PyResult<()> {
        ToPyResult(self.0.finish_gather(ds_id)).into_py()
    }

    fn release(&mut self, ds_id: ParamId) -> PyResult<bool> {
        ToPyResult(self.0.release(ds_id)).into_py()
    }

    fn invalidate(&mut self, ds_id: ParamId) -> PyResult<()> {
        ToPyResult(self.0.invalidate(ds_id)).into_py()
    }

    fn invalidate_all(&mut self) {
        self.0.invalidate_all();
    }

    fn drop_all_gathers(&mut self) -> usize {
        self.0.drop_all_gathers()
    }

    fn set_uses(&mut self, graph_id: usize, ds_id: ParamId, n: usize) -> PyResult<()> {
        ToPyResult(self.0.set_uses(graph_id, ds_id, n)).into_py()
    }

    fn uses(&self, graph_id: usize, ds_id: ParamId) -> PyResult<usize> {
        ToPyResult(self.0.uses(graph_id, ds_id)).into_py()
    }

    fn ids(&self) -> Vec<ParamId> {
        self.0.ids().collect()
    }

    fn __len__(&self) -> usize {
        self.0.len()
    }

    // Signed so that `-1 in registry` is False instead of an OverflowError.
    fn __contains__(&self, ds_id: i64) -> bool {
        ParamId::try_from(ds_id).is_ok_and(|id| self.0.contains(id))
    }

    fn total_numel(&self) -> usize {
        self.0.total_numel()
    }

    fn total_shard_numel(&self) -> usize {
        self.0.total_shard_numel()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ParamInfo>()?;
    m.add_class::<PyRegistry>()?;
    Ok(())
}
