//! The baseline: DeepCompile's `fast_free_schedule` rule (DESIGN.md "Greedy baseline").
//!
//! Repeatedly pick the all-gather whose release ("last use") needs the fewest other unscheduled
//! all-gathers. Among those whose path to the release needs no other all-gather, take the least
//! (all-gathers scheduled, bytes gathered on the way to it, compute until free, index) and emit
//! everything up to and including its release. Otherwise (every candidate needs another gather)
//! take the least (bytes of the other gathers needed, all-gathers scheduled, bytes gathered,
//! compute until free, index) and emit everything up to its release too, the other gathers it
//! needs included. (DeepCompile emits only the gather itself there: with a tied embedding, which
//! every later release needs, that issued every gather of the forward before any release.)
//! A release is emitted as soon as everything it waits for is. After each pick,
//! reduce-scatters and graph outputs whose ancestry holds no unscheduled all-gather are emitted
//! with their requirements; whatever is left goes last in topological order. It has no budget
//! and makes no fused groups.
//!
//! Counting "other gathers needed" for every all-gather after every pick is quadratic. This
//! implementation keeps, for each all-gather, one *witness*: an unscheduled all-gather among the
//! ancestors of its release. Only when the witness is scheduled is a new one searched for; an
//! all-gather without a witness needs no other gather (count 1), and stays so. When no count-1
//! candidate exists (e.g. a weight and a bias consumed by one op) the counts are computed exactly
//! for the `FALLBACK_CANDIDATES` all-gathers whose release comes first in topological order, an
//! approximation of DeepCompile's full scan that is exact for the usual weight+bias pairs.
//! Among count-1 candidates the key is (bytes, compute until free, index) and bytes never
//! change, so only the least-bytes candidates (at most `TIE_CANDIDATES` of them) are evaluated
//! per pick.
//!
//! Files: `state` (the walk: what is scheduled, each all-gather's witness), `task` (what a pick
//! costs and the keys picks compare); this file makes the picks.

mod state;
mod task;

#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::graph::{Graph, NodeKind, NONE};
use state::State;
use task::{fallback_key, free_key, lt, Task};

const FALLBACK_CANDIDATES: usize = 8;
/// Count-1 candidates of equal bytes whose compute-until-free is compared per pick.
const TIE_CANDIDATES: usize = 64;

/// The greedy baseline order. `dur` gives every node's device time (used for "compute until free").
pub fn greedy_order(g: &Graph, dur: &[f64]) -> Vec<u32> {
    let n = g.len();
    let mut target = vec![NONE; n];
    let mut ags = Vec::new();
    for y in 0..n as u32 {
        if !g.is_gather(y) {
            continue;
        }
        ags.push(y);
        let r = g.release_of[y as usize];
        target[y as usize] = if r != NONE {
            r
        } else {
            // No release: the last (topologically) user of the gather or of its waits.
            let mut best = y;
            for &u in g.users(y) {
                let cand = if g.kind(u) == NodeKind::Wait {
                    g.users(u)
                        .iter()
                        .copied()
                        .max_by_key(|&x| g.topo_rank[x as usize])
                        .unwrap_or(u)
                } else {
                    u
                };
                if g.topo_rank[cand as usize] > g.topo_rank[best as usize] {
                    best = cand;
                }
            }
            best
        };
    }
    let sinks: Vec<u32> = (0..n as u32)
        .filter(|&v| {
            let k = g.kind(v);
            k == NodeKind::ReduceScatter
                || (g.users(v).is_empty() && matches!(k, NodeKind::Compute | NodeKind::Other))
        })
        .collect();
    let mut st = State {
        g,
        dur,
        sched: vec![false; n],
        order: Vec::with_capacity(n),
        stamp: vec![0; n],
        epoch: 0,
        stack: Vec::new(),
        target,
        watchers: vec![Vec::new(); n],
        level1: BinaryHeap::new(),
        ready_sinks: Vec::new(),
        remaining_ags: ags.len(),
    };
    for &y in &ags {
        st.watch(y);
    }
    // Sinks that need no all-gather at all are left for the end, as in DeepCompile.
    for &s in &sinks {
        let x = st.find_witness(s, NONE);
        if x != NONE {
            st.watchers[x as usize].push(s);
        }
    }
    let mut by_target = ags.clone();
    by_target.sort_by_key(|&y| (st.g.topo_rank[st.target[y as usize] as usize], y));
    let mut first_open = 0usize;

    let (mut ua, mut uf, mut best_ua, mut best_uf) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    while st.remaining_ags > 0 {
        // Count-1 candidates all have one gather on the path and gather only their own bytes, so
        // the key reduces to (bytes, compute until free, id): only the least-bytes ones compete.
        while let Some(&Reverse((_, y))) = st.level1.peek() {
            if st.sched[y as usize] {
                st.level1.pop();
            } else {
                break;
            }
        }
        let mut chosen: Option<Task> = None;
        if let Some(&Reverse((b0, _))) = st.level1.peek() {
            let mut tied = Vec::new();
            while let Some(&Reverse((b, y))) = st.level1.peek() {
                if b != b0 || tied.len() >= TIE_CANDIDATES {
                    break;
                }
                st.level1.pop();
                if !st.sched[y as usize] {
                    tied.push(y);
                }
            }
            for &y in &tied {
                let (t, _) = st.task(y, &mut ua, &mut uf);
                if chosen
                    .as_ref()
                    .is_none_or(|c| lt(&free_key(&t), &free_key(c)))
                {
                    chosen = Some(t);
                    std::mem::swap(&mut ua, &mut best_ua);
                    std::mem::swap(&mut uf, &mut best_uf);
                }
            }
            let pick = chosen.map(|c| c.id);
            for y in tied {
                if Some(y) != pick {
                    st.level1.push(Reverse((st.g.nodes[y as usize].bytes, y)));
                }
            }
        } else {
            while first_open < by_target.len() && st.sched[by_target[first_open] as usize] {
                first_open += 1;
            }
            let cands: Vec<u32> = by_target[first_open..]
                .iter()
                .copied()
                .filter(|&y| !st.sched[y as usize])
                .take(FALLBACK_CANDIDATES)
                .collect();
            let mut tasks: Vec<(Task, usize)> = cands
                .iter()
                .map(|&y| st.task(y, &mut ua, &mut uf))
                .collect();
            let min_count = tasks
                .iter()
                .map(|t| t.1)
                .min()
                .expect("an unscheduled all-gather exists");
            tasks.retain(|t| t.1 == min_count);
            let free_path: Vec<Task> = tasks
                .iter()
                .filter(|t| t.0.free_acc_mem == 0)
                .map(|t| t.0)
                .collect();
            let pick = if !free_path.is_empty() {
                *free_path
                    .iter()
                    .reduce(|a, b| if lt(&free_key(b), &free_key(a)) { b } else { a })
                    .unwrap()
            } else {
                tasks
                    .iter()
                    .map(|t| t.0)
                    .reduce(|a, b| {
                        if lt(&fallback_key(&b), &fallback_key(&a)) {
                            b
                        } else {
                            a
                        }
                    })
                    .unwrap()
            };
            st.task(pick.id, &mut best_ua, &mut best_uf);
            chosen = Some(pick);
        }
        let _ = chosen.expect("a candidate all-gather");
        let nodes = std::mem::take(&mut best_uf);
        st.schedule(&nodes);
        // Reduce-scatters and outputs that no longer wait on any all-gather.
        while let Some(s) = st.ready_sinks.pop() {
            if st.sched[s as usize] {
                continue;
            }
            let mut req = Vec::new();
            st.new_epoch();
            st.requirements(s, &mut req);
            st.schedule(&req);
        }
    }
    for &v in &g.topo {
        if !st.sched[v as usize] {
            st.sched[v as usize] = true;
            st.order.push(v);
        }
    }
    inputs_first(g, st.order)
}

/// `order` with the graph's inputs (no deps, no time: placeholders) moved to the front, in their
/// order. The schedule above pulls an input in just before its first user, and a gather can be
/// issued no earlier than its shard's input: in a lowered FX graph every gather reads a
/// placeholder, so without this the search could prefetch nothing.
fn inputs_first(g: &Graph, order: Vec<u32>) -> Vec<u32> {
    let (mut front, rest): (Vec<u32>, Vec<u32>) = order.into_iter().partition(|&v| g.is_input(v));
    front.extend(rest);
    front
}
