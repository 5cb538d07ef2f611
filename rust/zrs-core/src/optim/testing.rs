//! What the optimizers' tests share: random shards, the instruction sets to compare, ulps.

use super::Isa;
use half::bf16;

pub struct Shards {
    pub params: Vec<f32>,
    pub grads: Vec<f32>,
    pub grads_bf16: Vec<bf16>,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub copy: Vec<bf16>,
}

/// Shards of `len` elements from `seed`: parameters and gradients of mixed signs and scales,
/// a first moment of either sign and a second moment of positive values.
pub fn streams(seed: u64, len: usize) -> Shards {
    let mut state = seed | 1;
    let mut next = move || {
        // xorshift64*: enough spread for tests, no dependency.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let x = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        (x as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut gen = |scale: f32| (0..len).map(|_| next() * scale).collect::<Vec<f32>>();
    let params = gen(0.5);
    let grads = gen(1e-2);
    let a = gen(1e-3);
    let b = gen(1e-4).into_iter().map(f32::abs).collect();
    let grads_bf16 = grads.iter().map(|&g| bf16::from_f32(g)).collect();
    Shards {
        params,
        grads,
        grads_bf16,
        a,
        b,
        copy: vec![bf16::ZERO; len],
    }
}

/// Every instruction set this CPU has, each at one thread and at three.
pub fn isas() -> Vec<(Isa, usize)> {
    let have = Isa::detect();
    [Isa::Baseline, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|&i| super::supported(i, have))
        .flat_map(|i| [(i, 1), (i, 3)])
        .collect()
}

/// The distance from `got` to `want` in units of f32's rounding error (2^-24) of `scale`, the
/// sum of the magnitudes of the terms that made `want`: a sum that cancels is judged by its
/// terms, not by its small result.
pub fn rounding_errors(got: f32, want: f64, scale: f64) -> f64 {
    let err = (f64::from(got) - want).abs();
    if err == 0.0 {
        return 0.0;
    }
    err / (scale * f64::from(f32::EPSILON) / 2.0)
}
