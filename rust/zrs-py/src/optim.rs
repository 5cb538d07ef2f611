//! Python wrapper for `zrs_core::optim`: the host optimizer's steps over tensors' storage,
//! handed over by address. `zrs.runtime.host_optim` checks the tensors (CPU, contiguous, dtype,
//! length); here the core checks the addresses, and the step runs without the GIL.

use pyo3::prelude::*;
use zrs_core::optim::{self, check_spans, AdamW, CopyOut, Grads, HostPool, Isa, Sgd, Span};
use zrs_core::Error;

use crate::error::ToPyResult;

/// A tensor's storage: its address and dtype name (`float32`, `bfloat16`, `float16`).
type Buffer = (usize, String);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    fn parse(name: &str, what: &str, allowed: &[Dtype]) -> zrs_core::Result<Self> {
        let d = match name {
            "float32" => Dtype::F32,
            "bfloat16" => Dtype::Bf16,
            "float16" => Dtype::F16,
            _ => {
                return Err(Error::Invalid(format!(
                    "host optimizer: {what} of unknown dtype {name}"
                )))
            }
        };
        if allowed.contains(&d) {
            Ok(d)
        } else {
            Err(Error::Invalid(format!(
                "host optimizer: {what} of dtype {name} is not supported"
            )))
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

/// The addresses of one step, checked, as `Send` numbers until the GIL is released.
struct Addresses {
    numel: usize,
    params: usize,
    grads: (usize, Dtype),
    states: [usize; 2],
    copy: Option<(usize, Dtype)>,
}

impl Addresses {
    fn new(
        numel: usize,
        params: usize,
        grads: Buffer,
        states: [Option<usize>; 2],
        copy: Option<Buffer>,
    ) -> zrs_core::Result<Self> {
        let g = Dtype::parse(&grads.1, "gradients", &[Dtype::F32, Dtype::Bf16])?;
        let c = match copy {
            Some((addr, name)) => Some((
                addr,
                Dtype::parse(&name, "the compute-dtype copy", &[Dtype::Bf16, Dtype::F16])?,
            )),
            None => None,
        };
        let span = |name, addr, d: Dtype| Span {
            name,
            addr,
            bytes: numel * d.size(),
            align: d.size(),
        };
        let mut written = vec![span("params", params, Dtype::F32)];
        for (name, s) in ["first state", "second state"].into_iter().zip(states) {
            written.extend(s.map(|addr| span(name, addr, Dtype::F32)));
        }
        written.extend(c.map(|(addr, d)| span("copy", addr, d)));
        check_spans(&written, &[span("gradient", grads.0, g)])?;
        Ok(Self {
            numel,
            params,
            grads: (grads.0, g),
            states: states.map(|s| s.unwrap_or(0)),
            copy: c,
        })
    }

    /// Views the buffers as slices and runs `f` on them.
    ///
    /// SAFETY: the caller (`zrs.runtime.host_optim`) passes the storage of live, contiguous CPU
    /// tensors of `numel` elements of the named dtypes, which nothing else touches during the
    /// step; `new` checked that they are aligned and that no written one overlaps another.
    unsafe fn with_slices<R>(
        &self,
        f: impl FnOnce(&mut [f32], Grads<'_>, [&mut [f32]; 2], CopyOut<'_>) -> R,
    ) -> R {
        let n = self.numel;
        let f32s = |addr: usize, len: usize| -> &mut [f32] {
            if len == 0 || addr == 0 {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(addr as *mut f32, len)
            }
        };
        let grads = match self.grads {
            (_, _) if n == 0 => Grads::F32(&[]),
            (a, Dtype::Bf16) => Grads::Bf16(std::slice::from_raw_parts(a as *const half::bf16, n)),
            (a, _) => Grads::F32(std::slice::from_raw_parts(a as *const f32, n)),
        };
        let copy = match self.copy {
            Some(_) if n == 0 => CopyOut::None,
            Some((a, Dtype::Bf16)) => {
                CopyOut::Bf16(std::slice::from_raw_parts_mut(a as *mut half::bf16, n))
            }
            Some((a, _)) => CopyOut::F16(std::slice::from_raw_parts_mut(a as *mut half::f16, n)),
            None => CopyOut::None,
        };
        let [a, b] = self.states;
        f(f32s(self.params, n), grads, [f32s(a, n), f32s(b, n)], copy)
    }
}

/// The threads that run the host optimizer's steps.
#[pyclass(frozen, name = "HostPool", module = "zrs._core")]
pub struct PyHostPool(HostPool);

#[pymethods]
impl PyHostPool {
    #[new]
    #[pyo3(signature = (threads = 0, isa = None))]
    fn new(threads: usize, isa: Option<&str>) -> PyResult<Self> {
        let isa = match isa {
            None => None,
            Some("avx512") => Some(Isa::Avx512),
            Some("avx2") => Some(Isa::Avx2),
            Some("baseline") => Some(Isa::Baseline),
            Some(other) => {
                let msg =
                    format!("unknown instruction set {other:?}: use avx512, avx2 or baseline");
                return ToPyResult(Err(Error::Invalid(msg))).into_py();
            }
        };
        ToPyResult(HostPool::new(threads, isa).map(Self)).into_py()
    }

    #[getter]
    fn threads(&self) -> usize {
        self.0.threads()
    }

    #[getter]
    fn isa(&self) -> &'static str {
        self.0.isa().name()
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (*, step, lr, beta1, beta2, eps, weight_decay, maximize, numel, params, grads, exp_avg, exp_avg_sq, copy = None))]
    fn adamw(
        &self,
        py: Python<'_>,
        step: u64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        maximize: bool,
        numel: usize,
        params: usize,
        grads: Buffer,
        exp_avg: usize,
        exp_avg_sq: usize,
        copy: Option<Buffer>,
    ) -> PyResult<()> {
        let h = AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            maximize,
        };
        let run = Addresses::new(
            numel,
            params,
            grads,
            [Some(exp_avg), Some(exp_avg_sq)],
            copy,
        )
        .and_then(|a| {
            py.allow_threads(|| {
                // SAFETY: see `Addresses::with_slices`.
                unsafe { a.with_slices(|p, g, [m, v], c| h.step(&self.0, step, p, g, m, v, c)) }
            })
        });
        ToPyResult(run).into_py()
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (*, first, lr, momentum, dampening, weight_decay, nesterov, maximize, numel, params, grads, momentum_buffer = None, copy = None))]
    fn sgd(
        &self,
        py: Python<'_>,
        first: bool,
        lr: f64,
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: bool,
        maximize: bool,
        numel: usize,
        params: usize,
        grads: Buffer,
        momentum_buffer: Option<usize>,
        copy: Option<Buffer>,
    ) -> PyResult<()> {
        let h = Sgd {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize,
        };
        let run =
            Addresses::new(numel, params, grads, [momentum_buffer, None], copy).and_then(|a| {
                py.allow_threads(|| {
                    // SAFETY: see `Addresses::with_slices`.
                    unsafe { a.with_slices(|p, g, [b, _], c| h.step(&self.0, first, p, g, b, c)) }
                })
            });
        ToPyResult(run).into_py()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyHostPool>()?;
    m.add("HOST_ISA", optim::Isa::detect().name())
}
