//! The backward hooks: a unit's backward beginning and finishing, a parameter's gradient
//! completing, and the backward ending.
//!
//! A unit's backward gathers what its last forward activation fetched and holds it until each
//! parameter's gradient is complete, which is when it is released. A frozen parameter has no
//! gradient to wait for: it is released once every activation that fetched it in this step has
//! finished its backward, that is the gradient of its inputs (`post_backward`) and of every
//! trainable parameter it fetched are complete (with LoRA, the frozen base weights of a layer go
//! as soon as the layer's backward is done, not at the end of the backward). An activation
//! whose inputs need no gradient never reports its end: what it fetched stays to the backward's
//! end. With a complete trace each unit's backward prefetches the activations before it in the
//! trace, nearest first.

use crate::error::{Error, Result};
use crate::registry::Slot;

use super::coordinator::{Coordinator, Phase, TraceState};
use super::{EndStep, Fetch, GradReady, UnitId};

impl Coordinator {
    /// A unit's backward starts: gather what its last activation in this step's forward fetched
    /// (its own parameters if it did not run), except parameters whose gradient is complete,
    /// and with a complete trace prefetch the positions before the unit's. Errors when no
    /// training forward ran.
    pub fn pre_backward(&mut self, unit: UnitId) -> Result<Fetch> {
        let own = self.units.get(unit).ok_or(Error::UnknownUnit(unit))?;
        if matches!(self.step.phase, Phase::Idle | Phase::Forward) {
            return Err(Error::BackwardOutsideStep(unit));
        }
        self.step.phase = Phase::Backward;
        let required: Vec<Slot> = self
            .step
            .log
            .last_params(unit)
            .unwrap_or(own)
            .iter()
            .copied()
            .filter(|&s| !self.params.grad_done(s))
            .collect();
        for &slot in &required {
            self.params.hold_backward(slot);
        }
        let mut fetch = Fetch::default();
        self.params.gather_now(&required, &mut fetch);
        if let TraceState::Complete(trace) = &self.state {
            if let Some(q) = trace.position_before(unit, self.step.cursor) {
                let before = (0..q).rev().map(|p| trace.params(p));
                fetch.prefetch = self.params.prefetch(&self.cfg, before);
                self.step.cursor = q;
            }
        }
        Ok(fetch)
    }

    /// `slot`'s gradient for this backward is complete (every use in it is done): drop its
    /// backward hold and release it unless it is persistent or a recompute's open activation
    /// still holds it, with any frozen parameter whose last user this finished. Says which
    /// planned bucket the gradient goes to (none while recording or after the step departed
    /// from the trace). Errors outside a backward and for a parameter built as frozen.
    pub fn grad_ready(&mut self, slot: Slot) -> Result<GradReady> {
        self.params.check(slot)?;
        if matches!(self.step.phase, Phase::Idle | Phase::Forward) {
            return Err(Error::GradOutsideBackward(slot));
        }
        if !self.params.spec(slot).requires_grad {
            return Err(Error::GradOfFrozen(slot));
        }
        self.step.phase = Phase::Backward;
        if self.params.complete_grad(slot) {
            self.step.log.complete_grad(slot);
        }
        let mut release = Vec::new();
        if self.params.releasable(slot) && self.params.release(slot) {
            release.push(slot);
        }
        if self.has_frozen {
            let users: Vec<UnitId> = self.step.log.users(slot).collect();
            release.extend(self.release_frozen_of(&users));
        }
        let bucket_numel = self.trace().and_then(|t| t.bucket(slot)).unwrap_or(0);
        Ok(GradReady {
            release,
            bucket_numel,
        })
    }

    /// An activation of `unit` finished its backward: the gradient of its inputs is complete.
    /// Returns the frozen parameters that are no longer needed (see the module documentation).
    /// Errors outside a training step's backward.
    pub fn post_backward(&mut self, unit: UnitId) -> Result<Vec<Slot>> {
        if unit >= self.units.len() {
            return Err(Error::UnknownUnit(unit));
        }
        if matches!(self.step.phase, Phase::Idle | Phase::Forward) {
            return Err(Error::BackwardOutsideStep(unit));
        }
        self.step.phase = Phase::Backward;
        self.step.post_done[unit] += 1;
        Ok(self.release_frozen_of(&[unit]))
    }

    /// Every activation of `unit` in this step finished its backward.
    fn finished(&self, unit: UnitId) -> bool {
        let log = &self.step.log;
        self.step.post_done[unit] >= log.activations(unit)
            && (log.unit_params(unit).iter())
                .all(|&s| !self.params.spec(s).requires_grad || self.params.grad_done(s))
    }

    /// Releases the frozen parameters of the finished `units` whose users all finished.
    fn release_frozen_of(&mut self, units: &[UnitId]) -> Vec<Slot> {
        let mut released = Vec::new();
        for &unit in units {
            if !self.finished(unit) {
                continue;
            }
            for slot in self.step.log.unit_params(unit) {
                if self.params.spec(slot).requires_grad
                    || !self.step.log.users(slot).all(|u| self.finished(u))
                {
                    continue;
                }
                self.params.drop_backward(slot);
                if self.params.releasable(slot) && self.params.release(slot) {
                    released.push(slot);
                }
            }
        }
        released
    }

    /// The backward ended: release every non-persistent parameter and end the step; `recorded`
    /// when the recording became the trace (Python then compares it across ranks). Outside a
    /// training step's backward it does nothing.
    pub fn end_backward(&mut self) -> EndStep {
        match self.step.phase {
            Phase::AwaitBackward | Phase::Backward => {
                let (release, recorded) = self.finish_step();
                EndStep { release, recorded }
            }
            Phase::Idle | Phase::Forward => EndStep::default(),
        }
    }
}
