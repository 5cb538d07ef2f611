//! Planner benches: greedy baseline and the full search (greedy included) on synthetic 1b-shaped
//! transformer graphs of about 1k, 10k and 100k nodes, on the bandwidth-limited cost model.
//!
//! `cargo bench -p zrs-core --bench plan`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;
use std::time::Duration;
use zrs_core::plan::{greedy, plan, synth, CostModel, Graph, Problem, Scheduler};

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
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
