"""The host optimizer against the CPU optimizers a user could run instead (issue 37): parameters
a second of one AdamW (and SGD with momentum) step over one flat fp32 shard, on this machine's
cores.

    python benches/host_optim.py --numel 67108864 --threads 1,all --out benches/results/x.jsonl

Systems: zrs-core's AdamW and SGD (with and without the bf16 copy it writes in the same pass),
torch.optim's on CPU tensors (single-tensor, foreach and fused) and DeepSpeed's CPUAdam where
DeepSpeed is installed (its extension builds on first use). Each system and thread count runs in
a process of its own, with OMP_NUM_THREADS and torch's threads set to the count, so no pool of
one system warms or holds the cores of another. One JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SYSTEMS = (
    "zrs_adamw", "zrs_adamw_bf16_copy", "torch_adamw", "torch_adamw_foreach",
    "torch_adamw_fused", "deepspeed_cpu_adam", "zrs_sgd", "torch_sgd", "torch_sgd_foreach",
)  # fmt: skip
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
SGD = dict(lr=1e-2, momentum=0.9)


def _stepper(system: str, numel: int, threads: int):
    """A function that runs one step of `system` over fresh shards of `numel` elements."""
    p = torch.randn(numel) * 0.02
    g = torch.randn(numel) * 1e-3
    if system.startswith("zrs_"):
        from zrs.runtime.host_optim import HostOptimizer

        host = HostOptimizer.start(threads)
        a, b = torch.zeros(numel), torch.zeros(numel)
        copy = torch.empty(numel, dtype=torch.bfloat16) if "copy" in system else None
        steps = iter(range(1, 1 << 30))
        if system == "zrs_sgd":
            return lambda: host.sgd(p, g, a, first=False, **SGD)
        return lambda: host.adamw(p, g, a, b, step=next(steps), copy=copy, **HYPER)
    p.requires_grad_()
    p.grad = g
    if system == "deepspeed_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([p], adamw_mode=True, **HYPER)
    elif system.startswith("torch_sgd"):
        opt = torch.optim.SGD([p], foreach=system.endswith("foreach"), **SGD)
    else:
        kind = system.removeprefix("torch_adamw").lstrip("_")
        flags = {"foreach": kind == "foreach", "fused": True if kind == "fused" else None}
        opt = torch.optim.AdamW([p], **flags, **HYPER)
    return opt.step


def _one(system: str, numel: int, threads: int, reps: int) -> dict:
    torch.set_num_threads(threads)
    with torch.no_grad():
        step = _stepper(system, numel, threads)
        for _ in range(2):
            step()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    row = {"system": system, "numel": numel, "threads": threads, "ms_med": round(ms, 3)}
    row |= {"ms_min": round(min(times) * 1e3, 3), "params_per_s": round(numel / ms * 1e3)}
    if system.startswith("zrs_"):
        from zrs import _core

        row["isa"] = _core.HOST_ISA
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--threads", default="1,all", help="comma-separated counts; all = every core")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # system,threads: run one row here
    args = ap.parse_args(argv)
    if args.one:
        system, threads = args.one.split(",")
        print(json.dumps(_one(system, args.numel, int(threads), args.reps)), flush=True)
        return
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    cores = os.cpu_count() or 1
    counts = [cores if t == "all" else int(t) for t in args.threads.split(",")]
    host = {"cpu": platform.processor() or platform.machine(), "cores": cores}
    for threads in counts:
        for system in args.systems.split(","):
            env = os.environ | {"OMP_NUM_THREADS": str(threads)}
            cmd = [sys.executable, __file__, "--one", f"{system},{threads}",
                   "--numel", str(args.numel), "--reps", str(args.reps)]  # fmt: skip
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                row = {"system": system, "threads": threads, "error": done.stderr[-1500:]}
            else:
                row = json.loads(lines[-1]) | host
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row | {"command": shlex_join(sys.argv)}) + "\n")


def shlex_join(argv: list[str]) -> str:
    import shlex

    return shlex.join(["python", *argv])


if __name__ == "__main__":
    main()
