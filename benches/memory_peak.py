"""What is live at a step's memory peak, from a CUDA allocator snapshot (``step.py --memory``).

    python benches/memory_peak.py SNAPSHOT.pickle [--top N]

``step.py --memory DIR`` records the allocator's history for one step after the timed ones and
dumps ``torch.cuda.memory._dump_snapshot``'s pickle. This replays the trace's allocations and
frees, finds the moment the most bytes were allocated, and groups the blocks live then by the
code that allocated them: the first frame in zrs, in an inductor-generated module or in this
benchmark, else the innermost Python frame. Memory allocated before the recording started (the
parameter shards, optimizer state) appears as one ``(before the step)`` group.
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

KEY_MARKERS = ("/zrs/", "torchinductor", "/benches/")
TOP = 12


def _origin(frames: list[dict[str, Any]]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(m in name for m in KEY_MARKERS):
            return f"{Path(name).name}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{Path(f.get('filename', '?')).name}:{f.get('line')} {f.get('name')}"
    return "(no stack)"


def peak_breakdown(snapshot: dict[str, Any], before_bytes: int, top: int = TOP) -> dict[str, Any]:
    """The peak over the recorded trace (plus `before_bytes` live when it started) and the
    largest groups of blocks live at that moment."""
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for device_trace in snapshot.get("device_traces", []):
        for ev in device_trace:
            action, addr, size = ev["action"], ev["addr"], ev["size"]
            if action == "alloc":
                live[addr] = (size, _origin(ev.get("frames", [])))
                cur += size
                if cur > peak:
                    peak, at_peak = cur, dict(live)
            elif action == "free_completed" and addr in live:
                cur -= live.pop(addr)[0]
    groups: dict[str, int] = defaultdict(int)
    for size, origin in at_peak.values():
        groups[origin] += size
    ranked = sorted(groups.items(), key=lambda kv: kv[1], reverse=True)
    gib = 2**30
    return {
        "peak_GiB": round((before_bytes + peak) / gib, 3),
        "before_step_GiB": round(before_bytes / gib, 3),
        "live_at_peak_GiB": [[k, round(v / gib, 3)] for k, v in ranked[:top]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--before-bytes", type=int, default=0, help="allocated when recording began")
    ap.add_argument("--top", type=int, default=TOP)
    args = ap.parse_args()
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)
    out = peak_breakdown(snap, args.before_bytes, args.top)
    print(f"peak {out['peak_GiB']} GiB, of it {out['before_step_GiB']} GiB before the step")
    for origin, size in out["live_at_peak_GiB"]:
        print(f"{size:8.3f} GiB  {origin}")


if __name__ == "__main__":
    main()
