"""Mark every gathered parameter as must-recompute in the joint graph.

The min-cut partitioner then never saves a gathered parameter (or a view or cast of it) for
backward: backward gathers it again from the shard, which is what makes this ZeRO-3.
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from zrs.passes._nodes import cast_dtype, is_op, is_view


def tag_gathers_for_recompute(graph: fx.Graph) -> fx.Graph:
    for node in graph.nodes:
        if not is_op(node, "gather"):
            continue
        stack = [node]
        while stack:
            n = stack.pop()
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            stack.extend(u for u in n.users if is_view(u) or cast_dtype(u) is not None)
    return graph
