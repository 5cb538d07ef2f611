//! Python wrapper for `zrs_core::eager`: the eager path's parameter coordinator. Every method
//! answers with plain lists and tuples, so that a module hook does the least work per call.

use pyo3::prelude::*;
use zrs_core::eager::{self, EagerConfig, ParamSpec, UnitId};
use zrs_core::registry::Slot;

use crate::error::ToPyResult;

/// A fetch as Python reads it: (issue, wait, prefetch groups, divergence as
/// (position, expected unit or None, unit)).
type Fetch = (
    Vec<Slot>,
    Vec<Slot>,
    Vec<Vec<Slot>>,
    Option<(usize, Option<UnitId>, UnitId)>,
);

fn fetch(f: eager::Fetch) -> Fetch {
    let diverged = f.diverged.map(|d| (d.position, d.expected, d.got));
    (f.issue, f.wait, f.prefetch, diverged)
}

/// Decides, hook by hook, which parameters to gather, prefetch, keep and release.
#[pyclass(name = "Coordinator", module = "zrs._core")]
pub struct PyCoordinator(eager::Coordinator);

#[pymethods]
impl PyCoordinator {
    #[new]
    #[pyo3(signature = (params, units, grad_bucket_numel, prefetch_numel = None, max_live_numel = None, max_reuse_distance = None, persist_numel = None))]
    fn new(
        params: Vec<(u64, u64, bool)>,
        units: Vec<Vec<Slot>>,
        grad_bucket_numel: u64,
        prefetch_numel: Option<u64>,
        max_live_numel: Option<u64>,
        max_reuse_distance: Option<u64>,
        persist_numel: Option<u64>,
    ) -> PyResult<Self> {
        let params: Vec<ParamSpec> = params
            .into_iter()
            .map(|(numel, shard_numel, requires_grad)| ParamSpec {
                numel,
                shard_numel,
                requires_grad,
            })
            .collect();
        ToPyResult(eager::unit_numels(&params, &units).and_then(|numels| {
            let cfg = EagerConfig::resolve(
                prefetch_numel,
                max_live_numel,
                max_reuse_distance,
                persist_numel,
                grad_bucket_numel,
                &numels,
            );
            eager::Coordinator::new(cfg, params, units).map(Self)
        }))
        .into_py()
    }

    fn begin_forward(&mut self, training: bool) -> Vec<Slot> {
        self.0.begin_forward(training)
    }

    fn pre_forward(&mut self, unit: UnitId) -> PyResult<Fetch> {
        ToPyResult(self.0.pre_forward(unit).map(fetch)).into_py()
    }

    fn fetch(&mut self, slot: Slot) -> PyResult<Fetch> {
        ToPyResult(self.0.fetch(slot).map(fetch)).into_py()
    }

    fn post_forward(&mut self, unit: UnitId) -> PyResult<Vec<Slot>> {
        ToPyResult(self.0.post_forward(unit)).into_py()
    }

    fn end_forward(&mut self) -> Vec<Slot> {
        self.0.end_forward()
    }

    fn pre_backward(&mut self, unit: UnitId) -> PyResult<Fetch> {
        ToPyResult(self.0.pre_backward(unit).map(fetch)).into_py()
    }

    fn grad_ready(&mut self, slot: Slot) -> PyResult<(Vec<Slot>, u64)> {
        let ready = self.0.grad_ready(slot);
        ToPyResult(ready.map(|g| (g.release, g.bucket_numel))).into_py()
    }

    fn post_backward(&mut self, unit: UnitId) -> PyResult<Vec<Slot>> {
        ToPyResult(self.0.post_backward(unit)).into_py()
    }

    fn end_backward(&mut self) -> (Vec<Slot>, bool) {
        let end = self.0.end_backward();
        (end.release, end.recorded)
    }

    fn reset(&mut self) -> Vec<Slot> {
        self.0.reset()
    }

    #[getter]
    fn mode(&self) -> &'static str {
        self.0.mode().as_str()
    }

    #[getter]
    fn live_numel(&self) -> u64 {
        self.0.live_numel()
    }

    fn trace_units(&self) -> Vec<UnitId> {
        self.0.trace_units().to_vec()
    }

    fn trace_params(&self) -> Vec<(usize, Slot)> {
        self.0.trace_params()
    }

    fn status(&self, slot: Slot) -> PyResult<&'static str> {
        ToPyResult(self.0.status(slot).map(|s| s.as_str())).into_py()
    }

    #[getter]
    fn prefetch_numel(&self) -> u64 {
        self.0.config().prefetch_numel
    }

    #[getter]
    fn max_live_numel(&self) -> u64 {
        self.0.config().max_live_numel
    }

    #[getter]
    fn max_reuse_distance(&self) -> u64 {
        self.0.config().max_reuse_distance
    }

    #[getter]
    fn persist_numel(&self) -> u64 {
        self.0.config().persist_numel
    }

    fn __repr__(&self) -> String {
        format!(
            "Coordinator(mode='{}', live_numel={}, trace_units={})",
            self.0.mode().as_str(),
            self.0.live_numel(),
            self.0.trace_units().len()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCoordinator>()
}
