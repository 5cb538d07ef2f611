//! The `search` scheduler: a budget-aware list scheduler over a simulated clock, improved by a
//! search over prefetch positions and bucket boundaries scored by the simulator.
//!
//! 1. **Base sequence.** The compute-stream program (every node but the all-gathers) in the
//!    greedy baseline's order, with reduce-scatters hoisted right after their last dependency so
//!    gradients free early. Each all-gather has a just-in-time slot (before its first user) and an
//!    earliest slot (after its deps). With every gather just in time the sequence has the least
//!    peak the planner knows; memory per slot lives in a range-add/range-max segment tree.
//! 2. **List scheduling.** Walk the sequence with the simulator's clock. Before each slot, issue
//!    the next all-gathers (FIFO in just-in-time order, as the comm stream runs them) while the
//!    segment tree says the memory from this slot up to the gather's just-in-time slot stays
//!    within the budget, optionally limited by a look-ahead horizon and by a memory-pressure rule
//!    (past half the budget, issue only when the comm stream is idle). Gathers issued at one slot
//!    form fused buckets while the comm model says they are latency-bound ([`FusePolicy`]) and
//!    the runtime can fuse them (one gathered dtype, each parameter once: `Graph::fusable`): one
//!    bucket is open per dtype at a slot, and a gather that cannot join its dtype's bucket starts
//!    the next one. The simulated buckets are the ones the runtime issues.
//!    With a FIFO comm stream, issuing a gather earlier never delays another one, so "as early as
//!    the budget allows" is the latency-hiding choice; the horizon and pressure variants trade
//!    some of it for a lower peak.
//! 3. **Search.** The variants (fusion threshold × horizon × pressure) are each simulated; the
//!    best is refined by a local search over bucket boundaries (split or merge the buckets whose
//!    waits stall the compute stream), each move scored by the simulator, within an evaluation
//!    budget that scales down with graph size.
//! 4. **Never worse.** The greedy order competes too when it fits the budget: the result is the
//!    best of all by (makespan, peak).
//!
//! Files: `base` (the base sequence, step 1), `seg_tree` (its memory per slot), `list_schedule`
//! (one variant, step 2), `candidate` (scoring and comparing plans), `refine` (the local search
//! of step 3); this file runs them (steps 3 and 4).
//!
//! [`FusePolicy`]: super::buckets::FusePolicy

mod base;
mod candidate;
mod list_schedule;
mod refine;
mod seg_tree;

#[cfg(test)]
mod tests;

pub use candidate::Candidate;
pub use list_schedule::{Variant, PREFETCH_WINDOW_GATHERS};
pub use seg_tree::SegTree;

use super::sim::Problem;
use crate::error::{Error, Result};
use base::build_base;
use candidate::{better, score};
use list_schedule::construct;
use refine::refine_buckets;

/// Variants whose charged time (the makespan and the host time of their collectives) is within
/// this fraction of the fastest makespan of the least one compete on peak memory instead.
pub const MAKESPAN_TOLERANCE: f64 = 1e-3;

/// Of those, variants within this fraction of the least peak compete on the collectives they
/// issue. Each collective costs the host a runtime call and NCCL a launch, which the simulator
/// does not model: on the HF Llama 1.1B shape's backward (2xH200) a bucketed variant lost to the
/// unbucketed one by 4 KiB of peak, and 200 gathers went out one by one on a host-bound step.
pub const PEAK_TOLERANCE: f64 = 1e-3;

/// Host time charged per collective when plans compete: the simulator models the device's
/// streams, not the host that feeds them. A weight, not a measurement: in a profiled 1b step at
/// two ranks (session 46) c10d's own call took about 26 us of each all-gather, but a host that
/// runs ahead of the device hides it. At 10 us the HF Llama 1.1B shape's forward, a host-bound
/// step, goes out in 24 collectives (106 before: their plan was 0.26 % faster on paper), while
/// the device-bound synthetic 1b and 7b graphs keep the plans they had (any weight from 5 to
/// 19 us does both).
pub const HOST_US_PER_COLLECTIVE: f64 = 10.0;

/// Search options: how many simulator runs the local search may spend.
///
/// A count, not a wall-clock limit: the search must be deterministic, because every rank plans
/// its own copy of the graph and all of them must arrive at the same order and buckets (a
/// different order on one rank would pair its collectives with other ranks' different ones).
#[derive(Clone, Copy, Debug)]
pub struct SearchOptions {
    /// Maximum simulator evaluations of the local search (besides the variants).
    pub max_evals: usize,
}

impl SearchOptions {
    /// Scaled to the graph: many evaluations for small graphs, few for huge ones, so that a
    /// 10k-node graph plans in a few milliseconds and a 100k-node one well under half a second.
    pub fn for_size(n: usize) -> Self {
        SearchOptions {
            max_evals: (100_000 / n.max(1)).clamp(2, 32),
        }
    }
}

/// The variants tried for every graph.
pub fn variants(n: usize) -> Vec<Variant> {
    let inf = f64::INFINITY;
    let v = |fuse_factor: f64, horizon_us: f64, pressure: bool, alap: bool| Variant {
        fuse_factor,
        horizon_us,
        pressure,
        alap,
    };
    // As early as the budget allows (with and without buckets); as late as the deadlines allow
    // (the same overlap for less memory, when the estimates hold); "lazy" (issue only when the
    // comm stream would otherwise idle before the next slot); the memory-pressure rule.
    let mut out = vec![
        v(2.0, inf, false, false),
        v(0.0, inf, false, false),
        v(2.0, 0.0, false, true),
        v(2.0, inf, true, false),
    ];
    if n <= 5_000 {
        out.extend([
            v(8.0, inf, false, false),
            v(0.5, inf, false, false),
            v(32.0, inf, false, false),
            v(2.0, 0.0, false, false),
            v(0.0, 0.0, false, true),
            v(2.0, 200.0, false, true),
        ]);
    }
    out
}

/// Among variants within MAKESPAN_TOLERANCE of the least charged time (the makespan less the
/// host time the buckets spare, `Candidate::charged_us`) and PEAK_TOLERANCE of their least
/// peak, the one issuing the fewest collectives (then the least peak, then the fastest).
fn pick_among_fast(pool: &[Candidate]) -> Option<Candidate> {
    let fastest = pool
        .iter()
        .map(|c| c.sim.makespan_us)
        .fold(f64::INFINITY, f64::min);
    let cheapest = pool
        .iter()
        .map(Candidate::charged_us)
        .fold(f64::INFINITY, f64::min);
    let fast: Vec<&Candidate> = pool
        .iter()
        .filter(|c| c.charged_us() <= cheapest + fastest * MAKESPAN_TOLERANCE + 1e-3)
        .collect();
    let least = fast.iter().map(|c| c.sim.peak_bytes).min()?;
    let limit = least as f64 * (1.0 + PEAK_TOLERANCE);
    fast.into_iter()
        .filter(|c| c.sim.peak_bytes as f64 <= limit)
        .min_by(|a, b| {
            b.collectives_saved()
                .cmp(&a.collectives_saved())
                .then(a.sim.peak_bytes.cmp(&b.sim.peak_bytes))
                .then(a.sim.makespan_us.total_cmp(&b.sim.makespan_us))
        })
        .cloned()
}

/// Outcome of the search, with what it tried.
#[derive(Clone, Debug)]
pub struct SearchResult {
    pub best: Candidate,
    /// Peak of the just-in-time base sequence (the least peak the planner knows for it).
    pub base_peak: u64,
    pub evals: usize,
}

/// Run the search within `budget`; `greedy` is the baseline order (and its simulation).
pub fn search(
    p: &Problem,
    budget: u64,
    greedy: &Candidate,
    opts: &SearchOptions,
) -> Result<SearchResult> {
    let base = build_base(p, &greedy.order);

    let base_peak = base.peak.max(0) as u64;
    let minimal = base_peak.min(greedy.sim.peak_bytes);
    if budget < minimal {
        return Err(Error::BudgetInfeasible {
            budget,
            minimal,
            base: 0,
        });
    }
    let greedy_fits = greedy.sim.peak_bytes <= budget;
    let mut evals = 0usize;
    let mut pool: Vec<Candidate> = Vec::new();
    if base_peak <= budget {
        let b = budget.min(i64::MAX as u64) as i64;
        let vs = variants(p.len());
        let run = |v: &Variant| -> Result<Candidate> {
            let (order, groups) = construct(p, &base, b, v);
            score(p, order, groups, v.label())
        };
        // The variants are independent: run them on the cores there are.
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
        let cands: Vec<Result<Candidate>> = if threads > 1 && p.len() >= 2_000 {
            let chunk = vs.len().div_ceil(threads.min(vs.len()));
            std::thread::scope(|sc| {
                let handles: Vec<_> = vs
                    .chunks(chunk)
                    .map(|part| sc.spawn(move || part.iter().map(run).collect::<Vec<_>>()))
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().expect("planner variant thread panicked"))
                    .collect()
            })
        } else {
            vs.iter().map(run).collect()
        };
        for cand in cands {
            let cand = cand?;
            evals += 1;
            // Cannot happen by construction; never return an over-budget plan.
            if cand.sim.peak_bytes <= budget {
                pool.push(cand);
            }
        }
    }
    let pick = pick_among_fast(&pool);
    let best_variant = pool
        .into_iter()
        .reduce(|a, b| if better(&b, &a) { b } else { a });
    // Never worse than greedy: fall back to the fastest variant, then to greedy itself.
    let mut best = match (pick, best_variant) {
        (Some(pk), _) if !greedy_fits || !better(greedy, &pk) => pk,
        (_, Some(bv)) if !greedy_fits || !better(greedy, &bv) => bv,
        _ if greedy_fits => greedy.clone(),
        _ => {
            unreachable!("the greedy order or the base sequence fits a budget >= the minimal peak")
        }
    };
    evals += refine_buckets(p, &mut best, budget, opts)?;
    Ok(SearchResult {
        best,
        base_peak,
        evals,
    })
}
