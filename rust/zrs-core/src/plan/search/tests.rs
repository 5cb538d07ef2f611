//! Unit tests of the search's fused buckets through `plan`: one gathered dtype and each
//! parameter at most once per bucket, whatever the variants and local moves do; and the round trip
//! of the IR's dtype that the buckets rely on.

use super::super::graph::{Graph, GraphSpec, NodeKind, NodeSpec};
use super::super::{plan, CostModel, Scheduler};

/// `layers` ops, each using a weight (bf16) and a bias (f32), every parameter gathered right
/// before its op and released after it; `tied` names the weight of layers 0 and 1 as one
/// parameter, gathered twice.
fn layered(layers: usize, tied: bool) -> Graph {
    let mut s = GraphSpec {
        world: Some(2),
        ..GraphSpec::default()
    };
    let mut prev: Option<usize> = None;
    for l in 0..layers {
        let mut waits = Vec::new();
        let params = [
            (
                if tied && l == 1 { 0 } else { 2 * l as u64 },
                64 << 10,
                "torch.bfloat16",
            ),
            (2 * l as u64 + 1, 4 << 10, "torch.float32"),
        ];
        for (ds, bytes, dtype) in params {
            let ag = s.push(NodeSpec {
                ds_id: Some(ds),
                bytes,
                dtype: Some(dtype.into()),
                ..NodeSpec::new(format!("ag{l}.{ds}"), NodeKind::Allgather)
            }) as usize;
            let w = s.push(NodeSpec {
                ds_id: Some(ds),
                deps: vec![ag],
                ..NodeSpec::new(format!("wait{l}.{ds}"), NodeKind::Wait)
            }) as usize;
            waits.push((ds, w));
        }
        let mut deps: Vec<usize> = waits.iter().map(|w| w.1).collect();
        deps.extend(prev);
        let op = s.push(NodeSpec {
            deps,
            duration_us: Some(1.0), // latency-bound gathers: fusing pays
            alloc_bytes: Some(1 << 10),
            ..NodeSpec::new(format!("op{l}"), NodeKind::Compute)
        }) as usize;
        for (ds, w) in waits {
            s.push(NodeSpec {
                ds_id: Some(ds),
                deps: vec![w, op],
                ..NodeSpec::new(format!("rel{l}.{ds}"), NodeKind::Release)
            });
        }
        prev = Some(op);
    }
    Graph::new(s).unwrap()
}

#[test]
fn mixed_dtypes_never_share_a_group() {
    let g = layered(6, false);
    let cost = CostModel::nvlink(2);
    let p = plan(&g, Scheduler::Search, Some(1 << 30), &cost).unwrap();
    assert!(!p.groups.is_empty(), "the gathers still fuse, per dtype");
    for grp in &p.groups {
        assert!(grp.len() >= 2, "{grp:?}");
        let d0 = g.nodes[grp[0] as usize].dtype;
        assert!(
            grp.iter().all(|&m| g.nodes[m as usize].dtype == d0),
            "mixed dtypes in {:?}",
            grp.iter()
                .map(|&m| &g.names[m as usize])
                .collect::<Vec<_>>()
        );
    }
    // Both dtypes are fused (one bucket open per dtype at a slot).
    let fused: std::collections::HashSet<_> = p
        .groups
        .iter()
        .map(|grp| g.nodes[grp[0] as usize].dtype)
        .collect();
    assert_eq!(fused.len(), 2, "{:?}", p.groups);
}

#[test]
fn a_parameter_is_never_twice_in_one_group() {
    let cost = CostModel::nvlink(2);
    // Untied, the weights of layers 0 and 1 are fused together...
    let g = layered(6, false);
    let p = plan(&g, Scheduler::Search, Some(1 << 30), &cost).unwrap();
    let name = |g: &Graph, v: u32| g.names[v as usize].clone();
    let together = |g: &Graph, groups: &[Vec<u32>], a: &str, b: &str| {
        groups
            .iter()
            .any(|grp| grp.iter().any(|&m| name(g, m) == a) && grp.iter().any(|&m| name(g, m) == b))
    };
    assert!(together(&g, &p.groups, "ag0.0", "ag1.2"), "{:?}", p.groups);
    // ...tied, the two gathers of one parameter are not.
    let g = layered(6, true);
    let p = plan(&g, Scheduler::Search, Some(1 << 30), &cost).unwrap();
    assert!(!together(&g, &p.groups, "ag0.0", "ag1.0"), "{:?}", p.groups);
    for grp in &p.groups {
        let mut ids: Vec<_> = grp.iter().map(|&m| g.nodes[m as usize].ds_id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), grp.len(), "{grp:?}");
    }
}

#[test]
fn the_ir_dtype_round_trips() {
    let g = layered(2, false);
    assert_eq!(g.dtypes, vec!["torch.bfloat16", "torch.float32"]);
    let spec = g.to_spec();
    assert_eq!(spec.nodes[0].dtype.as_deref(), Some("torch.bfloat16"));
    assert!(spec.to_json().contains("\"dtype\":\"torch.float32\""));
    let back = Graph::new(GraphSpec::from_json(&spec.to_json()).unwrap()).unwrap();
    assert_eq!(back.nodes, g.nodes);
}

fn candidate(makespan_us: f64, peak_bytes: u64, groups: Vec<Vec<u32>>) -> super::Candidate {
    super::Candidate {
        order: Vec::new(),
        groups,
        sim: crate::plan::sim::SimResult {
            makespan_us,
            peak_bytes,
            ..Default::default()
        },
        label: String::new(),
    }
}

#[test]
fn equal_plans_up_to_a_sliver_of_peak_pick_the_fewest_collectives() {
    // Makespans equal, the bucketed plan 4 KiB above the unbucketed one's peak (the HF Llama
    // shape's backward): the buckets win. Far more memory, or a slower plan, never does.
    let gib = 1u64 << 30;
    let unbucketed = candidate(100_000.0, 14 * gib, vec![]);
    let bucketed = candidate(100_000.0, 14 * gib + 4096, vec![vec![1, 2, 3], vec![4, 5]]);
    let costly = candidate(100_000.0, 15 * gib, vec![vec![1, 2, 3, 4, 5, 6]]);
    let slower = candidate(200_000.0, 14 * gib, vec![vec![1, 2, 3, 4, 5, 6, 7]]);
    let pool = [unbucketed.clone(), bucketed.clone(), costly, slower];
    let pick = super::pick_among_fast(&pool).unwrap();
    assert_eq!(pick.groups, bucketed.groups);
    assert_eq!(pick.collectives_saved(), 3);
    // Past the tolerance the least peak wins again.
    let heavier = candidate(100_000.0, 14 * gib + gib / 10, vec![vec![1, 2, 3]]);
    let pick = super::pick_among_fast(&[unbucketed.clone(), heavier]).unwrap();
    assert!(pick.groups.is_empty());
}

#[test]
fn a_plan_slower_by_less_than_the_host_time_its_buckets_spare_wins() {
    // The HF Llama shape's forward: a plan of 24 collectives 0.26 % slower on paper than one of
    // 106. Charged the host time of each collective, the fewer win; slower by more, they lose.
    let gib = 1u64 << 30;
    let host = super::HOST_US_PER_COLLECTIVE;
    let many = candidate(100_000.0, 14 * gib, vec![vec![1, 2]]);
    let few = |makespan_us| candidate(makespan_us, 14 * gib, vec![vec![1, 2, 3, 4, 5, 6]]);
    // 4 collectives fewer, 4 host calls slower: as cheap, and fewer.
    let pick = super::pick_among_fast(&[many.clone(), few(100_000.0 + 4.0 * host)]).unwrap();
    assert_eq!(pick.collectives_saved(), 5);
    // Slower by that and twice the tolerance besides: the many win.
    let far = 100_000.0 + 4.0 * host + 2.0 * 100_000.0 * super::MAKESPAN_TOLERANCE;
    let pick = super::pick_among_fast(&[many.clone(), few(far)]).unwrap();
    assert_eq!(pick.collectives_saved(), 1);
    // The memory rule still holds among the cheap: far more peak loses.
    let heavy = candidate(100_000.0, 15 * gib, vec![vec![1, 2, 3, 4, 5, 6]]);
    assert!(
        super::better(&heavy, &many),
        "cheaper once charged for its collectives"
    );
    let pick = super::pick_among_fast(&[many, heavy]).unwrap();
    assert_eq!(pick.collectives_saved(), 1);
}
