"""Where the first trained step's time goes: world sizes, cold and warm caches, one line each.

    python benches/compile_time.py --preset 1b --worlds 1,2 --systems zrs,fsdp2_compile \\
        --out benches/results/compile_time.jsonl
    python benches/compile_time.py --table benches/results/compile_time.jsonl

    python benches/compile_time.py --preset 1b --worlds 2 --states cold --rounds 3 \\
        --systems zrs_shard_compile,zrs_shard_compile_layers,fsdp2_compile --deadline 500

Each (system, world) trains `--steps` steps with `benches/step.py` under torchrun twice, with one
inductor/Triton/extensions cache folder: emptied first (cold: a fresh machine), then as the
first run left it (warm: a restart on the same machine); `--rounds` repeats them all, the
systems' order turned each round, and `--deadline` starts no run past that many seconds (a
device call's limit). Each run's record (step.py's own line,
kept whole under "record") is summarised into the phases below, in seconds, rank 0's:

  first_step     the first trained step: model build to the end of its optimizer step
  dynamo         dynamo's bytecode tracing
  aot            AOTAutograd, less the inductor compiles inside it
  region_traces  of which: tracing the repeated blocks' bodies (invoke_subgraph)
  inductor       inductor's forward and backward compiles, less zrs's passes inside them
  codegen        of which: inductor's code generation (Triton kernels' compile follows it)
  lowering       of which: inductor's lowering of the FX graphs to its IR (GraphLowering.run)
  scheduling     of which: inductor's scheduler set-up, its fusion decisions included
  triton         of which: waiting for the Triton kernels that its compile workers build
  zrs_passes     zero3 lowering, keep, buckets, coalesce (zrs's own, inside inductor)
  profile, plan  zrs's profile of the graph's ops and the Rust planner
  exchanges      zrs's compile-time rank meetings: the rank check, the budget, the timed sweep
  gc_full        Python's full garbage collections over the build and first step (they walk
                 every object a compile has made so far)
  graphs         each compiled graph's own forward and backward compile, "fw+bw" seconds, in
                 compile order (zrs.shard(compile=True): the root's graph, then the layer's)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PASSES = ("lower", "keep", "buckets", "coalesce")
EXCHANGES = ("rank_check", "budget", "sweep")


def _get(d: dict, *keys: str) -> float:
    return sum(float(d.get(k, 0.0)) for k in keys)


def breakdown(record: dict) -> dict[str, float]:
    """The phases of one step.py record (see the module's docstring)."""
    t = record.get("compile_phases_s") or {}
    z = record.get("zrs_compile_s") or {}
    inductor_total = _get(
        t, "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler"
    )
    zrs_inside = _get(z, *PASSES, "profile", "plan")
    phases = {
        "first_step": float(record.get("warmup_s", 0.0)),
        "dynamo": _get(t, "bytecode_tracing"),
        "aot": max(0.0, _get(t, "create_aot_dispatcher_function") - inductor_total),
        "region_traces": _get(
            t,
            "invoke_subgraph_proxy_tensor",
            "invoke_subgraph_trace_joint_graph",
            "invoke_subgraph_fake_tensor",
        ),
        "inductor": max(0.0, inductor_total - zrs_inside),
        "codegen": _get(t, "GraphLowering.codegen"),
        "lowering": _get(t, "GraphLowering.run"),
        "scheduling": _get(t, "Scheduler.__init__"),
        "triton": _get(t, "async_compile.wait"),
        "zrs_passes": _get(z, *PASSES),
        "profile": _get(z, "profile"),
        "plan": _get(z, "plan"),
        "exchanges": _get(z, *EXCHANGES),
        "gc_full": _get(record.get("first_step_gc_s") or {}, "full_s"),
    }
    return {k: round(v, 2) for k, v in phases.items()}


def compile_threads(setting: str, world: int, cores: int) -> str | None:
    """TORCHINDUCTOR_COMPILE_THREADS for each rank of a run: "torch" (None: torch's default, a
    worker per core in every rank), "split" (the host's cores divided among the ranks), or a
    number."""
    if setting == "torch":
        return None
    if setting == "split":
        return str(max(1, cores // world))
    return str(int(setting))


def _run(system: str, world: int, cache: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env |= {
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"),
    }
    threads = compile_threads(args.compile_threads, world, os.cpu_count() or 1)
    if threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = threads
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        cmd = [
            "torchrun", "--standalone", "--nproc-per-node", str(world), str(HERE / "step.py"),
            "--preset", args.preset, "--systems", system, "--warmup", "1",
            "--steps", str(args.steps), "--out", out.name, *shlex.split(args.step_args),
        ]  # fmt: skip
        shown = shlex.join(cmd)
        # A session of its own: on a timeout the workers go with torchrun, not on holding the
        # GPUs and the caches' locks into the next run.
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            log, _ = proc.communicate(timeout=args.timeout)
            why = f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            why = f"timed out after {args.timeout:g} s"
        lines = [json.loads(x) for x in out.read().splitlines() if x.strip()]
    if proc.returncode != 0 or not lines:
        return {"error": why, "log_tail": log[-3000:], "command": shown}
    return {"record": lines[-1], "command": shown}


def runs(systems: list[str], worlds: list[int], states: list[str], rounds: int) -> list[tuple]:
    """(round, system, world, state) in the order they run: each round all of them, its
    systems turned by one against the round before (the machine's state drifts over a call: a
    system that always ran first would always meet it first), each (system, world)'s states
    one after the other (a warm run reuses the cold one's caches)."""
    order = []
    for r in range(rounds):
        turn = r % len(systems)
        for system in systems[turn:] + systems[:turn]:
            order += [(r, system, world, state) for world in worlds for state in states]
    return order


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    start = time.monotonic()
    worlds = [int(w) for w in args.worlds.split(",")]
    planned = runs(args.systems.split(","), worlds, args.states.split(","), args.rounds)
    for r, system, world, state in planned:
        if args.deadline and time.monotonic() - start > args.deadline:
            print(f"not run (--deadline {args.deadline:g} s): {system} world {world} {state}")
            continue
        cache = Path(args.cache_root) / f"{args.preset}_{system}_{world}"
        if state == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        run = _run(system, world, cache, args)
        row = {"system": system, "preset": args.preset, "world": world, "cache": state, "round": r}
        row["compile_threads"] = args.compile_threads
        if "record" in run:
            rec = run["record"]
            row |= breakdown(rec) | {"step_ms_med": rec.get("step_ms_med")}
            row |= {"peak_GiB": rec.get("peak_GiB"), "device": rec.get("device")}
        row |= run
        print(json.dumps({k: v for k, v in row.items() if k != "record"}), flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


COLUMNS = (
    "first_step", "dynamo", "aot", "region_traces", "inductor", "codegen", "lowering",
    "scheduling", "triton", "zrs_passes", "profile", "plan", "exchanges", "gc_full",
)  # fmt: skip


def graphs(record: dict) -> str:
    """Each graph's own compile, in compile order: its forward's seconds (dynamo to inductor)
    and its backward's, "fw+bw"; "-" for a record from before step.py kept them."""
    kept = record.get("compile_graphs")
    if not kept:
        return "-"
    return ", ".join(f"{g.get('fw_s', 0.0):.1f}+{g.get('bw_s', 0.0):.1f}" for g in kept)


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows, one per run."""
    head = ["preset", "system", "world", "cache", *COLUMNS, "step ms", "graphs (fw+bw s)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 5) + "---|"]
    for r in rows:
        cells = [r["preset"], r["system"], str(r["world"]), r["cache"]]
        if "error" in r:
            cells += [r["error"]] + [""] * (len(COLUMNS) + 1)
        else:
            cells += [f"{r[c]:.1f}" for c in COLUMNS] + [f"{r.get('step_ms_med') or 0:.1f}"]
            cells.append(graphs(r.get("record", {})))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1b")
    p.add_argument("--worlds", default="1,2", help="comma-separated world sizes")
    p.add_argument("--systems", default="zrs,fsdp2_compile", help="step.py systems")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    p.add_argument("--states", default="cold,warm", help="cold (emptied caches first), warm")
    p.add_argument("--step-args", default="", help="more step.py arguments, one string")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds a run may take")
    p.add_argument("--cache-root", default="/tmp/compile_time_cache")
    p.add_argument(
        "--compile-threads",
        default="torch",
        help="inductor's compile workers per rank: torch (its default), split (the host's "
        "cores divided among the ranks) or a number",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="repeat every run, the systems' order turned each"
    )
    p.add_argument(
        "--deadline", type=float, default=0.0, help="start no run after this many seconds (0: none)"
    )
    p.add_argument("--out", type=Path, help="append the JSON lines here")
    p.add_argument("--table", type=Path, help="print the Markdown table of this file and exit")
    args = p.parse_args(argv)
    if args.table is not None:
        rows = [json.loads(x) for x in args.table.read_text().splitlines() if x.strip()]
        # The phases again from each kept record: a file written before a phase was added shows it.
        print(table([r | breakdown(r["record"]) if "record" in r else r for r in rows]))
        return
    rows = measure(args)
    print(table(rows))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
