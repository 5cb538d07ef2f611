//! The eager path's parameter coordinator: DeepSpeed's PartitionedParameterCoordinator as a
//! state machine that Python drives from its module hooks.
//!
//! Python holds the tensors and calls the [`Coordinator`] before a unit's forward, after it,
//! before its backward, when a parameter's gradient is complete and at the end of the backward;
//! each call answers with what Python must do (gather, wait, prefetch, release). Rust holds ids,
//! sizes, states, the trace and every decision, so the per-hook Python work is a few list
//! operations and the decisions are the same on every rank.
//!
//! A *unit* is a module that fetches parameters, named by a [`UnitId`] that Python assigns (the
//! root may own none). The first step's forward is recorded as a trace of unit activations
//! and the parameters each one fetched; later steps that follow it prefetch the units ahead
//! (forward, then the backward in reverse) and keep a parameter gathered when its next use is
//! near. A step that departs from the trace falls back to gathering on demand and the next step
//! records afresh.
//!
//! Files: `coordinator` (the state machine and its step boundaries), `forward` and `backward`
//! (its hook calls), `params` (each parameter's status and holds), `trace` (the recording and
//! the trace's next-use distances), `buckets` (gradient buckets from the recorded backward
//! order).

mod backward;
mod buckets;
mod coordinator;
mod forward;
mod params;
mod trace;

#[cfg(test)]
mod props;
#[cfg(test)]
mod shadow;
#[cfg(test)]
mod tests;

pub use coordinator::Coordinator;

use crate::error::{Error, Result};
use crate::registry::Slot;

/// A unit's id: a module that fetches parameters, 0..m, assigned by Python.
pub type UnitId = usize;

/// The coordinator's limits, in elements of gathered parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EagerConfig {
    /// Elements a forward or backward hook may start prefetching at once.
    pub prefetch_numel: u64,
    /// Gathered elements (persistent ones aside) beyond which nothing is prefetched or kept for
    /// reuse; the parameters a unit needs now are gathered regardless.
    pub max_live_numel: u64,
    /// A parameter whose next use is at most this many gathered elements away stays gathered.
    pub max_reuse_distance: u64,
    /// Parameters of fewer elements are gathered once and kept until [`Coordinator::reset`].
    pub persist_numel: u64,
    /// Per-rank elements of a gradient bucket (a reduce-scatter).
    pub grad_bucket_numel: u64,
}

impl EagerConfig {
    /// The limits given, with defaults from the largest unit's numel (`unit_numels`, one per
    /// unit): `prefetch` defaults to the largest unit, so one unit ahead always fits;
    /// `max_live` to 3 × the largest unit (the unit running, the one prefetched and the ones
    /// kept for reuse); `max_reuse` to the largest unit (a parameter is kept when at most about
    /// one unit runs before its next use); `persist` to 0 (nothing persists).
    pub fn resolve(
        prefetch: Option<u64>,
        max_live: Option<u64>,
        max_reuse: Option<u64>,
        persist: Option<u64>,
        grad_bucket_numel: u64,
        unit_numels: &[u64],
    ) -> Self {
        let largest = unit_numels.iter().copied().max().unwrap_or(0);
        Self {
            prefetch_numel: prefetch.unwrap_or(largest),
            max_live_numel: max_live.unwrap_or(largest.saturating_mul(3)),
            max_reuse_distance: max_reuse.unwrap_or(largest),
            persist_numel: persist.unwrap_or(0),
            grad_bucket_numel,
        }
    }
}

/// Each unit's gathered numel (its distinct own parameters), the input of
/// [`EagerConfig::resolve`]'s defaults. Errors on an unknown slot.
pub fn unit_numels(params: &[ParamSpec], units: &[Vec<Slot>]) -> Result<Vec<u64>> {
    units
        .iter()
        .map(|own| {
            let mut seen = Vec::with_capacity(own.len());
            let mut total = 0u64;
            for &slot in own {
                let spec = params.get(slot).ok_or(Error::UnknownSlot(slot))?;
                if !seen.contains(&slot) {
                    seen.push(slot);
                    total = total.saturating_add(spec.numel);
                }
            }
            Ok(total)
        })
        .collect()
}

/// What the coordinator knows of one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamSpec {
    /// Elements of the gathered (padded) parameter.
    pub numel: u64,
    /// Elements each rank holds.
    pub shard_numel: u64,
    pub requires_grad: bool,
}

/// Where a parameter's gathered copy is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamStatus {
    /// Only the local shard exists.
    Released,
    /// A prefetch issued its all-gather; nobody has waited for it yet.
    InFlight,
    /// The gathered copy is in place.
    Gathered,
}

impl ParamStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ParamStatus::Released => "released",
            ParamStatus::InFlight => "in_flight",
            ParamStatus::Gathered => "gathered",
        }
    }
}

/// Whether the coordinator follows a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceMode {
    /// This step's forward is being recorded: gather on demand, release after each unit.
    Record,
    /// Steps follow the recorded trace: prefetch ahead and keep what is used again soon.
    Complete,
    /// This step departed from the trace: gather on demand until it ends, then record afresh.
    Invalid,
}

impl TraceMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TraceMode::Record => "record",
            TraceMode::Complete => "complete",
            TraceMode::Invalid => "invalid",
        }
    }
}

/// Where a step's forward first departed from the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Divergence {
    /// The activation's position in the forward (pre_forward calls before it in this step).
    pub position: usize,
    /// The trace's unit at that position; `None` past the trace's end.
    pub expected: Option<UnitId>,
    pub got: UnitId,
}

/// What Python does before a unit runs. The three lists are disjoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fetch {
    /// Needed now and released: gather them now (one fused collective) and wait.
    pub issue: Vec<Slot>,
    /// Needed now and in flight from an earlier prefetch: wait for them.
    pub wait: Vec<Slot>,
    /// To start gathering now without waiting, one fused collective per group (one group per
    /// upcoming unit activation, in the order they run).
    pub prefetch: Vec<Vec<Slot>>,
    /// Set, once, when this call found the forward departing from the trace.
    pub diverged: Option<Divergence>,
}

/// What Python does with a parameter whose gradient is complete.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GradReady {
    /// Free these gathered copies: the parameter's own, and frozen parameters whose every user
    /// finished its backward with this gradient.
    pub release: Vec<Slot>,
    /// Per-rank elements of the planned bucket the gradient goes to; 0 when none is planned.
    /// Python reduce-scatters a bucket once its members fill it.
    pub bucket_numel: u64,
}

/// What Python does at the end of a backward.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndStep {
    /// Free these gathered copies (waiting first for any still in flight).
    pub release: Vec<Slot>,
    /// This step's recording became the trace: compare it across ranks.
    pub recorded: bool,
}
