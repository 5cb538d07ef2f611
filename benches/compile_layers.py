"""How zrs's compile grows with the layers, on CPU ranks (gloo): rank 0's first forward and
backward of the Llama decoder (`llama.py`, preset `tiny`) at each layer count and world size,
with torch's compile timers (calls and seconds).

    python benches/compile_layers.py --layers 4,8 --worlds 1,2 --backend eager
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "support")]
from _dist import run_workers  # noqa: E402


def worker(rank: int, world: int, layers: int, backend: str) -> dict:
    import dataclasses

    import torch
    from torch._dynamo.utils import compilation_time_metrics

    import zrs
    from llama import PRESETS, Llama

    torch.manual_seed(0)
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=layers)
    model = zrs.compile(Llama(cfg), backend=backend)
    x = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len))
    t0 = time.perf_counter()
    model(x).float().pow(2).mean().backward()
    first = time.perf_counter() - t0
    timers = {k: (len(v), round(sum(v), 2)) for k, v in compilation_time_metrics.items()}
    return {"first_s": round(first, 2), "timers": timers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,8", help="comma-separated layer counts")
    p.add_argument("--worlds", default="1,2", help="comma-separated world sizes")
    p.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    p.add_argument("--top", type=int, default=12, help="timers shown, the longest first")
    args = p.parse_args()
    for layers in map(int, args.layers.split(",")):
        for world in map(int, args.worlds.split(",")):
            r = run_workers(worker, world, layers, args.backend, timeout=900)[0]
            print(f"layers {layers}, world {world}: first step {r['first_s']} s")
            longest = sorted(r["timers"].items(), key=lambda kv: -kv[1][1])[: args.top]
            for name, (calls, seconds) in longest:
                print(f"  {name}: {calls} calls, {seconds} s")


if __name__ == "__main__":
    main()
