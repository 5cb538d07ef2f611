"""Time from each fault to the error on the surviving ranks (2 CPU ranks, gloo), and the cost of
the step check that zrs runs before every forward.

    PYTHONPATH=tests/support python benches/faults.py --timeout 10 --out FILE.jsonl

Runs the scenarios of the tests (`tests/support/faults.py`, hence the PYTHONPATH) with `zrs.compile(timeout=...)`; one JSON line per fault and
rank: the error's class, its first 200 characters and the seconds from the fault to it. Then one
line for the step check: the mean microseconds of one exchange of the step counters between the
ranks (`zrs.runtime.exchange.all_gather_ints` on a gloo group, what `ZeroState.begin_forward` issues).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import faults
from _dist import run_faulty, run_workers


def _check_cost(rank: int, world: int, calls: int) -> float:
    import torch.distributed as dist

    from zrs.runtime.exchange import all_gather_ints

    group = dist.new_group(backend="gloo")
    for _ in range(20):
        all_gather_ints([1, 2, 3, 1, 1], group)
    t0 = time.perf_counter()
    for _ in range(calls):
        all_gather_ints([1, 2, 3, 1, 1], group)
    return (time.perf_counter() - t0) / calls * 1e6


def _line(fault: str, rank: int, record: dict | None, timeout: float) -> dict:
    if record is None:
        return {"fault": fault, "rank": rank, "kind": "(stopped or killed itself)"}
    return {
        "fault": fault,
        "rank": rank,
        "timeout_s": timeout,
        "kind": record.get("kind"),
        "seconds": round(record["seconds"], 2) if "seconds" in record else None,
        "error": (record.get("error") or "")[:200],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--device", default="CPU, 2 gloo ranks", help="where it ran, for the record")
    p.add_argument("--only-check", action="store_true", help="only the step check's cost")
    a = p.parse_args()
    lines = []
    t = a.timeout
    bound = 20 * t + 120
    for phase in () if a.only_check else ("forward", "backward", "optimizer"):
        per_rank = run_workers(faults.one_rank_raises, 2, t, phase, timeout=bound)
        for rank, r in enumerate(per_rank):
            first_zrs = next((e for e in r["errors"] if e["kind"] == "ZrsError"), None)
            lines.append(_line(f"one rank raises in the {phase}", rank, first_zrs, t))
    per_rank = [] if a.only_check else run_workers(faults.disagreements, 2, t, timeout=bound)
    for rank, cases in enumerate(per_rank):
        for case, record in cases.items():
            lines.append(_line(f"disagreement: {case}", rank, record, t))
    for how in () if a.only_check else ("stop", "kill"):
        for rank, r in enumerate(run_faulty(faults.peer_lost, 2, t, how, timeout=bound)):
            lines.append(
                _line(f"peer {'stopped (SIGSTOP)' if how == 'stop' else 'killed'}", rank, r, t)
            )
    costs = run_workers(_check_cost, 2, 2000, timeout=120)
    lines.append({"fault": "none: the step check per forward", "us_per_check": max(costs)})
    command = " ".join(["python", *sys.argv])
    with a.out.open("a") if a.out else open("/dev/null", "w") as fh:
        for line in lines:
            line = {**line, "command": command, "device": a.device}
            print(json.dumps(line))
            fh.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
