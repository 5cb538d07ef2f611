"""The step benchmark's Markdown table (``step.py --table FILE``, and after a run): the latest
record per (preset, world, system, tag, varlen), and the JSON-lines reader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from systems import ALL_SYSTEMS


def fmt(v, spec: str = "") -> str:
    return "" if v is None else format(v, spec)


def table(records: list[dict]) -> str:
    """Markdown table, the latest record per (preset, world, system, tag, varlen). --varlen rows
    (tag "+varlen") show the throughput and MFU over the real tokens."""
    latest: dict[tuple, dict] = {}
    for r in records:
        tag = r.get("tag", "") + ("+varlen" if r.get("varlen") else "")
        key = (r.get("preset"), r.get("world"), r.get("system"), tag)
        latest.pop(key, None)
        latest[key] = r
    rows = [
        "| preset | GPUs | system | tag | step ms (med) | step ms (min) | tok/s/GPU | MFU "
        "| peak GiB | warm-up s | loss | device |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = {s: i for i, s in enumerate(ALL_SYSTEMS)}
    for (preset, world, system, tag), r in sorted(
        latest.items(),
        key=lambda kv: (str(kv[0][0]), kv[0][3], order.get(kv[0][2], 99), kv[0][1] or 0),
    ):
        if "error" in r:
            err = r["error"].splitlines()[0][:80].replace("|", "/")
            cells = [f"error: {err}", "", "", "", "", "", ""]
        else:
            real = "_real" if r.get("varlen") else ""
            mfu = r.get("mfu" + real)
            cells = [
                fmt(r.get("step_ms_med"), ".1f"),
                fmt(r.get("step_ms_min"), ".1f"),
                fmt(r.get("tok_s_gpu" + real), ",.0f"),
                f"{100 * mfu:.1f}%" if mfu is not None else "",
                fmt(r.get("peak_GiB"), ".2f"),
                fmt(r.get("warmup_s"), ".1f"),
                fmt(r.get("loss"), ".3f"),
            ]
        rows.append(
            "| "
            + " | ".join([str(preset), str(world), system, tag or "-", *cells, r.get("device", "")])
            + " |"
        )
    return "\n".join(rows)


def read_records(path: Path) -> list[dict]:
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"{path}:{n}: not JSON, skipped", file=sys.stderr)
    return records
