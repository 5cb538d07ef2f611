"""The first trained step of zrs.shard with compiled layers and of FSDP2 + compile, phase by phase
(issue 34): the library's preparation (zrs's recipe steps; FSDP2's per-block torch.compile and
fully_shard, then materialising the meta model), the optimizer, and the first forward,
backward and optimizer step, each ended by a device sync. One system a process:

  torchrun --standalone --nproc-per-node 2 benches/first_step_phases.py --system zrs \\
      --preset hf_llama_1b --out benches/results/first_step_phases.jsonl

Both build the same model on the meta device and initialise it as ``from_config`` would
(benches/hf_models.py), with bf16 compute and fp32 gradient reduction; torch, transformers and
the process group are set up before the clock starts, the same for both. Set
``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR``) to an empty folder for a cold compile;
alternate the systems, since the first process on a machine runs slower. ``first_step_s`` sums
the phases up to the end of the first optimizer step; ``later_steps_ms`` are the next steps'
forward, backward and step together. One JSON line per run, from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers  # noqa: F401  (imported before the clock, as torch is: the same for both)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models

SYSTEMS = ("zrs", "fsdp2")
ZRS_STEPS = (
    "agree_and_connect",
    "make_state",
    "shard_parameters",
    "install_units",
    "install_forward",
)


class Phases:
    """Wall time between marks, each taken after a device sync."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        self.last = now


def _zrs(model, phases: Phases, backend: str):
    import zrs
    from zrs import prepare

    phases.mark("import")
    for name in ZRS_STEPS:  # each step of zrs.shard's recipe, timed where zrs.shard calls it
        step = getattr(prepare, name)

        def timed(*args, _step=step, _name=name, **kwargs):
            out = _step(*args, **kwargs)  # its mark holds the glue since the last one too
            phases.mark(_name)
            return out

        setattr(prepare, name, timed)
    fn = hf_models.init_fn(model)
    return zrs.shard(
        model,
        init_fn=fn,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        compile=backend,
    )


def _fsdp2(model, phases: Phases, backend: str, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    phases.mark("import")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = hf_models.blocks(model)
    n = len(layers)
    for i in range(n):  # as benches/systems/fsdp2.py and torchtitan: compile, then shard
        layers[i] = torch.compile(layers[i], backend=backend, fullgraph=True)
        fully_shard(layers[i], mesh=mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    phases.mark("shard")
    model.to_empty(device=device)
    fn = hf_models.init_fn(model)
    for module in model.modules():
        fn(module)
    hf_models.retie(model)
    phases.mark("materialize")
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--preset", default="hf_llama_tiny", choices=sorted(hf_models.HF_PRESETS))
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (both systems)")
    ap.add_argument("--steps", type=int, default=3, help="steps in all, the first included")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    p = hf_models.HF_PRESETS[args.preset]
    with torch.device("meta"):
        model = hf_models.build(p, hf_models.hf_config(p))
    torch.manual_seed(0)
    phases = Phases(device)
    if args.system == "zrs":
        model = _zrs(model, phases, args.backend)
    else:
        model = _fsdp2(model, phases, args.backend, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    phases.mark("optimizer")
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, p.vocab_size, (p.micro_batch, p.seq_len), generator=generator)
    tokens = tokens.to(device)
    for step in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        if step == 0:
            phases.mark("forward")
        loss.backward()
        if step == 0:
            phases.mark("backward")
        opt.step()
        opt.zero_grad()
        phases.mark("optimizer_step" if step == 0 else f"step{step}")
    first = {k: v for k, v in phases.seconds.items() if not k.startswith("step")}
    record = {
        "system": "zrs_shard_compile" if args.system == "zrs" else "fsdp2_compile",
        "preset": args.preset,
        "world": dist.get_world_size(),
        "backend": args.backend,
        "first_step_s": round(sum(first.values()), 2),
        "phases_s": {k: round(v, 3) for k, v in first.items()},
        "later_steps_ms": [
            round(1e3 * phases.seconds[f"step{i}"], 1) for i in range(1, args.steps)
        ],
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "command": " ".join(sys.argv),
    }
    if dist.get_rank() == 0:
        line = json.dumps(record)
        print(line)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as fh:
                fh.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
