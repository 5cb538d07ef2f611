//! A plan's order checked against its graph, and its memory recounted without timing.

use crate::error::{Error, Result};
use crate::plan::graph::{Graph, NONE};

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
