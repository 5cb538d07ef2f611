"""Checkpoint benchmark: save and load time with torch.distributed.checkpoint (DCP), zrs and FSDP2.

Runs under torchrun, one process per GPU (or on the CPU with gloo, for smoke tests). For each
system in ``--systems`` it builds the model of ``--preset`` (benches/step.py's presets and
builders), trains one step with AdamW so that the optimizer state exists, then times, ``--repeats``
times each, in the same processes:

  save_s          the plain DCP recipe: get_state_dict + dcp.save to a fresh directory
  load_s          get_state_dict + dcp.load + set_state_dict from that directory
  zrs_save_s      (zrs only) zrs.checkpoint.save
  zrs_load_s      (zrs only) zrs.checkpoint.load: its metadata and file-size checks, the read
                  into fresh buffers, then set_state_dict

Each timed region has a device sync and a barrier on both sides; a repeat's time is the maximum
over ranks; the record has the min and median over repeats. Before each load the parameters are
zeroed; after it every parameter's local shard must equal the copy taken before saving
(``verified``). Also recorded: the checkpoint's size on disk (``size_GiB``, the files under its
directory: one node) and the peak GPU memory during each load (``load_peak_GiB``, max over ranks,
with ``allocated_GiB`` before it). The OS page cache is not dropped: a load right after its save
may read from memory. Each checkpoint is deleted once loaded (a 1b one is ~11 GiB: weights and
two AdamW moments in fp32).

Systems: zrs (zrs.compile, param_dtype bf16; --zrs-backend eager by default, since compilation
does not change the state) and fsdp2 (fully_shard per block and on the root, eager, as
step.py's fsdp2_eager). On the GPU machine:

    torchrun --standalone --nproc-per-node 1 benches/checkpoint.py --preset 1b \\
        --out benches/results/ckpt_h100x1.jsonl
    python benches/checkpoint.py --table benches/results/ckpt_h100x1.jsonl
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import step
import zrs  # zrs.checkpoint: zrs/checkpointing/checkpoint.py, imported at first use
from harness.data import Data
from harness.device import max_memory, sync
from harness.run import emit, guarded, standalone_env
from harness.table import fmt, read_records
from systems.common import ALL_PRESETS, Ctx, make_spec
from systems.fsdp2 import build_fsdp2
from systems.zrs import build_zrs

SYSTEMS = ("zrs", "fsdp2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=ALL_PRESETS, default="1b")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--repeats", type=int, default=3, help="timings of each kind (default 3)")
    p.add_argument("--dir", type=Path, default=Path("/tmp/ckpt_bench"), help="checkpoints' root")
    p.add_argument("--micro-batch", type=int, default=1, help="of the one training step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--zrs-backend", choices=["inductor", "eager"], default="eager")
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    p.add_argument("--command", help=argparse.SUPPRESS)  # the launching command, for the record
    p.add_argument("--table", type=Path, metavar="FILE", help="print a Markdown table of FILE")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    # step.py's defaults for everything its helpers read (dtypes, seed, lr, zrs options, ...).
    full = step.parse_args(["--preset", args.preset, "--systems", "zrs"])
    full.__dict__.update(vars(args))
    return full


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds `fn` takes on this rank, between synced and barriered points."""
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    sync(device)
    elapsed = time.perf_counter() - t0
    dist.barrier()
    return elapsed


def plain_save(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def plain_load(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def dir_GiB(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def measure(system: str, ctx: Ctx) -> dict:
    args, device, rank = ctx.args, ctx.device, ctx.rank
    built = build_zrs(ctx, compiled=True) if system == "zrs" else build_fsdp2(ctx, compiled=False)
    model, opt = built.keep[0], built.keep[1]
    loss = built.step(*Data(ctx, n=1)(0))  # one step: AdamW's moments exist
    sync(device)
    saved = {n: local(p).detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    kinds: dict[str, tuple[Callable, Callable]] = {"": (plain_save, plain_load)}
    if system == "zrs":
        kinds["zrs_"] = (zrs.checkpoint.save, zrs.checkpoint.load)
    root = args.dir / f"{system}_{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}"
    times: list[list[float]] = []  # per kind and repeat: save s, load s, peak, allocated GiB
    sizes: dict[str, float] = {}
    ok = True
    for r in range(args.repeats):  # the kinds interleaved: first-call costs are not one kind's
        for prefix, (save, load) in kinds.items():
            path = root / f"{prefix or 'dcp_'}{r}"
            save_s = timed(device, lambda: save(path, model, opt))  # noqa: B023
            sizes[prefix] = dir_GiB(path) if rank == 0 else 0.0
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()  # so that the load has to restore them
            sync(device)
            cuda = device.type == "cuda"
            allocated = torch.cuda.memory_allocated(device) / 2**30 if cuda else 0.0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            load_s = timed(device, lambda: load(path, model, opt))  # noqa: B023
            times.append([save_s, load_s, max_memory(device), allocated])
            ok &= all(torch.equal(local(p).cpu(), saved[n]) for n, p in model.named_parameters())
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    vals = torch.tensor(
        [*(x for row in times for x in row), float(not ok)], dtype=torch.float64, device=device
    )
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)  # the slowest rank, per repeat
    loss_t = loss.detach().float().reshape(1).to(torch.float64)
    dist.all_reduce(loss_t)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    *flat, bad = vals.tolist()
    spec = ctx.spec
    record: dict = {
        "system": system,
        "preset": args.preset,
        "world": ctx.world,
        "repeats": args.repeats,
    }
    for k, prefix in enumerate(kinds):
        rows = [flat[4 * i : 4 * i + 4] for i in range(k, len(times), len(kinds))]
        for j, what in enumerate(("save", "load")):
            xs = [row[j] for row in rows]
            record[f"{prefix}{what}_s"] = round(min(xs), 3)
            record[f"{prefix}{what}_s_med"] = round(statistics.median(xs), 3)
        record[f"{prefix}size_GiB"] = round(sizes[prefix], 3)
        record[f"{prefix}load_peak_GiB"] = round(max(row[2] for row in rows), 2)
        record[f"{prefix}allocated_GiB"] = round(max(row[3] for row in rows), 2)
    record.update(
        verified=bad == 0,
        loss=round(loss_t.item() / ctx.world, 4),
        params_M=round(spec.n_params / 1e6, 1),
        micro_batch=spec.micro_batch,
        seq_len=spec.seq_len,
        param_dtype=args.param_dtype,
    )
    if system == "zrs":
        record["zrs_backend"] = args.zrs_backend
    record.update(built.versions or {})
    return record


def run_one(system: str, ctx: Ctx) -> dict:
    """One system in its own process group; its record, or an error record."""
    base = {"system": system, "preset": ctx.args.preset, "world": ctx.world}
    return guarded(ctx, base, lambda: measure(system, ctx))


def table(records: list[dict]) -> str:
    """Markdown table, the latest record per (preset, world, system)."""
    latest = {(r.get("preset"), r.get("world"), r.get("system")): r for r in records}
    rows = [
        "| preset | GPUs | system | save s (min/med) | load s (min/med) | zrs save s | zrs load s "
        "| GiB on disk | load peak GiB | verified | device |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]

    def pair(r: dict, key: str) -> str:
        return "" if key not in r else f"{r[key]:.2f} / {r[key + '_med']:.2f}"

    for (preset, world, system), r in sorted(latest.items(), key=str):
        if "error" in r:
            cells = [f"error: {r['error'].splitlines()[0][:80].replace('|', '/')}", *[""] * 6]
        else:
            cells = [pair(r, "save_s"), pair(r, "load_s"), pair(r, "zrs_save_s"),
                     pair(r, "zrs_load_s"), fmt(r.get("size_GiB"), ".2f"),
                     fmt(r.get("load_peak_GiB"), ".2f"), str(r.get("verified"))]  # fmt: skip
        rows.append(f"| {preset} | {world} | {system} | {' | '.join(cells)} | {r['device']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table is not None:
        print(table(read_records(args.table)))
        return
    standalone_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    ctx = Ctx(args, make_spec(args), rank, world, local_rank, device)
    records = []
    for system in args.systems:
        record = run_one(system, ctx)
        if rank == 0 or "error" in record:
            emit(record, args.out)
        records.append(record)
    if rank == 0:
        print(table(records), flush=True)


if __name__ == "__main__":
    main()
