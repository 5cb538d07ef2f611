//! Unit tests of the coordinator: prefetching, reuse, buckets, persistence, divergence and the
//! errors. The property tests are in `props`.

use super::*;
use super::{params, trace};
use crate::error::Error;

fn spec(numel: u64) -> ParamSpec {
    ParamSpec {
        numel,
        shard_numel: numel / 2,
        requires_grad: true,
    }
}

/// A root (unit 0, owning nothing) calling units 1..=k in order, unit u owning slot u - 1.
fn chain(numels: &[u64], persist: Option<u64>, bucket: u64) -> Coordinator {
    let params: Vec<ParamSpec> = numels.iter().map(|&n| spec(n)).collect();
    let units: Vec<Vec<Slot>> = std::iter::once(vec![])
        .chain((0..numels.len()).map(|s| vec![s]))
        .collect();
    let numels = unit_numels(&params, &units).unwrap();
    let cfg = EagerConfig::resolve(None, None, None, persist, bucket, &numels);
    Coordinator::new(cfg, params, units).unwrap()
}

/// One forward of the root calling `units` in order: each pre_forward's fetch and each
/// post_forward's release (the root's last), then end_forward's.
fn forward(c: &mut Coordinator, units: &[UnitId], training: bool) -> Vec<(Fetch, Vec<Slot>)> {
    assert_eq!(c.begin_forward(training), Vec::<Slot>::new());
    let root = c.pre_forward(0).unwrap();
    let mut out: Vec<_> = (units.iter())
        .map(|&u| (c.pre_forward(u).unwrap(), c.post_forward(u).unwrap()))
        .collect();
    out.push((root, c.post_forward(0).unwrap()));
    out.push((Fetch::default(), c.end_forward()));
    out
}

fn fetch(issue: &[Slot], wait: &[Slot], prefetch: &[&[Slot]]) -> Fetch {
    Fetch {
        issue: issue.to_vec(),
        wait: wait.to_vec(),
        prefetch: prefetch.iter().map(|g| g.to_vec()).collect(),
        diverged: None,
    }
}

#[test]
fn defaults_come_from_the_largest_unit() {
    let cfg = EagerConfig::resolve(None, None, None, None, 64, &[0, 30, 10]);
    assert_eq!(
        (
            cfg.prefetch_numel,
            cfg.max_live_numel,
            cfg.max_reuse_distance
        ),
        (30, 90, 30)
    );
    assert_eq!((cfg.persist_numel, cfg.grad_bucket_numel), (0, 64));
    let cfg = EagerConfig::resolve(Some(1), Some(2), Some(3), Some(4), 5, &[30]);
    assert_eq!(
        cfg.prefetch_numel + cfg.max_live_numel + cfg.max_reuse_distance,
        6
    );
    assert_eq!(cfg.persist_numel, 4);
    let params = [spec(10), spec(20)];
    assert_eq!(
        unit_numels(&params, &[vec![0, 1, 0], vec![]]),
        Ok(vec![30, 0])
    );
    assert_eq!(unit_numels(&params, &[vec![2]]), Err(Error::UnknownSlot(2)));
}

#[test]
fn prefetches_one_unit_ahead_with_the_default_config() {
    let mut c = chain(&[10, 10, 10], None, 100);
    // Recording: gather on demand, release after each unit.
    let rec = forward(&mut c, &[1, 2, 3], false);
    assert_eq!(rec[0], (fetch(&[0], &[], &[]), vec![0]));
    assert_eq!(rec[2], (fetch(&[2], &[], &[]), vec![2]));
    assert_eq!(c.mode(), TraceMode::Complete);
    assert_eq!(c.trace_units(), &[0, 1, 2, 3]);
    assert_eq!(c.trace_params(), vec![(1, 0), (2, 1), (3, 2)]);
    // Following the trace: each unit waits for its prefetched parameter and prefetches the next.
    let run = forward(&mut c, &[1, 2, 3], false);
    assert_eq!(
        run[3].0,
        fetch(&[], &[], &[&[0]]),
        "the root prefetches unit 1"
    );
    assert_eq!(run[0], (fetch(&[], &[0], &[&[1]]), vec![0]));
    assert_eq!(run[1], (fetch(&[], &[1], &[&[2]]), vec![1]));
    assert_eq!(run[2], (fetch(&[], &[2], &[]), vec![2]));
    assert_eq!(c.live_numel(), 0);
}

#[test]
fn a_unit_is_prefetched_whole_or_not_at_all() {
    // The embedding (unit 1, numel 12) is the largest unit, so prefetch_numel is 12: a layer of
    // two parameters (4 + 4) fits, and the one after it only in part.
    let params: Vec<ParamSpec> = [12, 4, 4, 4, 4, 4, 4].iter().map(|&n| spec(n)).collect();
    let units = vec![vec![], vec![0], vec![1, 2], vec![3, 4], vec![5, 6]];
    let numels = unit_numels(&params, &units).unwrap();
    let cfg = EagerConfig::resolve(None, None, None, None, 100, &numels);
    let mut c = Coordinator::new(cfg, params, units).unwrap();
    forward(&mut c, &[1, 2, 3, 4], false);
    let run = forward(&mut c, &[1, 2, 3, 4], false);
    let groups: Vec<&[Slot]> = run
        .iter()
        .flat_map(|(f, _)| &f.prefetch)
        .map(|g| &g[..])
        .collect();
    // (the root's fetch, which prefetches the embedding, comes last in `forward`'s list)
    assert_eq!(groups, [&[1, 2][..], &[3, 4], &[5, 6], &[0]], "{run:?}");
}

#[test]
fn the_last_unit_stays_gathered_for_its_backward_only_when_training() {
    let mut c = chain(&[10, 10, 10], None, 100);
    forward(&mut c, &[1, 2, 3], true);
    assert_eq!(
        c.mode(),
        TraceMode::Record,
        "the step ends with its backward"
    );
    assert!(c.end_backward().recorded);
    let run = forward(&mut c, &[1, 2, 3], true);
    // Slot 1 is used again after unit 3 runs twice (20 > 10): released; slot 2 at once: kept.
    assert_eq!((run[1].1.clone(), run[2].1.clone()), (vec![1], vec![]));
    assert_eq!(c.status(2), Ok(ParamStatus::Gathered));
    assert_eq!(c.pre_backward(3).unwrap(), fetch(&[], &[], &[&[1]]));
    assert_eq!(c.grad_ready(2).unwrap().release, vec![2]);
    assert_eq!(c.pre_backward(2).unwrap(), fetch(&[], &[1], &[&[0]]));
    let end = c.end_backward();
    assert_eq!((end.release, end.recorded), (vec![0, 1], false));
    // Without a backward to come, the last unit releases like the others.
    let run = forward(&mut c, &[1, 2, 3], false);
    assert_eq!(run[2].1, vec![2]);
}

#[test]
fn grad_buckets_follow_the_recorded_backward() {
    let mut c = chain(&[10, 10, 10], None, 10); // shards of 5: two per bucket
    forward(&mut c, &[1, 2, 3], true);
    for unit in [3, 2, 1] {
        c.pre_backward(unit).unwrap();
        let ready = c.grad_ready(unit - 1).unwrap();
        assert_eq!(ready.bucket_numel, 0, "no plan while recording");
    }
    assert!(c.end_backward().recorded);
    forward(&mut c, &[1, 2, 3], true);
    let buckets: Vec<u64> = [2, 1, 0]
        .into_iter()
        .map(|s| c.grad_ready(s).unwrap().bucket_numel)
        .collect();
    assert_eq!(buckets, vec![10, 10, 5]);
}

#[test]
fn persistent_parameters_stay_gathered_until_a_reset() {
    let mut c = chain(&[4, 10], Some(5), 100);
    assert_eq!(c.config().persist_numel, 5);
    let rec = forward(&mut c, &[1, 2], true);
    assert_eq!(
        rec[0],
        (fetch(&[0], &[], &[]), vec![]),
        "gathered, not released"
    );
    assert_eq!(c.live_numel(), 0, "persistent parameters do not count");
    c.pre_backward(2).unwrap();
    assert_eq!(c.pre_backward(1).unwrap(), Fetch::default());
    assert_eq!(c.grad_ready(0).unwrap().release, Vec::<Slot>::new());
    assert_eq!(c.end_backward().release, vec![1]);
    let run = forward(&mut c, &[1, 2], false);
    assert_eq!(
        run[2].0,
        fetch(&[], &[], &[&[1]]),
        "the root skips the persistent one"
    );
    assert_eq!(run[0].0, Fetch::default(), "nor is it gathered again");
    assert_eq!(c.reset(), vec![0]);
    assert_eq!(c.status(0), Ok(ParamStatus::Released));
    assert_eq!(c.mode(), TraceMode::Complete, "a reset keeps the trace");
}

#[test]
fn a_changed_order_diverges_once_then_records_again() {
    let mut c = chain(&[10, 10, 10], None, 100);
    forward(&mut c, &[1, 2, 3], false);
    forward(&mut c, &[1, 2, 3], false);
    assert_eq!(c.mode(), TraceMode::Complete);
    c.begin_forward(false);
    assert_eq!(c.pre_forward(0).unwrap().diverged, None);
    let f = c.pre_forward(2).unwrap();
    let at = Divergence {
        position: 1,
        expected: Some(1),
        got: 2,
    };
    assert_eq!(f.diverged, Some(at));
    assert_eq!(c.mode(), TraceMode::Invalid);
    assert_eq!(f.issue, vec![1]);
    assert!(f.prefetch.is_empty(), "no prefetch off the trace");
    c.post_forward(2).unwrap();
    assert_eq!(c.pre_forward(1).unwrap().diverged, None, "reported once");
    c.post_forward(1).unwrap();
    c.post_forward(0).unwrap();
    assert_eq!(c.end_forward(), Vec::<Slot>::new());
    assert_eq!((c.mode(), c.trace_units()), (TraceMode::Record, &[][..]));
    forward(&mut c, &[2, 1], false);
    assert_eq!(
        (c.mode(), c.trace_units()),
        (TraceMode::Complete, &[0, 2, 1][..])
    );
    // A longer forward diverges past the trace's end.
    c.begin_forward(false);
    for u in [0, 2, 1] {
        c.pre_forward(u).unwrap();
    }
    let past = c.pre_forward(3).unwrap().diverged.unwrap();
    assert_eq!((past.position, past.expected, past.got), (3, None, 3));
}

#[test]
fn reads_on_demand_join_the_innermost_unit() {
    let mut c = chain(&[10, 10], None, 100);
    c.begin_forward(true);
    c.pre_forward(0).unwrap();
    assert_eq!(
        c.fetch(1).unwrap(),
        fetch(&[1], &[], &[]),
        "the root reads unit 2's weight"
    );
    assert_eq!(c.fetch(1).unwrap(), Fetch::default());
    assert_eq!(c.post_forward(0).unwrap(), vec![1]);
    c.end_forward();
    assert_eq!(c.pre_backward(0).unwrap(), fetch(&[1], &[], &[]));
    c.end_backward();
    assert_eq!(c.trace_params(), vec![(0, 1)]);
}

#[test]
fn a_recompute_holds_its_parameters_through_the_backward() {
    let mut c = chain(&[10, 10], None, 100);
    forward(&mut c, &[1, 2], true);
    c.pre_backward(2).unwrap();
    assert_eq!(
        c.begin_forward(true),
        Vec::<Slot>::new(),
        "a recompute's root"
    );
    assert_eq!(c.pre_forward(1).unwrap(), fetch(&[0], &[], &[]));
    assert_eq!(
        c.grad_ready(0).unwrap().release,
        Vec::<Slot>::new(),
        "the recompute still runs"
    );
    assert_eq!(c.post_forward(1).unwrap(), vec![0]);
    assert_eq!(c.pre_forward(1).unwrap(), fetch(&[0], &[], &[]));
    assert_eq!(
        c.post_forward(1).unwrap(),
        Vec::<Slot>::new(),
        "its backward comes next"
    );
    assert_eq!(c.end_backward().release, vec![0, 1]);
}

#[test]
fn calls_out_of_place_are_errors() {
    let mut c = chain(&[10], None, 100);
    assert_eq!(c.fetch(0), Err(Error::ReadOutsideForward(0)));
    assert_eq!(c.pre_forward(1), Err(Error::ForwardOutsideStep(1)));
    assert_eq!(c.pre_backward(1), Err(Error::BackwardOutsideStep(1)));
    assert_eq!(c.grad_ready(0), Err(Error::GradOutsideBackward(0)));
    c.begin_forward(true);
    assert_eq!(
        c.fetch(0),
        Err(Error::ReadOutsideForward(0)),
        "no unit is running"
    );
    assert_eq!(c.post_forward(1), Err(Error::UnitNotActive(1)));
    assert_eq!(c.pre_forward(2), Err(Error::UnknownUnit(2)));
    assert_eq!(c.fetch(1), Err(Error::UnknownSlot(1)));
    assert_eq!(c.status(1), Err(Error::UnknownSlot(1)));
    let frozen = ParamSpec {
        requires_grad: false,
        ..spec(4)
    };
    let cfg = EagerConfig::resolve(None, None, None, None, 1, &[4]);
    let mut c = Coordinator::new(cfg, vec![frozen], vec![vec![0]]).unwrap();
    c.begin_forward(true);
    c.end_forward();
    assert_eq!(c.grad_ready(0), Err(Error::GradOfFrozen(0)));
    let unknown = Coordinator::new(cfg, vec![frozen], vec![vec![0, 1]]);
    assert_eq!(unknown.map(|_| ()), Err(Error::UnknownSlot(1)));
    let msg = Error::ReadOutsideForward(3).to_string();
    assert!(msg.contains("slot 3") && msg.contains("outside any forward"));
}

#[test]
fn distances_count_what_is_gathered_in_between() {
    // Positions: 0 fetches a (10), 1 fetches b (5), 2 fetches a again (tied) and c (7).
    let params = params::Params::new(vec![spec(10), spec(5), spec(7)], 0);
    let mut log = trace::StepLog::new(3);
    log.push(0, &[0]);
    log.push(1, &[1]);
    log.push(2, &[0]);
    log.add(2, 2);
    let t = trace::Trace::new(&log, &params, 3, 10);
    assert_eq!(t.next_use(0, 0, false), Some(5), "a: only b in between");
    assert_eq!(t.next_use(0, 0, true), Some(5));
    assert_eq!(t.next_use(1, 1, false), None, "b: no later forward use");
    assert_eq!(
        t.next_use(1, 1, true),
        Some(34),
        "b: position 2 forward and backward"
    );
    assert_eq!(
        t.next_use(2, 0, true),
        Some(0),
        "the last position's backward comes at once"
    );
    assert_eq!(t.next_use(2, 2, true), Some(0));
    assert_eq!(t.next_use(0, 2, true), None, "c is not fetched at 0");
    assert!(!t.has_grad_plan(), "no backward, no buckets");
}

#[test]
fn a_backward_finds_its_unit_before_the_last_one_found() {
    let params = params::Params::new(vec![], 0);
    let mut log = trace::StepLog::new(3);
    for unit in [0, 1, 2, 1] {
        log.push(unit, &[]);
    }
    let t = trace::Trace::new(&log, &params, 3, 10);
    assert_eq!(t.position_before(1, 4), Some(3));
    assert_eq!(t.position_before(1, 3), Some(1));
    assert_eq!(
        t.position_before(1, 1),
        Some(3),
        "none before: its last anywhere"
    );
    assert_eq!(t.position_before(2, 2), Some(2));
}

#[test]
fn a_trace_recorded_without_backward_plans_buckets_at_its_first_backward() {
    let mut c = chain(&[10, 10], None, 100);
    forward(&mut c, &[1, 2], false);
    assert_eq!(c.mode(), TraceMode::Complete);
    forward(&mut c, &[1, 2], true);
    assert_eq!(c.grad_ready(1).unwrap().bucket_numel, 0);
    c.grad_ready(0).unwrap();
    assert!(!c.end_backward().recorded, "the trace was recorded before");
    forward(&mut c, &[1, 2], true);
    assert_eq!(c.grad_ready(1).unwrap().bucket_numel, 10);
    assert_eq!(c.grad_ready(0).unwrap().bucket_numel, 10);
}

/// A LoRA-like layer stack: each layer a frozen weight (slot 2k) and a trainable adapter
/// (2k + 1), each layer one unit.
fn lora(layers: usize) -> Coordinator {
    let params: Vec<ParamSpec> = (0..2 * layers)
        .map(|s| ParamSpec {
            requires_grad: s % 2 == 1,
            ..spec(10)
        })
        .collect();
    let units: Vec<Vec<Slot>> = std::iter::once(vec![])
        .chain((0..layers).map(|k| vec![2 * k, 2 * k + 1]))
        .collect();
    let numels = unit_numels(&params, &units).unwrap();
    let cfg = EagerConfig::resolve(None, Some(1000), Some(0), None, 100, &numels);
    Coordinator::new(cfg, params, units).unwrap()
}

#[test]
fn a_frozen_weight_goes_when_its_layer_finished_its_backward() {
    let mut c = lora(3);
    forward(&mut c, &[1, 2, 3], true);
    c.pre_backward(3).unwrap();
    assert_eq!(
        c.post_backward(3).unwrap(),
        Vec::<Slot>::new(),
        "the adapter's gradient is due"
    );
    assert_eq!(
        c.grad_ready(5).unwrap().release,
        vec![5, 4],
        "the layer is done: both go"
    );
    c.pre_backward(2).unwrap();
    assert_eq!(
        c.grad_ready(3).unwrap().release,
        vec![3],
        "its inputs' gradient is due"
    );
    assert_eq!(c.status(2), Ok(ParamStatus::Gathered));
    assert_eq!(c.post_backward(2).unwrap(), vec![2]);
    c.pre_backward(1).unwrap();
    c.grad_ready(1).unwrap();
    // Layer 1's inputs need no gradient: no post_backward, its weight waits for the end.
    assert_eq!(c.end_backward().release, vec![0]);
}

#[test]
fn a_frozen_weight_stays_while_any_activation_that_used_it_runs_its_backward() {
    let mut c = lora(2);
    forward(&mut c, &[1, 2, 1], true); // layer 1 called twice
    c.pre_backward(1).unwrap();
    c.grad_ready(1).unwrap(); // the adapter's gradient sums both calls: complete at its last
    c.pre_backward(1).unwrap(); // the first call's backward starts before the second's ends
    assert_eq!(
        c.post_backward(1).unwrap(),
        Vec::<Slot>::new(),
        "one call still runs"
    );
    assert_eq!(c.status(0), Ok(ParamStatus::Gathered));
    assert_eq!(c.post_backward(1).unwrap(), vec![0]);
    c.pre_backward(2).unwrap();
    assert_eq!(c.grad_ready(3).unwrap().release, vec![3]);
    assert_eq!(c.post_backward(2).unwrap(), vec![2]);
    assert_eq!(c.end_backward().release, Vec::<Slot>::new());
    assert_eq!(c.post_backward(1), Err(Error::BackwardOutsideStep(1)));
}
