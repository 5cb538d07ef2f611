"""Helpers of the checkpoint tests (tests/e2e/test_checkpoint.py on CPU, the GPU suite's DCP
checkpoint): a zoo model sharded by zrs with its optimizer, trained a few steps, saved and
loaded with PyTorch's DCP recipe, and its whole state gathered for comparison.

A run is a tuple `(model, zrs backend, optimizer, ...)`: the model's name in the zoos
(`zoo.spec_of`), a zrs.compile backend or "shard" (zrs.shard, the eager path; "shard-offload"
with the optimizer on the host), "sgd" (SGD with momentum) or "adamw".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from zoo import LR, MOMENTUM, spec_of


def optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    return torch.optim.AdamW(params, lr=1e-2)


def sharded(spec: Any, backend: str, device: str = "cpu") -> torch.nn.Module:
    """The zoo model on `device`, sharded by zrs.shard ("shard") or zrs.compile(backend=); with
    offload="optimizer" after "-offload" ("shard-offload", "eager-offload")."""
    import zrs

    model = spec.build().to(device)
    api = backend.removesuffix("-offload")
    kwargs = {"offload": "optimizer"} if api != backend else {}
    if api == "shard":
        return zrs.shard(model, **kwargs)
    return zrs.compile(model, backend=api, **kwargs)


def new(
    run: tuple[str, ...], device: str = "cpu"
) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    """The run's spec, sharded model and optimizer."""
    spec = spec_of(run[0])
    model = sharded(spec, run[1], device)
    return spec, model, optimizer(run[2], model.parameters())


def train(
    spec: Any,
    model: Any,
    opt: torch.optim.Optimizer,
    rank: int,
    steps: range,
    device: str = "cpu",
) -> None:
    """Train `steps` on this rank's batches of those steps."""

    def to_device(t: Any) -> Any:
        return t.to(device) if isinstance(t, torch.Tensor) else t

    for step in steps:
        opt.zero_grad(set_to_none=True)
        spec.loss(model, tree_map(to_device, spec.batch(rank, step))).backward()
        opt.step()


def full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and the optimizer's state as full CPU tensors, keyed by parameter name.

    Gathered through zrs's own collectives: DTensor's redistribution runs gloo collectives
    whose buffers a worker thread may free (one rank of the full suite died in free() inside
    `get_optimizer_state_dict(full_state_dict=True)`; zrs.runtime.exchange says why zrs keeps its
    own alive)."""
    import zrs
    from zrs.checkpointing.optimizer_rows import ROWS
    from zrs.runtime import collectives
    from zrs.runtime.handles import ParamHandle

    handles = {id(h.param): h for h in model._zrs_state.handles}

    def gathered(h: ParamHandle, value: torch.Tensor) -> torch.Tensor:
        if not isinstance(value, DTensor):
            return value.detach().cpu().clone()
        flat = torch.zeros(h.shard_numel, dtype=value.dtype, device=value.device)
        flat[: h.local_numel] = value.to_local().reshape(-1)
        return collectives.gather_full(h, flat, None).cpu().clone()

    optim = {
        # (zrs's mark of the state's rows is shaped like the rows, not the parameter: left out)
        name: {k: gathered(handles[id(p)], v) for k, v in opt.state[p].items() if k != ROWS}
        for name, p in model.named_parameters()
        if p in opt.state
    }
    return {"model": zrs.full_state_dict(model, cpu_offload=True), "optim": optim}


def dcp_save(model: torch.nn.Module, opt: torch.optim.Optimizer, where: str) -> None:
    """PyTorch's recipe, as FSDP2 users write it."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)


def dcp_load(model: torch.nn.Module, opt: torch.optim.Optimizer, where: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    content = {"model": model_sd, "optim": optim_sd}
    dcp.load(content, checkpoint_id=where)
    set_state_dict(model, opt, model_state_dict=content["model"], optim_state_dict=content["optim"])


def assert_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Nested dicts of tensors with the same keys and bit-identical tensors."""
    assert got.keys() == want.keys(), f"{what}: keys differ"
    for key in want:
        if isinstance(want[key], dict):
            assert_equal(got[key], want[key], f"{what} {key}")
        elif isinstance(want[key], torch.Tensor):
            assert torch.equal(got[key], want[key]), f"{what}: {key} differs"
