//! The base sequence (step 1 of the search): the compute-stream program in the greedy order, each
//! all-gather's just-in-time and earliest slot, the memory per slot and the gathers' deadlines.
//! Built once per graph and shared, read-only, by every list-scheduling variant.

use super::seg_tree::SegTree;
use crate::plan::graph::{NodeKind, Stream, NONE};
use crate::plan::sim::Problem;

/// The base sequence and everything derived from it, shared by all variants.
pub(super) struct Base {
    pub(super) seq: Vec<u32>,
    /// Gathers in comm-stream (FIFO) order.
    pub(super) fifo: Vec<u32>,
    pub(super) jit: Vec<u32>,
    pub(super) earliest: Vec<u32>,
    pub(super) seg: SegTree,
    pub(super) peak: i64,
    /// Compute-stream time before each slot, ignoring stalls.
    pub(super) pc: Vec<f64>,
    /// Latest start of each gather (in `pc` time) for its wait not to stall the compute stream.
    pub(super) latest_start: Vec<f64>,
}

pub(super) fn build_base(p: &Problem, greedy: &[u32]) -> Base {
    let g = p.g;
    let n = g.len();
    // Compute-stream program in greedy order, reduce-scatters hoisted after their last dep.
    let mut seq: Vec<u32> = greedy
        .iter()
        .copied()
        .filter(|&v| !g.is_gather(v))
        .collect();
    {
        let mut pos = vec![0usize; n];
        for (k, &v) in seq.iter().enumerate() {
            pos[v as usize] = k;
        }
        let mut keyed: Vec<(u64, u32)> = seq
            .iter()
            .enumerate()
            .map(|(k, &v)| {
                let key = if g.kind(v) == NodeKind::ReduceScatter {
                    let last = g
                        .deps(v)
                        .iter()
                        .filter(|&&d| !g.is_gather(d))
                        .map(|&d| pos[d as usize])
                        .max();
                    match last {
                        Some(l) => 2 * l as u64 + 1,
                        None => 2 * k as u64,
                    }
                } else {
                    2 * k as u64
                };
                (key, v)
            })
            .collect();
        keyed.sort_by_key(|&(k, _)| k);
        seq = keyed.into_iter().map(|(_, v)| v).collect();
    }
    let m = seq.len();
    let mut pos = vec![NONE; n];
    for (k, &v) in seq.iter().enumerate() {
        pos[v as usize] = k as u32;
    }
    // The graph's inputs lead the sequence (the greedy order puts them first).
    let inputs = seq.iter().take_while(|&&v| g.is_input(v)).count() as u32;
    // Slot where each gather must be issued at the latest (before its first user) and earliest.
    let mut jit = vec![NONE; n];
    let mut earliest = vec![0u32; n];
    let mut gathers: Vec<u32> = Vec::new();
    // Greedy position fallback for gathers without users.
    let mut seen_non_gathers = 0u32;
    let mut greedy_slot = vec![0u32; n];
    for &v in greedy {
        if g.is_gather(v) {
            greedy_slot[v as usize] = seen_non_gathers;
        } else {
            seen_non_gathers += 1;
        }
    }
    for &v in g.topo.iter().rev() {
        if !g.is_gather(v) {
            continue;
        }
        gathers.push(v);
        let mut j = NONE;
        for &u in g.users(v) {
            let pu = if g.is_gather(u) {
                jit[u as usize]
            } else {
                pos[u as usize]
            };
            j = j.min(pu);
        }
        if j == NONE {
            j = greedy_slot[v as usize].min(m as u32);
        }
        jit[v as usize] = j;
        let mut e = 0u32;
        for &d in g.deps(v) {
            if g.is_input(d) {
                // After all the inputs, not right after its own: the gathers of one slot can
                // share a bucket, and the inputs take no time.
                e = e.max(inputs);
            } else if !g.is_gather(d) {
                e = e.max(pos[d as usize] + 1);
            }
        }
        earliest[v as usize] = e.min(j);
    }
    gathers.sort_by_key(|&v| (jit[v as usize], g.topo_rank[v as usize]));
    // Memory per slot with every gather just in time.
    let mut vals = vec![0i64; m + 1];
    let mut cur = g.base_bytes as i64;
    let mut gi = 0usize;
    for (k, val) in vals.iter_mut().enumerate() {
        while gi < gathers.len() && jit[gathers[gi] as usize] as usize == k {
            let a = &g.nodes[gathers[gi] as usize];
            cur += a.alloc as i64 - a.free as i64;
            gi += 1;
        }
        if k == m {
            *val = cur;
            break;
        }
        let node = &g.nodes[seq[k] as usize];
        *val = cur + node.alloc as i64;
        cur += node.alloc as i64 - node.free as i64;
    }
    // A gather's own allocation peak (before the slot's node) is covered: alloc >= 0 at the node.
    let seg = SegTree::new(&vals);
    // Deadlines: compute-only time at each gather's just-in-time slot, chained back through the
    // FIFO comm stream (a gather must also leave room for the ones after it).
    let mut pc = vec![0.0f64; m + 1];
    for k in 0..m {
        let v = seq[k] as usize;
        let d = if g.nodes[v].stream == Stream::Compute {
            p.dur[v]
        } else {
            0.0
        };
        pc[k + 1] = pc[k] + d;
    }
    let mut latest_start = vec![f64::INFINITY; n];
    let mut next_start = f64::INFINITY;
    for &x in gathers.iter().rev() {
        let finish = pc[jit[x as usize] as usize].min(next_start);
        let st = finish - p.dur[x as usize];
        latest_start[x as usize] = st;
        next_start = st;
    }
    let peak = seg.max(0, m + 1).max(g.base_bytes as i64);
    Base {
        seq,
        fifo: gathers,
        jit,
        earliest,
        seg,
        peak,
        pc,
        latest_start,
    }
}
