//! The host optimizer of offloaded training (issue 37): fused AdamW and SGD with momentum over
//! flat f32 shards in host memory, each writing the compute-dtype copy of the parameters it
//! updates in the same pass over a chunk.
//!
//! Each step follows the order of operations of `torch.optim`'s single-tensor update (the one
//! it runs for CPU tensors by default), each operation rounded to f32 as there, so that an
//! offloaded run and a run of the stock optimizer agree to a stated number of ulps
//! (`tests/optim/test_host_optim.py`). No floating-point operation is reordered or fused: the
//! same bits come out at every vector width and thread count.
//!
//! Work splits into chunks run by a pool of threads of its own ([`HostPool`]), so that the
//! caller's threads (torch's, Python's) stay free; within a chunk, the element loop is compiled
//! once per instruction set (AVX-512, AVX2, the baseline) and the widest the CPU has runs.

mod adamw;
mod convert;
mod sgd;
mod spans;
#[cfg(test)]
mod testing;

pub use adamw::AdamW;
pub use sgd::Sgd;
pub use spans::{check_spans, Span};

use crate::error::{Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// Elements a task updates: 128 KiB of each f32 stream, enough work per task that the pool's
/// hand-offs cost nothing measurable.
const CHUNK: usize = 32 * 1024;

/// The gradient shard a step reads: f32, or bf16 when gradients are reduced in bf16.
#[derive(Clone, Copy)]
pub enum Grads<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// Where the updated parameters' compute-dtype copy goes, if anywhere.
pub enum CopyOut<'a> {
    None,
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// The widest vector instructions this CPU has, picked once per pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Baseline,
}

impl Isa {
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Baseline => "baseline",
        }
    }
}

/// The threads that run host optimizer steps, and the instruction set their loops use.
pub struct HostPool {
    pool: rayon::ThreadPool,
    isa: Isa,
}

impl HostPool {
    /// `threads` workers (0: one per core rayon sees); `isa` caps the instruction set (for tests
    /// and benchmarks), `None` takes the widest the CPU has.
    pub fn new(threads: usize, isa: Option<Isa>) -> Result<Self> {
        let detected = Isa::detect();
        let isa = match isa {
            None => detected,
            Some(want) if supported(want, detected) => want,
            Some(want) => {
                return Err(Error::Invalid(format!(
                    "this CPU lacks the {} instructions asked for; its widest are {}",
                    want.name(),
                    detected.name()
                )))
            }
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("zrs-host-optim-{i}"))
            .build()
            .map_err(|e| {
                Error::Invalid(format!("could not start the host optimizer's threads: {e}"))
            })?;
        Ok(Self { pool, isa })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }
}

fn supported(want: Isa, have: Isa) -> bool {
    let rank = |i: Isa| match i {
        Isa::Baseline => 0,
        Isa::Avx2 => 1,
        Isa::Avx512 => 2,
    };
    rank(want) <= rank(have)
}

/// The streams of one step, checked to have the parameters' length.
struct Streams<'a> {
    params: &'a mut [f32],
    grads: Grads<'a>,
    states: [&'a mut [f32]; 2],
    copy: CopyOut<'a>,
}

/// One chunk of every stream, as a task sees it.
struct Chunk<'a> {
    params: &'a mut [f32],
    grads: Grads<'a>,
    states: [&'a mut [f32]; 2],
    copy: CopyOut<'a>,
}

/// A chunk's streams for an update's element loop, which writes a bf16 copy itself (an f16 one
/// is written after the loop, by `convert`).
type Parts<'c> = (
    &'c mut [f32],
    Grads<'c>,
    [&'c mut [f32]; 2],
    Option<&'c mut [bf16]>,
);

impl Chunk<'_> {
    fn parts(&mut self) -> Parts<'_> {
        let copy = match &mut self.copy {
            CopyOut::Bf16(out) => Some(&mut **out),
            _ => None,
        };
        let [a, b] = &mut self.states;
        (self.params, self.grads, [&mut **a, &mut **b], copy)
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "host optimizer: the {what} shard has {got} elements but the parameters' has {want}; \
             pass shards of one flat range"
        )))
    }
}

impl<'a> Streams<'a> {
    /// `used` states are checked; the rest may be empty.
    fn new(
        params: &'a mut [f32],
        grads: Grads<'a>,
        states: [&'a mut [f32]; 2],
        used: usize,
        copy: CopyOut<'a>,
    ) -> Result<Self> {
        let n = params.len();
        let glen = match grads {
            Grads::F32(g) => g.len(),
            Grads::Bf16(g) => g.len(),
        };
        check_len("gradient", glen, n)?;
        for (i, s) in states.iter().enumerate() {
            // A state the step does not use may be left empty.
            if i < used || !s.is_empty() {
                check_len(["first state", "second state"][i], s.len(), n)?;
            }
        }
        match &copy {
            CopyOut::None => {}
            CopyOut::Bf16(c) => check_len("compute-dtype copy", c.len(), n)?,
            CopyOut::F16(c) => check_len("compute-dtype copy", c.len(), n)?,
        }
        Ok(Self {
            params,
            grads,
            states,
            copy,
        })
    }

    /// Splits every stream into chunks of [`CHUNK`] elements (states that are empty stay
    /// empty) and runs `update` on each chunk in `pool` (an f16 copy after it).
    fn run(self, pool: &HostPool, update: impl Fn(Isa, &mut Chunk<'_>) + Sync) {
        let Streams {
            params,
            grads,
            states: [s0, s1],
            copy,
        } = self;
        let n = params.len();
        let starts: Vec<usize> = (0..n).step_by(CHUNK).collect();
        let mut chunks: Vec<Chunk<'_>> = Vec::with_capacity(starts.len());
        let (mut p, mut a, mut b, mut c) = (params, s0, s1, copy);
        let mut g = grads;
        for _ in &starts {
            let take = p.len().min(CHUNK);
            let (ph, pt) = p.split_at_mut(take);
            let (ah, at) = split_state(a, take);
            let (bh, bt) = split_state(b, take);
            let (gh, gt) = match g {
                Grads::F32(x) => (Grads::F32(&x[..take]), Grads::F32(&x[take..])),
                Grads::Bf16(x) => (Grads::Bf16(&x[..take]), Grads::Bf16(&x[take..])),
            };
            let (ch, ct) = match c {
                CopyOut::None => (CopyOut::None, CopyOut::None),
                CopyOut::Bf16(x) => {
                    let (h, t) = x.split_at_mut(take);
                    (CopyOut::Bf16(h), CopyOut::Bf16(t))
                }
                CopyOut::F16(x) => {
                    let (h, t) = x.split_at_mut(take);
                    (CopyOut::F16(h), CopyOut::F16(t))
                }
            };
            chunks.push(Chunk {
                params: ph,
                grads: gh,
                states: [ah, bh],
                copy: ch,
            });
            (p, a, b, c, g) = (pt, at, bt, ct, gt);
        }
        let isa = pool.isa;
        pool.pool.install(|| {
            chunks.par_iter_mut().for_each(|chunk| {
                update(isa, chunk);
                convert::write_f16_copy(chunk.params, &mut chunk.copy);
            })
        });
    }
}

fn split_state(s: &mut [f32], take: usize) -> (&mut [f32], &mut [f32]) {
    if s.is_empty() {
        s.split_at_mut(0)
    } else {
        s.split_at_mut(take)
    }
}

/// Defines `fn $name(isa, args)`, which runs `$body(args)` compiled for `isa`: `$body` is
/// `#[inline(always)]` into one function per instruction set, so LLVM vectorises its element
/// loops at that width; without fast-math flags every operation keeps its rounding.
macro_rules! multiversion {
    (fn $name:ident($($arg:ident : $ty:ty),* $(,)?) => $body:path) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(isa: $crate::optim::Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx512f")]
                unsafe fn wide($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx2")]
                unsafe fn mid($($arg: $ty),*) {
                    $body($($arg),*)
                }
                match isa {
                    // SAFETY: a pool picks an instruction set only after detecting it.
                    $crate::optim::Isa::Avx512 => unsafe { wide($($arg),*) },
                    $crate::optim::Isa::Avx2 => unsafe { mid($($arg),*) },
                    $crate::optim::Isa::Baseline => $body($($arg),*),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                let _ = isa;
                $body($($arg),*)
            }
        }
    };
}
pub(crate) use multiversion;
