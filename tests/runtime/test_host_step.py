"""A stock torch.optim optimizer's step run by the host optimizer (runtime/host_step.py): the
same trajectory and the same state dict as torch's own step, over several groups, a scheduler's
changing lr and a state dict reloaded midway; and a clear error for what it cannot run."""

from __future__ import annotations

import pytest
import torch

from zrs import _core
from zrs.runtime import host_step
from zrs.runtime.host_optim import HostOptimizer

HOST = HostOptimizer.start(threads=2)
STEPS = 6

OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2, betas=(0.8, 0.99)),
    "adam_decoupled": lambda groups: torch.optim.Adam(
        groups, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, dampening=0.1),
    "sgd_nesterov": lambda groups: torch.optim.SGD(
        groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True
    ),
    "sgd_plain": lambda groups: torch.optim.SGD(groups, lr=0.1),
}


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).requires_grad_() for shape in [(7, 5), (5,), (300,)]]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    # Two groups with their own hyperparameters, as a model's decay and no-decay groups.
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * 0.1 for s in [(7, 5), (5,), (300,)]]


def _host_step(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            host_step.update(HOST, opt, group, p)
            p.grad = None
    opt.step()  # with no gradients left it updates nothing, but schedulers see a step


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_host_step_follows_torch(name):
    make = OPTIMIZERS[name]
    ref_params, host_params = _params(), _params()
    ref, host = make(_groups(ref_params)), make(_groups(host_params))
    host_step.check_supported(host)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref, host)]
    for step in range(STEPS):
        for params in (ref_params, host_params):
            for p, g in zip(params, _grads(step), strict=True):
                p.grad = g.clone()
        ref.step()
        _host_step(host)
        for s in schedulers:
            s.step()
        if step == STEPS // 2:  # a resume midway: the host state loads as torch's does
            saved = host.state_dict()
            host = make(_groups(host_params))
            host.load_state_dict(saved)
            schedulers[1] = torch.optim.lr_scheduler.StepLR(host, step_size=2, gamma=0.5)
            schedulers[1].load_state_dict(schedulers[0].state_dict())
    for r, h in zip(ref_params, host_params, strict=True):
        torch.testing.assert_close(h, r, rtol=2e-6, atol=1e-7)
    want, got = ref.state_dict(), host.state_dict()
    assert want["param_groups"] == got["param_groups"]
    assert want["state"].keys() == got["state"].keys()
    for i, state in want["state"].items():
        assert state.keys() == got["state"][i].keys()
        for key, value in state.items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=2e-6, atol=1e-7)


def test_what_the_host_cannot_run_raises():
    params = _params()
    with pytest.raises(_core.ZrsError, match="Adagrad has no host update"):
        host_step.check_supported(torch.optim.Adagrad(params))
    with pytest.raises(_core.ZrsError, match="sets amsgrad=True"):
        host_step.check_supported(torch.optim.AdamW(params, amsgrad=True))
    with pytest.raises(_core.ZrsError, match=r"use torch\.optim\.AdamW"):
        host_step.check_supported(torch.optim.Adam(params, weight_decay=0.1))
    host_step.check_supported(torch.optim.Adam(params, weight_decay=0.0))
