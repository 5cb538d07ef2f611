//! The [`Coordinator`]: its state, its accessors and the boundaries of a step (its end and a
//! reset). The hook calls are in `forward` and `backward`.
//!
//! A step runs `begin_forward`, the units' forward hooks, `end_forward`, and for a training step
//! the backward hooks and `end_backward`. Its end releases every non-persistent parameter and
//! moves the trace mode on: a recording becomes the trace, a step that departed from the trace
//! makes the next step record afresh.

use crate::error::{Error, Result};
use crate::registry::Slot;

use super::params::Params;
use super::trace::{StepLog, Trace};
use super::{EagerConfig, ParamSpec, ParamStatus, TraceMode, UnitId};

/// Decides, hook by hook, what Python gathers, prefetches, keeps and releases (see the module
/// documentation).
#[derive(Debug, Clone)]
pub struct Coordinator {
    pub(super) cfg: EagerConfig,
    pub(super) params: Params,
    /// Each unit's own parameters, without repeats.
    pub(super) units: Vec<Vec<Slot>>,
    pub(super) state: TraceState,
    pub(super) step: Step,
    /// Some parameter is frozen: gradients and finished backwards may release frozen ones.
    pub(super) has_frozen: bool,
}

/// The trace mode with the trace it reads.
#[derive(Debug, Clone)]
pub(super) enum TraceState {
    Record,
    Complete(Trace),
    /// The step departed from this trace; it is dropped when the step ends.
    Invalid(Trace),
}

/// Where the running step is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// No step is open.
    Idle,
    /// The root's forward is running.
    Forward,
    /// A training forward returned; its backward has not started.
    AwaitBackward,
    /// The backward is running (forwards now are activation-checkpoint recomputes).
    Backward,
}

/// One open forward of a unit.
#[derive(Debug, Clone)]
pub(super) struct Activation {
    pub(super) unit: UnitId,
    /// Its place in this step's forward; `None` for a recompute during the backward, which is
    /// not part of the forward.
    pub(super) position: Option<usize>,
    /// The parameters it holds, each once.
    pub(super) held: Vec<Slot>,
}

/// The state of the running step.
#[derive(Debug, Clone)]
pub(super) struct Step {
    pub(super) phase: Phase,
    /// A backward is expected to follow the forward.
    pub(super) training: bool,
    pub(super) log: StepLog,
    pub(super) stack: Vec<Activation>,
    /// The trace position the last backward hook found; the next one looks before it.
    pub(super) cursor: usize,
    /// Per unit: its activations whose backward finished (`post_backward` calls).
    pub(super) post_done: Vec<usize>,
}

impl Coordinator {
    /// A coordinator for `params` (by slot) and `units` (each unit's own parameters; possibly
    /// none, and a slot may belong to several units, as tied weights do). Errors on a slot that
    /// `params` does not have.
    pub fn new(cfg: EagerConfig, params: Vec<ParamSpec>, units: Vec<Vec<Slot>>) -> Result<Self> {
        let n_params = params.len();
        let units = units
            .into_iter()
            .map(|own| {
                let mut distinct: Vec<Slot> = Vec::with_capacity(own.len());
                for slot in own {
                    if slot >= n_params {
                        return Err(Error::UnknownSlot(slot));
                    }
                    if !distinct.contains(&slot) {
                        distinct.push(slot);
                    }
                }
                Ok(distinct)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            has_frozen: params.iter().any(|p| !p.requires_grad),
            params: Params::new(params, cfg.persist_numel),
            cfg,
            state: TraceState::Record,
            step: Step {
                phase: Phase::Idle,
                training: false,
                log: StepLog::new(units.len()),
                stack: Vec::new(),
                cursor: 0,
                post_done: vec![0; units.len()],
            },
            units,
        })
    }

    pub fn config(&self) -> &EagerConfig {
        &self.cfg
    }

    pub fn mode(&self) -> TraceMode {
        match self.state {
            TraceState::Record => TraceMode::Record,
            TraceState::Complete(_) => TraceMode::Complete,
            TraceState::Invalid(_) => TraceMode::Invalid,
        }
    }

    /// The trace's units in forward order; empty while recording.
    pub fn trace_units(&self) -> &[UnitId] {
        self.any_trace().map_or(&[], Trace::units)
    }

    /// The trace's (position, slot) entries in order; empty while recording.
    pub fn trace_params(&self) -> Vec<(usize, Slot)> {
        self.any_trace().map_or_else(Vec::new, Trace::entries)
    }

    /// Numel of the non-persistent parameters that are gathered or in flight.
    pub fn live_numel(&self) -> u64 {
        self.params.live()
    }

    pub fn status(&self, slot: Slot) -> Result<ParamStatus> {
        self.params.check(slot)?;
        Ok(self.params.status(slot))
    }

    /// Releases everything, persistent parameters included, because their shards changed (an
    /// optimizer step) or the step failed part-way. A partial recording is discarded (the next
    /// step records afresh); a complete trace is kept.
    pub fn reset(&mut self) -> Vec<Slot> {
        let released = self.params.release_all(true);
        self.close_step(false);
        released
    }

    /// Ends the open step: releases every non-persistent parameter and moves the trace mode on.
    /// Returns the released slots and whether the recording became the trace.
    pub(super) fn finish_step(&mut self) -> (Vec<Slot>, bool) {
        let released = self.params.release_all(false);
        let recorded = self.close_step(true);
        (released, recorded)
    }

    /// Ends a forward that never returned (the hooks after an exception did not run): releases
    /// like [`finish_step`](Self::finish_step), but its partial recording is not a trace.
    pub(super) fn abort_step(&mut self) -> Vec<Slot> {
        let released = self.params.release_all(false);
        self.close_step(false);
        released
    }

    /// Forgets the step's holds and activations and moves the trace mode on: a recording of a
    /// `whole` step becomes the trace (true is returned), a partial one is discarded; a
    /// departed-from trace gives way to a recording; a complete trace without gradient buckets
    /// plans them from this step's backward.
    fn close_step(&mut self, whole: bool) -> bool {
        self.params.clear_step();
        self.step.stack.clear();
        self.step.post_done.fill(0);
        self.step.phase = Phase::Idle;
        let log = &self.step.log;
        let (state, recorded) = match std::mem::replace(&mut self.state, TraceState::Record) {
            TraceState::Record if whole => {
                let trace = Trace::new(log, &self.params, self.units.len(), self.bucket_numel());
                (TraceState::Complete(trace), true)
            }
            TraceState::Record | TraceState::Invalid(_) => (TraceState::Record, false),
            TraceState::Complete(mut trace) => {
                if whole && !trace.has_grad_plan() {
                    trace.plan_grads(log.grad_order(), &self.params, self.bucket_numel());
                }
                (TraceState::Complete(trace), false)
            }
        };
        self.state = state;
        self.step.log.clear();
        recorded
    }

    fn bucket_numel(&self) -> u64 {
        self.cfg.grad_bucket_numel
    }

    /// The trace that prefetching and reuse follow: only a complete one.
    pub(super) fn trace(&self) -> Option<&Trace> {
        match &self.state {
            TraceState::Complete(trace) => Some(trace),
            TraceState::Record | TraceState::Invalid(_) => None,
        }
    }

    fn any_trace(&self) -> Option<&Trace> {
        match &self.state {
            TraceState::Complete(trace) | TraceState::Invalid(trace) => Some(trace),
            TraceState::Record => None,
        }
    }
}
