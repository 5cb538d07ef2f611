"""A parameter frozen after zrs sharded it (`requires_grad_(False)`, as in progressive unfreezing
or fine-tuning a head first) gets no gradient, so no optimizer steps it; unfrozen, it trains
again."""

from __future__ import annotations

import pytest
import torch

import zrs
from zoo import spec_of


@pytest.mark.parametrize("how", ["compile", "shard"])
def test_a_parameter_frozen_after_sharding_stays_put(how: str) -> None:
    spec = spec_of("bias_stack")
    model = spec.build()
    model = zrs.compile(model, backend="eager") if how == "compile" else zrs.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(i: int) -> None:
        spec.loss(model, spec.batch(0, i)).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    for i in range(1, 3):
        spec.loss(model, spec.batch(0, i)).backward()
        assert frozen.grad is None
        opt.step()
        opt.zero_grad()
    assert torch.equal(before, frozen.detach())
    frozen.requires_grad_(True)
    step(3)
    assert not torch.equal(before, frozen.detach())
