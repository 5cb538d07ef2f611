"""A model built on the meta device is sharded module by module, never as a full copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zrs
from _dist import run_workers
from zrs.prepare import sharding


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))


def _reference() -> dict[str, torch.Tensor]:
    """What module-by-module initialisation in `modules()` order gives, from the same seed."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _build()
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    for m in model.modules():
        if next(m.parameters(recurse=False), None) is not None:
            m.reset_parameters()
    return model.state_dict()


def _meta_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = _build()
    seen = []
    materialize = sharding._materialize

    def spy(module, device, init_fn):
        # Only the module being sharded may hold full tensors at this point.
        seen.append(sum(p.numel() for p in module.parameters(recurse=False)))
        materialize(module, device, init_fn)

    sharding._materialize = spy
    torch.manual_seed(1)
    zrs.compile(model, backend="eager")
    assert all(not p.is_meta for p in model.parameters())
    assert seen == [5 * 7 + 7, 7 + 7, 7 * 3], seen
    x = torch.randn(2, 5)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    return zrs.full_state_dict(model)


@pytest.mark.parametrize("world", [1, 2])
def test_meta_model_matches_module_by_module_init(world):
    ref = _reference()
    for sd in run_workers(_meta_worker, world, timeout=600):
        assert sd.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(sd[k], ref[k])
