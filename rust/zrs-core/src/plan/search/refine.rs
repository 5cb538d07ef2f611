//! The local search over bucket boundaries (step 3 of the search, after the variants): split the
//! bucket whose wait stalls the compute stream, or pull it into the previous one, each move scored
//! by the simulator. Separate from the search loop, which picks the candidate this refines.

use super::candidate::{better, score, Candidate};
use super::SearchOptions;
use crate::error::Result;
use crate::plan::graph::{NodeKind, NONE};
use crate::plan::sim::{recount_peak, validate, Problem};

/// A local move: a new order, new groups and what was done.
type Move = (Vec<u32>, Vec<Vec<u32>>, &'static str);

/// Local search over bucket boundaries: for the buckets (and lone gathers) whose waits stall the
/// compute stream the most, try splitting the bucket in two, and pulling the next all-gather of
/// the comm stream forward into it (an earlier prefetch of that gather, fused). Each move is
/// scored by the simulator and kept if it is faster within the budget, counting the host time
/// of the collectives it adds or spares (`better`).
pub(super) fn refine_buckets(
    p: &Problem,
    best: &mut Candidate,
    budget: u64,
    opts: &SearchOptions,
) -> Result<usize> {
    let g = p.g;
    let mut evals = 0usize;
    let mut improved = true;
    let out_of_time = |evals: usize| evals >= opts.max_evals;
    while improved && !out_of_time(evals) {
        improved = false;
        let n = g.len();
        let mut group_of = vec![NONE; n];
        for (gi, grp) in best.groups.iter().enumerate() {
            for &m in grp {
                group_of[m as usize] = gi as u32;
            }
        }
        // Stall before each all-gather's wait.
        let sim = &best.sim;
        let mut stalls: Vec<(f64, u32)> = Vec::new();
        for v in 0..n as u32 {
            if !g.is_gather(v) {
                continue;
            }
            let mut stall = 0.0f64;
            for &u in g.users(v) {
                if g.kind(u) == NodeKind::Wait {
                    stall = stall.max(sim.end_us[v as usize] - sim.start_us[u as usize]);
                }
            }
            if stall > 1e-6 {
                stalls.push((stall, v));
            }
        }
        stalls.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut pos = vec![0usize; n];
        for (k, &v) in best.order.iter().enumerate() {
            pos[v as usize] = k;
        }
        for &(_, v) in stalls.iter().take(4) {
            if out_of_time(evals) {
                break;
            }
            let gi = group_of[v as usize];
            let members: Vec<u32> = if gi == NONE {
                vec![v]
            } else {
                best.groups[gi as usize].clone()
            };
            let mut moves: Vec<Move> = Vec::new();
            // Split.
            if members.len() >= 2 {
                let mid = members.len() / 2;
                let mut groups = best.groups.clone();
                groups.swap_remove(gi as usize);
                for part in [&members[..mid], &members[mid..]] {
                    if part.len() >= 2 {
                        groups.push(part.to_vec());
                    }
                }
                moves.push((best.order.clone(), groups, "split"));
            }
            // Pull the preceding comm-stream gather's bucket together with this one: issue this
            // bucket at the previous bucket's slot (an earlier prefetch), fused.
            let first = members.iter().map(|&m| pos[m as usize]).min().unwrap();
            if let Some(prev_pos) = (0..first).rev().find(|&k| g.is_gather(best.order[k])) {
                let prev = best.order[prev_pos];
                let pg = group_of[prev as usize];
                let prev_members: Vec<u32> = if pg == NONE {
                    vec![prev]
                } else {
                    best.groups[pg as usize].clone()
                };
                let last_prev = prev_members.iter().map(|&m| pos[m as usize]).max().unwrap();
                let mut order: Vec<u32> = Vec::with_capacity(n);
                let set: std::collections::HashSet<u32> = members.iter().copied().collect();
                for (k, &x) in best.order.iter().enumerate() {
                    if set.contains(&x) {
                        continue;
                    }
                    order.push(x);
                    if k == last_prev {
                        order.extend(members.iter().copied());
                    }
                }
                let mut groups: Vec<Vec<u32>> = best
                    .groups
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i as u32 != gi && i as u32 != pg)
                    .map(|(_, grp)| grp.clone())
                    .collect();
                let mut merged = prev_members.clone();
                merged.extend(members.iter().copied());
                groups.push(merged);
                moves.push((order, groups, "pull"));
            }
            for (order, groups, what) in moves {
                if out_of_time(evals) {
                    break;
                }
                evals += 1;
                if validate(g, &order, &groups).is_err()
                    || recount_peak(g, &order, &groups) > budget
                {
                    continue;
                }
                let cand = score(p, order, groups, format!("{} +{what}", best.label))?;
                // A move no faster on the device (it spares a collective's host time) must
                // not raise the peak.
                let faster = cand.sim.makespan_us < best.sim.makespan_us - 1e-3;
                if better(&cand, best)
                    && cand.sim.peak_bytes <= budget
                    && (faster || cand.sim.peak_bytes <= best.sim.peak_bytes)
                {
                    *best = cand;
                    improved = true;
                    break;
                }
            }
            if improved {
                break;
            }
        }
    }
    Ok(evals)
}
