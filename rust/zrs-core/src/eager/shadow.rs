//! A shadow of the coordinator for the property tests: the statuses Python would see from the
//! coordinator's answers alone, the holds that the hooks imply, and the trace mode the spec
//! predicts. Each method applies one call's answer and asserts what must hold of it.

use std::collections::HashSet;

use crate::registry::Slot;

use super::coordinator::Phase;
use super::{Coordinator, Divergence, Fetch, GradReady, ParamSpec, ParamStatus, TraceMode};
use super::{EndStep, UnitId};

pub(super) struct Shadow {
    specs: Vec<ParamSpec>,
    persistent: Vec<bool>,
    max_live: u64,
    own: Vec<Vec<Slot>>,
    status: Vec<ParamStatus>,
    /// Open activations: unit, position (None: a recompute) and held slots.
    stack: Vec<(UnitId, Option<usize>, Vec<Slot>)>,
    backward: Vec<bool>,
    grad_done: Vec<bool>,
    pub(super) phase: Phase,
    training: bool,
    mode: TraceMode,
    trace: Vec<UnitId>,
    trace_params: Vec<(usize, Slot)>,
    /// This step's forward activations and what each fetched.
    log: Vec<(UnitId, Vec<Slot>)>,
    /// Per unit: `post_backward` calls in this step, and backwards begun but not finished.
    post_done: Vec<usize>,
    open: Vec<usize>,
}

impl Shadow {
    pub(super) fn new(c: &Coordinator, specs: Vec<ParamSpec>, own: Vec<Vec<Slot>>) -> Self {
        let n = specs.len();
        let own_len = own.len();
        let own = own
            .into_iter()
            .map(|o| {
                o.iter()
                    .enumerate()
                    .filter(|(i, s)| !o[..*i].contains(s))
                    .map(|(_, &s)| s)
                    .collect()
            })
            .collect();
        Self {
            persistent: specs
                .iter()
                .map(|p| p.numel < c.config().persist_numel)
                .collect(),
            max_live: c.config().max_live_numel,
            specs,
            own,
            status: vec![ParamStatus::Released; n],
            stack: Vec::new(),
            backward: vec![false; n],
            grad_done: vec![false; n],
            phase: Phase::Idle,
            training: false,
            mode: TraceMode::Record,
            trace: Vec::new(),
            trace_params: Vec::new(),
            log: Vec::new(),
            post_done: vec![0; own_len],
            open: vec![0; own_len],
        }
    }

    /// Slots that took part in this step's forward, requiring grad.
    pub(super) fn step_grads(&self) -> Vec<Slot> {
        let mut seen = Vec::new();
        for s in self.log.iter().flat_map(|(_, p)| p) {
            if self.specs[*s].requires_grad && !seen.contains(s) {
                seen.push(*s);
            }
        }
        seen
    }

    pub(super) fn step_units(&self) -> Vec<UnitId> {
        self.log.iter().map(|(u, _)| *u).collect()
    }

    fn holders(&self, slot: Slot) -> usize {
        self.stack.iter().filter(|a| a.2.contains(&slot)).count()
    }

    fn releasable(&self, slot: Slot) -> bool {
        self.status[slot] != ParamStatus::Released
            && !self.persistent[slot]
            && self.holders(slot) == 0
            && !self.backward[slot]
    }

    /// Applies a release list: each a real transition of a parameter nobody holds.
    fn released(&mut self, slots: &[Slot], with_persistent: bool) {
        let distinct: HashSet<&Slot> = slots.iter().collect();
        assert_eq!(
            distinct.len(),
            slots.len(),
            "a slot released twice: {slots:?}"
        );
        for &s in slots {
            assert_ne!(
                self.status[s],
                ParamStatus::Released,
                "slot {s} released twice"
            );
            assert!(
                with_persistent || !self.persistent[s],
                "persistent slot {s} released"
            );
            assert_eq!(self.holders(s), 0, "slot {s} released while held");
            assert!(
                !self.backward[s],
                "slot {s} released while the backward holds it"
            );
            self.status[s] = ParamStatus::Released;
        }
    }

    /// Checks a fetch of `required` and applies it.
    fn fetched(&mut self, f: &Fetch, required: &[Slot]) {
        let all: Vec<Slot> = f
            .issue
            .iter()
            .chain(&f.wait)
            .chain(f.prefetch.iter().flatten())
            .copied()
            .collect();
        assert_eq!(
            all.iter().collect::<HashSet<_>>().len(),
            all.len(),
            "lists overlap: {f:?}"
        );
        for &s in required {
            match self.status[s] {
                ParamStatus::Released => assert!(f.issue.contains(&s), "{s} not issued: {f:?}"),
                ParamStatus::InFlight => assert!(f.wait.contains(&s), "{s} not waited: {f:?}"),
                ParamStatus::Gathered => {}
            }
        }
        for &s in f.issue.iter().chain(&f.wait) {
            assert!(required.contains(&s), "{s} fetched but not required: {f:?}");
            self.status[s] = ParamStatus::Gathered;
        }
        for &s in f.prefetch.iter().flatten() {
            assert_eq!(
                self.status[s],
                ParamStatus::Released,
                "prefetch of {s}: {f:?}"
            );
            assert!(
                !self.grad_done[s],
                "prefetch of {s}, whose gradient is complete"
            );
            self.status[s] = ParamStatus::InFlight;
        }
        assert!(f.prefetch.iter().all(|g| !g.is_empty()));
        if self.mode != TraceMode::Complete || self.phase == Phase::Idle {
            assert!(f.prefetch.is_empty(), "prefetch without a trace: {f:?}");
        }
        assert!(required
            .iter()
            .all(|&s| self.status[s] == ParamStatus::Gathered));
    }

    /// Ends the step (`whole`: its forward returned) or resets: the exact releases and the mode.
    fn close(&mut self, released: &[Slot], whole: bool, with_persistent: bool) -> bool {
        let expected: Vec<Slot> = (0..self.specs.len())
            .filter(|&s| {
                self.status[s] != ParamStatus::Released && (with_persistent || !self.persistent[s])
            })
            .collect();
        self.stack.clear();
        self.backward.fill(false);
        self.grad_done.fill(false);
        self.post_done.fill(0);
        self.open.fill(0);
        assert_eq!(released, expected);
        self.released(released, with_persistent);
        let recorded = whole && self.mode == TraceMode::Record;
        self.mode = match self.mode {
            TraceMode::Record if whole => {
                self.trace = self.step_units();
                self.trace_params = (self.log.iter().enumerate())
                    .flat_map(|(p, (_, slots))| slots.iter().map(move |&s| (p, s)))
                    .collect();
                TraceMode::Complete
            }
            TraceMode::Complete => TraceMode::Complete,
            TraceMode::Record | TraceMode::Invalid => TraceMode::Record,
        };
        self.phase = Phase::Idle;
        self.log.clear();
        recorded
    }

    pub(super) fn begin_forward(&mut self, training: bool, released: &[Slot]) {
        match self.phase {
            Phase::Backward => return assert!(released.is_empty()),
            Phase::Idle => assert!(released.is_empty()),
            Phase::Forward => _ = self.close(released, false, false),
            Phase::AwaitBackward => _ = self.close(released, true, false),
        }
        self.phase = Phase::Forward;
        self.training = training;
    }

    pub(super) fn pre_forward(&mut self, unit: UnitId, f: &Fetch) {
        let own = self.own[unit].clone();
        if self.phase == Phase::Forward {
            let position = self.log.len();
            let mut expected = None;
            if self.mode == TraceMode::Complete && self.trace.get(position) != Some(&unit) {
                let expected_unit = self.trace.get(position).copied();
                expected = Some(Divergence {
                    position,
                    expected: expected_unit,
                    got: unit,
                });
                self.mode = TraceMode::Invalid;
            }
            assert_eq!(f.diverged, expected);
            self.log.push((unit, own.clone()));
            self.stack.push((unit, Some(position), own.clone()));
        } else {
            assert_eq!((f.diverged, f.prefetch.len()), (None, 0));
            own.iter().for_each(|&s| self.backward[s] = true);
            self.stack.push((unit, None, own.clone()));
        }
        self.fetched(f, &own);
    }

    pub(super) fn fetch(&mut self, slot: Slot, f: &Fetch) {
        let backward = self.phase != Phase::Forward;
        if let Some((_, position, held)) = self.stack.last_mut() {
            if !held.contains(&slot) {
                held.push(slot);
                if let (false, Some(p)) = (backward, *position) {
                    self.log[p].1.push(slot);
                }
            }
        }
        if backward {
            self.backward[slot] = true;
        }
        assert_eq!((f.diverged, f.prefetch.len()), (None, 0));
        self.fetched(f, &[slot]);
    }

    pub(super) fn post_forward(&mut self, unit: UnitId, released: &[Slot]) {
        let i = self
            .stack
            .iter()
            .rposition(|a| a.0 == unit)
            .expect("an open activation");
        let (_, position, held) = self.stack.remove(i);
        let releasable: Vec<Slot> = held
            .iter()
            .copied()
            .filter(|&s| self.releasable(s))
            .collect();
        assert!(
            released.iter().all(|s| releasable.contains(s)),
            "{released:?} ⊄ {releasable:?}"
        );
        let reuse =
            self.phase == Phase::Forward && position.is_some() && self.mode == TraceMode::Complete;
        if !reuse {
            assert_eq!(released, releasable);
        }
        self.released(released, false);
    }

    pub(super) fn end_forward(&mut self, released: &[Slot]) {
        match (self.phase, self.training) {
            (Phase::Forward, false) => _ = self.close(released, true, false),
            (Phase::Forward, true) => {
                assert!(released.is_empty());
                self.phase = Phase::AwaitBackward;
            }
            _ => assert!(released.is_empty()),
        }
    }

    pub(super) fn pre_backward(&mut self, unit: UnitId, f: &Fetch) {
        self.phase = Phase::Backward;
        let last = self.log.iter().rev().find(|a| a.0 == unit).map(|a| &a.1);
        let required: Vec<Slot> = (last.unwrap_or(&self.own[unit]).iter())
            .copied()
            .filter(|&s| !self.grad_done[s])
            .collect();
        required.iter().for_each(|&s| self.backward[s] = true);
        assert_eq!(f.diverged, None);
        self.fetched(f, &required);
        self.open[unit] += 1;
    }

    pub(super) fn grad_ready(&mut self, slot: Slot, g: &GradReady) {
        self.phase = Phase::Backward;
        self.grad_done[slot] = true;
        self.backward[slot] = false;
        let own = self.releasable(slot);
        assert_eq!(
            g.release.first() == Some(&slot),
            own,
            "{slot}: {:?}",
            g.release
        );
        if own {
            self.released(&[slot], false);
        }
        let users: Vec<UnitId> = (self.log.iter())
            .filter(|a| a.1.contains(&slot))
            .map(|a| a.0)
            .collect();
        self.frozen_released(&users, &g.release[usize::from(own)..]);
        if self.mode != TraceMode::Complete {
            assert_eq!(g.bucket_numel, 0);
        }
    }

    pub(super) fn post_backward(&mut self, unit: UnitId, released: &[Slot]) {
        self.phase = Phase::Backward;
        self.post_done[unit] += 1;
        self.open[unit] = self.open[unit].saturating_sub(1);
        self.frozen_released(&[unit], released);
    }

    /// Every forward activation of `unit` in this step reported the end of its backward, and
    /// every trainable parameter they fetched has its gradient.
    fn finished(&self, unit: UnitId) -> bool {
        let acts = || self.log.iter().filter(|a| a.0 == unit);
        self.post_done[unit] >= acts().count()
            && acts()
                .flat_map(|a| &a.1)
                .all(|&s| !self.specs[s].requires_grad || self.grad_done[s])
    }

    /// Checks the frozen parameters an event of `units` released against the rule: of the
    /// finished ones among `units`, each frozen parameter whose every user finished loses its
    /// backward hold, and is released unless held otherwise.
    fn frozen_released(&mut self, units: &[UnitId], released: &[Slot]) {
        let mut done: Vec<Slot> = Vec::new();
        for &u in units.iter().filter(|&&u| self.finished(u)) {
            for a in self.log.iter().filter(|a| a.0 == u) {
                done.extend(a.1.iter().filter(|&&s| !self.specs[s].requires_grad));
            }
        }
        done.retain(|&s| {
            let mut users = self.log.iter().filter(|a| a.1.contains(&s)).map(|a| a.0);
            users.all(|u| self.finished(u))
        });
        done.iter().for_each(|&s| self.backward[s] = false);
        let expected: HashSet<Slot> = done.into_iter().filter(|&s| self.releasable(s)).collect();
        let got: HashSet<Slot> = released.iter().copied().collect();
        assert_eq!(got, expected, "frozen releases {released:?}");
        self.released(released, false);
    }

    pub(super) fn end_backward(&mut self, end: &EndStep) {
        if matches!(self.phase, Phase::AwaitBackward | Phase::Backward) {
            let recorded = self.close(&end.release, true, false);
            assert_eq!(end.recorded, recorded);
        } else {
            assert_eq!(end, &EndStep::default());
        }
    }

    pub(super) fn reset(&mut self, released: &[Slot]) {
        self.close(released, false, true);
    }

    /// What must hold after every call.
    pub(super) fn check(&self, c: &Coordinator) {
        // A unit whose backward runs has its last activation's frozen parameters gathered.
        for (unit, _) in self.open.iter().enumerate().filter(|(_, &n)| n > 0) {
            let last = self.log.iter().rev().find(|a| a.0 == unit).map(|a| &a.1);
            for &s in last.unwrap_or(&self.own[unit]) {
                assert!(
                    self.specs[s].requires_grad || self.status[s] != ParamStatus::Released,
                    "frozen slot {s} released while unit {unit}'s backward runs"
                );
            }
        }
        for (s, &status) in self.status.iter().enumerate() {
            assert_eq!(c.status(s).unwrap(), status, "slot {s}");
        }
        let live = |s: &usize| !self.persistent[*s] && self.status[*s] != ParamStatus::Released;
        let numel = |s: usize| self.specs[s].numel;
        let n = self.specs.len();
        assert_eq!(c.live_numel(), (0..n).filter(live).map(numel).sum::<u64>());
        let unheld: u64 = (0..n)
            .filter(live)
            .filter(|&s| self.releasable(s))
            .map(numel)
            .sum();
        assert!(
            unheld <= self.max_live,
            "{unheld} unheld live > {}",
            self.max_live
        );
        assert_eq!(c.mode(), self.mode);
        if self.mode == TraceMode::Complete {
            assert_eq!(c.trace_units(), self.trace);
            assert_eq!(c.trace_params(), self.trace_params);
        }
    }
}
