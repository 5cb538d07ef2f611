use super::*;
use crate::optim::testing::{isas, rounding_errors, streams};
use proptest::prelude::*;

fn hyper() -> impl Strategy<Value = Sgd> {
    (
        1e-4f64..1.0,
        prop_oneof![Just(0.0), 0.0f64..0.99],
        0.0f64..0.5,
        prop_oneof![Just(0.0), 0.0f64..0.1],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(lr, momentum, dampening, weight_decay, nesterov, maximize)| {
                let nesterov = nesterov && momentum > 0.0;
                let dampening = if nesterov { 0.0 } else { dampening };
                Sgd {
                    lr,
                    momentum,
                    dampening,
                    weight_decay,
                    nesterov,
                    maximize,
                }
            },
        )
}

/// One element's update in f64 (each value, and the scale of the terms that made it).
fn exact(h: &Sgd, first: bool, p: f32, g: f32, b: f32) -> [(f64, f64); 2] {
    let (p, b) = (f64::from(p), f64::from(b));
    let g = if h.maximize {
        -f64::from(g)
    } else {
        f64::from(g)
    };
    let g_scale = g.abs() + (h.weight_decay * p).abs();
    let g = g + h.weight_decay * p;
    let (b, b_scale) = if h.momentum == 0.0 {
        (b, b.abs())
    } else if first {
        (g, g_scale)
    } else {
        let old = h.momentum * b;
        (old + (1.0 - h.dampening) * g, old.abs() + g_scale)
    };
    let (d, d_scale) = if h.momentum == 0.0 {
        (g, g_scale)
    } else if h.nesterov {
        (g + h.momentum * b, g_scale + h.momentum * b_scale)
    } else {
        (b, b_scale)
    };
    [(p - h.lr * d, p.abs() + h.lr * d_scale), (b, b_scale)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn same_bits_everywhere(h in hyper(), seed in any::<u64>(), len in 0usize..80_000, first in any::<bool>(), bf16_grads in any::<bool>()) {
        let mut results = Vec::new();
        for (isa, threads) in isas() {
            let pool = HostPool::new(threads, Some(isa)).unwrap();
            let mut s = streams(seed, len);
            let grads = if bf16_grads { Grads::Bf16(&s.grads_bf16) } else { Grads::F32(&s.grads) };
            h.step(&pool, first, &mut s.params, grads, &mut s.a, CopyOut::Bf16(&mut s.copy)).unwrap();
            results.push((s.params, s.a, s.copy));
        }
        for r in &results[1..] {
            prop_assert!(r == &results[0]);
        }
    }

    /// The buffer and the parameter within a few roundings of the exact ones, each measured
    /// against the terms that make the value (`rounding_errors`).
    #[test]
    fn near_exact(h in hyper(), seed in any::<u64>(), first in any::<bool>()) {
        let pool = HostPool::new(1, None).unwrap();
        let mut s = streams(seed, 4096);
        let before = (s.params.clone(), s.grads.clone(), s.a.clone());
        h.step(&pool, first, &mut s.params, Grads::F32(&s.grads), &mut s.a, CopyOut::None).unwrap();
        for i in 0..s.params.len() {
            let [p, b] = exact(&h, first, before.0[i], before.1[i], before.2[i]);
            if h.momentum != 0.0 {
                prop_assert!(rounding_errors(s.a[i], b.0, b.1) <= 4.0, "buffer {} vs {b:?}", s.a[i]);
            } else {
                prop_assert_eq!(s.a[i], before.2[i]);
            }
            prop_assert!(rounding_errors(s.params[i], p.0, p.1) <= 8.0, "param {} vs {p:?}", s.params[i]);
        }
    }
}

#[test]
fn plain_sgd_needs_no_buffer() {
    let pool = HostPool::new(2, None).unwrap();
    let h = Sgd {
        lr: 0.1,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
        maximize: false,
    };
    let mut s = streams(3, 100);
    let want: Vec<f32> = s
        .params
        .iter()
        .zip(&s.grads)
        .map(|(p, g)| p + -0.1f32 * g)
        .collect();
    h.step(
        &pool,
        true,
        &mut s.params,
        Grads::F32(&s.grads),
        &mut [],
        CopyOut::None,
    )
    .unwrap();
    assert_eq!(s.params, want);
}

#[test]
fn rejects_nesterov_without_momentum() {
    let pool = HostPool::new(1, None).unwrap();
    let h = Sgd {
        lr: 0.1,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: true,
        maximize: false,
    };
    let mut s = streams(3, 4);
    assert!(h
        .step(
            &pool,
            true,
            &mut s.params,
            Grads::F32(&s.grads),
            &mut s.a,
            CopyOut::None
        )
        .is_err());
}
