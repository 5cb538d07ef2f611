//! The greedy walk's state: which nodes are scheduled, the order so far, and for each all-gather
//! its *witness* (an unscheduled all-gather that its release still needs), so that the count-1
//! candidates are known without recounting. Separate from the picks, which read and advance it.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::plan::graph::{Graph, NodeKind, NONE};

pub(super) struct State<'a> {
    pub(super) g: &'a Graph,
    pub(super) dur: &'a [f64],
    pub(super) sched: Vec<bool>,
    pub(super) order: Vec<u32>,
    pub(super) stamp: Vec<u32>,
    pub(super) epoch: u32,
    pub(super) stack: Vec<(u32, u32)>,
    pub(super) target: Vec<u32>,
    pub(super) watchers: Vec<Vec<u32>>,
    /// Count-1 all-gathers by (bytes, id): their key's bytes never change.
    pub(super) level1: BinaryHeap<Reverse<(u64, u32)>>,
    pub(super) ready_sinks: Vec<u32>,
    pub(super) remaining_ags: usize,
}

impl<'a> State<'a> {
    pub(super) fn new_epoch(&mut self) -> u32 {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.stamp.iter_mut().for_each(|s| *s = 0);
            self.epoch = 1;
        }
        self.epoch
    }

    /// Append the unscheduled ancestors of `v` (and `v`), not yet stamped in the current epoch, in
    /// DFS post-order following dep order.
    pub(super) fn requirements(&mut self, v: u32, out: &mut Vec<u32>) {
        let ep = self.epoch;
        if self.sched[v as usize] || self.stamp[v as usize] == ep {
            return;
        }
        self.stamp[v as usize] = ep;
        self.stack.clear();
        self.stack.push((v, 0));
        while let Some(&mut (x, ref mut i)) = self.stack.last_mut() {
            let deps = self.g.deps(x);
            if (*i as usize) < deps.len() {
                let d = deps[*i as usize];
                *i += 1;
                if !self.sched[d as usize] && self.stamp[d as usize] != ep {
                    self.stamp[d as usize] = ep;
                    self.stack.push((d, 0));
                }
            } else {
                out.push(x);
                self.stack.pop();
            }
        }
    }

    /// An unscheduled all-gather other than `exclude` among the ancestors of `t` (and `t`).
    pub(super) fn find_witness(&mut self, t: u32, exclude: u32) -> u32 {
        // Depth-first, last dep first (the nearest gathers, which are scheduled late, so a
        // witness is rarely replaced), with lazy frames: a huge fan-in is not pushed whole. A
        // frame holds the number of deps still to look at.
        let ep = self.new_epoch();
        let mut stack = std::mem::take(&mut self.stack);
        stack.clear();
        let mut found = NONE;
        if !self.sched[t as usize] {
            self.stamp[t as usize] = ep;
            stack.push((t, self.g.deps(t).len() as u32));
        }
        while let Some(&mut (x, ref mut left)) = stack.last_mut() {
            if x != exclude && self.g.is_gather(x) {
                found = x;
                break;
            }
            let deps = self.g.deps(x);
            let mut next = NONE;
            while *left > 0 {
                *left -= 1;
                let d = deps[*left as usize];
                if !self.sched[d as usize] && self.stamp[d as usize] != ep {
                    self.stamp[d as usize] = ep;
                    next = d;
                    break;
                }
            }
            if next == NONE {
                stack.pop();
            } else {
                stack.push((next, self.g.deps(next).len() as u32));
            }
        }
        self.stack = stack;
        found
    }

    pub(super) fn watch(&mut self, w: u32) {
        // `w` is an all-gather (level tracking) or a sink target.
        let (t, ex) = if self.g.is_gather(w) {
            (self.target[w as usize], w)
        } else {
            (w, NONE)
        };
        let x = self.find_witness(t, ex);
        if x == NONE {
            if self.g.is_gather(w) {
                self.level1
                    .push(Reverse((self.g.nodes[w as usize].bytes, w)));
            } else {
                self.ready_sinks.push(w);
            }
        } else {
            self.watchers[x as usize].push(w);
        }
    }

    pub(super) fn schedule(&mut self, nodes: &[u32]) {
        for &v in nodes {
            debug_assert!(!self.sched[v as usize]);
            self.sched[v as usize] = true;
            self.order.push(v);
        }
        // A release only frees memory: emit it as soon as everything it waits for is scheduled.
        // A gather that the fallback emits alone (a weight whose op also needs the bias) is no
        // candidate afterwards, and its release would otherwise wait for the end of the graph.
        for &v in nodes {
            for &r in self.g.users(v) {
                if self.g.kind(r) == NodeKind::Release
                    && !self.sched[r as usize]
                    && self.g.deps(r).iter().all(|&d| self.sched[d as usize])
                {
                    self.sched[r as usize] = true;
                    self.order.push(r);
                }
            }
        }
        for &v in nodes {
            if self.g.is_gather(v) {
                self.remaining_ags -= 1;
                let ws = std::mem::take(&mut self.watchers[v as usize]);
                for w in ws {
                    if !self.sched[w as usize] {
                        self.watch(w);
                    }
                }
            }
        }
    }
}
