"""First-step memory on the CPU: the process's peak RSS after zrs's first training step (capture,
planner profile, compile, the step) and after later ones, with the planner's profile on and off.

    python benches/first_step_rss.py [--out benches/results/first_step_rss_cpu.jsonl]

The CPU stand-in for ``step.py``'s ``peak_GiB_all`` against ``peak_GiB`` on a GPU: the planner's
profile runs every graph once on real tensors of its shapes, and a graph compiled (and profiled)
inside a step, as AOTAutograd's lazily compiled backward was, adds what the profile holds to the
step's live tensors. Each setting runs in a fresh process (world 1, gloo), since a process's
peak RSS never goes down, with an inductor cache of its own (a hit skips zrs's passes). The model is the Llama of ``llama.py`` at a
size whose activations dominate its parameters. The workers run with glibc's mmap threshold fixed
at 64 KiB, so that every large tensor is its own mapping, returned to the system when freed, and
peak RSS follows the peak of live tensors rather than the heap's fragmentation. The later steps'
peaks climb for a few steps, with the profile or without: on the CPU the last 16 collectives'
buffers stay referenced (the gloo deadlock workaround in ``zrs/runtime/exchange.py``), gradient buckets
included. Compare first steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CONFIG = dict(n_layers=4, dim=512, n_heads=8, ffn_dim=1376, vocab_size=8000, seq_len=2048)
STEPS = 3


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def worker(profile: bool, backend: str) -> dict:
    import torch.distributed as dist

    import zrs
    from llama import Llama, LlamaConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = LlamaConfig(**CONFIG, micro_batch=4)
    with torch.device("meta"):
        model = Llama(cfg)
    zrs.compile(model, profile=profile, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len))
    before = _peak_rss_gib()
    after = []
    for _ in range(STEPS):
        model(tokens, tokens).backward()
        opt.step()
        opt.zero_grad()
        after.append(round(_peak_rss_gib(), 3))
    dist.destroy_process_group()
    return {
        "profile": profile,
        "backend": backend,
        "peak_rss_GiB_before_steps": round(before, 3),
        "peak_rss_GiB_after_step": after,
        "config": CONFIG | {"micro_batch": cfg.micro_batch},
        "torch": torch.__version__,
        "device": "cpu",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="append the JSON lines to this file")
    ap.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--note", default="", help="a free-form note for the records")
    ap.add_argument("--worker", choices=("profile", "no_profile"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker == "profile", args.backend)))
        return
    command = " ".join([Path(sys.executable).name, *sys.argv])
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
    for setting in ("profile", "no_profile"):
        # A fresh inductor cache each: in one process the FX graph cache is on, and a hit
        # skips zrs's passes, the profile with them.
        with tempfile.TemporaryDirectory(prefix="zrs_rss_inductor_") as cache:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", setting, "--backend", args.backend],
                check=True,
                env=env | {"TORCHINDUCTOR_CACHE_DIR": cache},
                capture_output=True,
                text=True,
            ).stdout
        record = json.loads(out.strip().splitlines()[-1]) | {
            "command": command,
            "env": {"MALLOC_MMAP_THRESHOLD_": env["MALLOC_MMAP_THRESHOLD_"]},
        }
        if args.note:
            record["note"] = args.note
        print(json.dumps(record))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
