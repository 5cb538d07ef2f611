//! DeepCompile's *task* for a candidate all-gather (what emitting everything up to its release
//! needs: gathers, bytes, compute) and the two keys the picks compare tasks by. Separate from the
//! walk's state: a task is evaluated, nothing is scheduled.

use super::state::State;

#[derive(Clone, Copy, PartialEq, PartialOrd)]
pub(super) struct Task {
    /// Bytes of all-gathers other than the candidate on the way to its release.
    pub(super) free_acc_mem: u64,
    pub(super) n_ags: usize,
    pub(super) ag_acc_mem: u64,
    pub(super) free_cost: f64,
    pub(super) id: u32,
}

impl<'a> State<'a> {
    /// DeepCompile's task for candidate `y`: returns it and fills `until_ag` / `until_free`.
    pub(super) fn task(
        &mut self,
        y: u32,
        until_ag: &mut Vec<u32>,
        until_free: &mut Vec<u32>,
    ) -> (Task, usize) {
        until_ag.clear();
        until_free.clear();
        self.new_epoch();
        self.requirements(y, until_ag);
        let t = self.target[y as usize];
        let mut diff = Vec::new();
        self.requirements(t, &mut diff);
        let g = self.g;
        let ag_acc_mem: u64 = until_ag
            .iter()
            .filter(|&&v| g.is_gather(v))
            .map(|&v| g.nodes[v as usize].bytes)
            .sum();
        let free_acc_mem: u64 = diff
            .iter()
            .filter(|&&v| g.is_gather(v))
            .map(|&v| g.nodes[v as usize].bytes)
            .sum();
        let free_cost: f64 = diff.iter().map(|&v| self.dur[v as usize]).sum();
        until_free.extend_from_slice(until_ag);
        until_free.extend_from_slice(&diff);
        let n_ags = until_free.iter().filter(|&&v| g.is_gather(v)).count();
        // Count of unscheduled gathers needed to reach the release (the candidate included).
        let count = n_ags;
        (
            Task {
                free_acc_mem,
                n_ags,
                ag_acc_mem,
                free_cost,
                id: y,
            },
            count,
        )
    }
}

pub(super) fn free_key(t: &Task) -> (usize, u64, f64, u32) {
    (t.n_ags, t.ag_acc_mem, t.free_cost, t.id)
}

pub(super) fn fallback_key(t: &Task) -> (u64, usize, u64, f64, u32) {
    (t.free_acc_mem, t.n_ags, t.ag_acc_mem, t.free_cost, t.id)
}

pub(super) fn lt<K: PartialOrd>(a: &K, b: &K) -> bool {
    a.partial_cmp(b) == Some(std::cmp::Ordering::Less)
}
