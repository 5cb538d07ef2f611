"""Parameter handles and the process index: what the ops find from the integers in the graphs.

Each model's `ZeroState` owns its `ParamHandle`s; `LIVE` maps a ds_id to its handle and knows
the live models, weakly, so dropping a model frees it (docs/architecture.md). Only the runtime's
leaves sit below this module: it knows a model's state as the `Model` protocol, which
`zrs.runtime.state.ZeroState`, built on this module, satisfies.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from zrs._core import Registry, ZrsError

UNRESOLVED = -1  # the ds_id of a gather as the gather property traces it (compiler/regions.py)
# Inductor's CUDA code assumes, and asserts, that a custom op's outputs start 16-byte aligned.
ALIGN_BYTES = 16


def group_layout(numels: list[int], itemsize: int) -> tuple[list[int], int]:
    """Where each member of a fused gather's group buffer starts (elements), each 16-byte
    aligned, and the buffer's length. The runtime and the op's fake share it: inductor reads the
    alignment of the outputs from the fake."""
    step = max(1, ALIGN_BYTES // itemsize)
    starts, end = [], 0
    for n in numels:
        starts.append(end)
        end += -(-n // step) * step
    return starts, end


class Model(Protocol):
    """What this module needs of a model's state (`zrs.runtime.state.ZeroState`): its registry and
    the handles it owns, its count of optimizer steps, and what it does around a step."""

    registry: Registry
    param_dtype: torch.dtype | None
    handles: list[ParamHandle]
    ds_ids: dict[int, int]  # id(what its gathers read: the shard, or its device copy) -> ds_id
    optimizer_steps: int

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def registered(self, module: nn.Module, value: nn.Module | torch.Tensor) -> None: ...


@dataclass(eq=False)
class ParamHandle:
    """What the ops need about one sharded parameter, keyed by its process-wide `ds_id`.

    Two tensors share the shard's storage: `shard`, the flat, padded leaf that the gathers read
    (the graphs' input), and `param`, the module's parameter that users and optimizers see: a
    DTensor `Shard(0)` over the full shape whose local tensor is this rank's real rows (the whole
    tensor, plain, without torch.distributed). Gradients land in `param.grad`."""

    ds_id: int
    slot: int  # its place in the model's registry
    state: Model  # its model's `ZeroState`
    shard: torch.Tensor
    param: nn.Parameter
    shape: tuple[int, ...]
    numel: int
    padded_numel: int
    shard_numel: int
    local_numel: int  # this rank's real elements: the first of `shard`, the rest is padding
    local_shape: tuple[int, ...]
    spec: DTensorSpec | None  # the parameter's (and its gradient's) DTensor spec
    dtype: torch.dtype  # the parameter's own: gathered in it unless `param_dtype` says otherwise
    name: str = ""  # its qualified name in the model, for error messages
    # With offload (runtime/offload.py) `shard` and `param` are the fp32 master on the host, and
    # the gathers read `compute`: this rank's shard on the device in the compute dtype, a copy of
    # the master as of its `versions()` `compute_version` (None: stale, made again when read).
    compute: torch.Tensor | None = None
    compute_version: tuple[int, int, int] | None = None
    # offload="params": `compute` holds storage only while a gather reads it (staged); the
    # compute-dtype copy lives in `host_compute` (pinned; the master itself in fp32), and
    # `epoch` counts its rewrites (a staged copy's own version moves with every stage-in).
    host_compute: torch.Tensor | None = None
    epoch: int = 0
    stages: int = 0  # gathers reading the staged copy now
    staged_epoch: int = -1  # the host copy's epoch when it was staged

    def kept_stamp(self) -> int:
        """What a gathered copy kept for the backward is checked against (runtime/gather.py):
        a change of the gathers' input since the copy was made."""
        return self.epoch if self.host_compute is not None else self.source._version

    def versions(self) -> tuple[int, int, int]:
        """The counters an in-place write to the master moves: the flat shard's and, since a
        write through the DTensor parameter moves neither the shard's nor its local tensor's
        (the op runs below autograd), the parameter's own and its local tensor's."""
        return (self.shard._version, self.param._version, local_tensor(self.param)._version)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype its gathers produce: the model's `param_dtype`, else its own."""
        return self.state.param_dtype or self.dtype

    @property
    def source(self) -> torch.Tensor:
        """What the eager path's gathers read: the device copy with offload, else the shard."""
        return self.shard if self.compute is None else self.compute


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the storage an in-place write reaches), or `t` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


class Live:
    """The process's index from the integers in the compiled graphs to the objects that own the
    state: ds_id -> its ParamHandle, and the live models, for the optimizer hooks. It holds them
    weakly and owns nothing (a model's ZeroState owns its handles): dropping a model frees it."""

    def __init__(self) -> None:
        self.handles: weakref.WeakValueDictionary[int, ParamHandle] = weakref.WeakValueDictionary()
        self.states: weakref.WeakSet[Model] = weakref.WeakSet()
        # ds_ids are process-wide: every rank registers the same parameters in the same order.
        self.ds_ids = itertools.count()
        # zrs.compile calls, which name their store meetings: every rank counts alike.
        self.compile_calls = itertools.count()
        self.optimizer_hooks: list[object] = []
        self.module_hooks: list[object] = []

    def add(self, state: Model) -> None:
        self.states.add(state)
        if not self.optimizer_hooks:
            # Before any torch.optim step free the kept copies (a step is where shards change,
            # and one that writes through `.data` bumps no version counter, which
            # `gather._claim_kept` checks); after it count the step for the models it trains.
            self.optimizer_hooks = [
                register_optimizer_step_pre_hook(self._before_optimizer_step),
                register_optimizer_step_post_hook(self._after_optimizer_step),
            ]
        if not self.module_hooks:
            # Parameters registered into a sharded model later (PEFT's get_peft_model on it) are
            # neither sharded nor reduced: each model notes them, and refuses to step them.
            self.module_hooks = [
                register_module_parameter_registration_hook(self._registered),
                register_module_module_registration_hook(self._registered),
            ]

    def models(self) -> list[Model]:
        return list(self.states)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        for state in self.models():
            state.before_optimizer_step(optimizer)

    def _registered(self, module: nn.Module, _name: str, value: object) -> None:
        # A compiled forward registers modules it builds from the model's own (transformers'
        # `self.layers[:n]` slices a ModuleList): traced, the check guarded on the live models'
        # weak sets by position and failed once they changed (Mistral after Llama and Qwen2 in
        # one process: "list index out of range"); kept from dynamo, it broke the graph at each
        # slice. Parameters come from __init__ or a later call such as PEFT's, which run eagerly.
        if torch.compiler.is_compiling():
            return
        if isinstance(value, (nn.Module, torch.Tensor)):
            for state in self.models():
                state.registered(module, value)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for state in self.models():
            if any(id(h.param) in ids for h in state.handles):
                state.optimizer_steps += 1
                state.after_optimizer_step(optimizer)


LIVE = Live()


def add_handle(
    state: Model,
    shard: torch.Tensor,
    param: nn.Parameter,
    slot: int,
    name: str,
    dtype: torch.dtype,
) -> ParamHandle:
    info = state.registry.info(slot)
    local = param.to_local() if isinstance(param, DTensor) else param
    h = ParamHandle(
        ds_id=next(LIVE.ds_ids),
        slot=slot,
        state=state,
        shard=shard,
        param=param,
        shape=tuple(info.shape),
        numel=info.numel,
        padded_numel=info.padded_numel,
        shard_numel=info.shard_numel,
        local_numel=local.numel(),
        local_shape=tuple(local.shape),
        spec=param._spec if isinstance(param, DTensor) else None,
        dtype=dtype,
        name=name,
    )
    LIVE.handles[h.ds_id] = h
    state.handles.append(h)
    state.ds_ids[id(shard)] = h.ds_id
    return h


def handles(ds_ids: list[int]) -> list[ParamHandle]:
    try:
        return [LIVE.handles[i] for i in ds_ids]
    except KeyError:
        return [handle(i) for i in ds_ids]  # raises for the unknown one


def handle(ds_id: int) -> ParamHandle:
    try:
        return LIVE.handles[ds_id]
    except KeyError:
        raise ZrsError(
            f"unknown parameter ds_id {ds_id}: no live model of this process registered it (was "
            "the model dropped, or never passed to zrs.compile?); compile the model with "
            "zrs.compile(model) before running it"
        ) from None


def names(hs: list[ParamHandle]) -> str:
    """The parameters' names for an error message, the first few."""
    shown = ", ".join(f"`{h.name or h.ds_id}`" for h in hs[:3])
    return shown + (f" and {len(hs) - 3} more" if len(hs) > 3 else "")
