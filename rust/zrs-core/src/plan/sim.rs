//! The multi-stream simulator.
//!
//! Semantics (the runtime's, see DESIGN.md "Runtime"):
//! - The order is program order. Each stream runs its nodes in program order; a node starts once
//!   its stream is free and its deps have ended.
//! - A collective (all-gather or reduce-scatter stream) also waits for the compute stream to reach
//!   its program point: its output buffer is allocated there, and the comm stream waits on the
//!   compute stream's event before reusing memory (FSDP and DeepCompile do the same). This is what
//!   makes the prefetch position matter.
//! - A wait ends no earlier than its all-gather.
//! - A fused group is one all-gather issued at its first member's position, lasting the cost
//!   model's time for the summed bytes; every member starts and ends with it.
//! - Memory follows program order, as the caching allocator sees it: a node allocates, the peak
//!   is taken, then it frees. A group allocates all its members at the issue point.
//! - Exposed communication is `makespan - compute-stream busy time`: every idle gap of the
//!   compute stream is a wait on a collective, and so is any collective tail after it.
//! - Offload: a reduce-scatter with `host_bytes` is followed by its copy to the host on one copy
//!   stream of its own, in the order the reduce-scatters end (the runtime issues each copy as
//!   its reduce-scatter is waited for). The graph ends no earlier than its last copy (the
//!   backward's end waits for them), so a copy tail is exposed too; the copies take no device
//!   memory the graph accounts for.
//! - Hybrid sharding: a reduce-scatter with `replicate_bytes` is followed by the all-reduce of
//!   its output across the replicas on a stream of its own (a communicator over other ranks), in
//!   the order the reduce-scatters end; offload's host copy then follows the all-reduce. The
//!   graph ends no earlier than its last all-reduce.
//! - Offload of the parameters: an all-gather with `host_bytes` first copies its shard in from
//!   the host on its own stream (the runtime stages it there), so its time is the copy's and
//!   the gather's; the staged bytes are in its `alloc` and its wait's `free` (compiler/ir.py).

use serde::Serialize;

use super::cost::CostModel;
use super::graph::{Graph, NodeKind, Stream, NONE};
use crate::error::{Error, Result};

/// A graph with its cost model: the resolved duration of every node.
#[derive(Clone, Debug)]
pub struct Problem<'a> {
    pub g: &'a Graph,
    pub cost: CostModel,
    /// Duration of each node alone (collectives from the cost model unless given).
    pub dur: Vec<f64>,
    /// Duration of each reduce-scatter's copy to the host (0: none).
    pub host_dur: Vec<f64>,
    /// Duration of each reduce-scatter's all-reduce across the replicas (0: none).
    pub replicate_dur: Vec<f64>,
}

impl<'a> Problem<'a> {
    pub fn new(g: &'a Graph, cost: &CostModel) -> Self {
        let dur = g
            .nodes
            .iter()
            .map(|n| match (n.duration_us, n.kind) {
                (Some(d), _) => d,
                (None, NodeKind::Allgather) => {
                    cost.allgather_us(n.bytes) + cost.host_copy_us(n.host_bytes)
                }
                (None, NodeKind::ReduceScatter) => cost.reduce_scatter_us(n.bytes),
                (None, _) => 0.0,
            })
            .collect();
        let host_dur = g
            .nodes
            .iter()
            .map(|n| match n.kind {
                NodeKind::ReduceScatter => cost.host_copy_us(n.host_bytes),
                _ => 0.0,
            })
            .collect();
        let replicate_dur = g
            .nodes
            .iter()
            .map(|n| match n.kind {
                NodeKind::ReduceScatter => cost.all_reduce_us(n.replicate_bytes),
                _ => 0.0,
            })
            .collect();
        Problem {
            g,
            cost: cost.clone(),
            dur,
            host_dur,
            replicate_dur,
        }
    }

    pub fn len(&self) -> usize {
        self.g.len()
    }

    pub fn is_empty(&self) -> bool {
        self.g.is_empty()
    }

    /// Duration of a fused all-gather of these members (and of their stage-in, if staged).
    pub fn group_dur(&self, members: &[u32]) -> f64 {
        if members.len() == 1 {
            return self.dur[members[0] as usize];
        }
        let nodes = || members.iter().map(|&m| &self.g.nodes[m as usize]);
        let bytes: u64 = nodes().map(|n| n.bytes).sum();
        let staged: u64 = nodes().map(|n| n.host_bytes).sum();
        self.cost.allgather_us(bytes) + self.cost.host_copy_us(staged)
    }

    /// Total compute-stream busy time (independent of the order).
    pub fn compute_busy_us(&self) -> f64 {
        (0..self.len())
            .filter(|&v| self.g.nodes[v].stream == Stream::Compute)
            .map(|v| self.dur[v])
            .sum()
    }
}

/// The simulated timeline of one plan.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SimResult {
    pub makespan_us: f64,
    pub exposed_comm_us: f64,
    pub compute_us: f64,
    pub allgather_busy_us: f64,
    pub reduce_scatter_busy_us: f64,
    /// Offload: the copy stream's busy time, and each reduce-scatter's copy (0 for none).
    pub host_copy_busy_us: f64,
    pub host_start_us: Vec<f64>,
    pub host_end_us: Vec<f64>,
    /// Hybrid sharding: the all-reduce stream's busy time, and each reduce-scatter's all-reduce.
    pub all_reduce_busy_us: f64,
    pub all_reduce_start_us: Vec<f64>,
    pub all_reduce_end_us: Vec<f64>,
    pub peak_bytes: u64,
    /// Memory live after the last node.
    pub end_bytes: i64,
    pub start_us: Vec<f64>,
    pub end_us: Vec<f64>,
    /// Memory over time: (time, bytes) after each allocation and each free, in program order.
    pub mem_t_us: Vec<f64>,
    pub mem_bytes: Vec<i64>,
}

/// Check that `order` is a permutation and topological once every group is moved to its first
/// member, and that groups are disjoint sets of at least two all-gathers that may fuse (one
/// gathered dtype, each parameter once: [`Graph::fusable`]). Returns each node's group (or NONE)
/// and its position.
pub fn validate(g: &Graph, order: &[u32], groups: &[Vec<u32>]) -> Result<(Vec<u32>, Vec<u32>)> {
    let n = g.len();
    if order.len() != n {
        return Err(Error::Invalid(format!(
            "plan order has {} entries but the graph has {n} nodes",
            order.len()
        )));
    }
    let mut pos = vec![NONE; n];
    for (k, &v) in order.iter().enumerate() {
        if v as usize >= n {
            return Err(Error::Invalid(format!(
                "plan order names node #{v}, but the graph has {n} nodes"
            )));
        }
        if pos[v as usize] != NONE {
            return Err(Error::Invalid(format!(
                "plan order lists node '{}' (#{v}) twice",
                g.names[v as usize]
            )));
        }
        pos[v as usize] = k as u32;
    }
    let mut group_of = vec![NONE; n];
    let mut eff = pos.clone();
    for (gi, grp) in groups.iter().enumerate() {
        if grp.len() < 2 {
            return Err(Error::Invalid(format!(
                "prefetch group {gi} has {} member(s); a fused group has at least two",
                grp.len()
            )));
        }
        let mut lead = u32::MAX;
        for (k, &m) in grp.iter().enumerate() {
            if m as usize >= n {
                return Err(Error::Invalid(format!(
                    "prefetch group {gi} names node #{m}, but the graph has {n} nodes"
                )));
            }
            if !g.is_gather(m) {
                return Err(Error::Invalid(format!(
                    "prefetch group {gi} contains '{}' (#{m}), which is not an all-gather",
                    g.names[m as usize]
                )));
            }
            if group_of[m as usize] != NONE {
                return Err(Error::Invalid(format!(
                    "all-gather '{}' (#{m}) is in two prefetch groups",
                    g.names[m as usize]
                )));
            }
            if !g.fusable(&grp[..k], m) {
                return Err(Error::Invalid(format!(
                    "prefetch group {gi} cannot fuse all-gather '{}' (#{m}): its members must \
                     share one gathered dtype and name each parameter once",
                    g.names[m as usize]
                )));
            }
            group_of[m as usize] = gi as u32;
            lead = lead.min(pos[m as usize]);
        }
        for &m in grp {
            eff[m as usize] = lead;
        }
    }
    for v in 0..n as u32 {
        for &d in g.deps(v) {
            if eff[d as usize] >= eff[v as usize] {
                return Err(Error::Invalid(format!(
                    "plan order is not topological: '{}' (#{v}) is issued at position {} but its dependency '{}' (#{d}) \
                     at position {}",
                    g.names[v as usize], eff[v as usize], g.names[d as usize], eff[d as usize]
                )));
            }
        }
    }
    Ok((group_of, pos))
}

/// A stream that runs the work following a reduce-scatter (its all-reduce, its host copy) one
/// at a time, in the order it is handed over.
struct Serial {
    start: Vec<f64>,
    end: Vec<f64>,
    free: f64,
    busy: f64,
}

impl Serial {
    fn new(n: usize) -> Self {
        Serial {
            start: vec![0.0; n],
            end: vec![0.0; n],
            free: 0.0,
            busy: 0.0,
        }
    }

    /// Run node `v`'s `dur` once `ready` and the stream is free; returns when it ends (`ready`
    /// for no work).
    fn run(&mut self, v: usize, ready: f64, dur: f64) -> f64 {
        if dur <= 0.0 {
            return ready;
        }
        let s = ready.max(self.free);
        self.start[v] = s;
        self.end[v] = s + dur;
        self.free = s + dur;
        self.busy += dur;
        self.free
    }
}

/// Simulate a plan; validates it first.
pub fn simulate(p: &Problem, order: &[u32], groups: &[Vec<u32>]) -> Result<SimResult> {
    let (group_of, _pos) = validate(p.g, order, groups)?;
    Ok(simulate_unchecked(p, order, groups, &group_of, true))
}

/// Simulate a plan already known to be valid. `timeline` keeps the memory series.
pub fn simulate_unchecked(
    p: &Problem,
    order: &[u32],
    groups: &[Vec<u32>],
    group_of: &[u32],
    timeline: bool,
) -> SimResult {
    let g = p.g;
    let n = g.len();
    let mut start = vec![0.0f64; n];
    let mut end = vec![0.0f64; n];
    let mut done = vec![false; n];
    let mut free = [0.0f64; 3];
    let mut busy = [0.0f64; 3];
    let mut cur: i64 = g.base_bytes as i64;
    let mut peak: i64 = cur;
    let mut t_prog = 0.0f64;
    let cap = if timeline { 2 * n } else { 0 };
    let mut mem_t = Vec::with_capacity(cap);
    let mut mem_b = Vec::with_capacity(cap);
    let mut makespan = 0.0f64;
    // Hybrid sharding's all-reduces across the replicas, then offload's copies to the host: a
    // stream each, in the reduce-scatters' order.
    let mut all_reduces = Serial::new(n);
    let mut host_copies = Serial::new(n);
    for &v in order {
        let vi = v as usize;
        if done[vi] {
            continue; // a non-leading member of a group already issued
        }
        let gi = group_of.get(vi).copied().unwrap_or(NONE);
        let (alloc, freed);
        if gi != NONE {
            let members = &groups[gi as usize];
            let mut ready = free[Stream::Compute.index()];
            for &m in members {
                for &d in g.deps(m) {
                    ready = ready.max(end[d as usize]);
                }
            }
            let s = Stream::Allgather.index();
            let st = ready.max(free[s]);
            let dur = p.group_dur(members);
            let en = st + dur;
            free[s] = en;
            busy[s] += dur;
            let (mut a, mut f) = (0u64, 0u64);
            for &m in members {
                start[m as usize] = st;
                end[m as usize] = en;
                done[m as usize] = true;
                a += g.nodes[m as usize].alloc;
                f += g.nodes[m as usize].free;
            }
            alloc = a;
            freed = f;
            t_prog = t_prog.max(free[Stream::Compute.index()]);
            makespan = makespan.max(en);
        } else {
            let node = &g.nodes[vi];
            let s = node.stream.index();
            let mut ready = 0.0f64;
            for &d in g.deps(v) {
                ready = ready.max(end[d as usize]);
            }
            let ga = g.gather_of[vi];
            if node.kind == NodeKind::Wait && ga != NONE {
                ready = ready.max(end[ga as usize]);
            }
            if node.stream != Stream::Compute {
                ready = ready.max(free[Stream::Compute.index()]);
                t_prog = t_prog.max(free[Stream::Compute.index()]);
            }
            let st = ready.max(free[s]);
            let en = st + p.dur[vi];
            free[s] = en;
            busy[s] += p.dur[vi];
            start[vi] = st;
            end[vi] = en;
            done[vi] = true;
            if node.stream == Stream::Compute {
                t_prog = t_prog.max(st);
            }
            alloc = node.alloc;
            freed = node.free;
            makespan = makespan.max(en);
            let reduced = all_reduces.run(vi, en, p.replicate_dur[vi]);
            let copied = host_copies.run(vi, reduced, p.host_dur[vi]);
            makespan = makespan.max(copied);
        }
        cur += alloc as i64;
        peak = peak.max(cur);
        if timeline {
            mem_t.push(t_prog);
            mem_b.push(cur);
        }
        cur -= freed as i64;
        if timeline && freed != 0 {
            mem_t.push(t_prog);
            mem_b.push(cur);
        }
    }
    let compute = busy[Stream::Compute.index()];
    SimResult {
        makespan_us: makespan,
        exposed_comm_us: (makespan - compute).max(0.0),
        compute_us: compute,
        allgather_busy_us: busy[Stream::Allgather.index()],
        reduce_scatter_busy_us: busy[Stream::ReduceScatter.index()],
        host_copy_busy_us: host_copies.busy,
        host_start_us: host_copies.start,
        host_end_us: host_copies.end,
        all_reduce_busy_us: all_reduces.busy,
        all_reduce_start_us: all_reduces.start,
        all_reduce_end_us: all_reduces.end,
        peak_bytes: peak.max(0) as u64,
        end_bytes: cur,
        start_us: start,
        end_us: end,
        mem_t_us: mem_t,
        mem_bytes: mem_b,
    }
}

/// Peak memory of an order by a direct recount (no timing): used by tests and the search.
pub fn recount_peak(g: &Graph, order: &[u32], groups: &[Vec<u32>]) -> u64 {
    let n = g.len();
    let mut lead_alloc = vec![0u64; n];
    let mut lead_free = vec![0u64; n];
    let mut in_group = vec![false; n];
    let mut pos = vec![0usize; n];
    for (k, &v) in order.iter().enumerate() {
        pos[v as usize] = k;
    }
    for grp in groups {
        let lead = *grp.iter().min_by_key(|&&m| pos[m as usize]).unwrap();
        for &m in grp {
            in_group[m as usize] = true;
        }
        lead_alloc[lead as usize] = grp.iter().map(|&m| g.nodes[m as usize].alloc).sum();
        lead_free[lead as usize] = grp.iter().map(|&m| g.nodes[m as usize].free).sum();
    }
    let mut cur = g.base_bytes as i64;
    let mut peak = cur;
    for &v in order {
        let node = &g.nodes[v as usize];
        let (a, f) = if in_group[v as usize] {
            (lead_alloc[v as usize], lead_free[v as usize])
        } else {
            (node.alloc, node.free)
        };
        cur += a as i64;
        peak = peak.max(cur);
        cur -= f as i64;
    }
    peak.max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::cost::LinkModel;
    use crate::plan::graph::{GraphSpec, NodeKind, NodeSpec};

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
}
