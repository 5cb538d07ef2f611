//! Planner benches: greedy baseline and the full search (greedy included) on synthetic 1b-shaped
//! transformer graphs of about 1k, 10k and 100k nodes, on the bandwidth-limited cost model.
//!
//! `cargo bench -p zrs-core --bench plan`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;
use std::time::Duration;
use zrs_core::plan::{
    greedy, plan, synth, CostModel, Graph, GraphSpec, NodeKind, NodeSpec, Problem, Scheduler,
};

fn bench_plan(c: &mut Criterion) {
    let preset = synth::Preset::by_name("1b").unwrap();
    let cost = CostModel::nop2p(2);
    let mut group = c.benchmark_group("plan");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for n in [1_000usize, 10_000, 100_000] {
        let g = Graph::new(synth::synthetic_graph(&preset, n, 2)).unwrap();
        let p = Problem::new(&g, &cost);
        group.bench_with_input(BenchmarkId::new("greedy", n), &g, |b, g| {
            b.iter(|| black_box(greedy::greedy_order(g, &p.dur)))
        });
        group.bench_with_input(BenchmarkId::new("search", n), &g, |b, g| {
            b.iter(|| black_box(plan(g, Scheduler::Search, None, &cost).unwrap()))
        });
    }
    // A wide graph: 5000 independent parameters, each gathered for one op, all feeding a sum.
    let mut spec = GraphSpec::default();
    let mut outs = Vec::new();
    for i in 0..5_000u64 {
        let ag = spec.push(NodeSpec {
            ds_id: Some(i),
            bytes: 1_000_000 + i,
            ..NodeSpec::new(format!("ag{i}"), NodeKind::Allgather)
        }) as usize;
        let w = spec.push(NodeSpec {
            ds_id: Some(i),
            deps: vec![ag],
            ..NodeSpec::new(format!("w{i}"), NodeKind::Wait)
        }) as usize;
        let op = spec.push(NodeSpec {
            deps: vec![w],
            duration_us: Some(10.0),
            alloc_bytes: Some(1000),
            ..NodeSpec::new(format!("op{i}"), NodeKind::Compute)
        }) as usize;
        spec.push(NodeSpec {
            ds_id: Some(i),
            deps: vec![w, op],
            ..NodeSpec::new(format!("r{i}"), NodeKind::Release)
        });
        outs.push(op);
    }
    spec.push(NodeSpec {
        deps: outs,
        duration_us: Some(1.0),
        ..NodeSpec::new("sum", NodeKind::Compute)
    });
    let wide = Graph::new(spec).unwrap();
    group.bench_function("search/wide5000", |b| {
        b.iter(|| black_box(plan(&wide, Scheduler::Search, None, &cost).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
