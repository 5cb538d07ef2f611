//! Chrome-trace JSON (opens in Perfetto and chrome://tracing) and the memory-over-time series.

use serde_json::{json, Value};

use super::graph::{Graph, Stream, NONE};
use super::Plan;

/// Memory over time: `(time_us, bytes)` points in program order, from the plan's simulation.
pub fn memory_series(plan: &Plan) -> Vec<(f64, i64)> {
    plan.sim
        .mem_t_us
        .iter()
        .copied()
        .zip(plan.sim.mem_bytes.iter().copied())
        .collect()
}

/// The thread of offload's copies to the host, after the streams', and hybrid sharding's
/// all-reduces across the replicas after it.
const HOST_COPY_TID: usize = Stream::ALL.len();
const ALL_REDUCE_TID: usize = Stream::ALL.len() + 1;

/// One complete ("X") event per node (one per fused bucket), one thread per stream (and one for
/// offload's copies to the host, if any), and a counter ("C") track of live memory.
pub fn chrome_trace(g: &Graph, plan: &Plan) -> Value {
    let pid = 0;
    let mut ev: Vec<Value> = Vec::with_capacity(g.len() + plan.sim.mem_t_us.len() + 8);
    ev.push(json!({"ph": "M", "pid": pid, "name": "process_name",
        "args": {"name": format!("zrs plan ({}, {} nodes)", plan.scheduler, g.len())}}));
    for s in Stream::ALL {
        ev.push(json!({"ph": "M", "pid": pid, "tid": s.index(), "name": "thread_name", "args": {"name": s.as_str()}}));
        ev.push(json!({"ph": "M", "pid": pid, "tid": s.index(), "name": "thread_sort_index", "args": {"sort_index": s.index()}}));
    }
    let extra = [
        (plan.sim.host_copy_busy_us, HOST_COPY_TID, "host_copy"),
        (plan.sim.all_reduce_busy_us, ALL_REDUCE_TID, "all_reduce"),
    ];
    for (busy, tid, name) in extra {
        if busy > 0.0 {
            ev.push(json!({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}));
            ev.push(json!({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}}));
        }
    }
    let n = g.len();
    let mut group_of = vec![NONE; n];
    for (gi, grp) in plan.groups.iter().enumerate() {
        for &m in grp {
            group_of[m as usize] = gi as u32;
        }
    }
    let mut pos = vec![0usize; n];
    for (k, &v) in plan.order.iter().enumerate() {
        pos[v as usize] = k;
    }
    let mut emitted_group = vec![false; plan.groups.len()];
    for &v in &plan.order {
        let vi = v as usize;
        let node = &g.nodes[vi];
        let (ts, te) = (plan.sim.start_us[vi], plan.sim.end_us[vi]);
        let gi = group_of[vi];
        if gi != NONE {
            if emitted_group[gi as usize] {
                continue;
            }
            emitted_group[gi as usize] = true;
            let grp = &plan.groups[gi as usize];
            let bytes: u64 = grp.iter().map(|&m| g.nodes[m as usize].bytes).sum();
            let names: Vec<&str> = grp.iter().map(|&m| g.names[m as usize].as_str()).collect();
            ev.push(json!({"ph": "X", "pid": pid, "tid": Stream::Allgather.index(), "ts": ts, "dur": te - ts,
                "name": format!("bucket {} ({} gathers)", gi, grp.len()), "cat": "allgather",
                "args": {"members": names, "bytes": bytes, "position": pos[vi]}}));
            continue;
        }
        let mut args = json!({"position": pos[vi], "kind": node.kind.as_str()});
        if let Some(ds) = node.ds_id {
            args["ds_id"] = json!(ds);
        }
        if node.bytes > 0 {
            args["bytes"] = json!(node.bytes);
        }
        if node.alloc > 0 {
            args["alloc_bytes"] = json!(node.alloc);
        }
        if node.free > 0 {
            args["free_bytes"] = json!(node.free);
        }
        ev.push(
            json!({"ph": "X", "pid": pid, "tid": node.stream.index(), "ts": ts, "dur": te - ts,
            "name": g.names[vi], "cat": node.kind.as_str(), "args": args}),
        );
        let (rs, re) = (
            plan.sim.all_reduce_start_us[vi],
            plan.sim.all_reduce_end_us[vi],
        );
        if re > rs {
            ev.push(
                json!({"ph": "X", "pid": pid, "tid": ALL_REDUCE_TID, "ts": rs, "dur": re - rs,
                "name": format!("{} across replicas", g.names[vi]), "cat": "all_reduce",
                "args": {"bytes": node.replicate_bytes}}),
            );
        }
        let (hs, he) = (plan.sim.host_start_us[vi], plan.sim.host_end_us[vi]);
        if he > hs {
            ev.push(
                json!({"ph": "X", "pid": pid, "tid": HOST_COPY_TID, "ts": hs, "dur": he - hs,
                "name": format!("{} to host", g.names[vi]), "cat": "host_copy",
                "args": {"bytes": node.host_bytes}}),
            );
        }
    }
    for (t, b) in memory_series(plan) {
        ev.push(json!({"ph": "C", "pid": pid, "name": "memory", "ts": t, "args": {"bytes": b}}));
    }
    json!({
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "scheduler": plan.scheduler,
            "makespan_us": plan.sim.makespan_us,
            "exposed_comm_us": plan.sim.exposed_comm_us,
            "host_copy_busy_us": plan.sim.host_copy_busy_us,
            "all_reduce_busy_us": plan.sim.all_reduce_busy_us,
            "peak_bytes": plan.sim.peak_bytes,
            "budget_bytes": plan.budget_bytes,
        }
    })
}
