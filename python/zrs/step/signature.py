"""What a captured step (`zrs.CapturedStep`) keys its graphs on: a call's signature (its
arguments and the global modes), and what a graph assumes stays as it was captured."""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch

from zrs._core import ZrsError
from zrs.runtime.handles import local_tensor
from zrs.runtime.state import ZeroState


def signature(value: Any) -> Hashable:
    """One argument's part of a call's signature: a tensor's device, dtype, shape and strides
    (its values are copied into the graph's inputs), any other value itself."""
    if isinstance(value, torch.Tensor):
        return (value.device, value.dtype, tuple(value.shape), value.stride())
    try:
        hash(value)
    except TypeError:
        raise ZrsError(
            f"zrs.CapturedStep: an argument of type {type(value).__name__} is neither a tensor "
            "nor hashable; a captured step takes tensors (copied into the graph's inputs) and "
            "constants"
        ) from None
    return (type(value), value)


def mode() -> Hashable:
    """The global modes a replay would not see change: grad mode and autocast."""
    autocast = torch.is_autocast_enabled("cuda")
    return torch.is_grad_enabled(), autocast and torch.get_autocast_dtype("cuda")


def held(models: list[weakref.ref[ZeroState]], optimizers: list[torch.optim.Optimizer]) -> Hashable:
    """What a graph that runs `models` and steps `optimizers` assumes stays as captured: the
    addresses it reads and writes in place (every model's shards, each optimizer's parameters
    and state), and what changes the step its models run (every module's train/eval flag,
    which parameters train)."""
    out: list[Hashable] = []
    for ref in models:
        state = ref()
        if state is None:
            continue
        module = state.module() if state.module is not None else None
        out.append(tuple(m.training for m in module.modules()) if module is not None else ())
        out.extend((h.shard.data_ptr(), h.param.requires_grad) for h in state.handles)
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                out.append(local_tensor(p).data_ptr())
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        out.append(local_tensor(v).data_ptr())
    return tuple(out)
