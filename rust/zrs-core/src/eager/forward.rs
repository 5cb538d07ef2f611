//! The forward hooks: the root's forward beginning and ending, a unit's forward beginning and
//! ending, and a parameter read on demand.
//!
//! A unit's parameters are held while its forward runs and released after it, unless the trace
//! says they are used again soon (within `max_reuse_distance`) and the live numel allows. With a
//! complete trace each unit's forward also prefetches the activations after it.
//!
//! During a backward a forward is an activation-checkpoint recompute: its parameters are held
//! for the backward that follows at once, and nothing is recorded, validated or prefetched.

use std::cmp::Reverse;

use crate::error::{Error, Result};
use crate::registry::Slot;

use super::coordinator::{Activation, Coordinator, Phase, TraceState};
use super::{Divergence, Fetch, UnitId};

impl Coordinator {
    /// The root's forward starts; `training`: a backward will follow. A previous step still
    /// open (a training forward whose backward never came) is ended as `end_backward` would;
    /// a forward that never returned is ended without making its recording the trace. Returns
    /// the slots that released. During a backward (a recompute) it does nothing.
    pub fn begin_forward(&mut self, training: bool) -> Vec<Slot> {
        let released = match self.step.phase {
            Phase::Backward => return Vec::new(),
            Phase::Idle => Vec::new(),
            Phase::Forward => self.abort_step(),
            Phase::AwaitBackward => self.finish_step().0,
        };
        self.step.phase = Phase::Forward;
        self.step.training = training;
        self.step.cursor = self.trace().map_or(0, |t| t.len());
        released
    }

    /// A unit's forward starts: gather its own parameters, prefetch what the trace says comes
    /// next, and check that the forward still follows the trace (a departure is reported once,
    /// in [`Fetch::diverged`]). After the forward returned (before or during its backward) this
    /// is a recompute.
    pub fn pre_forward(&mut self, unit: UnitId) -> Result<Fetch> {
        if unit >= self.units.len() {
            return Err(Error::UnknownUnit(unit));
        }
        match self.step.phase {
            Phase::Idle => Err(Error::ForwardOutsideStep(unit)),
            Phase::Forward => Ok(self.forward_activation(unit)),
            Phase::AwaitBackward | Phase::Backward => Ok(self.recompute_activation(unit)),
        }
    }

    fn forward_activation(&mut self, unit: UnitId) -> Fetch {
        let position = self.step.log.len();
        let mut fetch = Fetch {
            diverged: self.follow_trace(position, unit),
            ..Fetch::default()
        };
        let own = &self.units[unit];
        for &slot in own {
            self.params.hold(slot);
        }
        self.params.gather_now(own, &mut fetch);
        self.step.log.push(unit, own);
        self.step.stack.push(Activation {
            unit,
            position: Some(position),
            held: own.clone(),
        });
        if let TraceState::Complete(trace) = &self.state {
            let ahead = (position + 1..trace.len()).map(|p| trace.params(p));
            fetch.prefetch = self.params.prefetch(&self.cfg, ahead);
        }
        fetch
    }

    /// Checks the activation at `position` against a complete trace; on the first departure the
    /// trace is invalid for the rest of the step.
    fn follow_trace(&mut self, position: usize, unit: UnitId) -> Option<Divergence> {
        let trace = self.trace()?;
        let expected = trace.units().get(position).copied();
        if expected == Some(unit) {
            return None;
        }
        if let TraceState::Complete(trace) = std::mem::replace(&mut self.state, TraceState::Record)
        {
            self.state = TraceState::Invalid(trace);
        }
        Some(Divergence {
            position,
            expected,
            got: unit,
        })
    }

    fn recompute_activation(&mut self, unit: UnitId) -> Fetch {
        let own = &self.units[unit];
        for &slot in own {
            self.params.hold(slot);
            self.params.hold_backward(slot);
        }
        let mut fetch = Fetch::default();
        self.params.gather_now(own, &mut fetch);
        self.step.stack.push(Activation {
            unit,
            position: None,
            held: own.clone(),
        });
        fetch
    }

    /// A read of a parameter outside a unit that owns it (a parent reading a child's weight).
    /// In the forward the innermost open activation holds it (and the recording counts it among
    /// that activation's parameters, so its backward gathers it again and prefetching covers
    /// it); in a backward it is held for the backward. Errors outside any forward or backward.
    pub fn fetch(&mut self, slot: Slot) -> Result<Fetch> {
        self.params.check(slot)?;
        let backward = match self.step.phase {
            Phase::Idle => return Err(Error::ReadOutsideForward(slot)),
            Phase::Forward => false,
            Phase::AwaitBackward | Phase::Backward => true,
        };
        match self.step.stack.last_mut() {
            Some(act) if !act.held.contains(&slot) => {
                act.held.push(slot);
                self.params.hold(slot);
                if let (false, Some(position)) = (backward, act.position) {
                    self.step.log.add(position, slot);
                }
            }
            None if !backward => return Err(Error::ReadOutsideForward(slot)),
            Some(_) | None => {}
        }
        if backward {
            self.params.hold_backward(slot);
        }
        let mut fetch = Fetch::default();
        self.params.gather_now(&[slot], &mut fetch);
        Ok(fetch)
    }

    /// A unit's forward returned: its innermost open activation drops its holds, and what
    /// nobody holds any more is released. In a forward that follows a complete trace, a
    /// parameter whose next use (this forward, then for a training step its backward) is
    /// within `max_reuse_distance` stays gathered while the live numel is within
    /// `max_live_numel`; the farthest used are released first until it is. Returns the released
    /// slots.
    pub fn post_forward(&mut self, unit: UnitId) -> Result<Vec<Slot>> {
        let i = self
            .step
            .stack
            .iter()
            .rposition(|a| a.unit == unit)
            .ok_or(Error::UnitNotActive(unit))?;
        let act = self.step.stack.remove(i);
        for &slot in &act.held {
            self.params.unhold(slot);
        }
        let mut free: Vec<Slot> = act
            .held
            .iter()
            .copied()
            .filter(|&s| self.params.releasable(s))
            .collect();
        if let (Phase::Forward, Some(p), Some(trace)) =
            (self.step.phase, act.position, self.trace())
        {
            let (cfg, training) = (&self.cfg, self.step.training);
            let mut near: Vec<(u64, Slot)> = free
                .iter()
                .filter_map(|&s| Some((trace.next_use(p, s, training)?, s)))
                .filter(|&(d, _)| d <= cfg.max_reuse_distance)
                .collect();
            free.retain(|s| !near.iter().any(|&(_, k)| k == *s));
            let freed: u64 = free.iter().map(|&s| self.params.live_cost(s)).sum();
            let mut live = self.params.live() - freed;
            near.sort_by_key(|&(d, _)| Reverse(d)); // stable: ties in hold order, on every rank
            for (_, slot) in near {
                if live <= cfg.max_live_numel {
                    break;
                }
                live -= self.params.live_cost(slot);
                free.push(slot);
            }
        }
        for &slot in &free {
            self.params.release(slot);
        }
        Ok(free)
    }

    /// The root's forward returned. A forward without backward ends its step here: every
    /// non-persistent parameter is released. A training forward keeps what it holds for its
    /// backward. Outside a forward (a recompute's root) it does nothing.
    pub fn end_forward(&mut self) -> Vec<Slot> {
        match (self.step.phase, self.step.training) {
            (Phase::Forward, false) => self.finish_step().0,
            (Phase::Forward, true) => {
                self.step.phase = Phase::AwaitBackward;
                Vec::new()
            }
            (Phase::Idle | Phase::AwaitBackward | Phase::Backward, _) => Vec::new(),
        }
    }
}
