"""The host optimizer (zrs-core's AdamW and SGD over CPU tensors) against torch.optim's.

From the same state, one update of each element agrees with torch's to within 4 roundings of the
terms that make it (units of 2^-24 times the sum of their magnitudes; `_errors`); nearly every
element comes out bit for bit (torch's vector kernels fuse some multiply-adds that zrs-core does
not). The compute-dtype copy equals the updated parameters cast by torch, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zrs import _core
from zrs.runtime.host_optim import HostOptimizer

ROUNDINGS = 4.0
HOST = HostOptimizer.start(threads=2)


def _errors(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    err = (got.double() - want.double()).abs()
    units = (err / (scale.double() * 2.0**-24)).nan_to_num(0.0)
    return max(units.tolist(), default=0.0)


def _state(seed: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "p": torch.randn(n, generator=g) * 0.3,
        "g": torch.randn(n, generator=g) * 1e-2,
        "a": torch.randn(n, generator=g) * 1e-3,
        "b": torch.rand(n, generator=g) * 1e-4,
    }


def _torch_step(opt_cls, s: dict, grad: torch.Tensor, state: dict, **hyper) -> tuple:
    ref = s["p"].clone().requires_grad_()
    opt = opt_cls([ref], **hyper)
    if state:
        opt.state[ref] = {k: v.clone() for k, v in state.items()}
    ref.grad = grad.clone()
    opt.step()
    return ref.detach(), opt.state[ref]


sizes = st.integers(0, 5000)
grad_dtypes = st.sampled_from([torch.float32, torch.bfloat16])
copy_dtypes = st.sampled_from([None, torch.bfloat16, torch.float16])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31), n=sizes, step=st.integers(1, 1000),
    lr=st.floats(1e-5, 1e-1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.9, 0.9999),
    eps=st.floats(1e-10, 1e-6), weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    maximize=st.booleans(), grad_dtype=grad_dtypes, copy_dtype=copy_dtypes,
)  # fmt: skip
def test_adamw_agrees_with_torch(
    seed, n, step, lr, beta1, beta2, eps, weight_decay, maximize, grad_dtype, copy_dtype
):
    s = _state(seed, n)
    grad = s["g"].to(grad_dtype)
    hyper = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    state = {"step": torch.tensor(float(step - 1)), "exp_avg": s["a"], "exp_avg_sq": s["b"]}
    want, want_state = _torch_step(
        torch.optim.AdamW, s, grad.float(), state, maximize=maximize, **hyper
    )
    p, m, v = s["p"].clone(), s["a"].clone(), s["b"].clone()
    copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)
    HOST.adamw(p, grad, m, v, step=step, maximize=maximize, copy=copy, **hyper)

    m_scale = s["a"].abs() + grad.float().abs()
    assert _errors(m, want_state["exp_avg"], m_scale) <= ROUNDINGS
    assert _errors(v, want_state["exp_avg_sq"], v) <= ROUNDINGS
    moved = (p - s["p"]).abs() * m_scale / m.abs().clamp_min(1e-30)
    assert _errors(p, want, s["p"].abs() + moved) <= ROUNDINGS
    if copy is not None:
        assert torch.equal(copy, p.to(copy_dtype))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31), n=sizes, first=st.booleans(), lr=st.floats(1e-4, 1.0),
    momentum=st.sampled_from([0.0, 0.5, 0.9]), dampening=st.sampled_from([0.0, 0.1]),
    weight_decay=st.sampled_from([0.0, 0.01]), nesterov=st.booleans(), maximize=st.booleans(),
    grad_dtype=grad_dtypes, copy_dtype=copy_dtypes,
)  # fmt: skip
def test_sgd_agrees_with_torch(
    seed, n, first, lr, momentum, dampening, weight_decay, nesterov, maximize, grad_dtype,
    copy_dtype,
):  # fmt: skip
    nesterov = nesterov and momentum > 0
    dampening = 0.0 if nesterov else dampening
    s = _state(seed, n)
    grad = s["g"].to(grad_dtype)
    hyper = dict(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
        nesterov=nesterov, maximize=maximize,
    )  # fmt: skip
    state = {} if first or momentum == 0 else {"momentum_buffer": s["a"]}
    want, want_state = _torch_step(torch.optim.SGD, s, grad.float(), state, **hyper)
    p, buf = s["p"].clone(), s["a"].clone() if momentum else None
    copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)
    HOST.sgd(p, grad, buf, first=first, copy=copy, **hyper)

    g_scale = grad.float().abs() + weight_decay * s["p"].abs()
    b_scale = g_scale if first or not momentum else momentum * s["a"].abs() + g_scale
    d_scale = g_scale + momentum * b_scale if nesterov else b_scale
    if momentum:
        assert _errors(buf, want_state["momentum_buffer"], b_scale) <= ROUNDINGS
    assert _errors(p, want, s["p"].abs() + lr * d_scale) <= ROUNDINGS
    if copy is not None:
        assert torch.equal(copy, p.to(copy_dtype))


def test_most_elements_come_out_bit_for_bit():
    s = _state(0, 100_003)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    state = {"step": torch.tensor(4.0), "exp_avg": s["a"], "exp_avg_sq": s["b"]}
    want, _ = _torch_step(torch.optim.AdamW, s, s["g"], state, **hyper)
    p = s["p"].clone()
    HOST.adamw(p, s["g"], s["a"].clone(), s["b"].clone(), step=5, **hyper)
    assert (p == want).float().mean().item() > 0.99


def test_bad_buffers_raise():
    p, g, a = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    hyper = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with pytest.raises(_core.ZrsError, match="first state buffer overlaps the second"):
        HOST.adamw(p, g, a, a, **hyper)
    with pytest.raises(_core.ZrsError, match="contiguous CPU tensor of 8 elements"):
        HOST.adamw(torch.zeros(16)[::2], g, a, torch.zeros(8), **hyper)
    with pytest.raises(_core.ZrsError, match=r"must be torch\.float32"):
        HOST.adamw(p.double(), g, a, torch.zeros(8), **hyper)
    with pytest.raises(_core.ZrsError, match="contiguous CPU tensor of 8 elements"):
        HOST.adamw(p, torch.zeros(7), a, torch.zeros(8), **hyper)
    with pytest.raises(_core.ZrsError, match="invalid beta1"):
        HOST.adamw(p, g, a, torch.zeros(8), **(hyper | {"betas": (1.0, 0.999)}))
    with pytest.raises(_core.ZrsError, match="needs a momentum buffer"):
        HOST.sgd(p, g, None, first=True, lr=0.1, momentum=0.9)
    with pytest.raises(_core.ZrsError, match="unknown instruction set"):
        HostOptimizer.start(1, "sse9")
