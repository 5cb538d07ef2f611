"""Keep the parameters a training forward uses last gathered for its backward.

The backward starts with the parameters the forward released last (the output head, the last
layer). Released, they are gathered again at once, before the backward has any compute to hide
the gathers behind: that stalled the backward's start with gathers that FSDP2, which keeps its
root and last block gathered, does not pay (BENCHMARKS.md). The planner
(`zrs._core.kept_for_backward`) picks the longest run of the forward's last releases within an
allowance of bytes; their `release_param` nodes get `keep=True`, and the runtime hands the
gathered copy to the parameter's next gather (``runtime.gather._claim_kept``).

The allowance, decided in zrs-core, is what the backward may prefetch ahead anyway at its start
(``PREFETCH_ALLOWANCE_GATHERS`` of the forward's largest gather), so the device holds no more at
the forward's end than it would at the backward's start. An explicit ``memory_budget`` caps it at
the budget left over the forward's planned peak. Only graph facts decide, so every rank keeps the
same parameters (the backward's gathers of kept parameters are skipped on every rank alike).
"""

from __future__ import annotations

from torch import fx

from zrs import _core
from zrs.compiler._fx import is_op, val
from zrs.compiler.ir import nbytes


def keep_for_backward(graph: fx.Graph, budget_left: int | None = None) -> list[int]:
    """Mark the last releases of the kept parameters `keep=True`; returns their ds_ids.
    `budget_left`: an explicit budget less the forward's planned peak (None: automatic)."""
    gathered: dict[int, int] = {}
    for n in graph.nodes:
        if is_op(n, "allgather_param"):
            gathered[int(n.args[2])] = nbytes(val(n))
    releases = [n for n in graph.nodes if is_op(n, "release_param")]
    kept = _core.kept_for_backward(
        [(int(r.args[2]), gathered.get(int(r.args[2]), 0)) for r in releases],
        max(gathered.values(), default=0),
        budget_left,
    )
    last = {int(r.args[2]): r for r in releases}  # a parameter's last release
    for ds_id in kept:
        last[ds_id].update_kwarg("keep", True)
    return kept
