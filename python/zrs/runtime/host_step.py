"""A stock ``torch.optim`` optimizer's update, run on the host (offload, issue 37).

The user builds ``torch.optim.AdamW``, ``Adam`` or ``SGD`` over ``model.parameters()`` as
always; with offload, each parameter's fp32 master shard lives in host memory and the update of
that shard runs in zrs-core (``host_optim.HostOptimizer``) with the group's hyperparameters as
they are at that step (a scheduler's ``lr`` included). The state stays in torch's own format
and place, ``optimizer.state[param]`` (``step``, ``exp_avg``, ``exp_avg_sq``; or
``momentum_buffer``), as host tensors shaped like the master shard, so that ``state_dict``,
``load_state_dict`` and checkpoints see what they would see without offload.

Optimizers and options the host update cannot run raise a ``ZrsError`` before the first step,
never a silent fallback to the GPU or to torch's CPU update.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from zrs import _core
from zrs.runtime.host_optim import HostOptimizer

SUPPORTED = "torch.optim.AdamW, torch.optim.Adam and torch.optim.SGD"
# Options whose value must be the default for the host update to match torch's.
_DEFAULTS = {"amsgrad": False, "capturable": False, "differentiable": False}


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raises unless every group of ``optimizer`` can run on the host."""
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        raise _core.ZrsError(
            f"offload runs the optimizer step on the host for {SUPPORTED}; "
            f"{kind.__module__}.{kind.__qualname__} has no host update. Use one of those, or "
            "train without offload"
        )
    for i, group in enumerate(optimizer.param_groups):
        for key, default in _DEFAULTS.items():
            if group.get(key, default) != default:
                raise _core.ZrsError(
                    f"offload: param group {i} sets {key}={group[key]!r}, which the host "
                    f"update does not support; set {key}={default!r}"
                )
        adam_l2 = kind is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
        if adam_l2 and group["weight_decay"] != 0:
            raise _core.ZrsError(
                f"offload: param group {i} of torch.optim.Adam has weight_decay="
                f"{group['weight_decay']} (an L2 term in the gradient), which the host update "
                "does not support; use torch.optim.AdamW (decoupled decay) or weight_decay=0"
            )


def update(
    host: HostOptimizer,
    optimizer: torch.optim.Optimizer,
    group: dict,
    param: torch.Tensor,
    copy: torch.Tensor | None = None,
) -> None:
    """One update of ``param`` (fp32 on the host, plain or a DTensor over this rank's rows) from
    its ``.grad`` by the rule of ``optimizer`` with ``group``'s hyperparameters, its state in
    ``optimizer.state[param]`` (made on the first update as torch makes it: tensors like
    ``param``); ``copy`` gets the updated rows in its dtype."""
    master, grad = _local(param), _local(param.grad)
    if isinstance(optimizer, torch.optim.SGD):
        momentum = group["momentum"]
        # torch keeps no state for SGD without momentum: touching it would add an empty entry.
        state = optimizer.state[param] if momentum != 0 else {}
        first = state.get("momentum_buffer") is None
        if momentum != 0 and first:
            state["momentum_buffer"] = torch.empty_like(param)
        buf = state.get("momentum_buffer")
        host.sgd(
            master, grad, None if buf is None else _local(buf), first=first, lr=group["lr"],
            momentum=momentum, dampening=group["dampening"],
            weight_decay=group["weight_decay"], nesterov=group["nesterov"],
            maximize=group["maximize"], copy=copy,
        )  # fmt: skip
        return
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    state["step"] += 1
    host.adamw(
        master, grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
        step=int(state["step"].item()), lr=group["lr"], betas=group["betas"], eps=group["eps"],
        weight_decay=group["weight_decay"] if _decoupled(optimizer, group) else 0.0,
        maximize=group["maximize"], copy=copy,
    )  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    # handles.local_tensor's twin: this module sits a tier below handles (the runtime's DAG)
    return t._local_tensor if isinstance(t, DTensor) else t


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
