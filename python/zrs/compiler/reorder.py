"""Apply a plan to the lowered FX graph: the planner's order, and one fused prefetch per group.

``apply_plan`` moves the FX nodes into the plan's order (placeholders stay first, the output last)
and, for each fused group, inserts one ``zrs.prefetch_params_fused(graph_id, shards, ds_ids,
dtypes)`` right before the group's first ``allgather_param``. The members' ``allgather_param``
nodes stay where the plan puts them and take their buffer from the prefetch; each takes the
prefetch's (empty) output as its ``prefetched`` argument, a data edge without which inductor
scheduled a prefetch after one of its members (the member then gathered alone and the prefetch's
claim on it leaked). With ``backend="inductor"`` the compiler turns inductor's peak-memory
reordering off: how far a prefetch runs ahead of its members' compute is no data dependency, and
its topological sorts would move them.
"""

from __future__ import annotations

import contextlib

from torch import fx
from torch._guards import detect_fake_mode

from zrs._core import ZrsError
from zrs.compiler._fx import OPS, is_op, val

# --- applying a plan ---------------------------------------------------------------------------


def _reorder(graph: fx.Graph, nodes: list[fx.Node], order: list[int]) -> None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    for i in order:
        n = nodes[i]
        if n.op in ("placeholder", "output"):
            continue
        if anchor is None:
            first = next(iter(graph.nodes))
            if first is not n:
                first.prepend(n)
        elif anchor.next is not n:
            anchor.append(n)
        anchor = n


def _prefetch_group(
    members: list[fx.Node], pos: dict[fx.Node, int]
) -> tuple[fx.Node, list[fx.Node]] | None:
    """One planner group as the runtime issues it: (its first gather, the members whose shard is
    defined before that gather), or None when fewer than two remain. zrs-core already made the
    group legal (one gather dtype, each parameter once); where a shard is defined is an FX fact."""
    members = sorted(members, key=pos.__getitem__)
    if not members:
        return None
    first = members[0]
    members = [ag for ag in members if pos[ag.args[0]] < pos[first]]
    return (first, members) if len(members) >= 2 else None


def apply_plan(
    graph: fx.Graph,
    nodes: list[fx.Node],
    order: list[int],
    groups: list[list[int]],
    graph_id: int,
) -> list[list[int]]:
    """Reorder `graph` to `order` (IR indices) and insert one prefetch per fused group.

    Returns the ds_ids of each inserted `prefetch_params_fused`.
    """
    if sorted(order) != list(range(len(nodes))):
        raise ZrsError(
            f"graph {graph_id}: the planner's order is not a permutation of the graph's "
            f"{len(nodes)} nodes; this is a planner bug, please report it (scheduler='none' "
            "works around it)"
        )
    _reorder(graph, nodes, order)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    inserted = []
    for group in groups:
        members = [nodes[i] for i in group if is_op(nodes[i], "allgather_param")]
        found = _prefetch_group(members, pos)
        if found is None:
            continue
        first, sub = found
        with graph.inserting_before(first):
            pf = graph.call_function(
                OPS.prefetch_params_fused.default,
                (graph_id, [ag.args[0] for ag in sub], [ag.args[2] for ag in sub]),
                {"dtypes": [val(ag).dtype for ag in sub]},
            )
        shard = val(sub[0].args[0])
        with detect_fake_mode([shard]) or contextlib.nullcontext():
            pf.meta["val"] = shard.new_empty(0)
        for ag in sub:  # a data edge: inductor must not schedule the prefetch after them
            ag.update_kwarg("prefetched", pf)
        inserted.append([int(ag.args[2]) for ag in sub])
    graph.lint()
    return inserted
