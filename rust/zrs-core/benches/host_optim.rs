//! Host optimizer benches: AdamW and SGD with momentum over 16M-element f32 shards with a bf16
//! copy, at one thread and at every core, on the widest instruction set and on the baseline.
//!
//! `cargo bench -p zrs-core --bench host_optim`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use std::time::Duration;
use zrs_core::optim::{AdamW, CopyOut, Grads, HostPool, Isa, Sgd};

const N: usize = 16 << 20;

fn bench_host_optim(c: &mut Criterion) {
    let mut params = vec![0.1f32; N];
    let grads = vec![1e-3f32; N];
    let (mut m, mut v) = (vec![0.0f32; N], vec![0.0f32; N]);
    let mut copy = vec![bf16::ZERO; N];
    let adamw = AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        maximize: false,
    };
    let sgd = Sgd {
        lr: 1e-2,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
        maximize: false,
    };
    let mut group = c.benchmark_group("host_optim");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(N as u64));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for isa in [Isa::Baseline, Isa::detect()] {
        for threads in [1, cores] {
            let pool = HostPool::new(threads, Some(isa)).unwrap();
            let id = format!("{}x{threads}", isa.name());
            group.bench_function(BenchmarkId::new("adamw", &id), |b| {
                let mut step = 0;
                b.iter(|| {
                    step += 1;
                    let out = CopyOut::Bf16(&mut copy);
                    adamw
                        .step(
                            &pool,
                            step,
                            &mut params,
                            Grads::F32(&grads),
                            &mut m,
                            &mut v,
                            out,
                        )
                        .unwrap()
                })
            });
            group.bench_function(BenchmarkId::new("sgd", &id), |b| {
                b.iter(|| {
                    let out = CopyOut::Bf16(&mut copy);
                    sgd.step(&pool, false, &mut params, Grads::F32(&grads), &mut m, out)
                        .unwrap()
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_host_optim);
criterion_main!(benches);
