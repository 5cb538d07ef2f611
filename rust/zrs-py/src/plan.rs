//! Python wrappers for `zrs_core::plan`: one call per graph, JSON strings in and out, the GIL
//! released while planning.

use pyo3::prelude::*;
use zrs_core::plan;
use zrs_core::plan::compiled::{self, GraphBudget};
use zrs_core::plan::cost::{CostModel, LinkModel};

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

/// Plan a graph that zrs.compile lowered (`plan::compiled`): `budget_bytes` counts what the graph
/// allocates on top of its `base_bytes`; with `budget_is_free_memory` it is the automatic budget,
/// also capped near the greedy peak. Returns the plan JSON, `budget_bytes` the planner's budget.
#[pyfunction]
#[pyo3(signature = (graph_json, scheduler = "search", budget_bytes = None, budget_is_free_memory = false, cost = None, detail = true))]
fn plan_compiled(
    py: Python<'_>,
    graph_json: &str,
    scheduler: &str,
    budget_bytes: Option<u64>,
    budget_is_free_memory: bool,
    cost: Option<&str>,
    detail: bool,
) -> PyResult<String> {
    let budget = GraphBudget::new(budget_bytes, budget_is_free_memory);
    ToPyResult(py.allow_threads(|| {
        compiled::plan_compiled_json(graph_json, scheduler, budget, cost, detail)
    }))
    .into()
}

/// The cost-model JSON a compiled graph is planned with (`plan::compiled::planning_cost`).
#[pyfunction]
#[pyo3(signature = (cost, device_type, world))]
fn planning_cost(cost: Option<&str>, device_type: &str, world: u32) -> PyResult<String> {
    ToPyResult(compiled::planning_cost_json(cost, device_type, world)).into()
}

/// The automatic memory budget for this much free device memory (`plan::compiled::auto_budget`).
#[pyfunction]
fn auto_budget(free_bytes: u64) -> u64 {
    compiled::auto_budget(free_bytes)
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

/// Fit a point-to-point copy link (offload's device-to-host copies) from (bytes, microseconds)
/// samples: the cost model's `host` link, as JSON.
#[pyfunction]
fn fit_copy_link(samples: Vec<(u64, f64)>) -> PyResult<String> {
    ToPyResult(LinkModel::fit_copy(&samples).map(|l| l.to_json())).into()
}

/// Fit the link of an all-reduce across `ranks` (hybrid sharding's replicas) from (bytes each
/// rank sums, microseconds) samples: the cost model's `inter` link, as JSON.
#[pyfunction]
fn fit_all_reduce_link(samples: Vec<(u64, f64)>, ranks: u32) -> PyResult<String> {
    ToPyResult(LinkModel::fit_all_reduce(&samples, ranks).map(|l| l.to_json())).into()
}

/// The cost model a device type plans with when nothing was measured, as JSON.
#[pyfunction]
fn default_cost_model(device_type: &str, world: u32) -> String {
    compiled::default_cost(device_type, world).to_json()
}

/// The forward's last-released parameters to keep for the backward (`plan::keep`): releases in
/// execution order as (ds_id, gathered bytes), the forward's largest gather, and the bytes an
/// explicit budget has left over the forward's planned peak (None without one).
#[pyfunction]
#[pyo3(signature = (releases, largest_gather_bytes, budget_left = None))]
fn kept_for_backward(
    releases: Vec<(u64, u64)>,
    largest_gather_bytes: u64,
    budget_left: Option<i64>,
) -> Vec<u64> {
    plan::keep::kept_for_backward(&releases, largest_gather_bytes, budget_left)
}

/// The per-rank elements of each gradient's bucket (`plan::grad_buckets`): the gradients'
/// per-rank shard elements in the backward's order, and a bucket's capacity.
#[pyfunction]
fn grad_buckets(numels: Vec<u64>, capacity: u64) -> Vec<u64> {
    plan::grad_buckets::grad_buckets(&numels, capacity)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(grad_buckets, m)?)?;
    m.add_function(wrap_pyfunction!(fit_copy_link, m)?)?;
    m.add_function(wrap_pyfunction!(fit_all_reduce_link, m)?)?;
    m.add_function(wrap_pyfunction!(default_cost_model, m)?)?;
    m.add_function(wrap_pyfunction!(kept_for_backward, m)?)?;
    m.add_function(wrap_pyfunction!(plan_graph, m)?)?;
    m.add_function(wrap_pyfunction!(plan_compiled, m)?)?;
    m.add_function(wrap_pyfunction!(planning_cost, m)?)?;
    m.add_function(wrap_pyfunction!(auto_budget, m)?)?;
    m.add(
        "PREFETCH_ALLOWANCE_GATHERS",
        plan::PREFETCH_ALLOWANCE_GATHERS,
    )?;
    m.add_function(wrap_pyfunction!(compare_plans, m)?)?;
    m.add_function(wrap_pyfunction!(chrome_trace, m)?)?;
    m.add_function(wrap_pyfunction!(synthetic_graph, m)?)?;
    m.add_function(wrap_pyfunction!(cost_model, m)?)?;
    m.add_function(wrap_pyfunction!(fit_cost_model, m)?)?;
    Ok(())
}
