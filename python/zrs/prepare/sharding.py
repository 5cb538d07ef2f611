"""Cut every parameter of a model into world-size shards and make module code gather at use.

Each parameter becomes a DTensor in the master dtype (fp32 by default: `options.py`) sharded by
rows (`Shard(0)` over its full shape, FSDP2's convention), stored as the real `nn.Parameter` under
the same name: optimizers, `state_dict()`, torch.distributed.checkpoint, `clip_grad_norm_` and
GradScaler see what they see under FSDP2. Its local tensor is a view of this rank's flat, padded
shard, which the gathers read. The owning module's class is swapped for a per-class subclass
whose property of that name returns `torch.ops.zrs.gather(shard, ...)`: dynamo traces the gather
like any op (SimpleFSDP's idea). Read eagerly inside a forward, it returns the eager path's
gathered parameter instead (`runtime/fetch.py`).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from zrs._core import ZrsError
from zrs.runtime import grads, handles, kernels
from zrs.runtime.handles import UNRESOLVED, ParamHandle
from zrs.runtime.state import ZeroState

InitFn = Callable[[nn.Module], None]

# (base class, sharded parameter names, is a repeated block) -> the class swapped in, per model:
# every layer of a repeated block shares one class, hence one compile region.
Subclasses = dict[tuple[type, frozenset[str], bool], type]


def _read(module: nn.Module, name: str) -> torch.Tensor:
    """A sharded parameter's full value, read eagerly: the eager path's leaf inside a zrs.shard
    forward, else the gather op run at once."""
    ds_id, shape, dtype = module._zrs_params[name]
    fetcher = module._zrs_fetcher
    if fetcher.depth:  # inside a forward: the eager path's leaf (runtime/fetch.py)
        return fetcher.param(ds_id)
    return torch.ops.zrs.gather(module._zrs_shards[name], ds_id, shape, dtype)


# A zrs.shard parameter that a user's torch.compile reaches outside any unit's compiled forward:
# nothing says its leaf is gathered, so it is read eagerly, at a graph break. Its traced gather
# would reach a backend that is not zrs's, which cannot resolve the parameter.
_read_eagerly = torch.compiler.disable(_read)


def _gathered(name: str) -> property:
    # Dynamo traces this at every read of every layer's call (a region's body is traced per
    # call, then matched): the traced path is kept short, with no call to inline.
    def get(self: nn.Module) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return _read(self, name)
        leaves = self._zrs_leaves
        if leaves is None:
            # zrs.compile: the gather op, traced. The id stays out of the graph (the backend
            # resolves it from the shard), so the layers of a repeated block trace to one
            # shared body (compiler/regions.py). It gathers in the compute dtype (bf16 under
            # param_dtype) rather than casting after: a cast made two more nodes per read (the
            # cast and its backward) for AOTAutograd, zrs's passes and inductor.
            _, shape, dtype = self._zrs_params[name]
            return torch.ops.zrs.gather(self._zrs_shards[name], UNRESOLVED, shape, dtype)
        # zrs.shard: a unit's forward compiled on its own (units.py) reads the eager path's
        # leaf, which the unit's hook gathered, as a graph input; read first, so that no
        # layer's own ds_id enters the guards and one compile serves every layer.
        if name in leaves:
            return leaves[name]
        return _read_eagerly(self, name)

    return property(get, doc=f"`{name}` gathered from its shards (zrs)")


def _guarded_register(base: type) -> Callable[..., None]:
    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        # Checked before nn.Module's own checks, whose hasattr() would run the gather property
        # (a collective on one rank only).
        if name in getattr(self, "_zrs_params", {}):
            raise ZrsError(
                f"cannot assign a new parameter to {type(self).__name__}.{name}: it is sharded by "
                "zrs.compile, and replacing it would drop its shards. Set the weights before "
                "zrs.compile, or update the shard in place through model.parameters()"
            )
        base.register_parameter(self, name, param)

    return register_parameter


def _guarded_apply(base: type) -> Callable[..., nn.Module]:
    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        # `model.to()`, `.cuda()`, `.half()` and the like. A sharded parameter's local tensor is
        # a view of zrs's shard, and torch swaps a DTensor parameter for whatever `fn` returns, a
        # copy when the device merely compares unequal (`cpu` against `cpu:0`): the optimizer
        # would then step a tensor that no gather reads, and the model would stop training. So
        # sharded parameters stay as they are; a conversion that would move or cast one raises.
        sharded = [
            n for n in getattr(self, "_zrs_params", {}) if self._parameters.get(n) is not None
        ]
        kept = {}
        for name in sharded:
            param = self._parameters[name]
            applied = fn(param)
            if applied is not param and (
                applied.dtype != param.dtype
                or applied.device not in (param.device, _compute_device(self, name))
            ):
                raise ZrsError(
                    f"cannot move or cast {type(self).__name__}.{name} ({param.dtype} on "
                    f"{param.device}, to {applied.dtype} on {applied.device}): it is sharded by "
                    "zrs, and a copy would leave the optimizer stepping a tensor that no gather "
                    "reads. Move or cast the model before zrs.shard / zrs.compile, and choose "
                    "the dtypes with param_dtype and master_dtype"
                )
            kept[name] = param
            self._parameters[name] = None  # base._apply skips it, in its place
        try:
            return base._apply(self, fn, recurse)
        finally:
            self._parameters.update(kept)

    return _apply


def _compute_device(module: nn.Module, name: str) -> torch.device:
    """Where a sharded parameter's gathers read it: with offload the master stays on the host
    by design, and the model's device is its compute device (Lightning moves every model there
    after configure_model)."""
    return handles.handle(module._zrs_params[name][0]).source.device


def _install_properties(
    module: nn.Module, base: type, names: frozenset[str], block: bool, classes: Subclasses
) -> None:
    key = (base, names, block)
    if key not in classes:
        attrs: dict[str, Any] = {n: _gathered(n) for n in names}
        attrs["_zrs_base_class"] = base
        attrs["_zrs_leaves"] = None  # zrs.compile; zrs.shard sets a dict per module (units.py)
        attrs["_zrs_block"] = block
        attrs["register_parameter"] = _guarded_register(base)
        attrs["_apply"] = _guarded_apply(base)
        if block:
            # dynamo traces every layer's call into one shared body, compiled once
            attrs["forward"] = torch.compiler.nested_compile_region(_without_aliases(base.forward))
        classes[key] = type(f"Zrs{base.__name__}", (base,), attrs)
    module.__class__ = classes[key]


def _without_aliases(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward`, returning a copy of any input it returns as is (T5's layers pass their position
    bias on): a compile region's outputs may not alias its inputs.

    Dynamo traces this at every layer's call, and pytree's flattening, traced, was a third of the
    instructions it traced for a small decoder: arguments (and tuples among them) of tensors and
    constants, and an output that is a tensor or a tuple of them, are checked without it."""

    @functools.wraps(forward)
    def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        flat = []
        for a in (*args, *kwargs.values()):
            if type(a) is tuple:  # Llama's (cos, sin)
                flat.extend(a)
            else:
                flat.append(a)
        if not all(_leaf(a) for a in flat):
            flat = tree_leaves((args, kwargs))
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]

        def fresh(t: Any) -> Any:
            return t.clone() if any(t is x for x in inputs) else t

        out = forward(self, *args, **kwargs)
        if isinstance(out, torch.Tensor):
            return fresh(out)
        if type(out) is tuple and all(_leaf(o) for o in out):
            return tuple(fresh(o) if isinstance(o, torch.Tensor) else o for o in out)
        return tree_map_only(torch.Tensor, fresh, out)

    return run


def _leaf(x: Any) -> bool:
    """A value pytree does not look into (the common ones)."""
    return x is None or isinstance(x, (torch.Tensor, bool, int, float, str))


def drop_regions(model: nn.Module) -> bool:
    """Turn the model's compile regions back into plain modules; False if it had none."""
    dropped = False
    classes: Subclasses = {}
    for module in model.modules():
        if getattr(module, "_zrs_block", False):
            names = frozenset(getattr(module, "_zrs_params", {}))
            _install_properties(module, module._zrs_base_class, names, False, classes)
            dropped = True
    return dropped


def _composes_layers(module: nn.Module) -> bool:
    return any(True for child in module.children() for _ in child.parameters())


def repeated_blocks(model: nn.Module) -> set[int]:
    """ids of the modules that are layers of a stack: children of one nn.ModuleList or
    nn.Sequential that share their class with a sibling and are blocks of parametrised modules
    (a stack of nn.Linear gains nothing: each region would be one op). The outermost only: a
    stack inside a layer of another stays part of that layer's body."""
    blocks: set[int] = set()
    inside: list[str] = []  # names of the blocks found so far (pre-order)
    for name, module in model.named_modules():
        if any(name.startswith(f"{b}.") for b in inside):
            continue
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(n, c) for n, c in module.named_children() if _composes_layers(c)]
        counts = Counter(type(c) for _, c in children)
        for n, c in children:
            if counts[type(c)] >= 2:
                blocks.add(id(c))
                inside.append(f"{name}.{n}" if name else n)
    return blocks


def _materialize(module: nn.Module, device: torch.device, init_fn: InitFn | None) -> None:
    """Give one module's meta tensors real storage and initialise them (this module only).

    Its real tensors (a pretrained weight beside a meta bias) keep their values and identity:
    to_empty and the initialisation work on meta stand-ins for them, and the originals go back
    afterwards (their identity ties them to the other modules that share them)."""
    params = {n: p for n, p in module._parameters.items() if p is not None and not p.is_meta}
    buffers = {n: b for n, b in module._buffers.items() if b is not None and not b.is_meta}
    for n, p in params.items():
        module._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for n, b in buffers.items():
        module._buffers[n] = torch.empty_like(b, device="meta")
    try:
        module.to_empty(device=device, recurse=False)
        if init_fn is not None:
            init_fn(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        else:
            raise ZrsError(
                f"{type(module).__name__} was built on the meta device but has no "
                "reset_parameters(); pass zrs.compile(model, init_fn=fn) where fn(module) "
                "initialises one module's own parameters and buffers"
            )
    finally:
        module._parameters.update(params)
        module._buffers.update({n: b.to(device) for n, b in buffers.items()})


# The most bytes one broadcast of a module's parameters carries (a larger tensor goes alone).
BROADCAST_BUCKET_BYTES = 256 << 20


def _rank0_values(state: ZeroState, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """`params` on the device, contiguous, holding rank 0's values on every rank, whatever each
    rank's RNG did: one coalesced broadcast per module (a collective per parameter cost 201 of
    them at the HF Llama 1.1B shape). One rank: no collective, so that a job of one GPU never
    initialises NCCL for it."""
    fulls = [p.detach().to(state.device).contiguous() for p in params]
    if fulls and state.group is not None and state.world_size > 1:
        # Rank 0 of the group (the group's own numbering, as the process group's API takes it).
        dist._broadcast_coalesced(state.gather_group, fulls, BROADCAST_BUCKET_BYTES, 0)
    if fulls and state.replicate_group is not None:
        # Then the first replica's values to the others: the job's rank 0's everywhere.
        dist._broadcast_coalesced(state.replicate_group, fulls, BROADCAST_BUCKET_BYTES, 0)
    return fulls


def _shard_one(state: ZeroState, param: nn.Parameter, full: torch.Tensor, name: str) -> ParamHandle:
    """`param` sharded into `state`, from `full`: its value on the device, rank 0's."""
    slot = state.registry.register(
        list(param.shape), str(param.dtype).removeprefix("torch."), param.requires_grad
    )
    info = state.registry.info(slot)
    flat = torch.zeros(info.padded_numel, dtype=state.master_dtype, device=state.device)
    flat[: info.numel].copy_(full.reshape(-1))
    # A 0-d parameter has no rows to cut: every rank holds it (a replicated DTensor), and its
    # gradient reaches every rank (grads._replicate_scalar).
    start = state.rank * info.shard_numel if param.dim() else 0
    piece = flat[start : start + info.shard_numel]
    if state.offload is None:
        shard = piece.clone()
    else:  # the master on the host (runtime/offload.py)
        shard = state.offload.host_empty(info.shard_numel, state.master_dtype).copy_(piece)
    shard.requires_grad_(param.requires_grad)
    # Every rank's shard has the same padded size for the model's life. Static, it keeps its size
    # out of the symbols that zrs.compile's dynamic=True gives every input: a symbol per shard made
    # each layer's compile region a body of its own, traced and compiled once per layer.
    torch._dynamo.mark_static(shard)
    rows = state.registry.local_rows(slot, state.rank)
    local_shape = (rows, *param.shape[1:]) if param.dim() else ()
    local = shard.detach().narrow(0, 0, rows * math.prod(param.shape[1:])).view(local_shape)
    if state.mesh is not None:
        strides = itertools.accumulate(reversed(param.shape[1:]), operator.mul, initial=1)
        local = DTensor.from_local(
            local,
            state.mesh,
            state.placements(param.dim()),
            run_check=False,
            shape=param.shape,
            stride=tuple(reversed(list(strides))) if param.dim() else (),
        )
    h = handles.add_handle(
        state,
        shard,
        nn.Parameter(local, param.requires_grad),
        slot,
        name,
        param.dtype if state.own_dtypes else state.master_dtype,
    )
    if state.offload is not None:
        state.offload.attach(h)
    if param.requires_grad:
        # Weakly: a tensor the dynamo cache still holds must not keep a dropped model's state.
        handle = weakref.ref(h)
        h.source.register_post_accumulate_grad_hook(lambda _: grads.move_eager_grad(handle()))
    return h


def shard_parameters(
    model: nn.Module, state: ZeroState, init_fn: InitFn | None, regions: bool
) -> None:
    """Shard every parameter of `model` into `state` (`shard_model`); the model keeps its state."""
    if state.device.type == "cuda":
        kernels.build_in_background()  # nvcc runs while the model is sharded (and compiled)
    shard_model(model, state, init_fn, regions)
    model._zrs_state = state
    state.module = weakref.ref(model)


def shard_model(
    model: nn.Module, state: ZeroState, init_fn: InitFn | None = None, regions: bool = True
) -> None:
    """Replace every parameter of `model` by its local shard, module by module; with `regions`,
    the layers of each stack become nested compile regions."""
    done: dict[int, ParamHandle] = {}  # id(original parameter) -> handle: tied weights share one
    blocks = repeated_blocks(model) if regions else set()
    classes: Subclasses = {}
    for prefix, module in model.named_modules():
        own = dict(module._parameters)
        if any(t is not None and t.is_meta for t in [*own.values(), *module._buffers.values()]):
            originals = dict(own)
            _materialize(module, state.device, init_fn)
            # to_empty created new tensors; keep the identity of the originals for tying.
            own = {n: (originals[n], module._parameters[n]) for n in own}
        else:
            own = {n: (p, p) for n, p in own.items()}
            for n, b in module._buffers.items():
                if b is not None and b.device != state.device:
                    module._buffers[n] = b.to(state.device)
        fresh = {id(o): v for o, v in own.values() if o is not None and id(o) not in done}
        fulls = dict(zip(fresh, _rank0_values(state, list(fresh.values())), strict=True))
        specs = {}
        shards = {}
        for name, (orig, value) in own.items():
            if orig is None:
                continue
            h = done.get(id(orig))
            if h is None:
                h = done[id(orig)] = _shard_one(
                    state, value, fulls[id(orig)], f"{prefix}.{name}" if prefix else name
                )
            module._parameters[name] = h.param
            # gathered in its own dtype (an fp16 layer among fp32 ones stays fp16) or param_dtype
            gathered = h.compute_dtype
            specs[name] = (h.ds_id, list(h.shape), None if gathered == h.source.dtype else gathered)
            shards[name] = h.source  # what gathers read: with offload, the device copy
        if specs:
            module._zrs_params = specs
            module._zrs_shards = shards
        if specs or id(module) in blocks:
            _install_properties(
                module, module.__class__, frozenset(specs), id(module) in blocks, classes
            )
