"""``python -m zrs.planner``: plan a graph with the greedy baseline and the search; print one JSON
line comparing them (options: ``--help``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from zrs import _core
from zrs.planner import compare, plan, plot_memory, write_trace

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
        prog="python -m zrs.planner",
        description="Plan a graph with the greedy baseline and the search; print one JSON line.",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("graph", nargs="?", help="planner graph JSON file (dumped by the FX pass)")
    src.add_argument(
        "--synthetic", type=int, metavar="N", help="a synthetic transformer graph of about N nodes"
    )
    ap.add_argument("--preset", default="1b", help="synthetic model preset: 1b, 7b, 70b, tiny")
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
        print(f"zrs.planner: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
