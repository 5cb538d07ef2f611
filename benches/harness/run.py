"""The step benchmark's processes: a plain ``python`` run as world 1, each rank's device, each
system in its own process-group lifetime (an exception becomes an error record), and the records
with the run's environment, printed and appended to --out."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import shlex
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from harness.measure import measure
from harness.table import table
from systems import deepspeed as deepspeed_systems
from systems.common import Ctx, make_spec
from systems.single import SINGLE_SYSTEMS

ENV_KEYS = (
    "NCCL_P2P_DISABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MAX_CTAS",
    "NCCL_MIN_CTAS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_CTA_POLICY",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "TORCH_CUDA_ARCH_LIST",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "ZRS_COMM_STREAMS",
    "BENCH_CACHE",
)


def environment(ctx: Ctx) -> dict:
    if ctx.device.type == "cuda":
        name = torch.cuda.get_device_name(ctx.device)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        name, nccl = f"cpu ({platform.processor() or platform.machine()})", None
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    launcher = ["python"] if _STANDALONE else ["torchrun", f"--nproc-per-node={ctx.world}"]
    command = ctx.args.command or shlex.join([*launcher, *sys.argv])
    return {
        "device": name,
        "torch": torch.__version__,
        "nccl": nccl,
        "env": env,
        "command": command,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def emit(record: dict, out: Path | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(line + "\n")


def init_group(ctx: Ctx) -> None:
    timeout = datetime.timedelta(seconds=ctx.args.pg_timeout)
    if ctx.device.type == "cuda":
        dist.init_process_group("nccl", device_id=ctx.device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def cleanup(device: torch.device) -> None:
    gc.unfreeze()  # measure's --gc freeze: what the system left becomes collectable again
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def guarded(ctx: Ctx, base: dict, body: Callable[[], dict], distributed: bool = True) -> dict:
    """`body()`'s record, run in its own process-group lifetime (none when not `distributed`), or
    an error record on `base`; either way with the environment's fields."""
    try:
        if distributed:
            init_group(ctx)
        record = body()
    except Exception as e:  # report, and go on with the next system
        traceback.print_exc()
        record = {**base, "rank": ctx.rank, "error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        cleanup(ctx.device)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    record.update(environment(ctx))
    return record


def run_one(system: str, ctx: Ctx) -> dict | None:
    """Run one system in its own process-group lifetime; its record, or an error record."""
    single = system in SINGLE_SYSTEMS
    if single and ctx.rank != 0:
        return None  # the single-GPU bound runs on rank 0 alone
    distributed = not single  # every sharded system gets a process group, world 1 included
    base = {"system": system, "preset": ctx.args.preset, "tag": ctx.args.tag}
    if ctx.args.varlen:
        base["varlen"] = True
    base["world"] = 1 if single else ctx.world

    def body() -> dict:
        if system in deepspeed_systems.DEEPSPEED_SYSTEMS:
            deepspeed_systems.claim(system)
        return measure(system, ctx, distributed)

    return guarded(ctx, base, body, distributed)


_STANDALONE: list[bool] = []  # [True] when run without torchrun


def standalone_env() -> None:
    """Run as a plain ``python benches/step.py`` (no torchrun): one process, world 1, its process
    groups on a free local port."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    _STANDALONE.append(True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def worker(args: argparse.Namespace) -> None:
    standalone_env()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            sys.exit(f"step.py: local rank {local_rank} but {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // local_world))
    torch.set_float32_matmul_precision("high")
    ctx = Ctx(args, make_spec(args), rank, world, local_rank, device)
    records = []
    for system in args.systems:
        record = run_one(system, ctx)
        if record is None:
            continue
        if rank == 0 or "error" in record:  # a failing rank reports itself: rank 0 may be killed
            emit(record, args.out)
        records.append(record)
    if rank == 0 and records:
        print(table(records), flush=True)
