"""Mark every gathered parameter as must-recompute in the joint graph.

The min-cut partitioner then never saves a gathered parameter (or a view or cast of it) for
backward: backward gathers it again from the shard, which is what makes this ZeRO-3.

A repeated block (an `invoke_subgraph` call, compiler/regions.py) is partitioned on its own first,
and its forward returns what its backward needs, some of its own inputs (or views of them) among
them: the gathered parameters and the block's input activation. Those outputs are rerouted: the
backward takes the view of the input itself. A gathered parameter is then recomputed from the
shard like any other; an activation is saved by the outer graph, which knows it is alive.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from zrs.compiler._fx import cast_dtype, is_op, is_view, region_body

_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE


def tag_gathers_for_recompute(graph: fx.Graph) -> fx.Graph:
    for node in graph.nodes:
        if not is_op(node, "gather"):
            continue
        stack = [node]
        while stack:
            n = stack.pop()
            n.meta["recompute"] = _RECOMPUTE
            stack.extend(u for u in n.users if is_view(u) or cast_dtype(u) is not None)
    return graph


def _view_chain(out: fx.Node) -> tuple[int, list[fx.Node]] | None:
    """(placeholder index, the view nodes from it to `out`) if `out` is a view of an input."""
    chain = []
    while out.op == "call_function" and is_view(out):
        chain.append(out)
        out = out.args[0]
    if out.op != "placeholder":
        return None
    inputs = list(out.graph.find_nodes(op="placeholder"))
    return inputs.index(out), chain[::-1]


def _sized_by_the_body(view: fx.Node) -> bool:
    """The view's arguments name nodes of the body (symbolic sizes): it cannot be replayed
    outside."""
    named: list[fx.Node] = []
    fx.node.map_arg((view.args[1:], view.kwargs), named.append)
    return bool(named)


def _copy_output(body: fx.GraphModule, index: int) -> None:
    """Make the body's output `index` a copy instead of an alias of an input."""
    output = next(iter(body.graph.find_nodes(op="output")))
    values = list(output.args[0])
    with body.graph.inserting_before(output):
        copy = body.graph.call_function(torch.ops.aten.clone.default, (values[index],))
    copy.meta = dict(values[index].meta)
    values[index] = copy
    output.args = (type(output.args[0])(values),)
    body.recompile()


def reroute_aliased_outputs(gm: fx.GraphModule) -> int:
    """In the joint graph: a block's output that is one of the block's inputs (or a view of one)
    is replaced, for its users, by that view taken outside the block. A gathered parameter's view
    is tagged for recompute, so the backward gathers it again. A view sized by the block's own
    symbols cannot be taken outside: the block returns a copy. Returns the number rerouted.

    Inductor (torch 2.11) does not see a region's output as an alias of its input: once the
    region's call has run, it reused the input's buffer while the saved output still pointed into
    it (a block's input activation, saved for its backward, was overwritten by the next block)."""
    rerouted = 0
    for call in gm.graph.find_nodes(
        op="call_function", target=torch.ops.higher_order.invoke_subgraph
    ):
        body = region_body(call)
        if body is None:
            continue
        for user in list(call.users):
            if user.target is not operator.getitem or not user.users:
                continue
            outputs = next(iter(body.graph.find_nodes(op="output"))).args[0]
            found = _view_chain(outputs[user.args[1]])
            operand = call.args[2 + found[0]] if found is not None else None
            if found is None or not isinstance(operand, fx.Node):
                continue
            if any(_sized_by_the_body(view) for view in found[1]):
                _copy_output(body, user.args[1])
                continue
            recompute = operand.meta.get("recompute") == _RECOMPUTE
            value = operand
            with gm.graph.inserting_before(user.next):
                for view in found[1]:
                    value = gm.graph.call_function(
                        view.target, (value, *view.args[1:]), view.kwargs
                    )
                    value.meta = {k: v for k, v in view.meta.items() if k != "recompute"}
                    if recompute:
                        value.meta["recompute"] = _RECOMPUTE
            user.replace_all_uses_with(value)
            rerouted += 1
    return rerouted
