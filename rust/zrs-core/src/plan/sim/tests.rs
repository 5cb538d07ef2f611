//! The simulator's unit tests.

use super::*;
use crate::plan::cost::{CostModel, LinkModel};
use crate::plan::graph::{Graph, GraphSpec, NodeKind, NodeSpec};

/// Two layers' backward: each computes a gradient and reduce-scatters it (with offload,
/// copying `host_bytes` of it to the host after).
fn backward(host_bytes: u64) -> Graph {
    let mut s = GraphSpec::default();
    let mut prev = Vec::new();
    for l in 0..2 {
        let op = s.push(NodeSpec {
            deps: prev.clone(),
            duration_us: Some(100.0),
            ..NodeSpec::new(format!("grad{l}"), NodeKind::Compute)
        }) as usize;
        s.push(NodeSpec {
            deps: vec![op],
            ds_id: Some(l),
            bytes: 1 << 20,
            host_bytes,
            ..NodeSpec::new(format!("rs{l}"), NodeKind::ReduceScatter)
        });
        prev = vec![op];
    }
    Graph::new(s).unwrap()
}

#[test]
fn a_replicated_reduce_scatter_all_reduces_its_shard_after_it_on_one_stream() {
    let mut spec = backward(0).to_spec();
    for n in spec.nodes.iter_mut() {
        if n.kind == NodeKind::ReduceScatter {
            n.replicate_bytes = 1_000_000;
        }
    }
    let g = Graph::new(spec).unwrap();
    let order: Vec<u32> = (0..g.len() as u32).collect();
    let one = simulate(&Problem::new(&g, &cost(None)), &order, &[]).unwrap();
    assert_eq!(one.all_reduce_busy_us, 0.0, "one replica: no all-reduce");
    let inter = LinkModel {
        latency_us: 5.0,
        bus_gbps: 1.0,
    };
    let hybrid = CostModel {
        replicas: 4,
        inter: Some(inter),
        ..cost(Some(HOST))
    };
    let r = simulate(&Problem::new(&g, &hybrid), &order, &[]).unwrap();
    let (rs0, rs1) = (1, 3);
    // ring all-reduce over 4 replicas: 2 x 3/4 of 1 MB at 1 GB/s, plus the latency
    let each = 5.0 + 1500.0;
    assert_eq!(r.all_reduce_start_us[rs0], r.end_us[rs0]);
    assert!((r.all_reduce_end_us[rs0] - r.all_reduce_start_us[rs0] - each).abs() < 1e-9);
    assert_eq!(r.all_reduce_start_us[rs1], r.all_reduce_end_us[rs0]);
    assert!((r.all_reduce_busy_us - 2.0 * each).abs() < 1e-9);
    // the gradients' host copies (none here) and the graph's end follow the all-reduces
    assert_eq!(r.makespan_us, r.all_reduce_end_us[rs1]);
    assert!(r.exposed_comm_us > one.exposed_comm_us + each);
    // without an inter link the reduce-scatter's stands in
    let intra = CostModel {
        replicas: 4,
        ..cost(None)
    };
    assert!(intra.all_reduce_us(1_000_000) > 0.0);
    assert!(intra.all_reduce_us(1_000_000) < hybrid.all_reduce_us(1_000_000));
}

#[test]
fn replicate_bytes_belong_to_reduce_scatters_only() {
    let mut spec = backward(0).to_spec();
    spec.nodes[0].replicate_bytes = 8;
    assert!(Graph::new(spec).is_err());
}

fn cost(host: Option<LinkModel>) -> CostModel {
    CostModel {
        host,
        ..CostModel::nvlink(2)
    }
}

const HOST: LinkModel = LinkModel {
    latency_us: 10.0,
    bus_gbps: 1.0, // 1 MB in 1000 us: longer than the backward's compute
};

#[test]
fn host_copies_follow_their_reduce_scatters_on_one_stream() {
    let g = backward(1_000_000);
    let order: Vec<u32> = (0..g.len() as u32).collect();
    let plain = simulate(&Problem::new(&g, &cost(None)), &order, &[]).unwrap();
    assert_eq!(plain.host_copy_busy_us, 0.0, "no host link: no copies");
    let p = Problem::new(&g, &cost(Some(HOST)));
    let r = simulate(&p, &order, &[]).unwrap();
    let (rs0, rs1) = (1, 3);
    assert_eq!(
        r.host_start_us[rs0], r.end_us[rs0],
        "issued as its reduce-scatter ends"
    );
    assert!((r.host_end_us[rs0] - r.host_start_us[rs0] - 1010.0).abs() < 1e-9);
    // the second waits for the first (one copy stream), though its reduce-scatter ended
    assert_eq!(r.host_start_us[rs1], r.host_end_us[rs0]);
    assert_eq!(
        r.makespan_us, r.host_end_us[rs1],
        "the graph ends after its last copy"
    );
    assert!((r.host_copy_busy_us - 2020.0).abs() < 1e-9);
    assert!(
        r.exposed_comm_us > plain.exposed_comm_us + 1000.0,
        "the copy tail is exposed"
    );
    assert_eq!(
        (r.start_us.clone(), r.peak_bytes),
        (plain.start_us, plain.peak_bytes)
    );
}

/// Two parameters gathered (staging `staged` bytes each from the host first), waited for
/// and read by one compute node.
fn staged_forward(staged: u64) -> Graph {
    let mut s = GraphSpec::default();
    let mut waits = Vec::new();
    for l in 0..2 {
        let ag = s.push(NodeSpec {
            ds_id: Some(l),
            bytes: 1 << 20,
            host_bytes: staged,
            ..NodeSpec::new(format!("ag{l}"), NodeKind::Allgather)
        }) as usize;
        waits.push(s.push(NodeSpec {
            deps: vec![ag],
            ds_id: Some(l),
            ..NodeSpec::new(format!("wait{l}"), NodeKind::Wait)
        }) as usize);
    }
    s.push(NodeSpec {
        deps: waits,
        duration_us: Some(10.0),
        ..NodeSpec::new("mm", NodeKind::Compute)
    });
    Graph::new(s).unwrap()
}

#[test]
fn a_staged_gather_copies_its_shard_in_first() {
    let order: Vec<u32> = (0..5).collect();
    let g = staged_forward(1_000_000);
    let plain = simulate(&Problem::new(&g, &cost(None)), &order, &[]).unwrap();
    let p = Problem::new(&g, &cost(Some(HOST)));
    let r = simulate(&p, &order, &[]).unwrap();
    let ag0 = 0;
    let gather = plain.end_us[ag0] - plain.start_us[ag0];
    assert!((r.end_us[ag0] - r.start_us[ag0] - gather - 1010.0).abs() < 1e-6);
    assert_eq!(
        r.host_copy_busy_us, 0.0,
        "a stage-in is on the gather's stream"
    );
    // fused, the two stage one transfer of their summed bytes, then gather
    let fused = p.group_dur(&[0, 2]);
    let want = CostModel::nvlink(2).allgather_us(2 << 20) + HOST.copy_us(2_000_000);
    assert!((fused - want).abs() < 1e-6, "{fused} != {want}");
    // no staged bytes: the host link changes nothing
    let unstaged = staged_forward(0);
    let q = Problem::new(&unstaged, &cost(Some(HOST)));
    assert_eq!(q.dur, Problem::new(&g, &cost(None)).dur);
}

#[test]
fn host_bytes_belong_to_reduce_scatters_and_gathers_only() {
    let mut s = GraphSpec::default();
    s.push(NodeSpec {
        duration_us: Some(1.0),
        host_bytes: 8,
        ..NodeSpec::new("mm", NodeKind::Compute)
    });
    let err = Graph::new(s).unwrap_err().to_string();
    assert!(err.contains("only a reduce_scatter"), "{err}");
    assert!(err.contains("or an allgather"), "{err}");
}
