"""Mark every gathered parameter as must-recompute in the joint graph.

The min-cut partitioner then never saves a gathered parameter (or a view or cast of it) for
backward: backward gathers it again from the shard, which is what makes this ZeRO-3.

A repeated block (an `invoke_subgraph` call, passes/regions.py) is partitioned on its own first,
and its forward returns what its backward needs, the gathered parameters it received (or views of
them) among them. Those outputs are rerouted: the backward takes the view of the gathered
parameter itself, which the partitioner then recomputes from the shard like any other.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from zrs.passes._nodes import cast_dtype, is_op, is_view

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
    while out.op == "call_function" and is_view(out) and out.target is not operator.getitem:
        chain.append(out)
        out = out.args[0]
    if out.op != "placeholder":
        return None
    inputs = list(out.graph.find_nodes(op="placeholder"))
    return inputs.index(out), chain[::-1]


def reroute_saved_parameters(gm: fx.GraphModule) -> int:
    """In the joint graph: a block forward's output that is a gathered parameter it was given (or
    a view of one) is replaced, for its users, by that view taken outside the block, tagged for
    recompute. Returns the number of outputs rerouted."""
    rerouted = 0
    for call in gm.graph.find_nodes(
        op="call_function", target=torch.ops.higher_order.invoke_subgraph
    ):
        if not str(call.args[1]).startswith("partitioned_fw"):
            continue
        body: fx.GraphModule = getattr(gm, call.args[0].target)
        outputs = next(iter(body.graph.find_nodes(op="output"))).args[0]
        for user in list(call.users):
            if user.target is not operator.getitem or not user.users:
                continue
            found = _view_chain(outputs[user.args[1]])
            if found is None:
                continue
            operand = call.args[2 + found[0]]
            if not isinstance(operand, fx.Node) or operand.meta.get("recompute") != _RECOMPUTE:
                continue
            value = operand
            with gm.graph.inserting_before(user.next):
                for view in found[1]:
                    value = gm.graph.call_function(
                        view.target, (value, *view.args[1:]), view.kwargs
                    )
                    value.meta = {**view.meta, "recompute": _RECOMPUTE}
            user.replace_all_uses_with(value)
            rerouted += 1
    return rerouted
