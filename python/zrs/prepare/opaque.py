"""Layer calls as opaque ops inside a compiled root (`zrs.shard(model, compile=...)`).

A root whose own forward loops over its stack (`for layer in self.layers: x = layer(x)`) cannot
leave the loop at a graph break: torch 2.11's dynamo skips a frame that breaks inside a loop, so
its head and loss would run eagerly. Instead, each call of such a layer is one op of the root's
graph, `zrs::unit_call`: dynamo, AOTAutograd and inductor see an opaque call of a few nodes, and
the root's code around the loop (the embedding, the final norm, the head, the loss) compiles as
one graph, however many layers there are.

The op's kernel is what an eagerly run layer does: the unit's hooks (the coordinator gathers,
prefetches and releases, `units.py`) around its forward compiled on its own, recorded by autograd
into a graph of the layer's own, which is kept for the backward: the call's last output is a
token whose buffer holds that graph (`_Kept`), and the root's backward saves the token, so the
graph lives exactly as long as the root's autograd graph (an evaluation's forward with gradients
on frees it with its output). `zrs::unit_call_backward` runs that graph's backward (the unit's
gathers before it, the gradients' reduce-scatters after it, as eagerly) and returns the
gradients of the call's inputs to the root's compiled backward. Its fake kernel runs the
layer's own forward on fake tensors, with fake leaves for its parameters.

A layer is called this way with tensors and `None`s, by position or by keyword, and returns a
tensor or a tuple of tensors; a call with anything else runs the layer at a graph break, which
leaves the root's frame to dynamo's skip (it then runs eagerly, its layers still compiled).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._C import DispatchKey

from zrs._core import ZrsError
from zrs.runtime.fetch import Fetcher
from zrs.runtime.ops import LIB, outside_dynamo

_AUTOGRAD_KEYS = tuple(
    getattr(DispatchKey, k)
    for k in (
        "AutogradCPU",
        "AutogradCUDA",
        "AutogradFunctionality",
        "ADInplaceOrView",
        "AutogradOther",
    )
)


Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]  # a tensor's shape, stride, dtype


class LayerCalls:
    """What one model's opaque layer calls share.

    `anchor`: an input of every call that needs a gradient. A layer's parameters are no inputs
    of its op, so a first layer whose input needs no gradient (a frozen embedding, a plain
    tensor input) would look constant to autograd, and with it every later layer: none would
    run its backward. The anchor makes each call's outputs need a gradient whenever autograd
    records; its own gradient is none.

    `outputs`: the fake kernel's results, by the layer's kind and the call's inputs. Dynamo and
    AOTAutograd run the fake kernel three times a call, each a run of the layer's forward on
    fake tensors (0.6 s of a 3.6-4.3 s first step at 16 tiny layers on the CPU; 0.1 s with one
    run a kind); equal layers of a stack called with equal inputs give equal outputs, so one
    run serves them all. The first real call of each layer after a compile checks that it did.

    `kept`: the graphs of the calls whose backward has not run, by their token's address."""

    def __init__(self) -> None:
        self.anchor = torch.zeros((), requires_grad=True)
        self.outputs: dict[tuple, tuple[list[Meta], bool]] = {}
        self.kept: weakref.WeakValueDictionary[int, _Kept] = weakref.WeakValueDictionary()


@dataclass(eq=False)
class Site:
    """One layer whose calls are opaque ops."""

    module: nn.Module
    fetcher: Fetcher
    eager: Callable[..., Any]  # the layer's own forward: the fake kernel runs it
    shared: LayerCalls
    kind: tuple  # equal for layers whose calls with equal inputs give equal outputs
    slots: tuple[int, ...] = ()  # the slots of its parameters that take a gradient
    tuple_out: bool = False  # it returns a tuple (the fake kernel finds out)
    expect: tuple[tuple, list[Meta]] | None = None  # what the fake kernel promised last
    # its calls' graphs whose backward has not run
    pending: weakref.WeakValueDictionary[int, _Kept] = field(
        default_factory=weakref.WeakValueDictionary
    )


class _Kept(bytearray):
    """One call's autograd graph (its inputs' leaves and its outputs) as the buffer of the
    call's token: the token's storage holds the buffer, so the graph goes with the last
    autograd graph that saved the token. Found again by the token's address
    (`LayerCalls.kept`)."""

    leaves: list[torch.Tensor | None] | None
    outs: list[torch.Tensor] | None
    step: int  # the fetcher's count of ended backwards at the call


def _token(
    site: Site, leaves: list[torch.Tensor | None] | None, outs: list[torch.Tensor] | None
) -> torch.Tensor:
    kept = _Kept(1)
    kept.leaves, kept.outs, kept.step = leaves, outs, site.fetcher.backwards_ended
    token = torch.frombuffer(kept, dtype=torch.uint8)  # its storage holds `kept`
    if outs is not None:
        site.shared.kept[token.data_ptr()] = kept
        site.pending[id(kept)] = kept
    return token


_ids = itertools.count()
_SITES: weakref.WeakValueDictionary[int, Site] = weakref.WeakValueDictionary()


def install(
    module: nn.Module, fetcher: Fetcher, eager: Callable[..., Any], shared: LayerCalls
) -> None:
    """Make every call of `module` (a layer of a stack the root runs) the op in compiled code,
    and its ordinary call (hooks and forward) in eager code."""
    site_id = next(_ids)
    kind = (
        type(module),
        getattr(eager, "__func__", eager),
        tuple(_meta(fetcher.leaves[fetcher.slot_of[ds_id]]) for ds_id, _, _ in _params(module)),
        tuple((n, _meta(b)) for n, b in module.named_buffers()),
    )
    slots = {fetcher.slot_of[ds_id] for ds_id, _, _ in _params(module)}
    grads = tuple(sorted(slot for slot in slots if fetcher.leaves[slot].requires_grad))
    site = Site(module, fetcher, eager, shared, kind, grads)
    _SITES[site_id] = site
    module._zrs_site = site  # keeps it alive with the module
    call_impl = module._call_impl

    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return call_impl(*args, **kwargs)
        inputs = [*args, *kwargs.values()]
        for x in inputs:
            if not (x is None or isinstance(x, torch.Tensor)):
                return _at_graph_break(call_impl, *args, **kwargs)
        needs_grad = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
        *outs, _token = torch.ops.zrs.unit_call(
            inputs, shared.anchor, needs_grad, torch.is_grad_enabled(), site_id, ",".join(kwargs)
        )
        return tuple(outs) if site.tuple_out else outs[0]

    # nn.Module.__call__ runs `_compiled_call_impl` when it is set; dynamo inlines it too.
    module._compiled_call_impl = call


@torch.compiler.disable
def _at_graph_break(call_impl: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return call_impl(*args, **kwargs)


def _params(module: nn.Module) -> Iterator[tuple[int, Any, Any]]:
    for m in module.modules():
        yield from getattr(m, "_zrs_params", {}).values()


def _split(inputs: list[Any], kwnames: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = kwnames.split(",") if kwnames else []
    n = len(inputs) - len(names)
    return tuple(inputs[:n]), dict(zip(names, inputs[n:], strict=True))


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Autograd inside an op's kernel, which runs below it: the kernel records (or runs) the
    layer's own graph."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        if exclude.has(key):
            exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _outputs(site: Site, out: Any) -> list[torch.Tensor]:
    outs = list(out) if isinstance(out, tuple) else [out]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise ZrsError(
            f"zrs.shard(compile=...): {type(site.module).__name__} returned "
            f"{type(out).__name__}; a layer that the root's compiled loop calls must return a "
            "tensor or a tuple of tensors. Return those, or compile without zrs (compile=None "
            "and torch.compile on the layers)"
        )
    site.tuple_out = isinstance(out, tuple)
    return outs


def _unit_call(
    inputs: list[torch.Tensor | None],
    anchor: torch.Tensor,
    needs_grad: list[bool],
    grad: bool,
    site_id: int,
    kwnames: str,
) -> list[torch.Tensor]:
    site = _SITES[site_id]
    if torch._C._current_graph_task_id() != -1:
        raise ZrsError(
            f"{type(site.module).__name__}, a layer that the root's compiled loop calls, was "
            "recomputed inside the backward (activation checkpointing around the call): its "
            "call keeps its own autograd graph and cannot be replayed. Checkpoint inside the "
            "layer's forward instead"
        )
    if not grad:
        args, kwargs = _split(list(inputs), kwnames)
        outs = _outputs(site, site.module._call_impl(*args, **kwargs))
        token = _token(site, None, None)
    else:
        leaves = [
            x.detach().requires_grad_(need) if x is not None else None
            for x, need in zip(inputs, needs_grad, strict=True)
        ]
        args, kwargs = _split(leaves, kwnames)
        with _autograd_on():
            outs = _outputs(site, site.module._call_impl(*args, **kwargs))
        token = _token(site, leaves, outs)
        outs = [o.detach() for o in outs]
    if site.expect is not None:
        _check_promise(site, inputs, kwnames, outs)
    return [*_fresh(outs, inputs), token]


def _fresh(outs: list[torch.Tensor], inputs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The outputs, each copied where it shares storage with an input or an earlier output: an
    op's outputs may alias nothing (a residual layer that returns its input as is)."""
    seen = {x.untyped_storage().data_ptr() for x in inputs if x is not None}
    fresh = []
    for o in outs:
        ptr = o.untyped_storage().data_ptr()
        fresh.append(o.clone() if ptr in seen else o)
        seen.add(ptr)
    return fresh


def _meta(t: torch.Tensor) -> Meta:
    return tuple(t.shape), t.stride(), t.dtype


def _call_key(site: Site, inputs: list[torch.Tensor | None], kwnames: str) -> tuple | None:
    """The fake kernel's cache key for this call; None when a size is symbolic."""
    metas = tuple(None if x is None else (*_meta(x), x.device) for x in inputs)
    for m in metas:
        if m is not None and not all(type(d) is int for d in (*m[0], *m[1])):
            return None
    return (site.kind, site.module.training, metas, kwnames)


def _unit_call_fake(inputs, anchor, needs_grad, grad, site_id, kwnames):
    site = _SITES[site_id]
    like = next(x for x in inputs if x is not None)
    key = _call_key(site, inputs, kwnames)
    known = site.shared.outputs.get(key) if key is not None else None
    if known is None:
        args, kwargs = _split(list(inputs), kwnames)
        with site.fetcher.faked(like), _fake_buffers(site.module, like):
            out = site.eager(*args, **kwargs)
        outs = _outputs(site, out)
        if key is None:
            return [*(torch.empty_like(o) for o in outs), _fake_token(like)]
        known = site.shared.outputs[key] = ([_meta(o) for o in outs], site.tuple_out)
    metas, site.tuple_out = known
    site.expect = (key, metas)
    outs = [like.new_empty_strided(shape, stride, dtype=dtype) for shape, stride, dtype in metas]
    return [*outs, _fake_token(like)]


def _fake_token(like: torch.Tensor) -> torch.Tensor:
    """The token's fake: one byte on the CPU, in `like`'s fake mode."""
    return like.new_empty(1, dtype=torch.uint8, device="cpu")


@contextlib.contextmanager
def _fake_buffers(module: nn.Module, like: torch.Tensor) -> Iterator[None]:
    """The layer's buffers as fake tensors of `like`'s mode, which takes no real tensor."""
    owners = [
        (m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None
    ]
    for m, name, b in owners:
        m._buffers[name] = like.fake_mode.from_tensor(b)
    try:
        yield
    finally:
        for m, name, b in owners:
            m._buffers[name] = b


def _check_promise(site: Site, inputs: list, kwnames: str, outs: list[torch.Tensor]) -> None:
    """The first real call after a compile gives what the fake kernel said (shared by equal
    layers: `LayerCalls.outputs`)."""
    key, metas = site.expect
    site.expect = None
    if _call_key(site, inputs, kwnames) == key and [_meta(o) for o in outs] != metas:
        raise ZrsError(
            f"{type(site.module).__name__} (a layer that the root's compiled loop calls) "
            f"returned {[_meta(o) for o in outs]} where an equal layer called with equal inputs "
            f"returned {metas}: zrs takes layers of one class with equal parameters for equal. "
            "Give layers that differ classes of their own"
        )


def _unit_call_backward(
    grads: list[torch.Tensor | None], like: list[torch.Tensor], token: torch.Tensor, site_id: int
) -> list[torch.Tensor]:
    site = _SITES[site_id]
    fetcher = site.fetcher
    name = type(site.module).__name__
    kept = site.shared.kept.get(token.data_ptr())
    if kept is None or kept.outs is None:
        raise ZrsError(
            f"the backward of {name} (a layer called by the root's compiled loop) ran without "
            "its forward's graph: a second backward through one forward, or a layer recomputed "
            "by activation checkpointing around the root's loop. Run one backward per forward; "
            "checkpoint inside the layer instead"
        )
    leaves, outs = kept.leaves, kept.outs
    kept.leaves = kept.outs = None  # one backward per forward
    site.pending.pop(id(kept), None)
    # Another call of the layer in this step (two forwards before one backward, or two calls
    # in a forward) has its backward to come, as a graph of its own: the parameters' gradients
    # are complete only after the last, so they wait in their leaves for it (or for the
    # backward's end). A graph left from an earlier step (an output kept alive) holds nothing.
    step = fetcher.backwards_ended
    held = site.slots if any(k.step == step for k in site.pending.values()) else ()
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
    with fetcher.nested_backward(), fetcher.holding(held), _autograd_on():
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [
        (x.grad if x.grad is not None else torch.zeros_like(x))
        for x in leaves
        if x is not None and x.requires_grad
    ]


def _unit_call_backward_fake(grads, like, token, site_id):
    return [torch.empty_like(x) for x in like]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    tensors, _, needs_grad, _, site_id, _ = inputs
    ctx.site_id = site_id
    ctx.needs = [need and x is not None for x, need in zip(tensors, needs_grad, strict=True)]
    # the inputs whose gradients the backward returns, for their metadata (the kept graph holds
    # them anyway), and the token that holds the kept graph
    ctx.save_for_backward(
        output[-1], *(x for x, need in zip(tensors, ctx.needs, strict=True) if need)
    )


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    token, *like = ctx.saved_tensors
    flat = iter(torch.ops.zrs.unit_call_backward(list(grads[:-1]), like, token, ctx.site_id))
    return [next(flat) if need else None for need in ctx.needs], None, None, None, None, None


LIB.impl("unit_call", outside_dynamo(_unit_call), "CompositeExplicitAutograd")
LIB.impl("unit_call_backward", outside_dynamo(_unit_call_backward), "CompositeExplicitAutograd")
torch.library.register_fake("zrs::unit_call", _unit_call_fake, lib=LIB)
torch.library.register_fake("zrs::unit_call_backward", _unit_call_backward_fake, lib=LIB)
torch.library.register_autograd("zrs::unit_call", _backward, setup_context=_setup, lib=LIB)
