"""The planner from Python (its command line: `python -m zrs.planner`, ``__main__.py``).

The planner (Rust, ``zrs._core``) takes one graph in the planner IR (JSON: nodes of kind compute,
allgather, wait, release, reduce_scatter or other, with deps, durations and bytes) and returns
the program order, the fused prefetch groups and the simulated timeline::

    from zrs import planner
    g = planner.synthetic(preset="1b")                 # or a graph dumped by the FX pass
    p = planner.plan(g, "search", cost="nop2p")        # dict: order, groups, makespan_us, ...
    planner.write_trace(g, "out.json")                 # open in https://ui.perfetto.dev
    planner.plot_memory([p], "mem.png")

Command line (prints one JSON line comparing both schedulers)::

    python -m zrs.planner --synthetic 10000 [--cost nvlink|nop2p|COST.json] [--budget BYTES]
                       [--trace out.json] [--plot mem.png]
    python -m zrs.planner GRAPH.json [same options]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zrs import _core

Graph = dict[str, Any] | str

__all__ = [
    "compare",
    "cost_model",
    "default_cost_model",
    "fit_all_reduce_link",
    "fit_copy_link",
    "fit_cost_model",
    "plan",
    "plot_memory",
    "synthetic",
    "write_trace",
]


def _as_json(graph: Graph) -> str:
    return graph if isinstance(graph, str) else json.dumps(graph)


def _cost_arg(cost: str | dict[str, Any] | None) -> str | None:
    """A preset name, a cost-model dict, or a path to a cost-model JSON file."""
    if cost is None or isinstance(cost, dict):
        return None if cost is None else json.dumps(cost)
    if cost.strip().startswith("{"):
        return cost
    path = Path(cost)
    if path.suffix == ".json" and path.exists():
        return path.read_text()
    return cost


def plan(
    graph: Graph,
    scheduler: str = "search",
    budget_bytes: int | None = None,
    cost: str | dict[str, Any] | None = None,
    detail: bool = True,
) -> dict[str, Any]:
    """Plan one graph. ``budget_bytes`` defaults to the graph's, else the greedy peak."""
    out = _core.plan_graph(_as_json(graph), scheduler, budget_bytes, _cost_arg(cost), detail)
    return json.loads(out)


def compare(
    graph: Graph, budget_bytes: int | None = None, cost: str | dict[str, Any] | None = None
) -> dict[str, Any]:
    """Both schedulers on one graph: the CLI's summary line as a dict."""
    return json.loads(_core.compare_plans(_as_json(graph), budget_bytes, _cost_arg(cost)))


def synthetic(n_nodes: int = 0, preset: str = "1b", world: int = 2) -> dict[str, Any]:
    """A transformer-shaped training graph of about ``n_nodes`` nodes (0: the preset's size)."""
    return json.loads(_core.synthetic_graph(n_nodes, preset, world))


def cost_model(preset: str = "nvlink", world: int = 2) -> dict[str, Any]:
    return json.loads(_core.cost_model(preset, world))


def default_cost_model(device_type: str, world: int) -> dict[str, Any]:
    """The cost model zrs plans with on `device_type` when nothing was measured."""
    return json.loads(_core.default_cost_model(device_type, world))


def fit_cost_model(
    allgather: Sequence[tuple[int, float]],
    reduce_scatter: Sequence[tuple[int, float]],
    world: int,
) -> dict[str, Any]:
    """Fit latency + bytes/bandwidth from a sweep of (full bytes, microseconds) samples."""
    return json.loads(_core.fit_cost_model(list(allgather), list(reduce_scatter), world))


def fit_copy_link(samples: Sequence[tuple[int, float]]) -> dict[str, Any]:
    """Fit latency + bytes/bandwidth of a copy (offload's device-to-host link, the cost model's
    `host`) from (bytes, microseconds) samples."""
    return json.loads(_core.fit_copy_link(list(samples)))


def fit_all_reduce_link(samples: Sequence[tuple[int, float]], ranks: int) -> dict[str, Any]:
    """Fit latency + bytes/bandwidth of a ring all-reduce across `ranks` (hybrid sharding's
    replicas, the cost model's `inter` link) from (bytes each rank sums, microseconds) samples."""
    return json.loads(_core.fit_all_reduce_link(list(samples), ranks))


def write_trace(
    graph: Graph,
    path: str | Path,
    scheduler: str = "search",
    budget_bytes: int | None = None,
    cost: str | dict[str, Any] | None = None,
) -> Path:
    """Plan and write the Chrome trace (Perfetto) of the plan."""
    path = Path(path)
    path.write_text(_core.chrome_trace(_as_json(graph), scheduler, budget_bytes, _cost_arg(cost)))
    return path


from zrs.planner.plot import plot_memory  # noqa: E402  (it plots what `plan` returns)
