//! Unit tests of the greedy order on hand-made graphs: just-in-time gathers, the tie-breaks,
//! the weight-and-bias fallback, early releases and reduce-scatters.

use super::*;
use crate::plan::graph::{GraphSpec, NodeSpec};

fn ag(name: &str, ds: u64, bytes: u64) -> NodeSpec {
    NodeSpec {
        ds_id: Some(ds),
        bytes,
        ..NodeSpec::new(name, NodeKind::Allgather)
    }
}
fn wait(name: &str, ds: u64, dep: usize) -> NodeSpec {
    NodeSpec {
        ds_id: Some(ds),
        deps: vec![dep],
        ..NodeSpec::new(name, NodeKind::Wait)
    }
}
fn rel(name: &str, ds: u64, deps: Vec<usize>) -> NodeSpec {
    NodeSpec {
        ds_id: Some(ds),
        deps,
        ..NodeSpec::new(name, NodeKind::Release)
    }
}
fn op(name: &str, deps: Vec<usize>, us: f64) -> NodeSpec {
    NodeSpec {
        deps,
        duration_us: Some(us),
        ..NodeSpec::new(name, NodeKind::Compute)
    }
}
fn names(g: &Graph, order: &[u32]) -> Vec<String> {
    order.iter().map(|&v| g.names[v as usize].clone()).collect()
}
fn dur(g: &Graph) -> Vec<f64> {
    g.nodes
        .iter()
        .map(|n| n.duration_us.unwrap_or(0.0))
        .collect()
}

/// Two layers in a chain, all gathers listed first (as a naive capture would).
#[test]
fn chain_gathers_just_in_time() {
    let mut s = GraphSpec::default();
    s.push(ag("ag0", 0, 100)); // 0
    s.push(ag("ag1", 1, 100)); // 1
    s.push(wait("w0", 0, 0)); // 2
    s.push(op("mm0", vec![2], 10.0)); // 3
    s.push(rel("r0", 0, vec![2, 3])); // 4
    s.push(wait("w1", 1, 1)); // 5
    s.push(op("mm1", vec![3, 5], 10.0)); // 6
    s.push(rel("r1", 1, vec![5, 6])); // 7
    let g = Graph::new(s).unwrap();
    let o = greedy_order(&g, &dur(&g));
    assert_eq!(
        names(&g, &o),
        ["ag0", "w0", "mm0", "r0", "ag1", "w1", "mm1", "r1"]
    );
}

/// As an FX graph lowers it: every gather reads its shard's input (a placeholder). The
/// inputs lead the greedy order, so the search can issue the second layer's gather (and
/// fuse the two) before the first layer's compute instead of just before its own wait.
#[test]
fn gathers_of_placeholders_can_be_prefetched() {
    let mut s = GraphSpec::default();
    s.push(NodeSpec::new("p0", NodeKind::Other)); // 0
    s.push(NodeSpec::new("p1", NodeKind::Other)); // 1
    s.push(NodeSpec {
        deps: vec![0],
        ..ag("ag0", 0, 1 << 20)
    }); // 2
    s.push(wait("w0", 0, 2)); // 3
    s.push(op("mm0", vec![3], 500.0)); // 4
    s.push(rel("r0", 0, vec![3, 4])); // 5
    s.push(NodeSpec {
        deps: vec![1],
        ..ag("ag1", 1, 1 << 20)
    }); // 6
    s.push(wait("w1", 1, 6)); // 7
    s.push(op("mm1", vec![4, 7], 500.0)); // 8
    s.push(rel("r1", 1, vec![7, 8])); // 9
    let g = Graph::new(s).unwrap();
    let o = greedy_order(&g, &dur(&g));
    assert_eq!(&names(&g, &o)[..2], ["p0", "p1"]);
    let cost = crate::plan::cost::CostModel::nvlink(2);
    let p = crate::plan::plan(&g, crate::plan::Scheduler::Search, Some(1 << 30), &cost).unwrap();
    let pos = |name: &str| p.order.iter().position(|&v| g.names[v as usize] == name);
    assert!(pos("ag1") < pos("mm0"), "{:?}", names(&g, &p.order));
}

/// Of two independent gathers, the smaller one goes first (bytes gathered breaks the tie).
#[test]
fn smaller_gather_first() {
    let mut s = GraphSpec::default();
    s.push(ag("big", 0, 1000)); // 0
    s.push(ag("small", 1, 10)); // 1
    s.push(wait("wb", 0, 0)); // 2
    s.push(wait("ws", 1, 1)); // 3
    s.push(op("ub", vec![2], 1.0)); // 4
    s.push(op("us", vec![3], 1.0)); // 5
    s.push(rel("rb", 0, vec![2, 4])); // 6
    s.push(rel("rs", 1, vec![3, 5])); // 7
    let g = Graph::new(s).unwrap();
    let o = greedy_order(&g, &dur(&g));
    assert_eq!(
        names(&g, &o),
        ["small", "ws", "us", "rs", "big", "wb", "ub", "rb"]
    );
}

/// Equal bytes: the one whose release comes after less compute goes first.
#[test]
fn shorter_path_to_free_first() {
    let mut s = GraphSpec::default();
    s.push(ag("a", 0, 100)); // 0
    s.push(ag("b", 1, 100)); // 1
    s.push(wait("wa", 0, 0)); // 2
    s.push(wait("wb", 1, 1)); // 3
    s.push(op("ua", vec![2], 50.0)); // 4
    s.push(op("ub", vec![3], 5.0)); // 5
    s.push(rel("ra", 0, vec![2, 4])); // 6
    s.push(rel("rb", 1, vec![3, 5])); // 7
    let g = Graph::new(s).unwrap();
    let o = greedy_order(&g, &dur(&g));
    assert_eq!(names(&g, &o)[..4], ["b", "wb", "ub", "rb"]);
}

/// Weight and bias used by one op: no gather reaches its release alone, so the fallback emits
/// the path to the weight's release, the bias's gather included, and then the bias's release.
#[test]
fn weight_and_bias_fallback() {
    let mut s = GraphSpec::default();
    s.push(ag("w", 0, 1000)); // 0
    s.push(ag("b", 1, 10)); // 1
    s.push(wait("ww", 0, 0)); // 2
    s.push(wait("wb", 1, 1)); // 3
    s.push(op("addmm", vec![2, 3], 5.0)); // 4
    s.push(rel("rw", 0, vec![2, 4])); // 5
    s.push(rel("rb", 1, vec![3, 4])); // 6
    let g = Graph::new(s).unwrap();
    let o = greedy_order(&g, &dur(&g));
    let nm = names(&g, &o);
    // Fallback key: the bias needs 1000 other bytes, the weight 10: the weight is picked.
    assert_eq!(nm, ["w", "ww", "b", "wb", "addmm", "rw", "rb"]);
}

/// Layers whose op reads a weight and a bias: every weight is released right after its op,
/// not at the end of the graph (the fallback gathers the weight alone, and it is no
/// candidate afterwards).
#[test]
fn weight_released_after_its_op_in_a_stack() {
    let mut s = GraphSpec::default();
    let layers = 4;
    let mut x = s.push(NodeSpec::new("x", NodeKind::Other)) as usize;
    for l in 0..layers as u64 {
        let w = s.push(ag(&format!("w{l}"), 2 * l, 1000)) as usize;
        let b = s.push(ag(&format!("b{l}"), 2 * l + 1, 10)) as usize;
        let ww = s.push(wait(&format!("ww{l}"), 2 * l, w)) as usize;
        let wb = s.push(wait(&format!("wb{l}"), 2 * l + 1, b)) as usize;
        let y = s.push(op(&format!("addmm{l}"), vec![x, ww, wb], 5.0)) as usize;
        s.push(rel(&format!("rw{l}"), 2 * l, vec![ww, y]));
        s.push(rel(&format!("rb{l}"), 2 * l + 1, vec![wb, y]));
        x = y;
    }
    let g = Graph::new(s).unwrap();
    let o = greedy_order(&g, &dur(&g));
    let nm = names(&g, &o);
    let at = |n: &str| nm.iter().position(|m| m == n).unwrap();
    for l in 0..layers - 1 {
        assert!(at(&format!("rw{l}")) < at(&format!("w{}", l + 1)), "{nm:?}");
    }
    // At most one layer's weights are gathered at any point.
    let mut live = 0u64;
    let mut peak = 0u64;
    for &v in &o {
        match g.kind(v) {
            NodeKind::Allgather => live += g.nodes[v as usize].bytes,
            NodeKind::Release => live -= g.nodes[g.gather_of[v as usize] as usize].bytes,
            _ => {}
        }
        peak = peak.max(live);
    }
    assert!(peak <= 2 * 1010, "peak {peak} bytes gathered: {nm:?}");
}

/// Reduce-scatters are emitted as soon as no all-gather blocks them, not at the end.
#[test]
fn reduce_scatter_early() {
    let mut s = GraphSpec::default();
    s.push(ag("a", 0, 100)); // 0
    s.push(wait("wa", 0, 0)); // 1
    s.push(op("ga", vec![1], 5.0)); // 2 grad of a
    s.push(rel("ra", 0, vec![1, 2])); // 3
    s.push(NodeSpec {
        deps: vec![2],
        bytes: 100,
        ds_id: Some(0),
        ..NodeSpec::new("rs_a", NodeKind::ReduceScatter)
    }); // 4
    s.push(ag("b", 1, 100)); // 5
    s.push(wait("wb", 1, 5)); // 6
    s.push(op("gb", vec![2, 6], 5.0)); // 7
    s.push(rel("rb", 1, vec![6, 7])); // 8
    let g = Graph::new(s).unwrap();
    let o = greedy_order(&g, &dur(&g));
    assert_eq!(
        names(&g, &o),
        ["a", "wa", "ga", "ra", "rs_a", "b", "wb", "gb", "rb"]
    );
}
