"""Where a step's GPU time goes, from a torch.profiler Chrome trace (``benches/step.py --trace``).

    python benches/trace_summary.py TRACE.json[.gz] [...]

Per trace, over the profiled window (first kernel start to last kernel end, divided by the
number of steps in it):

* ``compute_ms``: time some non-NCCL kernel (or copy/memset) runs;
* ``comm_ms``: time some NCCL kernel runs; ``comm_exposed_ms`` the part of it with no compute
  kernel beside it. NCCL kernels spin until their peer arrives, so this includes waiting for a
  slower rank, not only transfer;
* ``idle_ms``: no kernel at all (the GPU waits for the CPU: launch overhead, host syncs, Python);
* ``streams``: busy milliseconds per CUDA stream, and the longest idle gaps on the stream that
  runs the most compute, with the name of the kernel that ended each gap.

The numbers are per step. ``step.py --trace`` puts this summary into its JSON record.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
TOP_GAPS = 5


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total overlap of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    kernels = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and e.get("dur", 0) > 0
    ]
    if not kernels:
        return {"error": "no GPU events in the trace (CPU run?)"}
    comm, compute = [], []
    by_stream: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in kernels:
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        (comm if e["name"].startswith("nccl") else compute).append(span)
        by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    start = min(s for s, _ in comm + compute)
    end = max(e for _, e in comm + compute)
    comm_u, compute_u = _union(comm), _union(compute)
    both = _intersect(comm_u, compute_u)
    busy = _length(_union(comm + compute))
    per = 1e3 * max(steps, 1)  # microseconds in the trace -> milliseconds per step
    streams = {}
    for sid, evs in by_stream.items():
        streams[str(sid)] = round(
            _length(_union([(e["ts"], e["ts"] + e["dur"]) for e in evs])) / per, 3
        )
    # The stream with the most non-NCCL time: where compute waits show up as gaps.
    main_sid = max(
        by_stream,
        key=lambda s: sum(e["dur"] for e in by_stream[s] if not e["name"].startswith("nccl")),
    )
    evs = sorted(by_stream[main_sid], key=lambda e: e["ts"])
    gaps = []
    for prev, nxt in itertools.pairwise(evs):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap > 0:
            gaps.append((gap, prev["name"][:60], nxt["name"][:60]))
    gaps.sort(reverse=True)
    return {
        "window_ms": round((end - start) / per, 3),
        "compute_ms": round(_length(compute_u) / per, 3),
        "comm_ms": round(_length(comm_u) / per, 3),
        "comm_exposed_ms": round((_length(comm_u) - both) / per, 3),
        "idle_ms": round((end - start - busy) / per, 3),
        "main_stream": str(main_sid),
        "main_stream_gaps_ms": round(sum(g for g, _, _ in gaps) / per, 3),
        "streams_busy_ms": streams,
        "top_gaps": [
            {"ms": round(g / 1e3, 3), "after": a, "before": b} for g, a, b in gaps[:TOP_GAPS]
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=3, help="steps in each trace (step.py: 3)")
    args = ap.parse_args()
    for path in args.traces:
        print(json.dumps({"trace": str(path), **summarize(load(path), args.steps)}))


if __name__ == "__main__":
    main()
