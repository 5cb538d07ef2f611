//! AdamW over flat f32 shards, in `torch.optim.AdamW`'s order of operations.

use super::convert::{bf16_from_f32, ToF32};
use super::{multiversion, Chunk, CopyOut, Grads, HostPool, Streams};
use crate::error::{Error, Result};
use half::bf16;

/// AdamW's hyperparameters, as `torch.optim.AdamW` takes them (`amsgrad` is not supported).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub maximize: bool,
}

/// The f32 scalars of one step, rounded from f64 as torch rounds a Python number it applies to
/// an f32 tensor.
struct Scalars {
    sign: f32,
    decay: f32,
    lerp_small: bool,
    w1: f32,
    one_minus_w1: f32,
    beta2: f32,
    w2: f32,
    bc2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
}

impl AdamW {
    /// The checks `torch.optim.AdamW` makes on its arguments.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |what: &str, v: f64| Err(Error::Invalid(format!("host AdamW: invalid {what} {v}")));
        if self.lr.is_nan() || self.lr < 0.0 {
            return bad("learning rate", self.lr);
        }
        if self.eps.is_nan() || self.eps < 0.0 {
            return bad("epsilon", self.eps);
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("beta1", self.beta1);
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", self.beta2);
        }
        if self.weight_decay.is_nan() || self.weight_decay < 0.0 {
            return bad("weight_decay", self.weight_decay);
        }
        Ok(())
    }

    fn scalars(&self, step: u64) -> Scalars {
        let t = step as f64;
        let bias_correction1 = 1.0 - self.beta1.powf(t);
        let bias_correction2 = 1.0 - self.beta2.powf(t);
        let w1 = (1.0 - self.beta1) as f32;
        Scalars {
            sign: if self.maximize { -1.0 } else { 1.0 },
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            lerp_small: w1.abs() < 0.5,
            w1,
            one_minus_w1: 1.0 - w1,
            beta2: self.beta2 as f32,
            w2: (1.0 - self.beta2) as f32,
            bc2_sqrt: bias_correction2.sqrt() as f32,
            eps: self.eps as f32,
            neg_step_size: (-(self.lr / bias_correction1)) as f32,
        }
    }

    /// The `step`-th update (counting from 1, as torch's `state["step"]` after its increment)
    /// of `params` from `grads`, with `exp_avg` and `exp_avg_sq` (zeros before the first), all
    /// of one length; then `copy` gets the updated parameters in its dtype.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &self,
        pool: &HostPool,
        step: u64,
        params: &mut [f32],
        grads: Grads<'_>,
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        copy: CopyOut<'_>,
    ) -> Result<()> {
        self.validate()?;
        if step == 0 {
            return Err(Error::Invalid(
                "host AdamW: steps count from 1 (torch's state[\"step\"] after its increment)"
                    .into(),
            ));
        }
        let s = self.scalars(step);
        let streams = Streams::new(params, grads, [exp_avg, exp_avg_sq], 2, copy)?;
        streams.run(pool, |isa, c: &mut Chunk<'_>| {
            let (p, g, [m, v], copy) = c.parts();
            update(isa, &s, p, g, m, v, copy)
        });
        Ok(())
    }
}

multiversion!(fn update(
    s: &Scalars,
    p: &mut [f32],
    g: Grads<'_>,
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [bf16]>,
) => body);

#[inline(always)]
fn body(
    s: &Scalars,
    p: &mut [f32],
    g: Grads<'_>,
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [bf16]>,
) {
    match g {
        Grads::F32(g) => with_grads(s, p, g, m, v, copy),
        Grads::Bf16(g) => with_grads(s, p, g, m, v, copy),
    }
}

#[inline(always)]
fn with_grads<G: ToF32>(
    s: &Scalars,
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [bf16]>,
) {
    match (s.lerp_small, copy) {
        (true, None) => elements::<true, false, G>(s, p, g, m, v, &mut []),
        (false, None) => elements::<false, false, G>(s, p, g, m, v, &mut []),
        (true, Some(c)) => elements::<true, true, G>(s, p, g, m, v, c),
        (false, Some(c)) => elements::<false, true, G>(s, p, g, m, v, c),
    }
}

/// torch's sequence: `p *= 1 - lr*wd`; `m.lerp_(g, 1 - beta1)`; `v.mul_(beta2).addcmul_(g, g,
/// 1 - beta2)`; `denom = v.sqrt() / sqrt(bc2) + eps`; `p.addcdiv_(m, denom, -lr/bc1)`.
/// With `COPY`, each updated parameter also goes to `copy` in bf16.
#[inline(always)]
fn elements<const SMALL: bool, const COPY: bool, G: ToF32>(
    s: &Scalars,
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    copy: &mut [bf16],
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let copy = if COPY { &mut copy[..n] } else { copy };
    for i in 0..n {
        let (p, m, v) = (&mut p[i], &mut m[i], &mut v[i]);
        let g = g[i].to_f32() * s.sign;
        let decayed = *p * s.decay;
        // torch's lerp: the formula that is exact at its end nearer the weight.
        *m = if SMALL {
            *m + s.w1 * (g - *m)
        } else {
            g - (g - *m) * s.one_minus_w1
        };
        *v = *v * s.beta2 + s.w2 * g * g;
        let denom = v.sqrt() / s.bc2_sqrt + s.eps;
        *p = decayed + s.neg_step_size * *m / denom;
        if COPY {
            copy[i] = bf16_from_f32(*p);
        }
    }
}

#[cfg(test)]
mod tests;
