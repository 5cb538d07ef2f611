"""Runtime state lives in objects: a compiled model, its ZeroState, its parameter handles and its
shards are freed when the user drops the model, and the process index forgets them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import zrs
from zrs.runtime.handles import LIVE


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_dropped_model_frees_everything_it_holds(backend):
    torch.manual_seed(0)
    model = zrs.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = model._zrs_state
    held = [model, state, *state.handles, *(h.shard for h in state.handles)]
    refs = [weakref.ref(x) for x in held]
    ds_ids = [h.ds_id for h in state.handles]
    assert all(i in LIVE.handles for i in ds_ids) and state in LIVE.states
    del model, opt, state, held
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, f"still alive after the model was dropped: {alive}"
    assert not any(i in LIVE.handles for i in ds_ids)
