"""The step benchmark's measurement of one system: build it, warm it up, time its steps, and
make its record (the metrics of benches/step.py's docstring), with the optional profiles."""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from harness.data import Data, varlen_metrics
from harness.device import (
    CollectorTime,
    compile_graphs,
    compile_phases,
    dynamo_graphs,
    max_memory,
    sync,
)
from harness.profiling import (
    TRACE_STEPS,
    StackSampler,
    artifact_path,
    host_profile,
    memory_step,
    profile_steps,
)
from systems import BUILDERS
from systems import zrs as zrs_systems
from systems.common import Ctx
from systems.deepspeed import DEEPCOMPILE_MIN_WARMUP
from systems.single import SINGLE_SYSTEMS


def measure(system: str, ctx: Ctx, distributed: bool) -> dict:
    """Build ``system``, warm it up, time it; the record (complete on rank 0)."""
    args, device, spec = ctx.args, ctx.device, ctx.spec
    warmup = args.warmup
    if system == "deepcompile":
        warmup = max(warmup, DEEPCOMPILE_MIN_WARMUP)
    data = Data(ctx)
    data.prepare(range(warmup + args.steps + TRACE_STEPS + 1))  # --varlen: sliced ahead
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    sampler = StackSampler() if args.first_profile is not None else None
    collector = CollectorTime()
    collector.start()
    first_step_gc: dict = {}
    t0 = time.perf_counter()
    if sampler is not None:
        sampler.start()
    built = BUILDERS[system](ctx)
    build_s = time.perf_counter() - t0
    loss = None
    first_step_s = 0.0
    for i in range(warmup):
        loss = built.step(*data(i))
        if i == 0:
            sync(device)
            first_step_s = time.perf_counter() - t0
            first_step_gc = collector.stop()
            if sampler is not None:
                sampler.stop()
    sync(device)
    warmup_total_s = time.perf_counter() - t0
    peak_all = max_memory(device)
    kernels = None
    if device.type == "cuda" and system in zrs_systems.BUILDERS:
        kernels = zrs_systems.settle()
    if args.gc == "freeze":
        gc.collect()
        gc.freeze()  # undone by cleanup (harness/run.py): the next system starts unfrozen
    if distributed:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    step_s: list[float] = []
    graphs0 = dynamo_graphs()
    w0 = time.perf_counter()
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(args.steps)
        ]
        for i, (start, end) in enumerate(events):
            start.record()
            loss = built.step(*data(warmup + i))
            end.record()
        sync(device)
        step_s = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for i in range(args.steps):
            s = time.perf_counter()
            loss = built.step(*data(warmup + i))
            step_s.append(time.perf_counter() - s)
    wall_s = time.perf_counter() - w0
    timed_graphs = dynamo_graphs() - graphs0
    peak = max_memory(device)

    # Slowest rank per step, peak memory, warm-up and graphs compiled while timed: max over
    # ranks; loss: mean over ranks.
    maxes = torch.tensor(
        [*step_s, timed_graphs, wall_s, peak, peak_all, build_s, first_step_s, warmup_total_s],
        dtype=torch.float64,
        device=device,
    )
    loss_t = loss.detach().float().reshape(1).to(torch.float64)
    if distributed:
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss_t)
        loss_t /= built.world
    vals = maxes.tolist()
    step_s, (timed_graphs, wall_s, peak, peak_all, build_s, first_step_s, warmup_total_s) = (
        vals[: args.steps],
        vals[-7:],
    )
    med = statistics.median(step_s)
    tokens = spec.micro_batch * spec.seq_len
    record = {
        "system": system,
        "preset": args.preset,
        "tag": args.tag,
        "world": built.world,
        "step_ms_med": round(med * 1e3, 2),
        "step_ms_min": round(min(step_s) * 1e3, 2),
        "step_ms_mean_wall": round(wall_s / args.steps * 1e3, 2),
        "step_ms_each": [round(s * 1e3, 1) for s in step_s],
        "tok_s_gpu": round(tokens / med, 1),
        "mfu": round(spec.flops_per_token() * tokens / med / (args.peak_tflops * 1e12), 4),
        # A replay allocates nothing: a captured step's memory comes from its graph's pool,
        # allocated at the capture, in the warm-up.
        "peak_GiB": round(max(peak_all, peak) if system == "zrs_captured" else peak, 2),
        "peak_GiB_all": round(max(peak_all, peak), 2),
        "build_s": round(build_s, 2),
        "warmup_s": round(first_step_s, 2),
        "warmup_total_s": round(warmup_total_s, 2),
        "compile_phases_s": compile_phases(),
        "compile_graphs": compile_graphs(),
        "first_step_gc_s": first_step_gc,  # rank 0's
        "loss": round(loss_t.item(), 4),
        "warmup_steps": warmup,
        "steps": args.steps,
        "params_M": round(spec.n_params / 1e6, 1),
        "micro_batch": spec.micro_batch,
        "seq_len": spec.seq_len,
        "layers": spec.n_layers,
        "param_dtype": args.param_dtype,
        "master_dtype": {"single": args.param_dtype, "single_amp": "fp32"}.get(
            system, args.master_dtype
        ),
        "reduce_dtype": built.reduce_dtype,
        "cudnn_sdpa": not args.no_cudnn_sdpa,
        "gc": args.gc,
    }
    if kernels is not None:
        record["zrs_kernels"] = kernels
    if spec.hf_model is not None:
        import transformers

        record["hf_model"] = spec.hf_model
        record["transformers"] = transformers.__version__
    if args.varlen:
        record.update(varlen_metrics(data, built.world, warmup, step_s))
        record["timed_compiles"] = int(timed_graphs)
    if system in zrs_systems.COMPILED:
        record.update(zrs_systems.record_fields(args, built))
    elif system in (*SINGLE_SYSTEMS, "fsdp2_compile"):
        record["compile_backend"] = args.compile_backend
    record.update(built.versions or {})
    if args.trace is not None:
        record.update(profile_steps(system, ctx, built, data, warmup + args.steps))
    if sampler is not None:
        path = artifact_path(args, args.first_profile, system, "stacks.txt")
        record["first_profile"] = sampler.summary(path)
    if args.host_profile is not None:
        record["host_profile"] = host_profile(system, ctx, built, data, warmup + args.steps)
    if args.memory is not None and device.type == "cuda":
        record["memory_at_peak"] = memory_step(system, ctx, built, data, warmup + args.steps)
    if built.close is not None:
        built.close()
    del built, loss
    return record
