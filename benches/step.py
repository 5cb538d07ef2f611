"""Training-step benchmark: zrs against the systems users would pick instead.

Runs under torchrun, one process per GPU, on any number of GPUs (or on the CPU with gloo, for
development). For each system in ``--systems`` it builds the Llama-style model of ``--preset``
(benches/llama.py), trains ``--warmup`` steps and then ``--steps`` timed steps with AdamW on random
tokens, and prints one JSON line (appended to ``--out`` too):

    torchrun --standalone --nproc-per-node 2 benches/step.py --preset 1b --systems zrs \\
        --out benches/results/h200x2.jsonl
    python benches/step.py --table benches/results/h200x2.jsonl   # Markdown table of a file

Systems:
  zrs              zrs.compile(model, param_dtype=bf16, reduce_dtype=fp32)
  fsdp2_eager      fully_shard per block and on the root, MixedPrecisionPolicy(bf16, fp32)
  fsdp2_compile    the same with each block torch.compile'd (fullgraph), as torchtitan does
  single           one GPU (rank 0 only), unsharded bf16 parameters, whole model compiled: the
                   compute-only bound
  deepspeed_zero3  DeepSpeed ZeRO-3, eager, bf16 (only when deepspeed imports)
  deepcompile      DeepSpeed ZeRO-3 with DeepCompile: "compile": {"deepcompile": true} and
                   engine.compile() (at least 8 warm-up steps; its passes run at step 5)

Each system gets its own process group, created before it is built and destroyed after it. An
exception is caught and reported as a JSON line with "error"; the next system still runs. Run one
system per torchrun invocation (scripts/bench_device.sh does) to isolate crashes and hangs as well,
and always for the DeepSpeed systems, which keep process-global state.

Metrics (times are the maximum over ranks, step by step):
  step_ms_med / step_ms_min   median / minimum of the timed steps (CUDA events on GPUs)
  tok_s_gpu                   micro_batch * seq_len / median step
  mfu                         flops_per_token * tokens / (median step * --peak-tflops); flops per
                              token = 6 * (parameters less the embedding) + 12 * layers * dim * seq
  peak_GiB                    torch.cuda.max_memory_allocated over the timed steps (max over ranks);
                              peak_GiB_all over the whole system's run (build and warm-up included)
  warmup_s                    wall time from the start of the model build to the end of the first
                              trained step (compilation included); warmup_total_s to the end of
                              all warm-up steps
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import importlib.util
import json
import os
import pickle
import platform
import shlex
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import PRESETS, Llama, LlamaConfig, init_weights
from memory_peak import peak_breakdown
from trace_summary import load, summarize

ALL_SYSTEMS = ("zrs", "fsdp2_eager", "fsdp2_compile", "single", "deepspeed_zero3", "deepcompile")
DEEPSPEED_SYSTEMS = ("deepspeed_zero3", "deepcompile")
_DEEPSPEED_RAN: list[str] = []  # DeepSpeed systems run in this process
DEEPCOMPILE_MIN_WARMUP = 8  # DeepCompile runs its profile-guided passes at step 5
ENV_KEYS = (
    "NCCL_P2P_DISABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "TORCH_CUDA_ARCH_LIST",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "ZRS_COMM_STREAMS",
    "BENCH_CACHE",
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def default_systems() -> list[str]:
    return [s for s in ALL_SYSTEMS if s not in DEEPSPEED_SYSTEMS or deepspeed_available()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Run under torchrun; see benches/README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b", help="model (default 1b)")
    p.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated, from {','.join(ALL_SYSTEMS)} (default: all available: "
        "the DeepSpeed ones only when deepspeed imports)",
    )
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (default 10; >= 8 for "
                   "deepcompile, raised there if lower)")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--tag", default="", help='label of the run, e.g. "" or "nop2p"')
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="cuda (NCCL, one GPU per rank) or cpu (gloo); default cuda when available",
    )
    p.add_argument("--micro-batch", type=int, help="sequences per rank per step (preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--reduce-dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="gradient reduce-scatter dtype of zrs and FSDP2 (DeepSpeed reduces in its "
        "bf16 default)",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="dense bf16 peak per device for MFU (default 989: H100/H200 SXM)",
    )
    p.add_argument(
        "--zrs-backend",
        choices=["inductor", "eager"],
        default="inductor",
        help="zrs.compile backend",
    )
    p.add_argument(
        "--zrs-scheduler",
        choices=["search", "greedy", "none"],
        default="search",
        help="zrs.compile scheduler (default search)",
    )
    p.add_argument(
        "--zrs-shared-reduce-communicator",
        action="store_true",
        help="zrs.compile(separate_reduce_communicator=False): gathers and reduce-scatters on "
        "one NCCL communicator",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of single and fsdp2_compile (default inductor; aot_eager "
        "for quick CPU smoke tests)",
    )
    p.add_argument(
        "--ds-init",
        choices=["zero_init", "full"],
        default="zero_init",
        help="DeepSpeed model construction: under deepspeed.zero.Init (default) or full on the GPU",
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="after the timed steps, profile 3 more with torch.profiler: Chrome traces per rank "
        "in DIR and the ops with the most device time per step in the record",
    )
    p.add_argument(
        "--memory",
        type=Path,
        metavar="DIR",
        help="(CUDA) after the timed steps, record the allocator's history for one more step: a "
        "snapshot per rank in DIR and what is live at the peak in the record (memory_peak.py)",
    )
    p.add_argument("--pg-timeout", type=float, default=1800, help="process-group timeout, seconds")
    p.add_argument("--command", help=argparse.SUPPRESS)  # the launching command, for the record
    p.add_argument("--table", type=Path, metavar="FILE", help="print a Markdown table of FILE")
    args = p.parse_args(argv)
    if args.table is None:
        systems = args.systems.split(",") if args.systems else default_systems()
        unknown = [s for s in systems if s not in ALL_SYSTEMS]
        if unknown:
            p.error(f"unknown system(s) {','.join(unknown)}; choose from {','.join(ALL_SYSTEMS)}")
        args.systems = systems
        if args.warmup < 1 or args.steps < 1:
            p.error("--warmup and --steps must be at least 1")
    return args


# --------------------------------------------------------------------------------------------
# Setup shared by the systems


@dataclass
class Ctx:
    args: argparse.Namespace
    cfg: LlamaConfig
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.args.param_dtype]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.args.reduce_dtype]


@dataclass
class Built:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # one training step -> loss
    world: int  # ranks the system trains on
    reduce_dtype: str
    keep: tuple = ()  # model, optimizer, engine: alive until the system is done
    versions: dict | None = None
    close: Callable[[], None] | None = None  # releases what the system holds


def make_config(args: argparse.Namespace) -> LlamaConfig:
    cfg = PRESETS[args.preset]
    changes = {}
    if args.micro_batch:
        changes["micro_batch"] = args.micro_batch
    if args.seq_len:
        changes["seq_len"] = args.seq_len
    if args.layers:
        changes["n_layers"] = args.layers
    if changes:
        cfg = LlamaConfig(**{**cfg.__dict__, **changes})
    return cfg


def adamw(params, ctx: Ctx) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params,
        lr=ctx.args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=ctx.device.type == "cuda",
    )


def plain_step(model, opt) -> Callable:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def make_batches(ctx: Ctx, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed random-token batches per rank, each rank its own, cycled through the steps."""
    g = torch.Generator().manual_seed(ctx.args.seed * 1000 + ctx.rank)
    cfg = ctx.cfg
    out = []
    for _ in range(n):
        tok = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len + 1), generator=g)
        out.append(
            (tok[:, :-1].contiguous().to(ctx.device), tok[:, 1:].contiguous().to(ctx.device))
        )
    return out


def meta_model(cfg: LlamaConfig) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


# --------------------------------------------------------------------------------------------
# The systems


def build_zrs(ctx: Ctx) -> Built:
    import zrs

    model = meta_model(ctx.cfg)
    torch.manual_seed(ctx.args.seed)
    zrs.compile(
        model,
        param_dtype=ctx.param_dtype,
        reduce_dtype=ctx.reduce_dtype,
        backend=ctx.args.zrs_backend,
        scheduler=ctx.args.zrs_scheduler,
        separate_reduce_communicator=not ctx.args.zrs_shared_reduce_communicator,
    )
    opt = adamw(model.parameters(), ctx)
    return Built(
        plain_step(model, opt),
        ctx.world,
        ctx.args.reduce_dtype,
        (model, opt),
        {"zrs": getattr(zrs, "__version__", "?")},
    )


def build_fsdp2(ctx: Ctx, compiled: bool) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy(param_dtype=ctx.param_dtype, reduce_dtype=ctx.reduce_dtype)
    model = meta_model(ctx.cfg)
    n = len(model.layers)
    for i in range(n):
        block = model.layers[i]
        if compiled:
            # As torchtitan does: compile each block, then shard the compiled wrapper, so that
            # FSDP2's hooks run outside the compiled region.
            block = torch.compile(block, backend=ctx.args.compile_backend, fullgraph=True)
            model.layers[i] = block
        # The last block is needed again right at the start of backward: keep it unsharded.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # embedding, final norm, head
    model.to_empty(device=ctx.device)
    torch.manual_seed(ctx.args.seed)
    init_weights(model)
    opt = adamw(model.parameters(), ctx)
    return Built(plain_step(model, opt), ctx.world, ctx.args.reduce_dtype, (model, opt))


def build_single(ctx: Ctx) -> Built:
    model = meta_model(ctx.cfg)
    model.to_empty(device=ctx.device)
    torch.manual_seed(ctx.args.seed)
    init_weights(model)
    model.to(ctx.param_dtype)
    model.compile(backend=ctx.args.compile_backend)
    opt = adamw(model.parameters(), ctx)
    return Built(plain_step(model, opt), 1, "none", (model, opt))


def build_deepspeed(ctx: Ctx, deepcompile: bool) -> Built:
    import deepspeed

    if ctx.param_dtype != torch.bfloat16:
        raise ValueError("the DeepSpeed systems are configured for --param-dtype bf16 only")
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts our process group
    config = {
        "train_micro_batch_size_per_gpu": ctx.cfg.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # torch's (fused) AdamW, as for the others
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "compile": {"deepcompile": deepcompile},
    }
    torch.manual_seed(ctx.args.seed)
    if ctx.args.ds_init == "zero_init":
        # DeepSpeed's way for ZeRO-3: each module is partitioned as soon as it is constructed.
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Llama(ctx.cfg)
    else:
        # The full fp32 model on this GPU; deepspeed.initialize partitions it and frees the rest
        # (7b: 27 GB for a moment).
        with torch.device(ctx.device):
            model = Llama(ctx.cfg)
    opt = adamw(model.parameters(), ctx)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    del model
    if deepcompile:
        # DeepCompile recompiles when its passes run; its own benchmark raises these limits.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 128)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 256
        )
        engine.compile(backend="inductor")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return Built(
        step,
        ctx.world,
        "bf16",
        (engine, opt),
        {"deepspeed": deepspeed.__version__, "ds_init": ctx.args.ds_init},
        close=engine.destroy,
    )


BUILDERS: dict[str, Callable[[Ctx], Built]] = {
    "zrs": build_zrs,
    "fsdp2_eager": lambda ctx: build_fsdp2(ctx, compiled=False),
    "fsdp2_compile": lambda ctx: build_fsdp2(ctx, compiled=True),
    "single": build_single,
    "deepspeed_zero3": lambda ctx: build_deepspeed(ctx, deepcompile=False),
    "deepcompile": lambda ctx: build_deepspeed(ctx, deepcompile=True),
}


# --------------------------------------------------------------------------------------------
# Measurement


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_memory(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def measure(system: str, ctx: Ctx, distributed: bool) -> dict:
    """Build ``system``, warm it up, time it; the record (complete on rank 0)."""
    args, device, cfg = ctx.args, ctx.device, ctx.cfg
    warmup = args.warmup
    if system == "deepcompile":
        warmup = max(warmup, DEEPCOMPILE_MIN_WARMUP)
    batches = make_batches(ctx)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    t0 = time.perf_counter()
    built = BUILDERS[system](ctx)
    loss = None
    first_step_s = 0.0
    for i in range(warmup):
        loss = built.step(*batches[i % len(batches)])
        if i == 0:
            sync(device)
            first_step_s = time.perf_counter() - t0
    sync(device)
    warmup_total_s = time.perf_counter() - t0
    peak_all = max_memory(device)
    if distributed:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    step_s: list[float] = []
    w0 = time.perf_counter()
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(args.steps)
        ]
        for i, (start, end) in enumerate(events):
            start.record()
            loss = built.step(*batches[(warmup + i) % len(batches)])
            end.record()
        sync(device)
        step_s = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for i in range(args.steps):
            s = time.perf_counter()
            loss = built.step(*batches[(warmup + i) % len(batches)])
            step_s.append(time.perf_counter() - s)
    wall_s = time.perf_counter() - w0
    peak = max_memory(device)

    # Slowest rank per step, peak memory and warm-up: max over ranks; loss: mean over ranks.
    maxes = torch.tensor(
        [*step_s, wall_s, peak, peak_all, first_step_s, warmup_total_s],
        dtype=torch.float64,
        device=device,
    )
    loss_t = loss.detach().float().reshape(1).to(torch.float64)
    if distributed:
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss_t)
        loss_t /= built.world
    vals = maxes.tolist()
    step_s, (wall_s, peak, peak_all, first_step_s, warmup_total_s) = vals[: args.steps], vals[-5:]
    med = statistics.median(step_s)
    tokens = cfg.micro_batch * cfg.seq_len
    record = {
        "system": system,
        "preset": args.preset,
        "tag": args.tag,
        "world": built.world,
        "step_ms_med": round(med * 1e3, 2),
        "step_ms_min": round(min(step_s) * 1e3, 2),
        "step_ms_mean_wall": round(wall_s / args.steps * 1e3, 2),
        "tok_s_gpu": round(tokens / med, 1),
        "mfu": round(cfg.flops_per_token() * tokens / med / (args.peak_tflops * 1e12), 4),
        "peak_GiB": round(peak, 2),
        "peak_GiB_all": round(max(peak_all, peak), 2),
        "warmup_s": round(first_step_s, 2),
        "warmup_total_s": round(warmup_total_s, 2),
        "loss": round(loss_t.item(), 4),
        "warmup_steps": warmup,
        "steps": args.steps,
        "params_M": round(cfg.n_params() / 1e6, 1),
        "micro_batch": cfg.micro_batch,
        "seq_len": cfg.seq_len,
        "layers": cfg.n_layers,
        "param_dtype": args.param_dtype,
        "reduce_dtype": built.reduce_dtype,
    }
    if system == "zrs":
        record["zrs_backend"] = args.zrs_backend
        record["zrs_scheduler"] = args.zrs_scheduler
        record["zrs_reduce_communicator"] = (
            "shared" if args.zrs_shared_reduce_communicator else "separate"
        )
        # zrs's own share of the warm-up (this rank's; dynamo, inductor and the kernel build
        # are the rest).
        state = built.keep[0]._zrs_state
        record["zrs_compile_s"] = {k: round(v, 2) for k, v in sorted(state.compile_s.items())}
        # The collectives' latency and bandwidth the planner fitted (None: not measured), to
        # replay its plans in the simulator later (benches/scale_sim.py) without a device.
        record["zrs_cost_model"] = state.cost_model
    elif system in ("single", "fsdp2_compile"):
        record["compile_backend"] = args.compile_backend
    record.update(built.versions or {})
    if args.trace is not None:
        record.update(profile_steps(system, ctx, built, batches, warmup + args.steps))
    if args.memory is not None and device.type == "cuda":
        record["memory_at_peak"] = memory_step(system, ctx, built, batches, warmup + args.steps)
    if built.close is not None:
        built.close()
    del built, loss
    return record


TRACE_STEPS = 3
TRACE_TOP = 20


def profile_steps(system: str, ctx: Ctx, built: Built, batches: list, start: int) -> dict:
    """Run TRACE_STEPS more steps under torch.profiler (after the timed ones, so they are not
    slowed): a Chrome trace per rank in --trace DIR, and the ops with the most device (else CPU)
    self time per step, for the record."""
    from torch.profiler import ProfilerActivity, profile

    args, device = ctx.args, ctx.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for i in range(TRACE_STEPS):
            built.step(*batches[(start + i) % len(batches)])
        sync(device)
    args.trace.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tag = args.tag or "nvlink"
    path = args.trace / f"{args.preset}_{system}_{tag}_rank{rank}.json.gz"
    prof.export_chrome_trace(str(path))  # gzipped: a 1b trace is ~20 MB of JSON
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    top = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:TRACE_TOP]
    return {
        "trace": str(path),
        "timeline": summarize(load(path), TRACE_STEPS),
        "top_ops_ms_per_step": [
            [e.key, round(getattr(e, key) / 1e3 / TRACE_STEPS, 3)] for e in top
        ],
    }


def memory_step(system: str, ctx: Ctx, built: Built, batches: list, start: int) -> dict:
    """One more step with the allocator's history on; its snapshot goes to --memory DIR and what
    was live at its peak (rank 0's) into the record."""
    args, device = ctx.args, ctx.device
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    built.step(*batches[start % len(batches)])
    sync(device)
    args.memory.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = args.memory / f"{args.preset}_{system}_{args.tag or 'nvlink'}_rank{rank}.pickle"
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return {"snapshot": str(path), **peak_breakdown(snapshot, before)}


def environment(ctx: Ctx) -> dict:
    if ctx.device.type == "cuda":
        name = torch.cuda.get_device_name(ctx.device)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        name, nccl = f"cpu ({platform.processor() or platform.machine()})", None
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    command = ctx.args.command or shlex.join(
        ["torchrun", f"--nproc-per-node={ctx.world}", *sys.argv]
    )
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
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_one(system: str, ctx: Ctx) -> dict | None:
    """Run one system in its own process-group lifetime; its record, or an error record."""
    single = system == "single"
    if single and ctx.rank != 0:
        return None  # the single-GPU bound runs on rank 0 alone
    distributed = not single  # every sharded system gets a process group, world 1 included
    base = {"system": system, "preset": ctx.args.preset, "tag": ctx.args.tag}
    try:
        if system in DEEPSPEED_SYSTEMS:
            if not deepspeed_available():
                raise ModuleNotFoundError("deepspeed is not installed")
            if _DEEPSPEED_RAN:
                # DeepSpeed caches its process groups in module globals: a second engine in the
                # same process, on a new group, hangs.
                raise RuntimeError(
                    f"{_DEEPSPEED_RAN[0]} already ran in this process: run each DeepSpeed system "
                    "in its own torchrun invocation (scripts/bench_device.sh does)"
                )
            _DEEPSPEED_RAN.append(system)
        if distributed:
            init_group(ctx)
        record = measure(system, ctx, distributed)
    except Exception as e:  # report, and go on with the next system
        traceback.print_exc()
        record = {
            **base,
            "world": 1 if single else ctx.world,
            "rank": ctx.rank,
            "error": f"{type(e).__name__}: {e}"[:2000],
        }
    finally:
        cleanup(ctx.device)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    record.update(environment(ctx))
    return record


def worker(args: argparse.Namespace) -> None:
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
    ctx = Ctx(args, make_config(args), rank, world, local_rank, device)
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


# --------------------------------------------------------------------------------------------
# Tables


def _fmt(v, spec: str = "") -> str:
    return "" if v is None else format(v, spec)


def table(records: list[dict]) -> str:
    """Markdown table, the latest record per (preset, world, system, tag)."""
    latest: dict[tuple, dict] = {}
    for r in records:
        key = (r.get("preset"), r.get("world"), r.get("system"), r.get("tag", ""))
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
            cells = [
                _fmt(r.get("step_ms_med"), ".1f"),
                _fmt(r.get("step_ms_min"), ".1f"),
                _fmt(r.get("tok_s_gpu"), ",.0f"),
                f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "",
                _fmt(r.get("peak_GiB"), ".2f"),
                _fmt(r.get("warmup_s"), ".1f"),
                _fmt(r.get("loss"), ".3f"),
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


def main(argv: list[str] | None = None) -> None:
    # `kill -USR1 <pid>` prints every thread's stack: where a hung rank waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = parse_args(argv)
    if args.table is not None:
        print(table(read_records(args.table)))
        return
    worker(args)


if __name__ == "__main__":
    main()
