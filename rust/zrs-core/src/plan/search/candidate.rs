//! A scored candidate plan: an order and its fused groups with their simulation, and the order
//! candidates compete by (makespan with the host time of their collectives, then peak). Separate
//! because the variants, the local search and the greedy baseline all compete as candidates.

use super::HOST_US_PER_COLLECTIVE;
use crate::error::Result;
use crate::plan::sim::{simulate_unchecked, validate, Problem, SimResult};

/// A scored candidate plan.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub order: Vec<u32>,
    pub groups: Vec<Vec<u32>>,
    pub sim: SimResult,
    pub label: String,
}

impl Candidate {
    /// The all-gathers its buckets spare: a bucket of n members is one collective, not n.
    pub fn collectives_saved(&self) -> usize {
        self.groups.iter().map(|g| g.len().saturating_sub(1)).sum()
    }

    /// The makespan less the host time its buckets spare: what plans of one graph compete by.
    pub fn charged_us(&self) -> f64 {
        self.sim.makespan_us - HOST_US_PER_COLLECTIVE * self.collectives_saved() as f64
    }
}

pub(super) fn better(a: &Candidate, b: &Candidate) -> bool {
    // Within a nanosecond counts as equal; then the lower peak wins.
    let (ta, tb) = (a.charged_us(), b.charged_us());
    if (ta - tb).abs() > 1e-3 {
        ta < tb
    } else {
        a.sim.peak_bytes < b.sim.peak_bytes
    }
}

pub(super) fn score(
    p: &Problem,
    order: Vec<u32>,
    groups: Vec<Vec<u32>>,
    label: String,
) -> Result<Candidate> {
    let (group_of, _) = validate(p.g, &order, &groups)?;
    let sim = simulate_unchecked(p, &order, &groups, &group_of, false);
    Ok(Candidate {
        order,
        groups,
        sim,
        label,
    })
}
