"""An optimizer's state dict in full tensors, for the libraries whose checkpoint is one file.

Accelerate's `save_state` and Trainer's checkpoints write one optimizer file on the main process
and load it on every rank. A sharded model's optimizer state is each rank's rows, so that file
needs the full tensors instead: `gather` turns a `state_dict()` into them (a collective: every
rank calls it, in the same order), and `scatter` turns a loaded one back into this rank's rows, at
any world size. Everything else in the state dict (param groups, `step`, the state of parameters
zrs does not shard) passes through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zrs.checkpointing.optimizer_rows import ROWS, sharded_params
from zrs.runtime.handles import ParamHandle


def _by_index(optimizer: torch.optim.Optimizer) -> dict[int, ParamHandle]:
    """The sharded parameters by their index in `optimizer.state_dict()`: the order of its
    param groups' parameters."""
    sharded = {id(p): h for p, h in sharded_params(optimizer)}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: sharded[id(p)] for i, p in enumerate(order) if id(p) in sharded}


def gather(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with each sharded parameter's state as full tensors on the CPU (without
    zrs's rows mark, which belongs to one rank). Collective."""
    state = dict(state_dict["state"])
    for i, h in sorted(_by_index(optimizer).items()):
        if i not in state:
            continue
        entry = {}
        for key in sorted(state[i]):
            value = state[i][key]
            if key == ROWS:
                continue
            if isinstance(value, DTensor) and tuple(value.shape) == h.shape:
                value = value.full_tensor().cpu()
            entry[key] = value
        state[i] = entry
    return {**state_dict, "state": state}


def scatter(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` (as `gather` wrote it) with each sharded parameter's full tensors cut to
    this rank's rows, as DTensors like the parameter."""
    state = dict(state_dict["state"])
    for i, h in _by_index(optimizer).items():
        if i not in state:
            continue
        entry = dict(state[i])
        for key, value in entry.items():
            full = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
            if full and tuple(value.shape) == h.shape and h.spec is not None:
                first = h.state.rank * h.state.registry.info(h.slot).shard_rows
                local = value.narrow(0, first, h.local_shape[0]).to(h.param.device)
                entry[key] = DTensor(local.contiguous(), h.spec, requires_grad=False)
        state[i] = entry
    return {**state_dict, "state": state}
