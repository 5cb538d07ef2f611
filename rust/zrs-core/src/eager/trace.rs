//! What one step's forward did ([`StepLog`]) and the [`Trace`] a recorded step becomes.
//!
//! A trace is the forward's unit activations in order (positions 0..n) with the parameters each
//! fetched. A training step runs them again in reverse in its backward, so the *combined
//! sequence* is positions 0..n-1 followed by n-1..0. The distance from a use of a parameter to
//! its next one is the numel gathered in between (the positions strictly between the two); the
//! coordinator keeps a parameter gathered when that distance is short. Distances are computed
//! once, when the trace completes, in O(entries).

use crate::registry::Slot;

use super::buckets;
use super::params::Params;
use super::UnitId;

/// One step's forward activations and the parameters each fetched (its own, then those read on
/// demand while it was the innermost activation), and its backward's gradient order.
#[derive(Debug, Clone)]
pub(super) struct StepLog {
    units: Vec<UnitId>,
    params: Vec<Vec<Slot>>,
    /// Slots in the order the backward completed their gradients, each once.
    grad_order: Vec<Slot>,
    /// Per unit: the position of its last activation in this step.
    last: Vec<Option<usize>>,
}

impl StepLog {
    pub(super) fn new(n_units: usize) -> Self {
        Self {
            units: Vec::new(),
            params: Vec::new(),
            grad_order: Vec::new(),
            last: vec![None; n_units],
        }
    }

    pub(super) fn clear(&mut self) {
        self.units.clear();
        self.params.clear();
        self.grad_order.clear();
        self.last.fill(None);
    }

    /// The position the next activation takes: the activations so far.
    pub(super) fn len(&self) -> usize {
        self.units.len()
    }

    pub(super) fn grad_order(&self) -> &[Slot] {
        &self.grad_order
    }

    /// Appends an activation of `unit` that fetched `own`; returns its position.
    pub(super) fn push(&mut self, unit: UnitId, own: &[Slot]) -> usize {
        let position = self.units.len();
        self.units.push(unit);
        self.params.push(own.to_vec());
        self.last[unit] = Some(position);
        position
    }

    /// Records an on-demand fetch by the activation at `position`.
    pub(super) fn add(&mut self, position: usize, slot: Slot) {
        self.params[position].push(slot);
    }

    pub(super) fn complete_grad(&mut self, slot: Slot) {
        self.grad_order.push(slot);
    }

    /// What the last activation of `unit` in this step fetched; `None` if it did not run.
    pub(super) fn last_params(&self, unit: UnitId) -> Option<&[Slot]> {
        self.last[unit].map(|p| self.params[p].as_slice())
    }

    /// How many times `unit` ran in this step's forward.
    pub(super) fn activations(&self, unit: UnitId) -> usize {
        self.units.iter().filter(|&&u| u == unit).count()
    }

    /// What any activation of `unit` fetched in this step, each once.
    pub(super) fn unit_params(&self, unit: UnitId) -> Vec<Slot> {
        let mut slots = Vec::new();
        for (&u, fetched) in self.units.iter().zip(&self.params) {
            for &slot in fetched.iter().filter(|_| u == unit) {
                if !slots.contains(&slot) {
                    slots.push(slot);
                }
            }
        }
        slots
    }

    /// The units whose activations fetched `slot` in this step (a unit once per activation).
    pub(super) fn users(&self, slot: Slot) -> impl Iterator<Item = UnitId> + '_ {
        let fetched = self.params.iter().map(move |p| p.contains(&slot));
        self.units
            .iter()
            .zip(fetched)
            .filter(|(_, f)| *f)
            .map(|(&u, _)| u)
    }
}

/// A recorded forward, with what prefetching and reuse read from it.
#[derive(Debug, Clone)]
pub(super) struct Trace {
    units: Vec<UnitId>,
    /// Position p fetched `slots[offsets[p]..offsets[p + 1]]`.
    offsets: Vec<usize>,
    slots: Vec<Slot>,
    /// `prefix[p]`: the numel the positions before p fetch (n + 1 entries).
    prefix: Vec<u64>,
    /// Per entry of `slots`: the distance to the parameter's next use in the forward; `None`
    /// at its last.
    next_forward: Vec<Option<u64>>,
    /// Per unit: its positions, ascending.
    positions: Vec<Vec<usize>>,
    /// Per slot: its gradient bucket's size; `None` until a backward under this trace completed
    /// gradients (a trace recorded by a forward without backward has no plan yet).
    grad_plan: Option<Vec<Option<u64>>>,
}

impl Trace {
    /// The trace `log` records, with its gradient buckets planned from the log's gradient order
    /// (when its backward completed any).
    pub(super) fn new(log: &StepLog, params: &Params, n_units: usize, bucket_numel: u64) -> Self {
        let n = log.units.len();
        let mut offsets = Vec::with_capacity(n + 1);
        let mut prefix = Vec::with_capacity(n + 1);
        let mut slots = Vec::new();
        let mut positions = vec![Vec::new(); n_units];
        let mut total = 0u64;
        for (p, (&unit, fetched)) in log.units.iter().zip(&log.params).enumerate() {
            offsets.push(slots.len());
            prefix.push(total);
            positions[unit].push(p);
            slots.extend_from_slice(fetched);
            let numel = fetched.iter().map(|&s| params.spec(s).numel);
            total = numel.fold(total, u64::saturating_add);
        }
        offsets.push(slots.len());
        prefix.push(total);

        // Walk back, remembering where each slot is used next.
        let mut next_pos: Vec<Option<usize>> = vec![None; slots.iter().max().map_or(0, |&s| s + 1)];
        let mut next_forward = vec![None; slots.len()];
        for p in (0..n).rev() {
            for e in offsets[p]..offsets[p + 1] {
                let slot = slots[e];
                next_forward[e] = next_pos[slot].map(|q| prefix[q] - prefix[p + 1]);
                next_pos[slot] = Some(p);
            }
        }
        let mut trace = Self {
            units: log.units.clone(),
            offsets,
            slots,
            prefix,
            next_forward,
            positions,
            grad_plan: None,
        };
        trace.plan_grads(log.grad_order(), params, bucket_numel);
        trace
    }

    pub(super) fn units(&self) -> &[UnitId] {
        &self.units
    }

    pub(super) fn len(&self) -> usize {
        self.units.len()
    }

    /// The parameters position `p` fetched.
    pub(super) fn params(&self, p: usize) -> &[Slot] {
        &self.slots[self.offsets[p]..self.offsets[p + 1]]
    }

    /// Every (position, slot) entry, in order.
    pub(super) fn entries(&self) -> Vec<(usize, Slot)> {
        (0..self.len())
            .flat_map(|p| self.params(p).iter().map(move |&s| (p, s)))
            .collect()
    }

    /// The distance from the use of `slot` at position `p` to its next use: in the forward, or
    /// for a `training` step in the backward's mirror of the forward (where a parameter's last
    /// forward use at p comes back after the positions p+1.. have run twice: once forward, once
    /// backward). `None`: no next use in this step (or `slot` is not fetched at `p`).
    pub(super) fn next_use(&self, p: usize, slot: Slot, training: bool) -> Option<u64> {
        if p >= self.len() {
            return None;
        }
        let e = (self.offsets[p]..self.offsets[p + 1]).find(|&e| self.slots[e] == slot)?;
        match self.next_forward[e] {
            Some(d) => Some(d),
            None if training => {
                Some((self.prefix[self.len()] - self.prefix[p + 1]).saturating_mul(2))
            }
            None => None,
        }
    }

    /// Where the backward of `unit` is in the trace: its last position before `cursor` (the
    /// position the previous backward hook found), else its last anywhere.
    pub(super) fn position_before(&self, unit: UnitId, cursor: usize) -> Option<usize> {
        let positions = self.positions.get(unit)?;
        match positions.partition_point(|&q| q < cursor) {
            0 => positions.last().copied(),
            i => Some(positions[i - 1]),
        }
    }

    pub(super) fn has_grad_plan(&self) -> bool {
        self.grad_plan.is_some()
    }

    /// Plans the gradient buckets from the order a backward completed the gradients; an empty
    /// order (no backward) plans nothing.
    pub(super) fn plan_grads(&mut self, order: &[Slot], params: &Params, bucket_numel: u64) {
        if order.is_empty() {
            return;
        }
        let shards: Vec<u64> = order.iter().map(|&s| params.spec(s).shard_numel).collect();
        let mut plan = vec![None; order.iter().max().map_or(0, |&s| s + 1)];
        for (&slot, bucket) in order.iter().zip(buckets::plan(&shards, bucket_numel)) {
            plan[slot] = Some(bucket);
        }
        self.grad_plan = Some(plan);
    }

    /// The planned bucket size of `slot`'s gradient.
    pub(super) fn bucket(&self, slot: Slot) -> Option<u64> {
        self.grad_plan.as_ref()?.get(slot).copied().flatten()
    }
}
