//! SGD with momentum over flat f32 shards, in `torch.optim.SGD`'s order of operations.

use super::convert::{bf16_from_f32, ToF32};
use super::{multiversion, Chunk, CopyOut, Grads, HostPool, Streams};
use crate::error::{Error, Result};
use half::bf16;

/// SGD's hyperparameters, as `torch.optim.SGD` takes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    pub maximize: bool,
}

struct Scalars {
    sign: f32,
    weight_decay: f32,
    momentum: f32,
    one_minus_dampening: f32,
    neg_lr: f32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// No momentum buffer.
    Plain,
    /// The first step: the buffer becomes the gradient.
    First,
    /// Later steps: the buffer decays and takes the gradient.
    Later,
}

impl Sgd {
    /// The checks `torch.optim.SGD` makes on its arguments.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Invalid(format!("host SGD: invalid {what}")));
        if self.lr.is_nan() || self.lr < 0.0 {
            return bad("learning rate");
        }
        if self.momentum.is_nan() || self.momentum < 0.0 {
            return bad("momentum");
        }
        if self.weight_decay.is_nan() || self.weight_decay < 0.0 {
            return bad("weight_decay");
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return bad("nesterov: it requires a momentum and zero dampening");
        }
        Ok(())
    }

    /// One update of `params` from `grads`. With a momentum, `momentum_buffer` has the
    /// parameters' length and `first` says it holds nothing yet (torch's `None` buffer); without
    /// one it may be empty. Then `copy` gets the updated parameters in its dtype.
    pub fn step(
        &self,
        pool: &HostPool,
        first: bool,
        params: &mut [f32],
        grads: Grads<'_>,
        momentum_buffer: &mut [f32],
        copy: CopyOut<'_>,
    ) -> Result<()> {
        self.validate()?;
        let mode = match (self.momentum != 0.0, first) {
            (false, _) => Mode::Plain,
            (true, true) => Mode::First,
            (true, false) => Mode::Later,
        };
        let s = Scalars {
            sign: if self.maximize { -1.0 } else { 1.0 },
            weight_decay: self.weight_decay as f32,
            momentum: self.momentum as f32,
            one_minus_dampening: (1.0 - self.dampening) as f32,
            neg_lr: (-self.lr) as f32,
        };
        let used = usize::from(mode != Mode::Plain);
        let (nesterov, decays) = (self.nesterov, self.weight_decay != 0.0);
        let streams = Streams::new(params, grads, [momentum_buffer, &mut []], used, copy)?;
        streams.run(pool, |isa, c: &mut Chunk<'_>| {
            let (p, g, [buf, _], copy) = c.parts();
            update(isa, &s, mode, nesterov, decays, p, g, buf, copy)
        });
        Ok(())
    }
}

multiversion!(fn update(
    s: &Scalars,
    mode: Mode,
    nesterov: bool,
    decays: bool,
    p: &mut [f32],
    g: Grads<'_>,
    buf: &mut [f32],
    copy: Option<&mut [bf16]>,
) => body);

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn body(
    s: &Scalars,
    mode: Mode,
    nesterov: bool,
    decays: bool,
    p: &mut [f32],
    g: Grads<'_>,
    buf: &mut [f32],
    copy: Option<&mut [bf16]>,
) {
    let k = Kind {
        mode,
        nesterov,
        decays,
    };
    match (g, copy) {
        (Grads::F32(g), None) => elements::<false, f32>(s, k, p, g, buf, &mut []),
        (Grads::F32(g), Some(c)) => elements::<true, f32>(s, k, p, g, buf, c),
        (Grads::Bf16(g), None) => elements::<false, bf16>(s, k, p, g, buf, &mut []),
        (Grads::Bf16(g), Some(c)) => elements::<true, bf16>(s, k, p, g, buf, c),
    }
}

/// The branches of one step, the same for every element.
#[derive(Clone, Copy)]
struct Kind {
    mode: Mode,
    nesterov: bool,
    decays: bool,
}

/// torch's sequence: `g = g + wd*p` (when `wd != 0`); the buffer `b = g` on the first step,
/// else `b = b*momentum + (1 - dampening)*g`; `g = g + momentum*b` (Nesterov) or `g = b`;
/// `p = p + (-lr)*g`. With `COPY`, each updated parameter also goes to `copy` in bf16.
#[inline(always)]
fn elements<const COPY: bool, G: ToF32>(
    s: &Scalars,
    k: Kind,
    p: &mut [f32],
    g: &[G],
    buf: &mut [f32],
    copy: &mut [bf16],
) {
    let n = p.len();
    let g = &g[..n];
    let copy = if COPY { &mut copy[..n] } else { copy };
    let grad = |p: f32, g: G| {
        let g = g.to_f32() * s.sign;
        // `g + 0*p` would turn -0 into +0 and an infinite p into NaN: torch skips it, so must we.
        if k.decays {
            g + s.weight_decay * p
        } else {
            g
        }
    };
    if k.mode == Mode::Plain {
        for i in 0..n {
            p[i] += s.neg_lr * grad(p[i], g[i]);
            if COPY {
                copy[i] = bf16_from_f32(p[i]);
            }
        }
        return;
    }
    let buf = &mut buf[..n];
    let first = k.mode == Mode::First;
    for i in 0..n {
        let g = grad(p[i], g[i]);
        let b = &mut buf[i];
        *b = if first {
            g
        } else {
            *b * s.momentum + s.one_minus_dampening * g
        };
        let d = if k.nesterov { g + s.momentum * *b } else { *b };
        p[i] += s.neg_lr * d;
        if COPY {
            copy[i] = bf16_from_f32(p[i]);
        }
    }
}

#[cfg(test)]
mod tests;
