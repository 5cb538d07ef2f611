"""The eager path's fetch units and their module hooks.

A *unit* is a module whose forward fetches parameters: each layer of a stack (a repeated block,
`sharding.repeated_blocks`) with every parameter inside it, and each other module with parameters of
its own. The root is always unit 0. Hooks on a unit tell the coordinator (zrs-core, executed by
`runtime/fetch.py`) that its forward starts and ends, and register a hook on its outputs that
tells it when its backward starts (and for a unit with frozen parameters one on its inputs that
tells it when its backward is over). Units are whole layers, as FSDP2's `fully_shard` units are,
not every module as in DeepSpeed: the hooks' host time grows with the units, and a layer's
parameters are gathered by one collective.

`zrs.compile` has one unit, the root, without hooks of its own: its compiled graphs gather what
they use, and a parameter that code outside the graphs reads is fetched on demand under the root.

`zrs.shard(model, compile=...)` compiles each layer of a stack once per distinct block, and the
root's own code around the stacks too: the embedding, the head and the loss become one graph.
A stack that runs inside a submodule (a Hugging Face `*ForCausalLM` around its `*Model`) is a
graph break there; a stack that the root's own forward loops over is called layer by layer as
opaque ops of the root's graph (`opaque.py`). The modules that code reads (the head) then
belong to the root unit, gathered with it, so that no hook breaks the graph between them.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zrs.prepare import opaque
from zrs.prepare.sharding import repeated_blocks
from zrs.runtime.fetch import Fetcher, Unit
from zrs.runtime.handles import ParamHandle, handle
from zrs.runtime.state import ZeroState

ROOT = 0
_log = logging.getLogger("zrs")


def find_units(
    model: nn.Module, layered: bool, own: tuple[str, ...] = ()
) -> list[tuple[nn.Module, Unit]]:
    """The root first, then the units in module order; each with the parameters it fetches.
    `layered=False`: the root alone, with no parameters of its own (zrs.compile). `own`: when
    the root's own code is compiled, the modules that run the stacks or are their layers: every
    module outside them belongs to the root unit."""
    if not layered:
        return [(model, Unit("", ()))]
    blocks = repeated_blocks(model)
    owner: dict[int, str] = {}  # id(module) -> the name of its unit
    units: dict[str, tuple[nn.Module, list[ParamHandle]]] = {"": (model, [])}
    for name, module in model.named_modules():
        # the root's own parameters are the root unit's; it does not own its descendants
        unit = (
            ""
            if not name
            else next((owner[id(m)] for m in _ancestors(model, name)[1:] if id(m) in owner), None)
        )
        if unit is None and (id(module) in blocks or getattr(module, "_zrs_params", None)):
            unit = "" if own and not _inside(name, own) else name
            units.setdefault(unit, (module, []))
        if unit is not None and name:
            owner[id(module)] = unit
        hs = units[unit if unit is not None else ""][1]
        for ds_id, _, _ in getattr(module, "_zrs_params", {}).values():
            h = handle(ds_id)
            if all(h is not x for x in hs):
                hs.append(h)
    return [(m, Unit(name, tuple(hs))) for name, (m, hs) in units.items()]


def _inside(name: str, modules: tuple[str, ...]) -> bool:
    """Whether the module called `name` is one of `modules` or inside one."""
    return any(name == m or name.startswith(f"{m}.") for m in modules)


def stack_runners(model: nn.Module, blocks: set[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Who runs the stacks of `blocks`: the names of the modules other than the root whose
    forwards run one (an nn.Sequential itself, an nn.ModuleList's parent), and the names of the
    layers whose stack the root's own forward runs (its loop, or the root an nn.Sequential)."""
    runners: set[str] = set()
    looped: list[str] = []
    for name, module in model.named_modules():
        if id(module) not in blocks:
            continue
        container = name.rpartition(".")[0]
        if isinstance(model.get_submodule(container), nn.Sequential):
            runner = container
        else:
            runner = container.rpartition(".")[0] if container else ""
        if runner:
            runners.add(runner)
        else:
            looped.append(name)
    return tuple(sorted(runners)), tuple(looped)


def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules from the root down to the parent of `name`."""
    found = [model]
    parts = name.split(".") if name else []
    for part in parts[:-1]:
        found.append(found[-1].get_submodule(part))
    return found


def install_units(
    model: nn.Module,
    state: ZeroState,
    layered: bool,
    limits: dict[str, Any],
    compile_backend: str | None = None,
    compile_root: bool = True,
) -> None:
    """Give `state` its eager path and hook its units (all but the root, which the model's
    forward drives: `forward.py`). `compile_backend`: torch.compile each layer of a stack with
    it (zrs.shard's `compile`), and with `compile_root` the root's own code around the stacks
    too."""
    blocks = repeated_blocks(model) if compile_backend is not None else set()
    if compile_backend is not None and not blocks:
        _log.warning(
            "zrs.shard(compile=%r): %s has no stack of repeated layers (children of an "
            "nn.ModuleList or nn.Sequential that share a class), so nothing is compiled and it "
            "trains eagerly; torch.compile(module) on the parts to compile works too",
            compile_backend,
            type(model).__name__,
        )
    runners, looped = stack_runners(model, blocks) if blocks and compile_root else ((), ())
    own = runners + looped  # the subtrees whose units stay their own when the root compiles
    units = find_units(model, layered, own)
    compiled_forwards: dict[Callable[..., Any], Callable[..., Any]] = {}
    fetcher = Fetcher(state, [u for _, u in units], **limits)
    state.fetcher = fetcher
    for module in model.modules():
        if getattr(module, "_zrs_params", None):
            module._zrs_fetcher = fetcher  # the gather property reads it
            if layered:
                module._zrs_leaves = {}  # the root's own: read eagerly
    eager_forwards = {}
    for index, (module, unit) in enumerate(units):
        if index == ROOT:
            continue
        # Only code compiled with the unit gathered reads its leaves as graph inputs; code
        # compiled elsewhere that reads another unit's parameter (a root reaching into a
        # submodule) reads it eagerly. zrs.shard's compiled layers: always after the hook.
        # Code the user compiles (a layer by hand, the whole model): the leaves are there only
        # while the unit's hook has it entered, and dynamo's guards on them send a read outside
        # (a tied head's `self.tok.weight` after the embedding's call) to the eager read.
        lent = [] if compile_backend is not None else _unit_leaves(module.modules(), fetcher)
        if id(module) in blocks:
            _share_leaves(module.modules(), fetcher)
        frozen = any(not h.param.requires_grad for h in unit.handles)
        module.register_forward_pre_hook(_pre(fetcher, index, frozen, lent), with_kwargs=True)
        module.register_forward_hook(_post(fetcher, index, lent))
        if id(module) in blocks:
            compiled = _compile_once(module, compile_backend, compiled_forwards)
            eager_forwards[id(module)] = module.forward
            module.forward = _compiled_forward(module, fetcher, unit, compiled)
    if own:
        for name in runners:
            runner = model.get_submodule(name)
            runner.forward = torch.compiler.disable(runner.forward)
        shared = opaque.LayerCalls()
        for name in looped:
            layer = model.get_submodule(name)
            opaque.install(layer, fetcher, eager_forwards[id(layer)], shared)
        root_modules = (m for name, m in model.named_modules() if not _inside(name, own))
        _compile_root(model, root_modules, compile_backend, fetcher, units[ROOT][1])


def _compile_root(
    model: nn.Module,
    modules: Iterable[nn.Module],
    backend: str | None,
    fetcher: Fetcher,
    unit: Unit,
) -> None:
    """Compile the root's forward around the stacks, whose runners run eagerly (a graph break
    each) and whose layers the root's own loop calls as opaque ops (`opaque.py`): the code
    before and after them (the embedding, the head and the loss) becomes graphs of its own.
    The root unit's parameters (`modules`', the head's) are read as graph inputs, as a layer's
    are."""
    _share_leaves(modules, fetcher)
    model.forward = functools.wraps(model.forward)(
        _compiled_forward(model, fetcher, unit, torch.compile(model.forward, backend=backend))
    )


def _compile_once(
    module: nn.Module,
    backend: str | None,
    compiled_forwards: dict[Callable[..., Any], Callable[..., Any]],
) -> Callable[..., Any]:
    """`module`'s forward under torch.compile, as a callable of the forward's own arguments.
    One torch.compile per forward function, shared by every layer of that class: each call
    copies inductor's whole configuration (docs/compile-time.md), and dynamo's cache entry is
    the function's code object either way. A forward set on the instance compiles alone."""
    forward = module.forward
    if not (inspect.ismethod(forward) and forward.__self__ is module):
        return torch.compile(forward, backend=backend)
    function = forward.__func__
    if function not in compiled_forwards:
        compiled_forwards[function] = torch.compile(function, backend=backend)
    return functools.partial(compiled_forwards[function], module)


def _compiled_forward(
    module: nn.Module, fetcher: Fetcher, unit: Unit, compiled: Callable[..., Any]
) -> Callable[..., Any]:
    """A layer's forward compiled on its own, run when the layer's hook gathered its
    parameters: the hooks stay outside the graph, so the gathers, prefetches and releases stay
    the coordinator's. Equal layers share their forward's code object, hence dynamo's cache
    entry: one compile for a stack. Only the layers of stacks: a lone module compiled alone
    fuses nothing, and torch.nn's own modules would share one cache entry's code (dynamo wraps
    them alike) up to its recompile limit."""
    eager = module.forward
    slots = [fetcher.slot_of[h.ds_id] for h in unit.handles]
    gather_now = torch.compiler.disable(fetcher.gather_now)  # the runtime is never traced

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (fetcher.entered and fetcher.entered[-1]):
            # Called outside the model's forward and backward (generate() runs the encoder
            # alone): the leaves are gathered as module code reads them, eagerly.
            return eager(*args, **kwargs)
        gather_now(slots)  # a no-op after the hook; a direct call of .forward() gathers
        return compiled(*args, **kwargs)

    return forward


Lent = list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def _unit_leaves(modules: Iterable[nn.Module], fetcher: Fetcher) -> Lent:
    """Each sharded module of a unit: its dict of leaves (the gather property's) and its
    parameters' leaves, to put there for good (`_share_leaves`) or while the unit's hook has
    it entered (`_pre`)."""
    found = []
    for module in modules:
        params = getattr(module, "_zrs_params", None)
        if params:
            leaves = {
                name: fetcher.leaves[fetcher.slot_of[ds_id]]
                for name, (ds_id, _, _) in params.items()
            }
            found.append((module._zrs_leaves, leaves))
    return found


def _share_leaves(modules: Iterable[nn.Module], fetcher: Fetcher) -> None:
    """Give every sharded module of a unit its parameters' leaves for good, which a forward
    compiled by zrs reads as graph inputs (the gather property): it runs after the hook."""
    for held, leaves in _unit_leaves(modules, fetcher):
        held.update(leaves)


def _pre(fetcher: Fetcher, unit: int, frozen: bool, lent: Lent):
    # A torch.compile that reaches a hook (layer.compile(), torch.compile(model)) breaks its
    # graph at the call and runs the hook eagerly: dynamo never traces the coordinator.
    @torch.compiler.disable
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        fetcher.enter(unit)
        if frozen:
            fetcher.after_backward(unit, (args, kwargs))
        if fetcher.entered[-1]:  # inside the model's forward: the unit's leaves are gathered
            for held, leaves in lent:
                held.update(leaves)

    return hook


def _post(fetcher: Fetcher, unit: int, lent: Lent):
    @torch.compiler.disable
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for held, _ in lent:
            held.clear()
        fetcher.exit(unit, output)

    return hook
