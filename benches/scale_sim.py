"""Simulated step time and exposed communication at 2 to 64 ranks (the planner's simulator).

For the 1b and 7b presets (`zrs.plan.synthetic`: one rank's training graph of the Llama-style
decoder with per-rank micro-batch 4, sequence 2048), plan with the greedy baseline and the search
under a ring cost model that grows with the world size, and print one JSON line per
(preset, world): compute, makespan and exposed communication of both schedulers.

The cost model per world size W (ring all-gather and reduce-scatter, `docs/planner.md`):
  time = latency(W) + bytes * (W - 1) / W / bus_bandwidth
  * one node (W <= 8, NVLink): the bus bandwidth and the per-step latency fitted from the measured
    2xH200 NVLink sweep (the planner's "nvlink" preset);
  * several nodes (W > 8): bus bandwidth 50 GB/s per GPU (the inter-node link), the same per-step
    latency;
  * latency(W) = (W - 1) x the measured 2-rank latency: a ring takes W - 1 steps.
The memory budget is the greedy schedule's peak (the search must win within the same memory).

`--hybrid`: full sharding over every rank against hybrid sharding (HSDP, docs/hybrid.md) at each
world W, in nodes of 8: sharded over the 8 GPUs of a node (NVLink, the W = 8 model above) and
replicated across the W / 8 nodes, each reduce-scatter's shard then all-reduced between the
nodes (a ring of 2 (r - 1) steps at 50 GB/s per GPU, the same per-step latency). One JSON line
per (preset, world, layout), the search's plan: its step, exposed communication and the peak
of what the step allocates (gathered parameters, activations), and beside it the state a rank
keeps (16 bytes a parameter over its shard group: fp32 master, AdamW moments, gradient). The
ring latency grows linearly with the ranks, as above: NCCL's trees grow slower, so the full
sharding rows at 512 are pessimistic.

    python benches/scale_sim.py [--worlds 2,4,8,64] [--presets 1b,7b] [--out FILE]
    python benches/scale_sim.py --hybrid --worlds 64,512 --presets 7b,70b [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from zrs import planner as zplan

GPUS_PER_NODE = 8
INTERNODE_BUS_GBPS = 50.0


def ring_cost(world: int) -> dict[str, Any]:
    """The cost model of one world size (see the module docstring)."""
    measured = zplan.cost_model("nvlink", 2)
    out: dict[str, Any] = {
        "name": f"ring_w{world}" + ("_internode" if world > GPUS_PER_NODE else "_nvlink"),
        "world": world,
    }
    for kind in ("allgather", "reduce_scatter"):
        link = measured[kind]
        bus = link["bus_gbps"] if world <= GPUS_PER_NODE else INTERNODE_BUS_GBPS
        out[kind] = {"latency_us": link["latency_us"] * (world - 1), "bus_gbps": bus}
    return out


def hybrid_cost(world: int) -> dict[str, Any]:
    """Sharded within a node (NVLink), all-reduced across the world / 8 nodes."""
    replicas = world // GPUS_PER_NODE
    latency = zplan.cost_model("nvlink", 2)["reduce_scatter"]["latency_us"]
    inter = {"latency_us": latency * 2 * (replicas - 1), "bus_gbps": INTERNODE_BUS_GBPS}
    return {
        **ring_cost(GPUS_PER_NODE),
        "name": f"hsdp_{GPUS_PER_NODE}x{replicas}",
        "replicas": replicas,
        "inter": inter,
    }


def replicated(graph: dict[str, Any], shards: int) -> dict[str, Any]:
    """`graph` with each reduce-scatter's shard all-reduced across the replicas after it."""
    for node in graph["nodes"]:
        if node["kind"] == "reduce_scatter" and node.get("bytes"):
            node["replicate_bytes"] = -(-node["bytes"] // shards)
    return graph


def simulate_hybrid(preset: str, world: int) -> list[dict[str, Any]]:
    """Full sharding over `world` ranks and HSDP (8 shards x world / 8 replicas): the search's
    step, compute and exposed communication of each."""
    layouts = {
        "full": (zplan.synthetic(0, preset, world), ring_cost(world)),
        "hsdp": (
            replicated(zplan.synthetic(0, preset, GPUS_PER_NODE), GPUS_PER_NODE),
            hybrid_cost(world),
        ),
    }
    rows = []
    for layout, (graph, cost) in layouts.items():
        shards = cost["world"]
        plan = zplan.compare(graph, None, cost)["search"]
        rows.append(
            {
                "preset": preset,
                "world": world,
                "layout": layout,
                "cost_model": cost,
                **{k: round(plan[k], 3) for k in ("compute_ms", "makespan_ms", "exposed_comm_ms")},
                "peak_GiB": round(plan["peak_bytes"] / 2**30, 2),
                "state_GiB": round(STATE_BYTES * _params(graph) / shards / 2**30, 2),
            }
        )
    return rows


# What a rank keeps of each parameter it shards, beside the step's peak: the fp32 master, two
# fp32 AdamW moments and the fp32 gradient.
STATE_BYTES = 16


def _params(graph: dict[str, Any]) -> int:
    """The model's parameters: each gathered tensor once, in bf16 (2 bytes an element)."""
    gathered = {n["ds_id"]: n["bytes"] for n in graph["nodes"] if n["kind"] == "allgather"}
    return sum(gathered.values()) // 2


def simulate(preset: str, world: int) -> dict[str, Any]:
    graph = zplan.synthetic(0, preset, world)
    cost = ring_cost(world)
    t0 = time.perf_counter()
    summary = zplan.compare(graph, None, cost)
    wall_ms = (time.perf_counter() - t0) * 1e3
    row: dict[str, Any] = {
        "preset": preset,
        "world": world,
        "cost_model": cost,
        "nodes": summary["nodes"],
    }
    for sched in ("greedy", "search"):
        s = summary[sched]
        row[sched] = {
            k: round(s[k], 3) if isinstance(s[k], float) else s[k]
            for k in ("compute_ms", "makespan_ms", "exposed_comm_ms", "peak_bytes", "groups")
        }
    g, s = row["greedy"], row["search"]
    row["exposed_reduction"] = (
        round(1 - s["exposed_comm_ms"] / g["exposed_comm_ms"], 4) if g["exposed_comm_ms"] else 0.0
    )
    row["plan_ms"] = round(summary["plan_ms"], 2)
    row["compare_wall_ms"] = round(wall_ms, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worlds", default="2,4,8,64")
    p.add_argument("--presets", default="1b,7b")
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    p.add_argument("--hybrid", action="store_true", help="full sharding against HSDP")
    args = p.parse_args(argv)
    if args.hybrid:
        return _hybrid(args, argv)
    rows = []
    for preset in args.presets.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            row = simulate(preset, world)
            row["command"] = "python benches/scale_sim.py " + " ".join(
                sys.argv[1:] if argv is None else argv
            )
            row["host"] = platform.node() or "cpu"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with args.out.open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    print()
    print(
        "| preset | ranks | compute ms | greedy step ms | greedy exposed ms | search step ms | search exposed ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g, s = r["greedy"], r["search"]
        print(
            f"| {r['preset']} | {r['world']} | {s['compute_ms']:.1f} | {g['makespan_ms']:.1f} | "
            f"{g['exposed_comm_ms']:.1f} | {s['makespan_ms']:.1f} | {s['exposed_comm_ms']:.1f} |"
        )
    return 0


def _hybrid(args: argparse.Namespace, argv: list[str] | None) -> int:
    rows = []
    for preset in args.presets.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            for row in simulate_hybrid(preset, world):
                row["command"] = "python benches/scale_sim.py " + " ".join(
                    sys.argv[1:] if argv is None else argv
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with args.out.open("a") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
    print()
    print(
        "| preset | GPUs | layout | compute ms | step ms | exposed comm ms | peak GiB | state GiB |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['world']} | {r['layout']} | {r['compute_ms']:.1f} | "
            f"{r['makespan_ms']:.1f} | {r['exposed_comm_ms']:.1f} | {r['peak_GiB']:.2f} | "
            f"{r['state_GiB']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
