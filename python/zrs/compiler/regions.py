"""On dynamo's graph, before AOTAutograd: gathers out of repeated blocks, and every gather named.

A repeated block (a layer of a stack, `prepare.sharding.repeated_blocks`) runs as a nested compile
region: dynamo traces it into one `invoke_subgraph` body shared by every layer, and AOTAutograd
and inductor then compile that body once, not once per layer. Its parameters' gathers are in the
body, so they would be compiled once too, yet each layer gathers its own parameters at its own
time. `lift_region_gathers` moves them to the call sites: each layer's call gathers its shards
(and casts them, when the body cast them at once) in the outer graph, where the zero3 pass and
the planner see one gather per parameter, as without regions, and passes the full tensors into
the body.

The gather property leaves the parameter's ds_id out of the traced graph (`UNRESOLVED`), so the
layers' bodies are identical; `resolve_gathers` writes it back from the shard tensor. Bodies that
dynamo kept apart only because a symbolic size was written two ways are merged first
(`merge_same_bodies`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from zrs._core import ZrsError
from zrs.compiler._fx import INVOKE_SUBGRAPH, region_body
from zrs.runtime.handles import UNRESOLVED


def is_gather(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in (
        torch.ops.zrs.gather,
        torch.ops.zrs.gather.default,
    )


def _cast_of(n: fx.Node) -> torch.dtype | None:
    """The dtype of `n.to(dtype)`, a cast of a gathered parameter in the block's own code (the
    gather property gathers in the compute dtype itself); None otherwise."""
    if n.op == "call_method" and n.target == "to" and len(n.args) == 2 and not n.kwargs:
        dtype = n.args[1]
        return dtype if isinstance(dtype, torch.dtype) else None
    return None


def _liftable(ph: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """A body placeholder read only by gathers of it (each alike, optionally each cast alike):
    (the gathers, their casts); None if anything else reads it."""
    users = list(ph.users)
    if not users or not all(is_gather(u) and u.args[0] is ph for u in users):
        return None
    if len({tuple(map(str, u.args[1:])) for u in users}) > 1:
        return None
    only = [next(iter(u.users)) if len(u.users) == 1 else None for u in users]
    dtypes = {_cast_of(c) if c is not None else None for c in only}
    if len(dtypes) == 1 and None not in dtypes:
        return users, [c for c in only if c is not None]
    return users, []


def _lift_body(gm: fx.GraphModule, name: str, calls: list[fx.Node]) -> bool:
    """Lift one shared body's gathers to all its call sites; False if the body cannot be lifted."""
    body: fx.GraphModule = getattr(gm, name)
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    plans = {i: _liftable(ph) for i, ph in enumerate(placeholders)}
    plans = {i: p for i, p in plans.items() if p is not None}
    inner = [n for n in body.graph.nodes if is_gather(n)]
    if sum(len(p[0]) for p in plans.values()) != len(inner):
        return False  # a gather of something else than a plain operand: inline instead
    for i, (gathers, casts) in plans.items():
        template, last = gathers[0], (casts[0] if casts else gathers[0])
        for call in calls:
            operand = call.args[2 + i]
            with gm.graph.inserting_before(call):
                full = gm.graph.call_function(template.target, (operand, *template.args[1:]))
                full.meta["example_value"] = template.meta.get("example_value")
                if casts:
                    full = gm.graph.call_method("to", (full, casts[0].args[1]))
                    full.meta["example_value"] = last.meta.get("example_value")
            args = list(call.args)
            args[2 + i] = full
            call.args = tuple(args)
        ph = placeholders[i]
        ph.meta["example_value"] = last.meta.get("example_value")
        for n in casts:
            n.replace_all_uses_with(ph)
            body.graph.erase_node(n)
        for n in gathers:
            n.replace_all_uses_with(ph)
            body.graph.erase_node(n)
    body.recompile()
    return True


def _inline(gm: fx.GraphModule, call: fx.Node) -> None:
    """Replace one invoke_subgraph call by a copy of its body."""
    body = region_body(call)
    assert body is not None
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    env: dict[fx.Node, Any] = dict(zip(placeholders, call.args[2:], strict=True))
    with gm.graph.inserting_before(call):
        outputs = gm.graph.graph_copy(body.graph, env)
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
    if call.users:
        raise ZrsError(
            f"cannot inline the nested compile region {call.name}: its result is used whole"
        )
    gm.graph.erase_node(call)


def _same_value(a: Any, b: Any) -> bool:
    """Equal for the compiled code: sizes compared as expressions, not by how they are written."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return (
            isinstance(a, (int, torch.SymInt))
            and isinstance(b, (int, torch.SymInt))
            and (statically_known_true(a == b))
        )
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.device, a.layout, a.requires_grad)
            == (b.dtype, b.device, b.layout, b.requires_grad)
            and _same_sizes(a.shape, b.shape)
            and _same_sizes(a.stride(), b.stride())
            and _same_value(a.storage_offset(), b.storage_offset())
        )
    return type(a) is type(b) and a == b


def _same_sizes(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))


def _same_body(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """The two bodies compute the same thing from operands alike, whatever their node names."""
    a_nodes, b_nodes = list(a.graph.nodes), list(b.graph.nodes)
    if len(a_nodes) != len(b_nodes):
        return False
    match: dict[fx.Node, fx.Node] = {}

    def same_args(x: Any, y: Any) -> bool:
        xs, x_spec = pytree.tree_flatten(x)
        ys, y_spec = pytree.tree_flatten(y)
        if x_spec != y_spec:
            return False
        for p, q in zip(xs, ys, strict=True):
            if isinstance(p, fx.Node):
                if not isinstance(q, fx.Node) or match.get(p) is not q:
                    return False
            elif isinstance(p, slice):
                if not isinstance(q, slice) or not same_args(
                    (p.start, p.stop, p.step), (q.start, q.stop, q.step)
                ):
                    return False
            elif not _same_value(p, q):
                return False
        return True

    for x, y in zip(a_nodes, b_nodes, strict=True):
        if x.op != y.op:
            return False
        if x.op == "placeholder":
            if not _same_value(x.meta.get("example_value"), y.meta.get("example_value")):
                return False
        elif x.op == "get_attr":
            p, q = getattr(a, str(x.target)), getattr(b, str(y.target))
            nested = isinstance(p, fx.GraphModule) and isinstance(q, fx.GraphModule)
            if not (_same_body(p, q) if nested else p is q):
                return False
        elif x.target != y.target or not same_args((x.args, x.kwargs), (y.args, y.kwargs)):
            return False
        match[x] = y
    return True


def merge_same_bodies(gm: fx.GraphModule) -> int:
    """Point the calls of bodies that compute the same thing at one of them; returns how many
    bodies were dropped.

    Dynamo (torch 2.11) installs a new body when an operand's metadata differs only in how a
    symbolic size is written: the first layer's input, the embedding's output, has storage
    256*s0*s1 where every later layer's has 256*s1*(s0 - 1) + 256*s1. The first layer then
    compiled as a block of its own, twice the tracing and codegen of one block.
    """
    kept: list[tuple[fx.Node, fx.GraphModule]] = []
    merged: dict[str, tuple[fx.Node, fx.GraphModule] | None] = {}
    for call in list(gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)):
        attr, body = call.args[0], region_body(call)
        assert body is not None
        name = str(attr.target)
        if name not in merged:
            merged[name] = next((k for k in kept if _same_body(k[1], body)), None)
            if merged[name] is None:
                kept.append((attr, body))
        into = merged[name]
        if into is not None:
            call.args = (into[0], into[0].target, *call.args[2:])
            if not attr.users:
                gm.graph.erase_node(attr)
    dropped = [n for n, into in merged.items() if into is not None]
    for name in dropped:
        gm.delete_submodule(name)
    return len(dropped)


def lift_region_gathers(gm: fx.GraphModule) -> int:
    """Lift the gathers of every nested compile region; returns the number of shared bodies.

    A body whose gathers cannot be lifted (a parameter read other than through its gather) is
    inlined at each call instead: that model compiles the block once per layer, as without
    regions, but right.
    """
    merge_same_bodies(gm)
    calls: dict[str, list[fx.Node]] = {}
    for n in gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH):
        calls.setdefault(n.args[0].target, []).append(n)
    lifted = 0
    for name, sites in calls.items():
        if _lift_body(gm, name, sites):
            lifted += 1
        else:
            for call in sites:
                _inline(gm, call)
    gm.graph.lint()
    gm.recompile()
    return lifted


def inline_regions(gm: fx.GraphModule) -> None:
    """Inline every nested compile region of the graph (the per-layer graph)."""
    for call in list(gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)):
        _inline(gm, call)
    gm.graph.lint()
    gm.recompile()


def resolve_gathers(
    gm: fx.GraphModule, example_inputs: list[Any], ds_id_of: Callable[[torch.Tensor], int | None]
) -> None:
    """Give every gather of the graph the ds_id of the shard it reads."""
    index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    for g in [n for n in gm.graph.nodes if is_gather(n)]:
        if g.args[1] != UNRESOLVED:
            continue
        src = g.args[0]
        if src in index:
            shard = example_inputs[index[src]]
        elif src.op == "get_attr":
            shard = operator.attrgetter(src.target)(gm)
        else:
            shard = None
        ds_id = ds_id_of(shard) if isinstance(shard, torch.Tensor) else None
        if ds_id is None:
            raise ZrsError(
                f"a gathered parameter in graph node {g.name} does not come straight from a "
                "zrs shard (it was computed from one, or captured in a nested region that zrs "
                "cannot lift): read sharded parameters through their module attributes"
            )
        g.args = (src, ds_id, *g.args[2:])
