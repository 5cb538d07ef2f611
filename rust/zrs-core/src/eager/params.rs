//! The coordinator's table of parameters: each one's status, who holds it, whether its gradient
//! is complete, and the live numel that bounds prefetching and reuse.
//!
//! Every status change goes through this table so that `live` stays exact (each decision reads
//! it in O(1)) and every release is a real transition: a parameter is released only when it is
//! gathered or in flight, so Python never frees a buffer twice.

use crate::error::{Error, Result};
use crate::registry::Slot;

use super::{EagerConfig, Fetch, ParamSpec, ParamStatus};

#[derive(Debug, Clone)]
pub(super) struct Params {
    specs: Vec<ParamSpec>,
    /// Gathered once and kept until a reset; not counted in `live`.
    persistent: Vec<bool>,
    status: Vec<ParamStatus>,
    /// Open forward activations holding each parameter (an activation holds it once).
    holders: Vec<u32>,
    /// Gathered for the running backward, until its gradient is complete.
    backward: Vec<bool>,
    /// Gradients complete in the running backward.
    grad_done: Vec<bool>,
    /// Numel of the non-persistent parameters that are not released.
    live: u64,
}

impl Params {
    pub(super) fn new(specs: Vec<ParamSpec>, persist_numel: u64) -> Self {
        let n = specs.len();
        Self {
            persistent: specs.iter().map(|p| p.numel < persist_numel).collect(),
            specs,
            status: vec![ParamStatus::Released; n],
            holders: vec![0; n],
            backward: vec![false; n],
            grad_done: vec![false; n],
            live: 0,
        }
    }

    pub(super) fn check(&self, slot: Slot) -> Result<()> {
        if slot < self.specs.len() {
            Ok(())
        } else {
            Err(Error::UnknownSlot(slot))
        }
    }

    pub(super) fn spec(&self, slot: Slot) -> &ParamSpec {
        &self.specs[slot]
    }

    pub(super) fn status(&self, slot: Slot) -> ParamStatus {
        self.status[slot]
    }

    pub(super) fn live(&self) -> u64 {
        self.live
    }

    /// The live numel that gathering `slot` adds: none for a persistent parameter.
    pub(super) fn live_cost(&self, slot: Slot) -> u64 {
        if self.persistent[slot] {
            0
        } else {
            self.specs[slot].numel
        }
    }

    pub(super) fn hold(&mut self, slot: Slot) {
        self.holders[slot] += 1;
    }

    pub(super) fn unhold(&mut self, slot: Slot) {
        self.holders[slot] -= 1;
    }

    pub(super) fn hold_backward(&mut self, slot: Slot) {
        self.backward[slot] = true;
    }

    pub(super) fn drop_backward(&mut self, slot: Slot) {
        self.backward[slot] = false;
    }

    pub(super) fn grad_done(&self, slot: Slot) -> bool {
        self.grad_done[slot]
    }

    /// Marks the gradient complete and drops the backward hold; true the first time in this
    /// backward.
    pub(super) fn complete_grad(&mut self, slot: Slot) -> bool {
        self.backward[slot] = false;
        !std::mem::replace(&mut self.grad_done[slot], true)
    }

    /// Nobody needs it any more: gathered or in flight, not persistent, and neither held by an
    /// open forward activation nor by the backward.
    pub(super) fn releasable(&self, slot: Slot) -> bool {
        self.status[slot] != ParamStatus::Released
            && !self.persistent[slot]
            && self.holders[slot] == 0
            && !self.backward[slot]
    }

    /// Makes `slots` usable now: released ones go to `fetch.issue`, in-flight ones (prefetched)
    /// to `fetch.wait`; all are gathered once Python has done the fetch.
    pub(super) fn gather_now(&mut self, slots: &[Slot], fetch: &mut Fetch) {
        for &slot in slots {
            match self.status[slot] {
                ParamStatus::Released => {
                    self.live += self.live_cost(slot);
                    fetch.issue.push(slot);
                }
                ParamStatus::InFlight => fetch.wait.push(slot),
                ParamStatus::Gathered => continue,
            }
            self.status[slot] = ParamStatus::Gathered;
        }
    }

    /// Frees the gathered or in-flight copy; false (nothing to do) when it is released already.
    pub(super) fn release(&mut self, slot: Slot) -> bool {
        if self.status[slot] == ParamStatus::Released {
            return false;
        }
        self.status[slot] = ParamStatus::Released;
        self.live -= self.live_cost(slot);
        true
    }

    /// Frees every gathered or in-flight copy, persistent ones only `with_persistent`.
    pub(super) fn release_all(&mut self, with_persistent: bool) -> Vec<Slot> {
        (0..self.specs.len())
            .filter(|&slot| (with_persistent || !self.persistent[slot]) && self.release(slot))
            .collect()
    }

    /// Forgets every hold and gradient mark: the step is over.
    pub(super) fn clear_step(&mut self) {
        self.holders.fill(0);
        self.backward.fill(false);
        self.grad_done.fill(false);
    }

    /// Starts gathering the parameters of the unit activations about to run, `positions` in the
    /// order they will run, one group per activation: each released parameter whose gradient is
    /// not complete, while this call's prefetch stays within `prefetch_numel` and the live numel
    /// within `max_live_numel`. It stops at the first activation that does not fit whole, so what
    /// is prefetched is always the nearest work, and a unit is gathered by one collective: the
    /// part that fits is taken only when it is the call's first group (a unit larger than the
    /// limits). Taking parts split every layer of a model whose largest unit (an embedding) is
    /// not a layer into two collectives a pass.
    pub(super) fn prefetch<'a>(
        &mut self,
        cfg: &EagerConfig,
        positions: impl Iterator<Item = &'a [Slot]>,
    ) -> Vec<Vec<Slot>> {
        let mut groups = Vec::new();
        let mut total = 0u64;
        for slots in positions {
            let mut group: Vec<Slot> = Vec::new();
            let mut wanted = 0usize;
            let (mut numel, mut live) = (total, self.live);
            for &slot in slots {
                if self.status[slot] != ParamStatus::Released
                    || self.grad_done[slot]
                    || group.contains(&slot)
                {
                    continue;
                }
                wanted += 1;
                let fits = numel.saturating_add(self.specs[slot].numel) <= cfg.prefetch_numel
                    && live.saturating_add(self.live_cost(slot)) <= cfg.max_live_numel;
                if fits && group.len() + 1 == wanted {
                    numel += self.specs[slot].numel;
                    live += self.live_cost(slot);
                    group.push(slot);
                }
            }
            let whole = group.len() == wanted;
            if !whole && !groups.is_empty() {
                return groups; // the rest of the unit waits for its own collective
            }
            for &slot in &group {
                self.status[slot] = ParamStatus::InFlight;
            }
            (total, self.live) = (numel, live);
            if !group.is_empty() {
                groups.push(group);
            }
            if !whole {
                return groups;
            }
        }
        groups
    }
}
