"""The GPU suite's one group of workers (tests/gpu): a single spawned NCCL process group per world
size (rank r on GPU r) runs every case in turn, and the tests of tests/gpu read its results. Each
process start, NCCL set-up and CUDA context is paid once, and one case's failure fails only the
tests that read it (`zoo.run_isolated`).

What the group runs, each against the unsharded single-process CPU reference (`zoo.train_reference`:
each rank its own batches, SGD with momentum), 3 steps, fp32 with TF32 off unless said otherwise:

* the zoo (`zoo.ZOO`) on zrs.compile's "eager" and "inductor" backends and on zrs.shard
  ("shard"), and a few of them with the collectives on zrs's side streams (`SIDE_STREAMS`);
* Hugging Face models (`HF_MODELS`: GPT-2 with biases and a tied head, a Llama on
  variable-length batches) on inductor;
* bf16 compute over fp32 masters (`BF16_MODELS`) against the bf16-autocast reference, and bf16
  masters (`MASTER_APIS`) against the model trained unsharded in bf16;
* offload="optimizer" (`offload_cases`): fp32, clipped, bf16, compiled layers and zrs.compile;
* hybrid sharding (`HYBRID`, mesh= a 2-D DeviceMesh): shards alone (1 x world), replicas alone
  (world x 1), and at 4 GPUs or more both (2 x world/2, contiguous and strided shard groups);
* a DCP checkpoint (PyTorch's recipe) of GPT-2 after 2 steps, saved by every rank under a
  directory of the parent's; the parent loads it in one process (tests/gpu/test_checkpoint_gpu.py);
* zrs.GraphedStep (`GRAPHED`) with and without CUDA graphs, 7 steps through a non-finite one,
  with deterministic algorithms: the two must agree bit for bit.

The worker takes the device as a parameter so that the whole group can be dry-run on the CPU
(gloo) by setting `DEVICE` and `DIST_BACKEND` below before the first `results()` call: every case
then runs on the CPU (the side streams and the CUDA graphs have nothing to do there).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch

import checkpointing as ckpt
from _dist import cached_run, reemit_warnings
from zoo import (
    ZOO,
    Case,
    Reference,
    case_outcome,
    run_cases,
    run_isolated,
    spec_of,
    train_reference,
)

# Where the group runs: "cuda" and "nccl" (a CPU dry run: "cpu" and "gloo").
DEVICE, DIST_BACKEND = "cuda", "nccl"
# Seconds the whole group may take before it fails as hung: above what it takes on two GPUs
# (284 s on 2 H200s in session 23), and small enough that a hung suite still ends within the
# device machine's 10-minute call.
GROUP_TIMEOUT = 420.0

FP32_BACKENDS = ("eager", "inductor", "shard")  # "shard": zrs.shard, the eager path
# What else the group runs is chosen for the suite's time (under 6 minutes with the faults): each
# compiled case costs its compile (session 23, 2 H200s: the zoo on inductor 1.6-17 s a model, HF
# GPT-2 43 s, the variable-length Llama 37 s, bf16 masters on gpt_tied 56 s). So: the cheaper
# model where a case's point does not need a particular one, and a Llama only on variable
# lengths (the same model class).
# (zrs api, zoo model): the collectives on zrs's side streams (ZRS_COMM_STREAMS=1, read when the
# model is sharded): compiled code and the eager path's hooks, a tied embedding and a deep stack.
SIDE_STREAMS = (
    ("inductor", "bias_stack"),
    ("shard", "gpt_tied"),
    ("shard", "bias_stack"),
)
HF_MODELS, HF_BACKEND = ("hf_gpt2", "hf_llama_varlen"), "inductor"
# zrs.shard with each unit's forward compiled by inductor (Triton): a tied head, a frozen layer,
# a stack of layers, and a Llama whose ranks recompile for their own lengths, each alone.
COMPILED_UNITS = "shard:inductor"
COMPILED_UNITS_MODELS = ("gpt_tied", "frozen", "bias_stack", "hf_llama_varlen")
# torch.compile(model) on a zrs.shard model: its hooks and forward guard run eagerly at breaks.
WHOLE_COMPILE, WHOLE_COMPILE_MODEL = "whole:inductor", "gpt_tied"
# zrs.shard(compile=True, compile_root=False): the looping root eager around compiled layers.
LAYERS_ONLY, LAYERS_ONLY_MODEL = "layers:inductor", "gpt_tied"
BF16_MODELS, BF16_BACKEND = ("mlp",), "inductor"
# bf16 masters: a model whose inputs are token ids (a bf16 model takes no fp32 batch; the zoo's
# float-input models would need param_dtype= to cast them), the dearest case of the group.
MASTER_MODEL, MASTER_APIS = "gpt_tied", ("inductor", "shard")
# zrs.shard(offload="optimizer"): the masters and the SGD step on the host, fp32 on a tied head,
# a frozen layer and a stack; clipped (the norm of host gradients, on the gloo mesh); bf16
# compute (the host update writes the bf16 copy); with each layer compiled; zrs.compile on
# inductor (its graphs gather from the device copies) in bf16 and overlapped with a clip;
# offload="params" on both APIs.
OFFLOAD_MODELS, OFFLOAD_CLIP = ("gpt_tied", "frozen", "bias_stack"), ("gpt_tied", 0.05)
# Hybrid sharding: (mesh kind, zrs api, zoo model, side streams), the mesh made for the group's
# world W by `hybrid_mesh`: "shards" 1xW, "replicas" Wx1 (the gradient all-reduce alone), "both"
# 2x(W/2) and "both-strided" its shard groups of every other rank (W >= 4, even).
HYBRID = (
    ("shards", "inductor", "gpt_tied", False),
    ("replicas", "shard", "bias_stack", False),
    ("replicas", "inductor", "used_twice", False),
    ("replicas", "shard", "gpt_tied", True),
    ("both", "inductor", "gpt_tied", False),
    ("both", "shard", "bias_stack", True),
    ("both-strided", "shard", "mlp", False),
)
# The checkpoint: (model, zrs backend, optimizer), trained CHECKPOINT_STEPS steps, then saved.
CHECKPOINT_RUN, CHECKPOINT_STEPS = ("hf_gpt2", "eager", "sgd"), 2
CHECKPOINT_KEY = "checkpoint-dcp"
# Offload (issue 37) under NCCL: AdamW saved by DCP after 2 steps and resumed for 2 more, against
# the same 4 steps uninterrupted.
OFFLOAD_RESUME_RUN = ("hf_gpt2", "shard-offload", "adamw")
OFFLOAD_RESUME_KEY = "offload-resume-dcp"
# zrs.GraphedStep: (zoo model, dtype, optimizer, zrs backend). "bf16_reduce": bf16 compute and
# reduction, each .grad a cast that the captured step keeps in place.
GRAPHED = (
    ("bias_stack", "fp32", "sgd", "inductor"),
    ("bias_stack", "bf16_reduce", "adamw", "eager"),
)
GRAPHED_STEPS, POISONED = 7, 4  # warmup 2, capture at 3, replays after; step 4 overflows
# The graphed steps stay alive until the worker ends, so that its destroy_process_group() runs
# with their graphs in place: a graph that held NCCL work would keep it waiting forever (seen
# before zrs.GraphedStep kept the norm's all-reduce out of its graphs).
LIVE_STEPS: list[object] = []


def world() -> int:
    """The group's size: the visible GPUs, or fewer with ZRS_GPU_WORLD (a CPU dry run: 2)."""
    wanted = os.environ.get("ZRS_GPU_WORLD")
    if DEVICE != "cuda":
        return int(wanted or 2)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted and int(wanted) > visible:
        pytest.fail(f"ZRS_GPU_WORLD={wanted} but only {visible} CUDA devices are visible")
    return int(wanted or visible)


# --- the cases ----------------------------------------------------------------------------------


def case(model: str, backend: str, **kw: Any) -> Case:
    """A case of the group (on DEVICE, each in a fresh process group)."""
    return Case(model, backend, device=DEVICE, default_group=False, **kw)


def fp32_cases() -> list[Case]:
    zoo = [case(m, b) for b in FP32_BACKENDS for m in ZOO]
    streams = [case(m, b, comm_streams=True) for b, m in SIDE_STREAMS]
    units = [case(m, COMPILED_UNITS) for m in COMPILED_UNITS_MODELS]
    whole = [case(WHOLE_COMPILE_MODEL, WHOLE_COMPILE), case(LAYERS_ONLY_MODEL, LAYERS_ONLY)]
    return zoo + streams + [case(m, HF_BACKEND) for m in HF_MODELS] + units + whole


def bf16_case(model: str) -> Case:
    return case(model, BF16_BACKEND, param_dtype=torch.bfloat16)


def master_case(api: str) -> Case:
    return case(MASTER_MODEL, api, master_dtype=torch.bfloat16)


def offload_cases() -> list[Case]:
    """(case, reference kind, max_norm) of the offloaded runs."""
    off = {"offload": "optimizer"}
    fp32 = [case(m, "shard", **off) for m in OFFLOAD_MODELS]
    clipped = case(OFFLOAD_CLIP[0], "shard", max_norm=OFFLOAD_CLIP[1], **off)
    bf16 = case("mlp", "shard", param_dtype=torch.bfloat16, **off)
    units = case("gpt_tied", COMPILED_UNITS, **off)
    accumulated = case("mlp", "shard", accumulate=2, **off)
    overlapped = [
        case("gpt_tied", "shard", overlapped=True, **off),
        case(OFFLOAD_CLIP[0], "shard", max_norm=OFFLOAD_CLIP[1], overlapped=True, **off),
        case("mlp", COMPILED_UNITS, param_dtype=torch.bfloat16, overlapped=True, **off),
        case("mlp", "shard", accumulate=2, overlapped=True, **off),  # adds in the worker
    ]
    compiled = [
        case("gpt_tied", "inductor", param_dtype=torch.bfloat16, **off),
        case(OFFLOAD_CLIP[0], "inductor", max_norm=OFFLOAD_CLIP[1], overlapped=True, **off),
    ]
    # offload="params": the compute copies on the host, staged in on the gather stream
    params = {"offload": "params"}
    staged = [
        case("gpt_tied", "shard", **params),
        case("mlp", "inductor", param_dtype=torch.bfloat16, **params),
        case("gpt_tied", COMPILED_UNITS, param_dtype=torch.bfloat16, overlapped=True, **params),
        case("bias_stack", "inductor", overlapped=True, **params),
    ]
    return [*fp32, clipped, bf16, units, accumulated, *overlapped, *compiled, *staged]


def hybrid_mesh(kind: str, size: int) -> str | None:
    """The `Case.mesh` of a HYBRID kind at `size` GPUs; None where it needs more."""
    if kind == "shards":
        return f"1x{size}"
    if kind == "replicas":
        return f"{size}x1"
    if size < 4 or size % 2:
        return None
    return f"2x{size // 2}" + ("-strided" if kind.endswith("strided") else "")


def hybrid_case(kind: str, backend: str, model: str, side_streams: bool) -> Case | None:
    mesh = hybrid_mesh(kind, world())
    return None if mesh is None else case(model, backend, comm_streams=side_streams, mesh=mesh)


def all_cases() -> list[Case]:
    bf16 = [bf16_case(m) for m in BF16_MODELS]
    hybrid = [c for c in (hybrid_case(*h) for h in HYBRID) if c is not None]
    return fp32_cases() + bf16 + [master_case(a) for a in MASTER_APIS] + offload_cases() + hybrid


def graphed_key(config: tuple[str, ...], graphs: bool) -> str:
    return "graphed-" + "-".join(config) + ("-graphs" if graphs else "-no-graphs")


# --- the worker ---------------------------------------------------------------------------------


def run_group(
    rank: int, world_size: int, device: str, cases: list[Case], root: str
) -> dict[str, dict]:
    """Worker entry point: `cases` (zoo.run_cases), the checkpoint saved under `root`, then the
    graphed steps; `{key: zoo.run_isolated's result}`."""
    # The offloaded cases' host updates are tiny; the suite's other groups compile beside them
    # on the same cores (a captured group's rank stalled past its 240 s meeting once).
    os.environ.setdefault("ZRS_OFFLOAD_THREADS", "2")
    if device == "cuda":
        # fp32 means fp32 (the references run on the CPU); and the graphed runs' bit for bit
        # needs deterministic cuBLAS, set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = run_cases(rank, world_size, cases)
    out[CHECKPOINT_KEY] = run_isolated(
        functools.partial(_save_checkpoint, rank, device, root), CHECKPOINT_KEY
    )
    out[OFFLOAD_RESUME_KEY] = run_isolated(
        functools.partial(_resume_offloaded, rank, device, root), OFFLOAD_RESUME_KEY
    )
    # Bit for bit needs the forward and backward to be, too: the embedding's backward otherwise
    # sums with atomics, in an order that changes from run to run (seen: gpt_tied, fp32 AdamW).
    torch.use_deterministic_algorithms(True)
    try:
        for config in GRAPHED:
            for graphs in (False, True):
                run = functools.partial(_train_graphed, config, graphs, rank, device)
                key = graphed_key(config, graphs)
                out[key] = run_isolated(run, key)
    finally:
        torch.use_deterministic_algorithms(False)
    return out


def checkpoint_dir(root: str) -> str:
    return os.path.join(root, "-".join(CHECKPOINT_RUN))


def _save_checkpoint(rank: int, device: str, root: str) -> dict:
    spec, model, opt = ckpt.new(CHECKPOINT_RUN, device)
    ckpt.train(spec, model, opt, rank, range(CHECKPOINT_STEPS), device)
    ckpt.dcp_save(model, opt, checkpoint_dir(root))
    return {"saved": ckpt.full(model, opt)}


def _resume_offloaded(rank: int, device: str, root: str) -> dict:
    where = os.path.join(root, "-".join(OFFLOAD_RESUME_RUN))
    spec, model, opt = ckpt.new(OFFLOAD_RESUME_RUN, device)
    ckpt.train(spec, model, opt, rank, range(2), device)
    ckpt.dcp_save(model, opt, where)
    ckpt.train(spec, model, opt, rank, range(2, 4), device)
    uninterrupted = ckpt.full(model, opt)
    spec, model, opt = ckpt.new(OFFLOAD_RESUME_RUN, device)
    ckpt.dcp_load(model, opt, where)
    ckpt.train(spec, model, opt, rank, range(2, 4), device)
    return {"uninterrupted": uninterrupted, "resumed": ckpt.full(model, opt)}


def _train_graphed(config: tuple[str, ...], graphs: bool, rank: int, device: str) -> dict:
    """One GraphedStep run: clipped, SGD-momentum or AdamW (a tensor learning rate that a
    scheduler halves), the gradients of step POISONED made NaN."""
    import zrs

    model_name, dtype, kind, backend = config
    spec = ZOO[model_name]
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else torch.device(device)
    )
    model = spec.build().to(dev)
    param_dtype = torch.bfloat16 if dtype.startswith("bf16") else None
    reduce_dtype = torch.bfloat16 if dtype == "bf16_reduce" else None
    zrs.compile(model, param_dtype=param_dtype, reduce_dtype=reduce_dtype, backend=backend)
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    else:
        lr = torch.tensor(0.01, device=dev)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)
    sched = (
        torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if kind == "adamw" else None
    )
    # On the CPU (a dry run) the step runs eagerly either way: no CUDA graphs there.
    step = zrs.GraphedStep(opt, max_norm=0.05, cuda_graphs=graphs if dev.type == "cuda" else None)
    norms = []
    for i in range(GRAPHED_STEPS):
        opt.zero_grad()
        batch = [t.to(dev) if isinstance(t, torch.Tensor) else t for t in spec.batch(rank, i)]
        spec.loss(model, batch).backward()
        if i == POISONED and rank == 0:
            # One rank's NaN must skip the step on every rank. Rank 0's shard, as the last
            # rank's may be empty (at world 4 each Linear(9, 9) is cut 3, 3, 3, 0 rows).
            p = next(p for p in model.parameters() if p.to_local().numel())
            p.grad.to_local().view(-1)[0] = float("nan")
        norms.append(step().clone())
        if sched is not None:
            sched.step()
    state = {k: v.detach().cpu().clone() for k, v in zrs.full_state_dict(model).items()}
    LIVE_STEPS.append(step)
    return {
        "state": state,
        "norms": torch.stack(norms).cpu(),
        "skipped": step.skipped_steps,
        "captured": step.graph is not None,
        "recaptures": step.recaptures,
    }


# --- the tests' side ----------------------------------------------------------------------------


@functools.cache
def root() -> str:
    """The directory the group saves its checkpoint under (removed when the session ends)."""
    where = tempfile.mkdtemp(prefix="zrs-gpu-")
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return where


def results() -> list[dict[str, dict]]:
    """Every rank's results of the group, run once per session."""
    size = world()
    return cached_run(
        ("gpu_group", DEVICE, size),
        run_group,
        size,
        DEVICE,
        all_cases(),
        root(),
        backend=DIST_BACKEND,
        timeout=GROUP_TIMEOUT,
    )


def outcome(key: str) -> list[dict]:
    """The per-rank results of one item of the group; fails the test if it raised anywhere."""
    return case_outcome(results(), key)


@functools.cache
def reference(model: str, dtype: str = "fp32", max_norm: float | None = None) -> Reference:
    """The unsharded reference at the group's world size: "fp32", "bf16" (the forward under
    bf16 autocast, fp32 weights) or "bf16_model" (the model in bf16, trained wholly in it);
    clipped to `max_norm`."""
    kw: dict[str, Any] = {"max_norm": max_norm}
    if dtype == "bf16":
        kw["autocast_dtype"] = torch.bfloat16
    elif dtype == "bf16_model":
        kw["model_dtype"] = torch.bfloat16
    return train_reference(spec_of(model), world(), **kw)


def check(per_rank: list[dict], problems: list[str], what: str) -> None:
    """Fail with every problem of the case `what`; else re-emit its ranks' warnings here."""
    assert not problems, f"{what} differs from the reference:\n  " + "\n  ".join(problems)
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {what}")
