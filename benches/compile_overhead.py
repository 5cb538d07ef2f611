"""Compile overhead of zrs against plain torch.compile, on the CPU, one process.

Each system runs in a fresh subprocess with cold inductor caches; the first step (forward, backward,
optimizer step, compile included) and the median of the following steps are timed. One JSON line
per system goes to stdout and, with --out, is appended to a file:

    python benches/compile_overhead.py --model-size small --out benches/results/compile_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

SYSTEMS = ("torch_compile", "zrs_inductor", "zrs_eager")


def worker(system: str, size: str, steps: int) -> dict:
    import torch

    import zrs
    from zrs.train.data import BatchSampler, load_corpus
    from zrs.train.gpt import GPT, config_for

    torch.manual_seed(0)
    cfg = config_for(size)
    model = GPT(cfg)
    model.init_weights(0)
    if system == "torch_compile":
        model.compile()
    else:
        zrs.compile(model, backend=system.removeprefix("zrs_"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = BatchSampler(load_corpus("train"), batch_size=8, seq_len=cfg.block_size, seed=0)
    times = []
    for step in range(steps):
        x, y = sampler.batch(step, rank=0)
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {
        "system": system,
        "model_size": size,
        "first_step_s": round(times[0], 3),
        "step_ms_med": round(1e3 * statistics.median(times[1:]), 2),
        "loss": round(loss.item(), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", help="append the JSON lines to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model_size, args.steps)))
        return
    rows = []
    for system in args.systems.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(
                os.environ,
                TORCHINDUCTOR_CACHE_DIR=cache,
                TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                TORCHINDUCTOR_AUTOGRAD_CACHE="0",
            )
            cmd = [sys.executable, __file__, "--worker", system, "--model-size", args.model_size]
            cmd += ["--steps", str(args.steps)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        row.update(
            device=f"cpu ({os.cpu_count()} cores, {platform.machine()})", command=" ".join(sys.argv)
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
