//! Property tests of the planner on random DAGs: every plan is a permutation, topologically
//! valid, within the budget (or a BudgetInfeasible error naming a feasible minimum), never slower
//! than greedy, the simulator's peak equals a direct recount, and every fused group is one the
//! runtime can issue (one gathered dtype, each parameter once, at least two members), and
//! offload's copies to the host follow their reduce-scatters on one stream and end the graph.

use proptest::prelude::*;
use zrs_core::plan::sim::{recount_peak, validate};
use zrs_core::plan::*;
use zrs_core::Error;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// A random training-like DAG: compute nodes over earlier ones, parameters gathered (with a wait
/// and a release) around their users, reduce-scatters after some computes; indices shuffled.
/// Gathers have one of three dtypes (or none), and some gather a parameter gathered before (a tied
/// weight).
fn random_graph(seed: u64, n_compute: usize) -> GraphSpec {
    let mut r = Rng(seed | 1);
    let mut nodes: Vec<NodeSpec> = Vec::new();
    let mut computes: Vec<usize> = Vec::new();
    let mut ds = 0u64;
    for i in 0..n_compute {
        let mut deps: Vec<usize> = Vec::new();
        for _ in 0..r.below(3) {
            if !computes.is_empty() {
                let d = computes[r.below(computes.len() as u64) as usize];
                if !deps.contains(&d) {
                    deps.push(d);
                }
            }
        }
        let mut waits = Vec::new();
        let n_params = if r.chance(60) { 1 + r.below(2) } else { 0 };
        for _ in 0..n_params {
            let ag = nodes.len();
            let id = if ds > 0 && r.chance(15) {
                r.below(ds)
            } else {
                ds += 1;
                ds - 1
            };
            let dtype = ["bf16", "f32", ""][r.below(3) as usize];
            nodes.push(NodeSpec {
                ds_id: Some(id),
                dtype: (!dtype.is_empty()).then(|| format!("torch.{dtype}")),
                bytes: 1 + r.below(1000),
                duration_us: if r.chance(20) {
                    Some(r.below(50) as f64)
                } else {
                    None
                },
                ..NodeSpec::new(format!("ag{ag}"), NodeKind::Allgather)
            });
            let w = nodes.len();
            nodes.push(NodeSpec {
                ds_id: Some(id),
                deps: vec![ag],
                ..NodeSpec::new(format!("wait{ag}"), NodeKind::Wait)
            });
            waits.push((id, w));
        }
        deps.extend(waits.iter().map(|x| x.1));
        let c = nodes.len();
        nodes.push(NodeSpec {
            deps,
            duration_us: Some(r.below(200) as f64),
            alloc_bytes: Some(r.below(500)),
            free_bytes: Some(r.below(200)),
            ..NodeSpec::new(
                format!("op{i}"),
                if r.chance(10) {
                    NodeKind::Other
                } else {
                    NodeKind::Compute
                },
            )
        });
        computes.push(c);
        for (d, w) in waits {
            nodes.push(NodeSpec {
                ds_id: Some(d),
                deps: vec![w, c],
                ..NodeSpec::new(format!("rel{w}"), NodeKind::Release)
            });
        }
        if r.chance(25) {
            nodes.push(NodeSpec {
                deps: vec![c],
                bytes: 1 + r.below(1000),
                free_bytes: Some(r.below(100)),
                host_bytes: if r.chance(50) { 1 + r.below(500) } else { 0 },
                replicate_bytes: if r.chance(50) { 1 + r.below(500) } else { 0 },
                ..NodeSpec::new(format!("rs{i}"), NodeKind::ReduceScatter)
            });
        }
    }
    // Shuffle indices so the input order is usually not topological.
    let n = nodes.len();
    let mut perm: Vec<usize> = (0..n).collect();
    if r.chance(70) {
        for i in (1..n).rev() {
            perm.swap(i, r.below(i as u64 + 1) as usize);
        }
    }
    let mut out: Vec<Option<NodeSpec>> = vec![None; n];
    for (old, node) in nodes.into_iter().enumerate() {
        let mut node = node;
        node.deps = node.deps.iter().map(|&d| perm[d]).collect();
        out[perm[old]] = Some(node);
    }
    GraphSpec {
        nodes: out.into_iter().map(|x| x.unwrap()).collect(),
        world: Some(2),
        ..GraphSpec::default()
    }
}

/// A random topological order and random fused groups of all-gathers (legal ones).
fn random_plan(g: &Graph, seed: u64) -> (Vec<u32>, Vec<Vec<u32>>) {
    let mut r = Rng(seed ^ 0x9E37_79B9_7F4A_7C15);
    let n = g.len();
    let mut indeg: Vec<usize> = (0..n as u32).map(|v| g.deps(v).len()).collect();
    let mut ready: Vec<u32> = (0..n as u32).filter(|&v| indeg[v as usize] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while !ready.is_empty() {
        let i = r.below(ready.len() as u64) as usize;
        let v = ready.swap_remove(i);
        order.push(v);
        for &u in g.users(v) {
            indeg[u as usize] -= 1;
            if indeg[u as usize] == 0 {
                ready.push(u);
            }
        }
    }
    let mut groups = Vec::new();
    let mut cur: Vec<u32> = Vec::new();
    for &v in &order {
        if g.is_gather(v) && g.deps(v).is_empty() && r.chance(50) && g.fusable(&cur, v) {
            cur.push(v);
            if cur.len() >= 3 || (cur.len() >= 2 && r.chance(30)) {
                groups.push(std::mem::take(&mut cur));
            }
        }
    }
    if cur.len() >= 2 {
        groups.push(cur);
    }
    (order, groups)
}

/// The NVLink preset, slow links, or slow links with a slow host link (offload's copies) and
/// three replicas over a slow link between them (hybrid sharding's all-reduces).
fn cost(seed: u64) -> CostModel {
    if seed.is_multiple_of(3) {
        CostModel::nvlink(2)
    } else if seed % 3 == 2 {
        CostModel {
            host: Some(LinkModel {
                latency_us: 5.0,
                bus_gbps: 0.002,
            }),
            replicas: 3,
            inter: Some(LinkModel {
                latency_us: 10.0,
                bus_gbps: 0.004,
            }),
            ..cost(1)
        }
    } else {
        CostModel {
            name: "test".into(),
            world: 2,
            allgather: LinkModel {
                latency_us: 20.0,
                bus_gbps: 0.005,
            },
            reduce_scatter: LinkModel {
                latency_us: 20.0,
                bus_gbps: 0.005,
            },
            host: None,
            replicas: 1,
            inter: None,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn greedy_is_a_valid_order(seed in any::<u64>(), n in 1usize..40) {
        let g = Graph::new(random_graph(seed, n)).unwrap();
        let p = Problem::new(&g, &cost(seed));
        let order = greedy::greedy_order(&g, &p.dur);
        prop_assert!(validate(&g, &order, &[]).is_ok(), "{:?}", validate(&g, &order, &[]).err());
    }

    #[test]
    fn search_is_valid_within_budget_and_never_worse(seed in any::<u64>(), n in 1usize..40, frac in 0.3f64..1.5) {
        let g = Graph::new(random_graph(seed, n)).unwrap();
        let c = cost(seed);
        let greedy = plan(&g, Scheduler::Greedy, None, &c).unwrap();
        let budget = (greedy.sim.peak_bytes as f64 * frac) as u64;
        match plan(&g, Scheduler::Search, Some(budget), &c) {
            Ok(s) => {
                prop_assert!(validate(&g, &s.order, &s.groups).is_ok());
                for grp in &s.groups {
                    prop_assert!(grp.len() >= 2);
                    let n0 = &g.nodes[grp[0] as usize];
                    let mut ids: Vec<_> = grp.iter().map(|&m| g.nodes[m as usize].ds_id).collect();
                    prop_assert!(grp.iter().all(|&m| g.nodes[m as usize].dtype == n0.dtype), "mixed dtypes in {:?}", grp);
                    ids.sort();
                    ids.dedup();
                    prop_assert_eq!(ids.len(), grp.len(), "a parameter twice in {:?}", grp);
                }
                prop_assert!(s.sim.peak_bytes <= budget, "peak {} budget {}", s.sim.peak_bytes, budget);
                prop_assert_eq!(s.sim.peak_bytes, recount_peak(&g, &s.order, &s.groups));
                if greedy.sim.peak_bytes <= budget {
                    prop_assert!(s.sim.makespan_us <= greedy.sim.makespan_us + 1e-6,
                        "search {} greedy {}", s.sim.makespan_us, greedy.sim.makespan_us);
                }
            }
            Err(Error::BudgetInfeasible { budget: b, minimal, base: 0 }) => {
                prop_assert_eq!(b, budget);
                prop_assert!(minimal > budget);
                let s = plan(&g, Scheduler::Search, Some(minimal), &c).unwrap();
                prop_assert!(s.sim.peak_bytes <= minimal);
            }
            Err(e) => prop_assert!(false, "unexpected error: {}", e),
        }
    }

    #[test]
    fn simulator_peak_matches_recount(seed in any::<u64>(), n in 1usize..40) {
        let g = Graph::new(random_graph(seed, n)).unwrap();
        let p = Problem::new(&g, &cost(seed));
        let (order, groups) = random_plan(&g, seed);
        let sim = simulate(&p, &order, &groups).unwrap();
        prop_assert_eq!(sim.peak_bytes, recount_peak(&g, &order, &groups));
        // Timeline sanity: deps end before users start; makespan = compute + exposed.
        for v in 0..g.len() as u32 {
            for &d in g.deps(v) {
                prop_assert!(sim.end_us[d as usize] <= sim.start_us[v as usize] + 1e-9);
            }
        }
        prop_assert!((sim.makespan_us - sim.compute_us - sim.exposed_comm_us).abs() < 1e-6);
    }

    #[test]
    fn host_copies_follow_their_reduce_scatters_and_end_the_graph(seed in any::<u64>(), n in 1usize..40) {
        let g = Graph::new(random_graph(seed, n)).unwrap();
        let with_host = cost(3 * (seed / 3) + 2);
        let without = CostModel { host: None, ..with_host.clone() };
        let (order, groups) = random_plan(&g, seed);
        let sim = simulate(&Problem::new(&g, &with_host), &order, &groups).unwrap();
        let plain = simulate(&Problem::new(&g, &without), &order, &groups).unwrap();
        // The copies change no node's time and no memory; the graph ends after the last.
        prop_assert_eq!(&sim.start_us, &plain.start_us);
        prop_assert_eq!(sim.peak_bytes, plain.peak_bytes);
        let mut copies: Vec<usize> = (0..g.len())
            .filter(|&v| g.nodes[v].host_bytes > 0)
            .collect();
        copies.sort_by(|&a, &b| sim.host_start_us[a].total_cmp(&sim.host_start_us[b]));
        let mut busy = 0.0;
        for (k, &v) in copies.iter().enumerate() {
            prop_assert!(sim.host_start_us[v] >= sim.end_us[v] - 1e-9, "before its reduce-scatter");
            if k > 0 {
                prop_assert!(sim.host_start_us[v] >= sim.host_end_us[copies[k - 1]] - 1e-9, "two copies at once");
            }
            prop_assert!(sim.makespan_us >= sim.host_end_us[v] - 1e-9);
            busy += sim.host_end_us[v] - sim.host_start_us[v];
        }
        prop_assert!((sim.host_copy_busy_us - busy).abs() < 1e-6);
        prop_assert!(sim.makespan_us >= plain.makespan_us - 1e-9);
        prop_assert_eq!(plain.host_copy_busy_us, 0.0);
    }
}

#[test]
fn invalid_plans_are_rejected() {
    let g = Graph::new(random_graph(7, 10)).unwrap();
    let p = Problem::new(&g, &CostModel::nvlink(2));
    let (order, _) = random_plan(&g, 7);
    let mut rev = order.clone();
    rev.reverse();
    assert!(g.len() < 2 || simulate(&p, &rev, &[]).is_err());
    assert!(simulate(&p, &order[1..], &[]).is_err());
    let compute = (0..g.len() as u32).find(|&v| !g.is_gather(v)).unwrap();
    assert!(simulate(&p, &order, &[vec![compute]]).is_err());
    let gathers: Vec<u32> = order.iter().copied().filter(|&v| g.is_gather(v)).collect();
    if let Some(&first) = gathers.first() {
        assert!(
            simulate(&p, &order, &[vec![first]]).is_err(),
            "a group of one"
        );
    }
}
