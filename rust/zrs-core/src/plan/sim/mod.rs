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

mod order;
mod problem;
#[cfg(test)]
mod tests;

use serde::Serialize;

pub use order::{recount_peak, validate};
pub use problem::Problem;

use super::graph::{NodeKind, Stream, NONE};
use crate::error::Result;

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
