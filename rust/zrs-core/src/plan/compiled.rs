//! Planning a graph that `zrs.compile` lowered: the cost model it plans with and its memory
//! budget, decided here so that the Python layer makes one call per graph.
//!
//! - [`planning_cost`]: the collectives' cost model (given, else [`default_cost`]) with the
//!   planning margin.
//! - [`auto_budget`]: the automatic budget from the device's free memory.
//! - [`plan_compiled`]: the budget for one graph ([`GraphBudget`]) and the plan within it.

use std::time::Instant;

use super::cost::{CostModel, LinkModel};
use super::graph::Graph;
use super::PREFETCH_ALLOWANCE_GATHERS;
use super::{cost_for, greedy, plan_json_value, plan_with_greedy, sim, Plan, Scheduler};
use crate::error::{Error, Result};

/// The CPU's collectives (gloo over loopback or TCP): a rough latency + bandwidth model.
pub const CPU_GLOO_LINK: LinkModel = LinkModel {
    latency_us: 50.0,
    bus_gbps: 5.0,
};

// Pessimism of the planning model. A sweep times each collective alone; in a training step a
// gather shares the SMs and the memory bandwidth with compute and waits for the slowest rank to
// reach it, so it runs several times slower than the sweep says. Planned with the sweep's own
// numbers, gathers are issued just in time and every slowdown stalls the compute stream. So the
// planner sees each collective PLAN_BANDWIDTH_DERATE times slower plus PLAN_LATENCY_SLACK_US:
// gathers are issued well ahead of their use and fused, for a little more peak memory. One rank
// communicates nothing, and plans with the model as given.
pub const PLAN_LATENCY_SLACK_US: f64 = 250.0;
pub const PLAN_BANDWIDTH_DERATE: f64 = 4.0;

/// Free device memory an automatic budget leaves unused: the larger of these two.
pub const BUDGET_MARGIN_BYTES: u64 = 1 << 30;
pub const BUDGET_MARGIN_PERCENT: u64 = 10;
/// An automatic budget is a multiple of this.
pub const BUDGET_ROUND_BYTES: u64 = 256 << 20;

/// The collectives' cost model when nothing was measured: the NVLink preset on CUDA, a rough
/// gloo model on any other device type.
pub fn default_cost(device_type: &str, world: u32) -> CostModel {
    let world = world.max(1);
    if device_type == "cuda" {
        CostModel::nvlink(world)
    } else {
        CostModel {
            name: "cpu_gloo".into(),
            world,
            allgather: CPU_GLOO_LINK,
            reduce_scatter: CPU_GLOO_LINK,
            host: None,
            replicas: 1,
            inter: None,
        }
    }
}

/// `cost` as the planner sees it with more than one rank: each collective's latency raised by
/// [`PLAN_LATENCY_SLACK_US`] and its bandwidth divided by [`PLAN_BANDWIDTH_DERATE`], "+margin"
/// appended to its name. Unchanged on one rank. The host link stays as measured: its sweep ran
/// with every rank of the host copying at once.
pub fn planning_margin(cost: &CostModel, world: u32) -> CostModel {
    if world <= 1 {
        return cost.clone();
    }
    let derate = |l: &LinkModel| LinkModel {
        latency_us: l.latency_us + PLAN_LATENCY_SLACK_US,
        bus_gbps: l.bus_gbps / PLAN_BANDWIDTH_DERATE,
    };
    let name = if cost.name.is_empty() {
        "custom"
    } else {
        &cost.name
    };
    CostModel {
        name: format!("{name}+margin"),
        world: cost.world,
        allgather: derate(&cost.allgather),
        reduce_scatter: derate(&cost.reduce_scatter),
        host: cost.host,
        replicas: cost.replicas,
        inter: cost.inter.as_ref().map(derate),
    }
}

/// The cost model a compiled graph is planned with: `cost` (a preset name or a cost-model JSON
/// object; `None`: [`default_cost`] for `device_type`) with the [`planning_margin`] of `world`
/// ranks. A preset is taken at `world` ranks.
pub fn planning_cost(cost: Option<&str>, device_type: &str, world: u32) -> Result<CostModel> {
    let world = world.max(1);
    let model = match cost.map(str::trim) {
        None => default_cost(device_type, world),
        Some(s) if s.starts_with('{') => CostModel::from_json(s)?,
        Some(name) => CostModel::preset(name, world)?,
    };
    Ok(planning_margin(&model, world))
}

/// The automatic memory budget for `free_bytes` of free device memory: less a margin (the larger
/// of [`BUDGET_MARGIN_BYTES`] and [`BUDGET_MARGIN_PERCENT`] of it), rounded down to a multiple of
/// [`BUDGET_ROUND_BYTES`]; 0 when the margin takes it all.
pub fn auto_budget(free_bytes: u64) -> u64 {
    let margin = BUDGET_MARGIN_BYTES.max(free_bytes / 100 * BUDGET_MARGIN_PERCENT);
    let left = free_bytes.saturating_sub(margin);
    left / BUDGET_ROUND_BYTES * BUDGET_ROUND_BYTES
}

/// Where a compiled graph's memory budget comes from. The bytes count what the graph allocates on
/// top of what is live at its start (`base_bytes`), as the user's `memory_budget` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphBudget {
    /// The planner's default: the greedy schedule's peak for the search; none for greedy.
    None,
    /// The user's `memory_budget`.
    User(u64),
    /// The automatic budget from the free device memory ([`auto_budget`]). It is also capped at
    /// the greedy schedule's peak plus [`PREFETCH_ALLOWANCE_GATHERS`] of the graph's largest
    /// all-gather: prefetching further ahead buys little (the planner's estimates are rough, so a
    /// far prefetch is a guess) and costs real memory (a fused gather in flight also holds its
    /// send block, which the planner does not count).
    FreeMemory(u64),
}

impl GraphBudget {
    /// From the Python arguments: no bytes is [`GraphBudget::None`] whatever `free_memory` says.
    pub fn new(bytes: Option<u64>, free_memory: bool) -> Self {
        match bytes {
            None => GraphBudget::None,
            Some(b) if free_memory => GraphBudget::FreeMemory(b),
            Some(b) => GraphBudget::User(b),
        }
    }
}

/// Plan a compiled graph within `budget`. The plan's `budget_bytes` is the planner's budget:
/// the graph's bytes plus `base_bytes`, capped for [`GraphBudget::FreeMemory`]. An infeasible
/// budget is [`Error::BudgetInfeasible`] in the user's terms: `budget` and `minimal` exclude the
/// graph's `base_bytes`, carried as `base`.
pub fn plan_compiled(
    g: &Graph,
    scheduler: Scheduler,
    budget: GraphBudget,
    cost: &CostModel,
) -> Result<Plan> {
    let t0 = Instant::now();
    let p = sim::Problem::new(g, cost);
    let greedy_order = greedy::greedy_order(g, &p.dur);
    let gsim = sim::simulate(&p, &greedy_order, &[])?;
    let base = g.base_bytes;
    let planner_budget = match budget {
        GraphBudget::None => g.budget_bytes,
        GraphBudget::User(b) => Some(b.saturating_add(base)),
        GraphBudget::FreeMemory(b) => {
            let cap = gsim.peak_bytes.saturating_add(
                g.largest_gather_bytes()
                    .saturating_mul(PREFETCH_ALLOWANCE_GATHERS),
            );
            Some(b.saturating_add(base).min(cap))
        }
    };
    plan_with_greedy(&p, scheduler, greedy_order, gsim, planner_budget, t0).map_err(|e| match e {
        Error::BudgetInfeasible {
            budget, minimal, ..
        } => Error::BudgetInfeasible {
            budget: budget.saturating_sub(base),
            minimal: minimal.saturating_sub(base),
            base,
        },
        e => e,
    })
}

/// JSON boundary of [`plan_compiled`]: the graph as planner IR JSON, `cost` as for
/// [`cost_for`] (normally [`planning_cost`]'s JSON); the result as [`super::plan_json`]'s.
pub fn plan_compiled_json(
    graph_json: &str,
    scheduler: &str,
    budget: GraphBudget,
    cost: Option<&str>,
    detail: bool,
) -> Result<String> {
    let g = Graph::from_json(graph_json)?;
    let cost = cost_for(&g, cost)?;
    let plan = plan_compiled(&g, scheduler.parse()?, budget, &cost)?;
    Ok(plan_json_value(&plan, detail).to_string())
}

/// JSON boundary of [`planning_cost`].
pub fn planning_cost_json(cost: Option<&str>, device_type: &str, world: u32) -> Result<String> {
    Ok(planning_cost(cost, device_type, world)?.to_json())
}

#[cfg(test)]
mod tests {
    use super::super::graph::{GraphSpec, NodeKind, NodeSpec};
    use super::super::{plan, synth};
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_margin_slows_every_collective_with_more_than_one_rank() {
        let nv = CostModel::nvlink(2);
        let m = planning_margin(&nv, 2);
        assert_eq!(m.name, "nvlink+margin");
        assert_eq!(m.world, 2);
        for (a, b) in [
            (&m.allgather, &nv.allgather),
            (&m.reduce_scatter, &nv.reduce_scatter),
        ] {
            assert_eq!(a.latency_us, b.latency_us + 250.0);
            assert_eq!(a.bus_gbps, b.bus_gbps / 4.0);
        }
        assert_eq!(planning_margin(&nv, 1), nv, "one rank: unchanged");
        let unnamed = CostModel {
            name: String::new(),
            ..nv.clone()
        };
        assert_eq!(planning_margin(&unnamed, 2).name, "custom+margin");
        // The text boundary: a preset name, a JSON object, or the default.
        let from_name = planning_cost(Some("nvlink"), "cuda", 2).unwrap();
        assert_eq!(from_name, m);
        let from_json = planning_cost(Some(&nv.to_json()), "cpu", 2).unwrap();
        assert_eq!(from_json, m);
        assert_eq!(planning_cost(None, "cuda", 2).unwrap(), m);
        assert_eq!(
            planning_cost(None, "cuda", 1).unwrap(),
            CostModel::nvlink(1)
        );
        assert!(planning_cost(Some("infiniband"), "cuda", 2).is_err());
        let back = CostModel::from_json(&planning_cost_json(None, "cuda", 4).unwrap()).unwrap();
        assert_eq!(back, planning_margin(&CostModel::nvlink(4), 4));
    }

    #[test]
    fn the_default_cpu_cost_is_a_gloo_model() {
        let c = default_cost("cpu", 0);
        assert_eq!((c.name.as_str(), c.world), ("cpu_gloo", 1));
        for l in [&c.allgather, &c.reduce_scatter] {
            assert_eq!((l.latency_us, l.bus_gbps), (50.0, 5.0));
        }
        assert_eq!(default_cost("cpu", 3).world, 3);
        assert_eq!(default_cost("cuda", 2), CostModel::nvlink(2));
        let planned = planning_cost(None, "cpu", 2).unwrap();
        assert_eq!(planned.name, "cpu_gloo+margin");
        assert_eq!(
            (planned.allgather.latency_us, planned.allgather.bus_gbps),
            (300.0, 1.25)
        );
        assert_eq!(
            planning_cost(None, "cpu", 1).unwrap(),
            default_cost("cpu", 1)
        );
    }

    #[test]
    fn the_automatic_budget_leaves_a_margin_and_rounds_down() {
        let round = BUDGET_ROUND_BYTES;
        // Small devices: the 1 GiB margin; large ones: 10 %.
        assert_eq!(auto_budget(8 * GIB), 7 * GIB);
        assert_eq!(auto_budget(8 * GIB + round - 1), 7 * GIB);
        assert_eq!(auto_budget(8 * GIB + round), 7 * GIB + round);
        // 80 GiB free: 8 GiB margin, 72 GiB left.
        assert_eq!(auto_budget(80 * GIB), 72 * GIB);
        // 100 GiB free: 10 GiB margin; 140 GiB: 14.
        assert_eq!(auto_budget(140 * GIB), 126 * GIB);
        // 50 GiB + 100 MiB: 5 GiB + 10 MiB margin; 45 GiB + 90 MiB left, rounded to 45 GiB.
        assert_eq!(auto_budget(50 * GIB + (100 << 20)), 45 * GIB);
        assert_eq!(auto_budget(GIB), 0);
        assert_eq!(auto_budget(GIB + round - 1), 0);
        assert_eq!(auto_budget(0), 0);
        assert_eq!(auto_budget(u64::MAX) % round, 0);
    }

    fn tiny() -> Graph {
        let p = synth::Preset::by_name("tiny").unwrap();
        Graph::new(synth::synthetic_graph(&p, 0, 2)).unwrap()
    }

    fn with_base(mut spec: GraphSpec, base: u64) -> Graph {
        spec.base_bytes = base;
        Graph::new(spec).unwrap()
    }

    #[test]
    fn budgets_count_on_top_of_the_graphs_base() {
        let p = synth::Preset::by_name("tiny").unwrap();
        let base = 1 << 20;
        let g = with_base(synth::synthetic_graph(&p, 0, 2), base);
        let cost = CostModel::nvlink(2);
        let greedy = plan(&g, Scheduler::Greedy, None, &cost).unwrap();
        let user = greedy.sim.peak_bytes; // ample: the greedy peak includes the base
        let s = plan_compiled(&g, Scheduler::Search, GraphBudget::User(user), &cost).unwrap();
        assert_eq!(s.budget_bytes, Some(user + base));
        assert!(s.within_budget);
        let none = plan_compiled(&g, Scheduler::Search, GraphBudget::None, &cost).unwrap();
        assert_eq!(none.budget_bytes, Some(greedy.sim.peak_bytes));
        let gr = plan_compiled(&g, Scheduler::Greedy, GraphBudget::None, &cost).unwrap();
        assert_eq!(gr.budget_bytes, None);
        assert_eq!(gr.order, greedy.order);
    }

    #[test]
    fn a_free_memory_budget_is_capped_near_the_greedy_peak() {
        let g = tiny();
        let cost = CostModel::nvlink(2);
        let greedy = plan(&g, Scheduler::Greedy, None, &cost).unwrap();
        let largest = g.largest_gather_bytes();
        assert!(largest > 0);
        let cap = greedy.sim.peak_bytes + PREFETCH_ALLOWANCE_GATHERS * largest;
        let free = 1 << 40;
        let s = plan_compiled(&g, Scheduler::Search, GraphBudget::FreeMemory(free), &cost).unwrap();
        assert_eq!(s.budget_bytes, Some(cap));
        assert!(s.sim.peak_bytes <= cap);
        // The user's budget is not capped.
        let u = plan_compiled(&g, Scheduler::Search, GraphBudget::User(free), &cost).unwrap();
        assert_eq!(u.budget_bytes, Some(free));
        // Less free memory than the cap: the free memory.
        let tight = greedy.sim.peak_bytes + 16;
        let t =
            plan_compiled(&g, Scheduler::Search, GraphBudget::FreeMemory(tight), &cost).unwrap();
        assert_eq!(t.budget_bytes, Some(tight));
        assert_eq!(GraphBudget::new(None, true), GraphBudget::None);
        assert_eq!(GraphBudget::new(Some(5), true), GraphBudget::FreeMemory(5));
        assert_eq!(GraphBudget::new(Some(5), false), GraphBudget::User(5));
    }

    #[test]
    fn an_infeasible_budget_is_reported_without_the_base() {
        let p = synth::Preset::by_name("tiny").unwrap();
        let base = 3 << 20;
        let spec = synth::synthetic_graph(&p, 0, 2);
        let g0 = Graph::new(spec.clone()).unwrap();
        let g = with_base(spec, base);
        let cost = CostModel::nvlink(2);
        // The planner's own terms: the minimum includes the base.
        let raw = plan(&g, Scheduler::Search, Some(1), &cost).unwrap_err();
        let Error::BudgetInfeasible {
            minimal: raw_min,
            base: 0,
            ..
        } = raw
        else {
            panic!("{raw}")
        };
        let e = plan_compiled(&g, Scheduler::Search, GraphBudget::User(1), &cost).unwrap_err();
        match &e {
            Error::BudgetInfeasible {
                budget,
                minimal,
                base: b,
            } => {
                assert_eq!((*budget, *b), (1, base));
                assert_eq!(*minimal, raw_min - base);
                // The named minimum is feasible as a user budget.
                let ok = plan_compiled(&g, Scheduler::Search, GraphBudget::User(*minimal), &cost)
                    .unwrap();
                assert!(ok.sim.peak_bytes <= minimal + base);
            }
            e => panic!("{e}"),
        }
        let msg = e.to_string();
        assert!(
            msg.starts_with("memory budget of 1 bytes is infeasible"),
            "{msg}"
        );
        assert!(msg.contains(&format!("{base} bytes of inputs")), "{msg}");
        // Without a base the message is the planner's, unchanged.
        let e0 = plan_compiled(&g0, Scheduler::Search, GraphBudget::User(1), &cost).unwrap_err();
        assert!(!e0.to_string().contains("inputs live"), "{e0}");
    }

    #[test]
    fn the_json_boundary_returns_the_effective_budget() {
        let mut spec = GraphSpec::default();
        let ag = spec.push(NodeSpec {
            ds_id: Some(0),
            bytes: 100,
            ..NodeSpec::new("ag", NodeKind::Allgather)
        });
        let w = spec.push(NodeSpec {
            ds_id: Some(0),
            deps: vec![ag as usize],
            ..NodeSpec::new("w", NodeKind::Wait)
        });
        let c = spec.push(NodeSpec {
            deps: vec![w as usize],
            duration_us: Some(10.0),
            ..NodeSpec::new("mm", NodeKind::Compute)
        });
        spec.push(NodeSpec {
            ds_id: Some(0),
            deps: vec![w as usize, c as usize],
            ..NodeSpec::new("rel", NodeKind::Release)
        });
        spec.base_bytes = 7;
        let cost = planning_cost_json(None, "cpu", 2).unwrap();
        let out = plan_compiled_json(
            &spec.to_json(),
            "search",
            GraphBudget::new(Some(1000), false),
            Some(&cost),
            false,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["budget_bytes"], 1007);
        assert_eq!(v["order"].as_array().unwrap().len(), 4);
        assert_eq!(v["peak_bytes"], 107);
    }
}
