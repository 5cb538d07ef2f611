//! Python wrappers for `zrs_core::plan`: one call per graph, JSON strings in and out, the GIL
//! released while planning.

use pyo3::prelude::*;
use zrs_core::plan;
use zrs_core::plan::cost::CostModel;

use crate::error::ToPyResult;

/// Plan one graph (planner IR JSON). `cost` is a preset name ("nvlink", "nop2p") or a cost-model
/// JSON object; `budget_bytes` defaults to the graph's, else greedy's peak. Returns the plan JSON.
#[pyfunction]
#[pyo3(signature = (graph_json, scheduler = "search", budget_bytes = None, cost = None, detail = true))]
fn plan_graph(
    py: Python<'_>,
    graph_json: &str,
    scheduler: &str,
    budget_bytes: Option<u64>,
    cost: Option<&str>,
    detail: bool,
) -> PyResult<String> {
    ToPyResult(
        py.allow_threads(|| plan::plan_json(graph_json, scheduler, budget_bytes, cost, detail)),
    )
    .into()
}

/// Plan with both schedulers; the one-line summary of `python -m zrs.plan`.
#[pyfunction]
#[pyo3(signature = (graph_json, budget_bytes = None, cost = None))]
fn compare_plans(
    py: Python<'_>,
    graph_json: &str,
    budget_bytes: Option<u64>,
    cost: Option<&str>,
) -> PyResult<String> {
    ToPyResult(py.allow_threads(|| plan::compare_json(graph_json, budget_bytes, cost))).into()
}

/// Plan a graph and return its Chrome trace (Perfetto) JSON.
#[pyfunction]
#[pyo3(signature = (graph_json, scheduler = "search", budget_bytes = None, cost = None))]
fn chrome_trace(
    py: Python<'_>,
    graph_json: &str,
    scheduler: &str,
    budget_bytes: Option<u64>,
    cost: Option<&str>,
) -> PyResult<String> {
    ToPyResult(
        py.allow_threads(|| plan::chrome_trace_json(graph_json, scheduler, budget_bytes, cost)),
    )
    .into()
}

/// A synthetic transformer training graph of about `n_nodes` nodes (0: the preset's layers).
#[pyfunction]
#[pyo3(signature = (n_nodes = 0, preset = "1b", world = 2))]
fn synthetic_graph(py: Python<'_>, n_nodes: usize, preset: &str, world: u32) -> PyResult<String> {
    ToPyResult(py.allow_threads(|| plan::synthetic_graph_json(n_nodes, preset, world))).into()
}

/// A preset cost model as JSON ("nvlink", "nop2p").
#[pyfunction]
#[pyo3(signature = (preset = "nvlink", world = 2))]
fn cost_model(preset: &str, world: u32) -> PyResult<String> {
    ToPyResult(CostModel::preset(preset, world).map(|m| m.to_json())).into()
}

/// Fit a cost model from a sweep: lists of (full bytes, microseconds) per collective.
#[pyfunction]
fn fit_cost_model(
    allgather: Vec<(u64, f64)>,
    reduce_scatter: Vec<(u64, f64)>,
    world: u32,
) -> PyResult<String> {
    ToPyResult(CostModel::fit(&allgather, &reduce_scatter, world).map(|m| m.to_json())).into()
}

/// The forward's last-released parameters to keep for the backward (`plan::keep`): releases in
/// execution order as (ds_id, gathered bytes), and the bytes they may hold.
#[pyfunction]
fn kept_for_backward(releases: Vec<(usize, u64)>, allowance: u64) -> Vec<usize> {
    plan::keep::kept_for_backward(&releases, allowance)
}

/// The per-rank elements of each gradient's bucket (`plan::grad_buckets`): the gradients'
/// per-rank shard elements in the backward's order, and a bucket's capacity.
#[pyfunction]
fn grad_buckets(numels: Vec<u64>, capacity: u64) -> Vec<u64> {
    plan::grad_buckets::grad_buckets(&numels, capacity)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(grad_buckets, m)?)?;
    m.add_function(wrap_pyfunction!(kept_for_backward, m)?)?;
    m.add_function(wrap_pyfunction!(plan_graph, m)?)?;
    m.add_function(wrap_pyfunction!(compare_plans, m)?)?;
    m.add_function(wrap_pyfunction!(chrome_trace, m)?)?;
    m.add_function(wrap_pyfunction!(synthetic_graph, m)?)?;
    m.add_function(wrap_pyfunction!(cost_model, m)?)?;
    m.add_function(wrap_pyfunction!(fit_cost_model, m)?)?;
    Ok(())
}
