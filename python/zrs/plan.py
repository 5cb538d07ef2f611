"""The planner from Python, and its command line.

The planner (Rust, ``zrs._core``) takes one graph in the planner IR (JSON: nodes of kind compute,
allgather, wait, release, reduce_scatter or other, with deps, durations and bytes) and returns
the program order, the fused prefetch groups and the simulated timeline::

    from zrs import plan
    g = plan.synthetic(preset="1b")                 # or a graph dumped by the FX pass
    p = plan.plan(g, "search", cost="nop2p")        # dict: order, groups, makespan_us, ...
    plan.write_trace(g, "out.json")                 # open in https://ui.perfetto.dev
    plan.plot_memory([p], "mem.png")

Command line (prints one JSON line comparing both schedulers)::

    python -m zrs.plan --synthetic 10000 [--cost nvlink|nop2p|COST.json] [--budget BYTES]
                       [--trace out.json] [--plot mem.png]
    python -m zrs.plan GRAPH.json [same options]
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zrs import _core

Graph = dict[str, Any] | str

__all__ = [
    "compare",
    "cost_model",
    "fit_cost_model",
    "main",
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


def fit_cost_model(
    allgather: Sequence[tuple[int, float]],
    reduce_scatter: Sequence[tuple[int, float]],
    world: int,
) -> dict[str, Any]:
    """Fit latency + bytes/bandwidth from a sweep of (full bytes, microseconds) samples."""
    return json.loads(_core.fit_cost_model(list(allgather), list(reduce_scatter), world))


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


# --- memory plot --------------------------------------------------------------------------------

_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]


def _png(width: int, height: int, pixels: bytearray) -> bytes:
    """Encode RGB rows (no filter) as a PNG."""
    raw = b"".join(
        b"\x00" + bytes(pixels[y * width * 3 : (y + 1) * width * 3]) for y in range(height)
    )

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def _plot_plain(
    series: list[tuple[str, list[float], list[float]]], budget: int | None, path: Path
) -> None:
    """A dependency-free step plot: one colored line per plan, the budget as a red dashed line."""
    w, h, m = 900, 360, 20
    px = bytearray(b"\xff" * (w * h * 3))

    def put(x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            i = (y * w + x) * 3
            px[i : i + 3] = bytes(c)

    t_max = max((max(t) for _, t, _ in series if t), default=1.0) or 1.0
    b_max = max([max(b) for _, _, b in series if b] + [budget or 0]) or 1.0

    def sx(t: float) -> int:
        return m + int((w - 2 * m) * t / t_max)

    def sy(b: float) -> int:
        return h - m - int((h - 2 * m) * b / b_max)

    for x in range(m, w - m):
        put(x, h - m, (0, 0, 0))
    for y in range(m, h - m):
        put(m, y, (0, 0, 0))
    if budget:
        for x in range(m, w - m):
            if (x // 6) % 2 == 0:
                put(x, sy(budget), (214, 39, 40))
    for k, (_, ts, bs) in enumerate(series):
        c = _COLORS[k % len(_COLORS)]
        px_prev, py_prev = sx(0), sy(bs[0] if bs else 0)
        for t, b in zip(ts, bs, strict=True):
            x1, y1 = sx(t), sy(b)
            for x in range(min(px_prev, x1), max(px_prev, x1) + 1):
                put(x, py_prev, c)
            for y in range(min(py_prev, y1), max(py_prev, y1) + 1):
                put(x1, y, c)
            px_prev, py_prev = x1, y1
    path.write_bytes(_png(w, h, px))


def plot_memory(plans: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Plot memory over time of detailed plans (``plan(..., detail=True)``) to a PNG.

    Uses matplotlib when it is installed; otherwise writes a plain plot (lines only, no text:
    greedy blue, search orange, budget red dashed) with a built-in PNG writer.
    """
    path = Path(path)
    series = [
        (
            p["scheduler"],
            [t / 1e3 for t in p["mem_t_us"]],
            [b / 2**30 for b in p["mem_bytes"]],
        )
        for p in plans
    ]
    budget = next((p.get("budget_bytes") for p in plans if p.get("budget_bytes")), None)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "zrs.plan: matplotlib is not installed; writing a plain plot without labels "
            "(greedy blue, search orange, budget red dashed)",
            file=sys.stderr,
        )
        _plot_plain(
            [(n, t, [b * 2**30 for b in bs]) for n, t, bs in series],
            budget,
            path,
        )
        return path
    fig, ax = plt.subplots(figsize=(10, 4))
    for name, ts, bs in series:
        ax.step(ts, bs, where="post", label=name)
    if budget:
        ax.axhline(budget / 2**30, color="red", linestyle="--", label="budget")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("live memory (GiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --- command line -------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20}
_UNITS["gib"] = 2**30


def parse_bytes(s: str) -> int:
    """``12345``, ``80GB``, ``64GiB``, ``1.5e9``."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", s)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte count: {s!r} (e.g. 80000000000 or 80GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m zrs.plan",
        description="Plan a graph with the greedy baseline and the search; print one JSON line.",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("graph", nargs="?", help="planner graph JSON file (dumped by the FX pass)")
    src.add_argument(
        "--synthetic", type=int, metavar="N", help="a synthetic transformer graph of about N nodes"
    )
    ap.add_argument("--preset", default="1b", help="synthetic model preset: 1b, 7b, tiny")
    ap.add_argument("--world", type=int, default=2, help="data-parallel ranks (synthetic)")
    ap.add_argument(
        "--cost", default=None, help="nvlink (default), nop2p, or a cost-model JSON file"
    )
    ap.add_argument(
        "--budget", type=parse_bytes, default=None, help="memory budget (default: greedy's peak)"
    )
    ap.add_argument("--trace", type=Path, help="write the search plan's Chrome trace here")
    ap.add_argument("--plot", type=Path, help="write a PNG of memory over time here")
    ap.add_argument("--dump", type=Path, help="write the (synthetic) graph JSON here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.synthetic is not None:
            graph = _core.synthetic_graph(args.synthetic, args.preset, args.world)
        else:
            graph = Path(args.graph).read_text()
        if args.dump:
            args.dump.write_text(graph)
        summary = compare(graph, args.budget, args.cost)
        budget = summary["budget_bytes"]
        if args.trace:
            write_trace(graph, args.trace, "search", budget, args.cost)
            summary["trace"] = str(args.trace)
        if args.plot:
            plans = [plan(graph, s, budget, args.cost) for s in ("greedy", "search")]
            plot_memory(plans, args.plot)
            summary["plot"] = str(args.plot)
    except (_core.ZrsError, OSError) as e:
        print(f"zrs.plan: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
