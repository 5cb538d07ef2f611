use super::*;
use crate::optim::testing::{isas, rounding_errors, streams};
use proptest::prelude::*;

fn hyper() -> impl Strategy<Value = AdamW> {
    (
        1e-5f64..1e-1,
        0.0f64..0.99,
        0.9f64..0.9999,
        1e-10f64..1e-6,
        0.0f64..0.2,
        any::<bool>(),
    )
        .prop_map(|(lr, beta1, beta2, eps, weight_decay, maximize)| AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            maximize,
        })
}

/// One element's update in f64 (each value, and the scale of the terms that made it).
fn exact(h: &AdamW, step: u64, p: f32, g: f32, m: f32, v: f32) -> [(f64, f64); 3] {
    let (p, m, v) = (f64::from(p), f64::from(m), f64::from(v));
    let g = if h.maximize {
        -f64::from(g)
    } else {
        f64::from(g)
    };
    let t = step as f64;
    // torch's lerp computes `m + w*(g - m)`: its error is relative to the inputs' sizes.
    let m_scale = m.abs() + g.abs();
    let m = h.beta1 * m + (1.0 - h.beta1) * g;
    let v = h.beta2 * v + (1.0 - h.beta2) * g * g;
    let denom = (v / (1.0 - h.beta2.powf(t))).sqrt() + h.eps;
    let decayed = p * (1.0 - h.lr * h.weight_decay);
    let moved = h.lr / (1.0 - h.beta1.powf(t)) * m / denom;
    // The move inherits the first moment's error, relative to its inputs.
    let moved_scale = moved.abs() * m_scale / m.abs().max(f64::MIN_POSITIVE);
    [
        (decayed - moved, decayed.abs() + moved_scale),
        (m, m_scale),
        (v, v),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Every instruction set and thread count gives the same bits, with f32 and bf16 gradients
    /// and every copy dtype, over lengths that end inside and on a chunk.
    #[test]
    fn same_bits_everywhere(h in hyper(), seed in any::<u64>(), len in 0usize..80_000, step in 1u64..50, bf16_grads in any::<bool>()) {
        let mut results = Vec::new();
        for (isa, threads) in isas() {
            let pool = HostPool::new(threads, Some(isa)).unwrap();
            let mut s = streams(seed, len);
            let grads = if bf16_grads { Grads::Bf16(&s.grads_bf16) } else { Grads::F32(&s.grads) };
            h.step(&pool, step, &mut s.params, grads, &mut s.a, &mut s.b, CopyOut::Bf16(&mut s.copy)).unwrap();
            results.push((s.params, s.a, s.b, s.copy));
        }
        for r in &results[1..] {
            prop_assert!(r == &results[0]);
        }
    }

    /// The f32 update stays within a few roundings of the exact one, each measured against the
    /// terms that make the value (`rounding_errors`).
    #[test]
    fn near_exact(h in hyper(), seed in any::<u64>(), step in 1u64..50) {
        let pool = HostPool::new(1, None).unwrap();
        let mut s = streams(seed, 4096);
        let before = (s.params.clone(), s.grads.clone(), s.a.clone(), s.b.clone());
        h.step(&pool, step, &mut s.params, Grads::F32(&s.grads), &mut s.a, &mut s.b, CopyOut::None).unwrap();
        for i in 0..s.params.len() {
            let [p, m, v] = exact(&h, step, before.0[i], before.1[i], before.2[i], before.3[i]);
            prop_assert!(rounding_errors(s.a[i], m.0, m.1) <= 4.0, "exp_avg {} vs {m:?}", s.a[i]);
            prop_assert!(rounding_errors(s.b[i], v.0, v.1) <= 4.0, "exp_avg_sq {} vs {v:?}", s.b[i]);
            prop_assert!(rounding_errors(s.params[i], p.0, p.1) <= 12.0, "param {} vs {p:?}", s.params[i]);
        }
    }
}

#[test]
fn rejects_what_torch_rejects() {
    let pool = HostPool::new(1, None).unwrap();
    let good = AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        maximize: false,
    };
    let mut s = streams(0, 8);
    let mut run = |h: AdamW, step: u64, n: usize| {
        h.step(
            &pool,
            step,
            &mut s.params[..n],
            Grads::F32(&s.grads),
            &mut s.a,
            &mut s.b,
            CopyOut::None,
        )
    };
    assert!(run(good, 1, 8).is_ok());
    assert!(run(AdamW { beta1: 1.0, ..good }, 1, 8).is_err());
    assert!(run(AdamW { lr: -1.0, ..good }, 1, 8).is_err());
    assert!(run(good, 0, 8).is_err());
    let err = run(good, 1, 7).unwrap_err().to_string();
    assert!(err.contains("gradient shard has 8 elements"), "{err}");
}
