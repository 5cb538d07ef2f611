//! A scored candidate plan: an order and its fused groups with their simulation, and the order
//! candidates compete by (makespan, then peak). Separate because the variants, the local search and
//! the greedy baseline all compete as candidates.

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
}

pub(super) fn better(a: &SimResult, b: &SimResult) -> bool {
    // Makespans within a nanosecond count as equal; then the lower peak wins.
    if (a.makespan_us - b.makespan_us).abs() > 1e-3 {
        a.makespan_us < b.makespan_us
    } else {
        a.peak_bytes < b.peak_bytes
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
