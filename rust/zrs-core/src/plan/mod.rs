//! The planner: decides when each parameter is gathered and released, and which gathers are
//! fused, so that communication hides behind compute within a memory budget.
//!
//! - [`graph`]: the IR (compute, all-gather, wait, release, reduce-scatter, other) and its JSON.
//! - [`cost`]: the collective cost model (latency + bytes/bandwidth, fitted or preset).
//! - [`sim`]: the multi-stream simulator (makespan, exposed communication, peak memory).
//! - [`greedy`]: DeepCompile's fast_free_schedule, the baseline.
//! - [`search`]: budget-aware list scheduling plus a simulator-scored search; never worse.
//! - [`buckets`]: fused prefetch buckets from the comm model.
//! - [`keep`]: which gathered parameters a forward keeps for its backward.
//! - [`compiled`]: what `zrs.compile` plans a lowered graph with: the cost model with its
//!   planning margin, the automatic memory budget and its cap.
//! - [`grad_buckets`]: which consecutive gradients share one reduce-scatter.
//! - [`synth`]: synthetic transformer graphs; [`trace`]: Chrome trace and memory series.
//!
//! One call plans one graph: [`plan`] (Rust) or [`plan_json`] (the JSON boundary used by Python);
//! a graph that `zrs.compile` lowered: [`compiled::plan_compiled`].

pub mod buckets;
pub mod compiled;
pub mod cost;
pub mod grad_buckets;
pub mod graph;
pub mod greedy;
pub mod keep;
pub mod search;
pub mod sim;
pub mod synth;
pub mod trace;

use std::str::FromStr;
use std::time::Instant;

use serde::Serialize;
use serde_json::{json, Value};

pub use compiled::{plan_compiled, GraphBudget};
pub use cost::{CostModel, LinkModel};
pub use graph::{DsId, Graph, GraphSpec, NodeKind, NodeSpec, Stream};
pub use sim::{simulate, Problem, SimResult};

use crate::error::{Error, Result};

/// How many of a graph's largest all-gather may be prefetched ahead at once: the search's prefetch
/// window, the cap of an automatic budget over the greedy peak ([`GraphBudget::FreeMemory`]) and
/// what a forward may keep gathered for its backward ([`keep::keep_allowance`]).
pub const PREFETCH_ALLOWANCE_GATHERS: u64 = 2;

/// Which scheduler to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheduler {
    Greedy,
    Search,
}

impl Scheduler {
    pub fn as_str(self) -> &'static str {
        match self {
            Scheduler::Greedy => "greedy",
            Scheduler::Search => "search",
        }
    }
}

impl FromStr for Scheduler {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "greedy" => Ok(Scheduler::Greedy),
            "search" => Ok(Scheduler::Search),
            other => Err(Error::Invalid(format!(
                "unknown scheduler '{other}'; use 'greedy' or 'search'"
            ))),
        }
    }
}

/// A plan: the order, the fused groups and the simulated timeline.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub scheduler: String,
    /// How the search found it (variant and local moves), or "greedy".
    pub variant: String,
    pub nodes: usize,
    /// Node indices in program order.
    pub order: Vec<u32>,
    /// Fused prefetch groups: all-gather node indices issued as one collective at the position of
    /// the first member in `order` (`prefetch_params_fused`).
    pub groups: Vec<Vec<u32>>,
    pub budget_bytes: Option<u64>,
    pub within_budget: bool,
    /// Planning wall time (greedy baseline included for the search).
    pub plan_us: f64,
    pub cost_model: CostModel,
    #[serde(flatten)]
    pub sim: SimResult,
}

impl Plan {
    /// The scalar fields only (no per-node arrays).
    pub fn summary(&self) -> Value {
        json!({
            "scheduler": self.scheduler,
            "variant": self.variant,
            "nodes": self.nodes,
            "groups": self.groups.len(),
            "budget_bytes": self.budget_bytes,
            "within_budget": self.within_budget,
            "plan_us": self.plan_us,
            "makespan_us": self.sim.makespan_us,
            "exposed_comm_us": self.sim.exposed_comm_us,
            "compute_us": self.sim.compute_us,
            "allgather_busy_us": self.sim.allgather_busy_us,
            "reduce_scatter_busy_us": self.sim.reduce_scatter_busy_us,
            "host_copy_busy_us": self.sim.host_copy_busy_us,
            "peak_bytes": self.sim.peak_bytes,
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    p: &Problem,
    scheduler: Scheduler,
    variant: String,
    order: Vec<u32>,
    groups: Vec<Vec<u32>>,
    sim: SimResult,
    budget: Option<u64>,
    t0: Instant,
) -> Plan {
    let plan_us = t0.elapsed().as_secs_f64() * 1e6;
    Plan {
        scheduler: scheduler.as_str().into(),
        variant,
        nodes: p.len(),
        within_budget: budget.is_none_or(|b| sim.peak_bytes <= b),
        order,
        groups,
        budget_bytes: budget,
        plan_us,
        cost_model: p.cost.clone(),
        sim,
    }
}

/// Plan one graph. The budget is `budget`, else the graph's `budget_bytes`, else (for the
/// search) the greedy baseline's peak, so that the search must win within the same memory.
/// `greedy` ignores the budget (it has none) and reports `within_budget`.
pub fn plan(
    g: &Graph,
    scheduler: Scheduler,
    budget: Option<u64>,
    cost: &CostModel,
) -> Result<Plan> {
    let t0 = Instant::now();
    let p = Problem::new(g, cost);
    let greedy_order = greedy::greedy_order(g, &p.dur);
    let gsim = sim::simulate(&p, &greedy_order, &[])?;
    plan_with_greedy(
        &p,
        scheduler,
        greedy_order,
        gsim,
        budget.or(g.budget_bytes),
        t0,
    )
}

/// [`plan`] given the greedy baseline's order and its simulation.
fn plan_with_greedy(
    p: &Problem,
    scheduler: Scheduler,
    greedy_order: Vec<u32>,
    gsim: SimResult,
    budget: Option<u64>,
    t0: Instant,
) -> Result<Plan> {
    let g = p.g;
    match scheduler {
        Scheduler::Greedy => Ok(finish(
            p,
            scheduler,
            "greedy".into(),
            greedy_order,
            Vec::new(),
            gsim,
            budget,
            t0,
        )),
        Scheduler::Search => {
            let budget = budget.unwrap_or(gsim.peak_bytes);
            let greedy = search::Candidate {
                order: greedy_order,
                groups: Vec::new(),
                sim: gsim,
                label: "greedy".into(),
            };
            let opts = search::SearchOptions::for_size(g.len());
            let r = search::search(p, budget, &greedy, &opts)?;
            // The search's candidates are simulated without the memory series; the plan has it.
            let sim = simulate(p, &r.best.order, &r.best.groups)?;
            Ok(finish(
                p,
                scheduler,
                r.best.label,
                r.best.order,
                r.best.groups,
                sim,
                Some(budget),
                t0,
            ))
        }
    }
}

/// The cost model for a graph: a JSON model, else the NVLink preset at the graph's world size.
pub fn cost_for(g: &Graph, cost_json: Option<&str>) -> Result<CostModel> {
    match cost_json {
        Some(s) => {
            let s = s.trim();
            if s.starts_with('{') {
                CostModel::from_json(s)
            } else {
                CostModel::preset(s, g.world.unwrap_or(cost::MEASURED_WORLD))
            }
        }
        None => Ok(CostModel::nvlink(g.world.unwrap_or(cost::MEASURED_WORLD))),
    }
}

/// JSON boundary: plan a graph given as JSON. `cost` is a cost-model JSON object or a preset name
/// (`"nvlink"`, `"nop2p"`). With `detail`, the result has the order, groups, per-node start/end
/// times and the memory series; without, only the summary and the order and groups.
pub fn plan_json(
    graph_json: &str,
    scheduler: &str,
    budget: Option<u64>,
    cost: Option<&str>,
    detail: bool,
) -> Result<String> {
    let g = Graph::from_json(graph_json)?;
    let cost = cost_for(&g, cost)?;
    let plan = plan(&g, scheduler.parse()?, budget, &cost)?;
    Ok(plan_json_value(&plan, detail).to_string())
}

/// A plan as JSON: with `detail` everything, else the summary with the order and groups.
fn plan_json_value(plan: &Plan, detail: bool) -> Value {
    if detail {
        serde_json::to_value(plan).expect("Plan serializes")
    } else {
        let mut s = plan.summary();
        s["order"] = json!(plan.order);
        s["groups"] = json!(plan.groups);
        s
    }
}

/// Both schedulers on one graph, as the `python -m zrs.plan` line reports them.
pub fn compare(g: &Graph, budget: Option<u64>, cost: &CostModel) -> Result<(Plan, Plan)> {
    let greedy = plan(g, Scheduler::Greedy, None, cost)?;
    let budget = budget.or(g.budget_bytes).unwrap_or(greedy.sim.peak_bytes);
    let search = plan(g, Scheduler::Search, Some(budget), cost)?;
    Ok((greedy, search))
}

/// JSON boundary for `python -m zrs.plan`: both schedulers on one graph, one JSON object with
/// `nodes`, `plan_ms` (the search's planning time, greedy baseline included), `budget_bytes`, and
/// for `greedy` and `search` each `makespan_ms`, `peak_bytes`, `exposed_comm_ms` (and a few more).
pub fn compare_json(graph_json: &str, budget: Option<u64>, cost: Option<&str>) -> Result<String> {
    let g = Graph::from_json(graph_json)?;
    let cost = cost_for(&g, cost)?;
    let (gr, se) = compare(&g, budget, &cost)?;
    let side = |p: &Plan| {
        json!({
            "makespan_ms": p.sim.makespan_us / 1e3,
            "peak_bytes": p.sim.peak_bytes,
            "exposed_comm_ms": p.sim.exposed_comm_us / 1e3,
            "compute_ms": p.sim.compute_us / 1e3,
            "all_reduce_busy_ms": p.sim.all_reduce_busy_us / 1e3,
            "groups": p.groups.len(),
            "within_budget": p.within_budget,
            "plan_ms": p.plan_us / 1e3,
            "variant": p.variant,
        })
    };
    Ok(json!({
        "nodes": g.len(),
        "plan_ms": se.plan_us / 1e3,
        "budget_bytes": se.budget_bytes,
        "cost_model": cost.name,
        "world": cost.world,
        "greedy": side(&gr),
        "search": side(&se),
    })
    .to_string())
}

/// JSON boundary: plan a graph and return its Chrome trace (Perfetto) as JSON.
pub fn chrome_trace_json(
    graph_json: &str,
    scheduler: &str,
    budget: Option<u64>,
    cost: Option<&str>,
) -> Result<String> {
    let g = Graph::from_json(graph_json)?;
    let cost = cost_for(&g, cost)?;
    let plan = plan(&g, scheduler.parse()?, budget, &cost)?;
    Ok(trace::chrome_trace(&g, &plan).to_string())
}

/// JSON boundary: a synthetic transformer graph (see [`synth`]).
pub fn synthetic_graph_json(n_nodes: usize, preset: &str, world: u32) -> Result<String> {
    if world == 0 {
        return Err(Error::InvalidWorldSize(0));
    }
    let p = synth::Preset::by_name(preset)?;
    Ok(synth::synthetic_graph(&p, n_nodes, world).to_json())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_beats_greedy_on_1b_nop2p() {
        let p = synth::Preset::by_name("1b").unwrap();
        let g = Graph::new(synth::synthetic_graph(&p, 0, 2)).unwrap();
        let cost = CostModel::nop2p(2);
        let (gr, se) = compare(&g, None, &cost).unwrap();
        assert!(se.sim.makespan_us <= gr.sim.makespan_us + 1e-6);
        assert!(se.sim.peak_bytes <= gr.sim.peak_bytes);
        assert!(
            se.sim.exposed_comm_us <= 0.75 * gr.sim.exposed_comm_us,
            "greedy {:?} search {:?}",
            gr.summary(),
            se.summary()
        );
    }

    #[test]
    fn infeasible_budget_names_the_minimum() {
        let p = synth::Preset::by_name("tiny").unwrap();
        let g = Graph::new(synth::synthetic_graph(&p, 0, 2)).unwrap();
        let cost = CostModel::nvlink(2);
        let err = plan(&g, Scheduler::Search, Some(1), &cost).unwrap_err();
        match err {
            Error::BudgetInfeasible {
                budget,
                minimal,
                base: 0,
            } => {
                assert_eq!(budget, 1);
                assert!(minimal > 1);
                // The named minimum is feasible.
                let ok = plan(&g, Scheduler::Search, Some(minimal), &cost).unwrap();
                assert!(ok.sim.peak_bytes <= minimal);
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn json_errors_are_clear() {
        let e = plan_json(
            r#"{"nodes":[{"name":"a","kind":"compute","deps":[3]}]}"#,
            "search",
            None,
            None,
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("depends on node #3"), "{e}");
        let e = plan_json(
            r#"{"nodes":[{"name":"a","kind":"compute","deps":[1]},{"name":"b","kind":"compute","deps":[0]}]}"#,
            "search",
            None,
            None,
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("cycle"), "{e}");
        let e = plan_json(
            r#"{"nodes":[{"name":"r","kind":"release","ds_id":4}]}"#,
            "greedy",
            None,
            None,
            false,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::UngatheredParam {
                    kind: "release",
                    ds_id: 4
                }
            ),
            "{e}"
        );
        let e = plan_json(r#"{"nodes":[]}"#, "beam", None, None, false).unwrap_err();
        assert!(e.to_string().contains("unknown scheduler"), "{e}");
    }

    #[test]
    fn compare_and_trace_json() {
        let g = synthetic_graph_json(0, "tiny", 2).unwrap();
        let v: Value =
            serde_json::from_str(&compare_json(&g, None, Some("nop2p")).unwrap()).unwrap();
        for k in ["nodes", "plan_ms", "budget_bytes"] {
            assert!(!v[k].is_null(), "{k}");
        }
        for side in ["greedy", "search"] {
            for k in ["makespan_ms", "peak_bytes", "exposed_comm_ms"] {
                assert!(v[side][k].is_number(), "{side}.{k}");
            }
        }
        assert!(v["search"]["makespan_ms"].as_f64() <= v["greedy"]["makespan_ms"].as_f64());
        let t: Value =
            serde_json::from_str(&chrome_trace_json(&g, "search", None, None).unwrap()).unwrap();
        let ev = t["traceEvents"].as_array().unwrap();
        assert!(ev.iter().any(|e| e["ph"] == "X" && e["tid"] == 1));
        assert!(ev.iter().any(|e| e["ph"] == "C" && e["name"] == "memory"));
        assert!(synthetic_graph_json(10, "nope", 2).is_err());
    }

    #[test]
    fn json_round_trip() {
        let p = synth::Preset::by_name("tiny").unwrap();
        let spec = synth::synthetic_graph(&p, 0, 2);
        let g = Graph::new(spec.clone()).unwrap();
        let back = GraphSpec::from_json(&g.to_spec().to_json()).unwrap();
        let g2 = Graph::new(back).unwrap();
        assert_eq!(g.nodes, g2.nodes);
        let out = plan_json(&spec.to_json(), "search", None, Some("nop2p"), true).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["order"].as_array().unwrap().len(), spec.nodes.len());
        assert!(v["start_us"].is_array() && v["mem_bytes"].is_array());
    }
}
