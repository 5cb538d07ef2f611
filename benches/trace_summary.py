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
  runs the most compute, with the name of the kernel that ended each gap;
* ``kernel_groups_ms``: summed kernel time per kind (matmul, attention, Triton, zrs's copy kernel,
  all-gather, reduce-scatter, ...), to compare two systems' compute kernel by kind;
  ``kernel_groups_count`` the number of launches per kind;
* ``slowed_beside_comm``: what NCCL kernels running beside them cost the matmul and attention
  kernels: per kernel name, the median launch with NCCL beside it for less than half its time
  is that kernel's speed alone, and each launch with NCCL beside it for more than half counts
  what it took beyond that (``ms``, over ``launches``). NCCL kernels take SMs from the
  kernels beside them, and spin there until the peer arrives;
* ``main_stream_kernels`` and ``main_stream_gap_sizes``: GPU events on the main stream, and its
  gaps by size (count and milliseconds per step): under a CUDA graph the host no longer opens
  gaps, and what is left is one short gap per kernel boundary.

``--compact DIR`` also writes each trace's GPU events alone (name, start, duration, stream) as
gzipped JSON: a 7b trace is hundreds of MB, its kernels a few MB, small enough to bring back from
the device machine and study there.

The numbers are per step. ``step.py --trace`` puts this summary into its JSON record.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
TOP_GAPS = 5
# Upper bounds (microseconds) of the gap-size classes in main_stream_gap_sizes.
GAP_CLASSES = ((2.0, "le_2us"), (10.0, "le_10us"), (100.0, "le_100us"), (float("inf"), "gt_100us"))
# Kernel kinds by name, first match wins. Matmuls on Hopper are nvjet/cutlass/xmma kernels.
KERNEL_GROUPS = (
    ("all_gather", ("ncclDevKernel_AllGather", "ncclKernel_AllGather")),
    ("reduce_scatter", ("ncclDevKernel_ReduceScatter", "ncclKernel_ReduceScatter")),
    ("nccl_other", ("nccl",)),
    ("zrs_copy", ("seg_copy_kernel",)),
    ("attention", ("flash", "fmha", "attn")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "sm90_")),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "FusedAdam")),
    ("triton", ("triton_",)),
    ("memcpy", ("Memcpy", "memcpy")),
    ("memset", ("Memset", "memset")),
)


def is_gpu_event(e: dict[str, Any]) -> bool:
    """A kernel, copy or memset on the device (a complete "X" event of a GPU category)."""
    return e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES


def kernel_group(name: str) -> str:
    for group, needles in KERNEL_GROUPS:
        if any(n in name for n in needles):
            return group
    return "other"


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


def slowed_beside_comm(
    kernels: list[dict[str, Any]], comm_u: list[tuple[float, float]]
) -> tuple[int, float]:
    """(launches, microseconds) that matmul and attention kernels lost to NCCL beside them."""
    alone: dict[str, list[float]] = defaultdict(list)
    beside: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        if kernel_group(e["name"]) not in ("matmul", "attention"):
            continue
        dur = float(e["dur"])
        shared = _intersect([(float(e["ts"]), float(e["ts"]) + dur)], comm_u)
        (beside if shared > dur / 2 else alone)[e["name"]].append(dur)
    launches, lost = 0, 0.0
    for name, durs in beside.items():
        if alone[name]:
            median = statistics.median(alone[name])
            launches += len(durs)
            lost += sum(d - median for d in durs)
    return launches, lost


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    kernels = [e for e in events if is_gpu_event(e) and e.get("dur", 0) > 0]
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
    sizes = {name: [0, 0.0] for _, name in GAP_CLASSES}
    for gap, _, _ in gaps:
        size = sizes[next(name for bound, name in GAP_CLASSES if gap <= bound)]
        size[0] += 1
        size[1] += gap
    groups: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in kernels:
        groups[kernel_group(e["name"])] += float(e["dur"])
        counts[kernel_group(e["name"])] += 1
    slowed = slowed_beside_comm(kernels, comm_u)
    return {
        "window_ms": round((end - start) / per, 3),
        "compute_ms": round(_length(compute_u) / per, 3),
        "comm_ms": round(_length(comm_u) / per, 3),
        "comm_exposed_ms": round((_length(comm_u) - both) / per, 3),
        "idle_ms": round((end - start - busy) / per, 3),
        "main_stream": str(main_sid),
        "main_stream_gaps_ms": round(sum(g for g, _, _ in gaps) / per, 3),
        "main_stream_kernels": round(len(evs) / max(steps, 1), 1),
        "main_stream_gap_sizes": {
            name: {"count": round(n / max(steps, 1), 1), "ms": round(t / per, 3)}
            for name, (n, t) in sizes.items()
        },
        "streams_busy_ms": streams,
        "slowed_beside_comm": {
            "launches": round(slowed[0] / max(steps, 1), 1),
            "ms": round(slowed[1] / per, 3),
        },
        "kernel_groups_ms": {
            g: round(t / per, 3) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])
        },
        "kernel_groups_count": {
            g: round(n / max(steps, 1), 1) for g, n in sorted(counts.items(), key=lambda kv: -kv[1])
        },
        "top_gaps": [
            {"ms": round(g / 1e3, 3), "after": a, "before": b} for g, a, b in gaps[:TOP_GAPS]
        ],
    }


def gpu_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's GPU events alone, in the Chrome format (loadable by ``load`` and Perfetto)."""
    return [
        {
            "ph": "X",
            "cat": e["cat"],
            "name": e["name"],
            "ts": e["ts"],
            "dur": e["dur"],
            "pid": e.get("pid", 0),
            "tid": e.get("tid", 0),
            "args": {"stream": e.get("args", {}).get("stream", e.get("tid"))},
        }
        for e in events
        if is_gpu_event(e)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=3, help="steps in each trace (step.py: 3)")
    ap.add_argument("--compact", type=Path, metavar="DIR", help="write GPU-only traces here")
    args = ap.parse_args()
    for path in args.traces:
        events = load(path)
        print(json.dumps({"trace": str(path), **summarize(events, args.steps)}))
        if args.compact is not None:
            args.compact.mkdir(parents=True, exist_ok=True)
            name = path.name.removesuffix(".gz").removesuffix(".json") + ".gpu.json.gz"
            with gzip.open(args.compact / name, "wt") as fh:
                json.dump({"traceEvents": gpu_events(events)}, fh)


if __name__ == "__main__":
    main()
