//! Property tests: random unit trees (tied weights, a root that may own nothing, nesting) run
//! for several steps whose forward order sometimes changes, with on-demand reads, training or
//! not, backwards in roughly reverse order with recomputes and gradients in random order, and
//! steps cut short by a reset or abandoned. The [`Shadow`] checks every answer.

use proptest::prelude::*;

use crate::registry::Slot;

use super::coordinator::Phase;
use super::shadow::Shadow;
use super::{unit_numels, Coordinator, EagerConfig, ParamSpec, UnitId};
use crate::error::Error;

/// splitmix64: the per-step choices, reproducible from the step's seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

#[derive(Debug, Clone)]
struct Model {
    params: Vec<ParamSpec>,
    own: Vec<Vec<Slot>>,
    /// `children[u]`: the units u calls, in order.
    children: Vec<Vec<UnitId>>,
    limits: [Option<u64>; 4],
    bucket: u64,
}

fn model() -> impl Strategy<Value = Model> {
    (1usize..10, 2usize..8).prop_flat_map(|(n_params, n_units)| {
        let param = (0u64..40, 0u8..5).prop_map(|(numel, frozen)| ParamSpec {
            numel,
            shard_numel: numel.div_ceil(2),
            requires_grad: frozen != 0,
        });
        let limit = || prop::option::weighted(0.6, 0u64..120);
        (
            prop::collection::vec(param, n_params),
            prop::collection::vec(prop::collection::vec(0..n_params, 0..3), n_units),
            prop::collection::vec(any::<usize>(), n_units),
            [limit(), limit(), limit(), prop::option::of(0u64..12)],
            1u64..60,
        )
            .prop_map(|(params, own, picks, limits, bucket)| {
                let mut children = vec![Vec::new(); own.len()];
                for u in 1..own.len() {
                    children[picks[u] % u].push(u);
                }
                Model {
                    params,
                    own,
                    children,
                    limits,
                    bucket,
                }
            })
    })
}

struct Run {
    c: Coordinator,
    sh: Shadow,
    rng: Rng,
    children: Vec<Vec<UnitId>>,
    n_params: usize,
    /// Calls left before the step is cut short.
    left: usize,
}

impl Run {
    /// Checks the state after a call; false when the step is cut short here (a reset, or in a
    /// forward sometimes abandoned: the next step's begin_forward ends it).
    fn tick(&mut self) -> bool {
        self.sh.check(&self.c);
        self.left = self.left.saturating_sub(1);
        if self.left > 0 {
            return true;
        }
        if self.sh.phase == Phase::Backward || self.rng.one_in(2) {
            let released = self.c.reset();
            self.sh.reset(&released);
            self.sh.check(&self.c);
        }
        false
    }

    fn fetch(&mut self) -> bool {
        let slot = self.rng.below(self.n_params);
        let f = self.c.fetch(slot).unwrap();
        self.sh.fetch(slot, &f);
        self.tick()
    }

    /// Runs `u`'s forward and its children's; false when the step was cut short.
    fn forward(&mut self, u: UnitId) -> bool {
        let f = self.c.pre_forward(u).unwrap();
        self.sh.pre_forward(u, &f);
        if !self.tick() || (self.rng.one_in(4) && !self.fetch()) {
            return false;
        }
        for child in self.children[u].clone() {
            if !self.forward(child) {
                return false;
            }
        }
        if self.rng.one_in(6) && !self.fetch() {
            return false;
        }
        let released = self.c.post_forward(u).unwrap();
        self.sh.post_forward(u, &released);
        self.tick()
    }

    fn grad_ready(&mut self, slot: Slot) -> bool {
        let g = self.c.grad_ready(slot).unwrap();
        self.sh.grad_ready(slot, &g);
        self.tick()
    }

    fn post_backward(&mut self, unit: UnitId) -> bool {
        let released = self.c.post_backward(unit).unwrap();
        self.sh.post_backward(unit, &released);
        self.tick()
    }

    /// A recompute of one unit (an activation-checkpointed region) inside the backward.
    fn recompute(&mut self, grads: &[Slot]) -> bool {
        // Before the backward's first hook a recompute's root would end the step: only units.
        if self.sh.phase == Phase::Backward {
            let released = self.c.begin_forward(true);
            self.sh.begin_forward(true, &released);
        }
        let u = self.rng.below(self.children.len());
        let f = self.c.pre_forward(u).unwrap();
        self.sh.pre_forward(u, &f);
        if !self.tick() || (self.rng.one_in(3) && !self.fetch()) {
            return false;
        }
        if !grads.is_empty() && self.rng.one_in(3) && !self.grad_ready(grads[0]) {
            return false;
        }
        let released = self.c.post_forward(u).unwrap();
        self.sh.post_forward(u, &released);
        self.tick()
    }

    fn backward(&mut self) -> bool {
        let mut units = self.sh.step_units();
        units.reverse();
        for _ in 0..self.rng.below(3) {
            let i = self.rng.below(units.len().saturating_sub(1));
            if i + 1 < units.len() {
                units.swap(i, i + 1);
            }
        }
        let mut grads = self.sh.step_grads();
        self.rng.shuffle(&mut grads);
        let mut finishing = Vec::new();
        for u in units {
            while !grads.is_empty() && self.rng.one_in(2) {
                let slot = grads.remove(0);
                if !self.grad_ready(slot) || (self.rng.one_in(8) && !self.grad_ready(slot)) {
                    return false;
                }
            }
            if self.rng.one_in(8) && !self.recompute(&grads) {
                return false;
            }
            let f = self.c.pre_backward(u).unwrap();
            self.sh.pre_backward(u, &f);
            if !self.tick() || (self.rng.one_in(8) && !self.fetch()) {
                return false;
            }
            // Its end comes when its inputs' gradient is complete, possibly after the next
            // unit's backward began; never when its inputs need no gradient.
            if !self.rng.one_in(4) {
                finishing.push(u);
            }
            while !finishing.is_empty() && self.rng.one_in(2) {
                if !self.post_backward(finishing.remove(0)) {
                    return false;
                }
            }
        }
        for u in finishing {
            if !self.post_backward(u) {
                return false;
            }
        }
        for slot in grads {
            if !self.grad_ready(slot) {
                return false;
            }
        }
        let end = self.c.end_backward();
        self.sh.end_backward(&end);
        self.tick()
    }

    fn step(&mut self, seed: u64) {
        self.rng = Rng(seed);
        let training = !self.rng.one_in(3);
        if self.rng.one_in(3) {
            let u = self.rng.below(self.children.len());
            let leaves: Vec<UnitId> = (self.children[u].iter().copied())
                .filter(|&k| self.children[k].is_empty())
                .collect();
            let kids = &mut self.children[u];
            match self.rng.below(3) {
                // A leaf called twice (a shared module), so the calls stay few.
                0 if kids.len() < 4 && !leaves.is_empty() => kids.push(leaves[0]),
                1 if kids.len() > 1 => _ = kids.pop(),
                _ => {}
            }
            self.rng.shuffle(kids);
        }
        self.left = if self.rng.one_in(4) {
            1 + self.rng.below(40)
        } else {
            usize::MAX
        };
        let released = self.c.begin_forward(training);
        self.sh.begin_forward(training, &released);
        if !self.tick() || !self.forward(0) {
            return;
        }
        let released = self.c.end_forward();
        self.sh.end_forward(&released);
        if !self.tick() || !training || self.rng.one_in(6) || !self.backward() {
            return;
        }
        // Between steps nothing may be read, and no backward or gradient may come.
        assert_eq!(self.sh.phase, Phase::Idle);
        assert_eq!(self.c.fetch(0), Err(Error::ReadOutsideForward(0)));
        assert_eq!(self.c.pre_backward(0), Err(Error::BackwardOutsideStep(0)));
        assert_eq!(self.c.grad_ready(0), Err(Error::GradOutsideBackward(0)));
        assert_eq!(self.c.post_backward(0), Err(Error::BackwardOutsideStep(0)));
        assert_eq!(self.c.post_forward(0), Err(Error::UnitNotActive(0)));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Every answer is consistent with the shadow's statuses and holds (never a release of a
    /// held or released parameter, never an issue of one that is not released, disjoint fetch
    /// lists, required parameters gathered), the live numel is exact and what nobody holds
    /// stays within `max_live_numel`, and the trace mode follows the spec: the same order
    /// twice completes the trace, a changed order diverges once at its first difference, the
    /// next step records and the one after completes.
    #[test]
    fn the_coordinator_follows_its_shadow(
        m in model(),
        seeds in prop::collection::vec(any::<u64>(), 1..12),
    ) {
        let numels = unit_numels(&m.params, &m.own).unwrap();
        let [prefetch, live, reuse, persist] = m.limits;
        let cfg = EagerConfig::resolve(prefetch, live, reuse, persist, m.bucket, &numels);
        let c = Coordinator::new(cfg, m.params.clone(), m.own.clone()).unwrap();
        let sh = Shadow::new(&c, m.params.clone(), m.own.clone());
        let n_params = m.params.len();
        let mut run = Run { c, sh, rng: Rng(0), children: m.children.clone(), n_params, left: 0 };
        for seed in seeds {
            run.step(seed);
        }
    }
}
