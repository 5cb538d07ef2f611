"""State dicts of a sharded model: the full export, the full import, and the guard on shards.

`model.state_dict()` holds the parameters as they are, DTensors (FSDP2's form), which
torch.distributed.checkpoint saves, reshards and loads. Three ordinary calls need more:

* `full_state_dict(model)` gathers full tensors, one parameter at a time, optionally to the CPU
  and onto rank 0 only, so a model larger than one device can be exported;
* `model.load_state_dict(full)` of an unsharded state dict (a plain model's, a `torch.load` of
  one): each rank keeps its rows (a hook on every sharded module);
* a `torch.save` of one rank's `model.state_dict()` holds that rank's rows only: loaded on
  another rank, or at another world size, it raises instead of copying the wrong rows (each
  saved DTensor carries the rank and world size that produced it).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zrs._core import ZrsError
from zrs.checkpointing.optimizer_rows import OPTIMIZER_ROWS
from zrs.runtime import collectives, handles
from zrs.runtime.handles import ParamHandle

# Attribute of a state-dict DTensor: (rank, world size) of the rank whose rows it holds. It
# survives torch.save (a tensor subclass pickles its __dict__).
_SAVED_BY = "_zrs_saved_by"


def _sharded(module: nn.Module) -> dict[str, ParamHandle]:
    return {
        name: handles.handle(ds_id)
        for name, (ds_id, _, _) in getattr(module, "_zrs_params", {}).items()
    }


def _mark_saved(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for name, h in _sharded(module).items():
        # The state dict's tensors alias the masters, and what writes them next may bump no
        # version counter (DCP's in-place load): with offload, the device copy is made again
        # from the master before its next gather (and after a load_state_dict, above).
        h.compute_version = None
        value = state_dict.get(prefix + name)
        if isinstance(value, DTensor):
            setattr(value, _SAVED_BY, (h.state.rank, h.state.world_size))


def _local_rows(h: ParamHandle, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full tensor `full`, as the parameter holds it."""
    full = full.detach().to(h.param.device, h.shard.dtype)
    if h.spec is None or not h.shape:  # the whole tensor; a 0-d one is replicated
        return full if h.spec is None else DTensor(full, h.spec, requires_grad=False)
    first = h.state.rank * h.state.registry.info(h.slot).shard_rows
    local = full.narrow(0, first, h.local_shape[0]).contiguous()
    return DTensor(local, h.spec, requires_grad=False)


def _take_local_rows(
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    """Before `module` loads: keep this rank's rows of each full tensor, and refuse another
    rank's shards."""
    for name, h in _sharded(module).items():
        h.compute_version = None  # with offload: the device copy is made again after the load
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, DTensor):
            saved_by = getattr(value, _SAVED_BY, None)
            here = (h.state.rank, h.state.world_size)
            if saved_by is not None and saved_by != here:
                raise ZrsError(
                    f"{key!r} holds the rows of rank {saved_by[0]} of {saved_by[1]}, not this "
                    f"rank's ({here[0]} of {here[1]}): a sharded model's state_dict() is one "
                    "rank's part. Save and load with torch.distributed.checkpoint "
                    "(zrs.checkpoint.save / load), or save zrs.full_state_dict(model) and load "
                    "that on every rank"
                )
        elif isinstance(value, torch.Tensor) and tuple(value.shape) == h.shape:
            state_dict[key] = _local_rows(h, value)


def install_hooks(model: nn.Module) -> None:
    """Give each module of a sharded model that has sharded parameters the two state-dict hooks
    above, and every optimizer step the check of the optimizer state's rows."""
    OPTIMIZER_ROWS.install()
    for module in model.modules():
        if getattr(module, "_zrs_params", None):
            module._register_state_dict_hook(_mark_saved)
            module._register_load_state_dict_pre_hook(_take_local_rows, with_module=True)


def full_state_dict(
    model: nn.Module,
    *,
    rank0_only: bool = False,
    cpu_offload: bool = False,
    keys: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Full, unsharded tensors keyed like the original model's `state_dict()`; with `keys`,
    those entries only (a PEFT adapter's, say), and only their parameters are gathered.

    Collective: every rank of the model's process group must call it, in the same order as its
    other zrs calls, with the same keys. The ranks meet first, so a call on some ranks only
    raises ZrsError on those within zrs's timeout instead of waiting in a gather. Parameters
    are gathered one at a time; with `cpu_offload` each goes to the CPU before the next is
    gathered (device memory: one full parameter), and with `rank0_only` the other ranks drop
    theirs at once and return an empty dict.
    """
    if not any(getattr(m, "_zrs_params", None) for m in model.modules()):
        raise ZrsError("full_state_dict needs a model sharded by zrs.compile")
    local = model.state_dict()
    if keys is not None:
        unknown = sorted(set(keys) - local.keys())
        if unknown:
            raise ZrsError(
                f"full_state_dict(keys=...): {unknown[:3]} are not keys of the model's "
                "state_dict(); name entries as model.state_dict() does"
            )
        local = {k: v for k, v in local.items() if k in keys}
    _meet(model, list(local))
    keep = not rank0_only or _rank(model) == 0
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}  # ds_id -> full tensor (tied weights gather once)
    names = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, h in _sharded(module).items():
            names[f"{prefix}.{name}" if prefix else name] = h
    for key, value in local.items():
        h = names.get(key)
        if h is not None:
            if h.ds_id not in gathered:
                # in the parameter's own dtype, as the unsharded model holds it
                full = collectives.gather_full(
                    h, h.shard, None if h.dtype == h.shard.dtype else h.dtype
                )
                full = full.cpu() if cpu_offload else full.clone()
                gathered[h.ds_id] = full if keep else full.new_empty(0)
            value = gathered[h.ds_id]
        elif cpu_offload:
            value = value.cpu()
        if keep:
            out[key] = value
    return out


def _meet(model: nn.Module, keys: list[str]) -> None:
    """Every rank reaches the gathers with the same keys, or ZrsError on each that came."""
    state = getattr(model, "_zrs_state", None)
    peers = state.peers if state is not None else None
    if peers is not None:
        peers.agree(
            "full_state_dict's entries",
            keys,
            hint="call zrs.full_state_dict (and save_pretrained) on every rank together, with "
            "the same keys; rank0_only=True leaves the result on rank 0 alone",
        )


def _rank(model: nn.Module) -> int:
    state = getattr(model, "_zrs_state", None)
    return state.job_rank if state is not None else 0
