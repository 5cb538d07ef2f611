"""Lower the functional gather / gather_grad pair into explicit ZeRO-3 communication.

Runs on the partitioned forward and backward graphs (after functionalization, so the alias
annotations of the lowered ops are legal):

* each `gather` becomes `allgather_param -> wait_allgather -> uses -> release_param`, with the
  release after the last real use (uses are counted through aliasing views; a tuple-returning user
  is released after its last `getitem`);
* a gather whose only user is a downcast gathers in the smaller dtype (fused downcast);
* at one rank, a gather in the shard's own dtype becomes a view of the shard: the shard is the
  whole parameter, and a gathered copy would only cost a device copy and its memory;
* each parameter gradient (`gather_grad`, or a sum of them for a parameter used several times)
  goes to `reduce_grad`, right where it is complete, and `end_backward` flushes the buckets. The
  graph then returns None for that shard: the runtime accumulates into `shard.grad` itself;
* a gradient that autograd casts to another floating dtype (back up to the shard's, the
  backward of a fused downcast; or down to the gathered one, where the op computed it wider)
  goes to `reduce_grad` before the cast: the bucket packing casts into the reduce dtype anyway,
  so the graph skips a full-size cast kernel, and no gradient is rounded twice.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from zrs._core import ZrsError
from zrs.compiler._fx import OPS, alias_closure, cast_dtype, is_op, val


def _lower_gather(graph: fx.Graph, g: fx.Node, graph_id: int, views: bool) -> None:
    shard, ds_id = g.args[0], g.args[1]
    dtype = g.kwargs.get("dtype", g.args[3] if len(g.args) > 3 else None)
    src = val(g)
    users = list(g.users)
    target = g
    if len(users) == 1:
        cast = cast_dtype(users[0])
        if cast is not None and src is not None and cast.itemsize < src.dtype.itemsize:
            dtype, target = cast, users[0]
    if views and val(target).dtype == val(shard).dtype:
        _view_of_shard(graph, g)
        return
    with graph.inserting_before(g):
        ag = graph.call_function(
            OPS.allgather_param.default, (shard, graph_id, ds_id), {"dtype": dtype}
        )
        wait = graph.call_function(OPS.wait_allgather.default, (ag, graph_id, ds_id))
    ag.meta["val"] = wait.meta["val"] = val(target)
    target.replace_all_uses_with(wait)
    if target is not g:
        graph.erase_node(target)
    graph.erase_node(g)

    # Nodes compare by their position in the graph (fx keeps a sort key on insertion), so no
    # pass over the whole graph per gather: the lowering stays linear in the graph's size.
    closure = alias_closure(wait)
    members = set(closure)
    escaping = [a for a in closure if any(u.op == "output" for u in a.users)]
    if escaping:
        # The parameter escapes the graph (returned, or saved for backward): hand out a copy so
        # the gathered buffer can still be freed.
        output = next(iter(graph.find_nodes(op="output")))
        with graph.inserting_before(output):
            for a in escaping:
                copy = graph.call_function(torch.ops.aten.clone.default, (a,))
                copy.meta["val"] = val(a)
                output.replace_input_with(a, copy)
    real = {u for n in closure for u in n.users if u not in members}
    # The release depends on the output of every real use (a tuple use: on its getitems), not only
    # the last one: inductor may fuse an earlier use into a kernel it schedules later, and only a
    # data dependency keeps that kernel ahead of the free.
    anchors = sorted({a for u in real for a in _tensor_outputs(u)})
    anchor = anchors[-1] if anchors else wait
    point = max([*real, anchor])
    with graph.inserting_after(point):
        rel = graph.call_function(
            OPS.release_param.default, (anchor, graph_id, ds_id, len(real), anchors[:-1])
        )
    rel.meta["val"] = val(anchor)


def _view_of_shard(graph: fx.Graph, g: fx.Node) -> None:
    """One rank, no cast: the gathered parameter is the shard's first elements, viewed in the
    parameter's shape. A view of the graph's input, which inductor never writes into (a gathered
    buffer it may reuse once dead); nothing to release, and a use saved for backward is the
    shard itself rather than a copy. The gradient still reaches `reduce_grad` through the
    backward's `gather_grad`."""
    shard, shape = g.args[0], g.args[2]
    numel = val(g).numel()
    with graph.inserting_before(g):
        head = graph.call_function(torch.ops.aten.slice.Tensor, (shard, 0, 0, numel))
        view = graph.call_function(torch.ops.aten.view.default, (head, list(shape)))
    head.meta["val"] = val(shard)[:numel]
    view.meta["val"] = val(g)
    g.replace_all_uses_with(view)
    graph.erase_node(g)


def _tensor_outputs(node: fx.Node) -> list[fx.Node]:
    """The nodes holding `node`'s tensor outputs: itself, or the getitems of a tuple output."""
    if isinstance(val(node), torch.Tensor):
        return [node]
    if isinstance(val(node), (tuple, list)):
        return [
            u
            for u in node.users
            if u.target is operator.getitem and isinstance(val(u), torch.Tensor)
        ]
    return []


def _grad_leaves(node: fx.Node) -> list[fx.Node]:
    """The terms of a gradient that autograd summed with `add` (a parameter used twice)."""
    if node.op == "call_function" and node.target is torch.ops.aten.add.Tensor:
        return [leaf for a in node.args[:2] if isinstance(a, fx.Node) for leaf in _grad_leaves(a)]
    return [node]


def _before_cast(node: fx.Node) -> fx.Node:
    """The input of `node` if `node` only casts a floating-point gradient to another floating
    dtype, else `node`. The packing kernel computes in float32 (float64 for a float64 side)
    before its one cast into the bucket, so:

    * a widening cast (the backward of a gather cast down after it) is lossless: skipping it
      only saves a full-size kernel and the wider temporary;
    * a narrowing one (a norm's weight, gathered in bf16 but used in float32 inside the op: its
      gradient is computed in float32 and rounded to the gathered dtype) would round the
      gradient before the bucket's own cast: the float32 one is reduced instead, as precise as
      the float32 master it updates."""
    dtype = cast_dtype(node)
    src = node.args[0] if node.args else None
    if dtype is None or not isinstance(src, fx.Node) or val(src) is None:
        return node
    return src if val(src).dtype.is_floating_point and dtype.is_floating_point else node


def _lower_grads(graph: fx.Graph, graph_id: int) -> None:
    output = next(iter(graph.find_nodes(op="output")))
    grads = list(output.args[0])
    for i, g in enumerate(grads):
        if not isinstance(g, fx.Node):
            continue
        leaves = _grad_leaves(g)
        reduced = [leaf for leaf in leaves if is_op(leaf, "gather_grad")]
        if not reduced:
            continue
        ids = {leaf.args[1] for leaf in reduced}
        if len(reduced) != len(leaves) or len(ids) != 1:
            raise ZrsError(
                f"backward graph {graph_id}: gradient output {i} mixes zrs parameter gradients "
                f"{sorted(ids)} with other terms; this is a zero3 pass bug, please report it"
            )
        fulls = sorted(leaf.args[0] for leaf in reduced)
        if len(fulls) == 1:  # a sum of several terms stays in the wide dtype
            fulls = [_before_cast(fulls[0])]
        with graph.inserting_before(fulls[-1].next):  # keeps the inserted nodes in order
            total = fulls[0]
            for f in fulls[1:]:
                total = graph.call_function(torch.ops.aten.add.Tensor, (total, f))
                total.meta["val"] = val(f)
            graph.call_function(OPS.reduce_grad.default, (total, graph_id, ids.pop()))
        grads[i] = None
    output.args = (tuple(grads),)
    visible = output.meta.get("user_visible_output_idxs")
    if visible is not None:  # inductor reads the strides of these outputs: None has none
        output.meta["user_visible_output_idxs"] = [i for i in visible if grads[i] is not None]
    with graph.inserting_before(output):
        # After every gradient the graph returns: inductor otherwise may move the kernel of one
        # past this op with no tensor inputs and free that kernel's inputs before it runs.
        after = [g for g in grads if isinstance(g, fx.Node) and isinstance(val(g), torch.Tensor)]
        graph.call_function(OPS.end_backward.default, (graph_id, after))


def lower_zero3(graph: fx.Graph, graph_id: int, *, is_backward: bool, views: bool) -> None:
    """`views`: one rank, where a gather that casts nothing becomes a view of the shard."""
    for g in list(graph.find_nodes(op="call_function", target=OPS.gather.default)):
        _lower_gather(graph, g, graph_id, views)
    if is_backward:
        _lower_grads(graph, graph_id)
    graph.eliminate_dead_code()
    leftover = graph.find_nodes(op="call_function", target=OPS.gather_grad.default)
    if leftover:
        raise ZrsError(
            f"graph {graph_id}: {len(leftover)} parameter gradient(s) do not reach the graph "
            "output; zrs cannot reduce them (please report this model)"
        )
    graph.lint()
