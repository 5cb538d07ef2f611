"""zrs: ZeRO-3 as a compiler for PyTorch training.

import zrs
model = zrs.compile(model)          # shards every parameter, compiles with torch.compile
model = zrs.shard(model)            # or: shards every parameter, trains eagerly
opt = torch.optim.AdamW(model.parameters())   # the parameters are the local fp32 shards
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zrs import checkpointing, integrations, prepare
from zrs._core import BudgetInfeasibleError, ZrsError
from zrs.checkpointing import full_state_dict
from zrs.prepare import InitFn
from zrs.runtime import ops as _ops  # noqa: F401  (registers the torch.ops.zrs namespace)
from zrs.step import CapturedStep, GraphedStep, OverlappedStep

__all__ = [
    "BudgetInfeasibleError",
    "CapturedStep",
    "GraphedStep",
    "OverlappedStep",
    "ZrsError",
    "checkpoint",
    "compile",
    "full_state_dict",
    "load_cache_artifacts",
    "save_cache_artifacts",
    "shard",
]
__version__ = "0.1.0"


def compile(
    model: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    backend: str = "inductor",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype | None = None,
    init_fn: InitFn | None = None,
    memory_budget: int | None = None,
    scheduler: str = "search",
    trace_dir: str | os.PathLike | None = None,
    profile: bool = True,
    keep_for_backward: bool | None = None,
    separate_reduce_communicator: bool = True,
    dynamic: bool | None = None,
    timeout: float | None = None,
    regions: bool = True,
    offload: str | None = None,
) -> nn.Module:
    """Shard `model` across the process group and compile it with the zrs ZeRO-3 backend.

    Every parameter is flattened, padded to a multiple of the world size and cut into equal shards;
    the local shard (fp32 unless `master_dtype` says otherwise) replaces it as the module's
    `nn.Parameter`, so any torch.optim optimizer
    works on `model.parameters()`. Module code that reads a parameter gathers it; inside compiled
    graphs the gathers, releases and gradient reduce-scatters are scheduled by zrs.

    Args:
        process_group: the data-parallel group (default: the world group; none needed for one
            process).
        mesh: instead of `process_group`, a DeviceMesh: 1-D, the group to shard over; 2-D,
            hybrid sharding (FSDP2's HSDP): the parameters are sharded within each group of the
            shard dimension and replicated across the replicate dimension, the gradients
            reduce-scattered within the shard group and all-reduced across the replicas. The
            dimensions are read by the names "dp_replicate" and "dp_shard", or unnamed as
            (replicate, shard); each parameter is a DTensor placed (Replicate(), Shard(0)) on
            the mesh (docs/hybrid.md). Not with `offload` yet.
        backend: "inductor" (default) or "eager" (run the lowered FX graphs without codegen).
        param_dtype: compute dtype of gathered parameters (e.g. torch.bfloat16; default: each
            parameter's own dtype).
        reduce_dtype: dtype of the gradient reduce-scatter (default: the master dtype).
        master_dtype: dtype of the shards, which the optimizer steps and keeps its state in.
            Default: fp32 master weights whatever the parameters' dtype (float64 in a float64
            model). torch.bfloat16 trains the model wholly in bf16, with no fp32 copy: half the
            memory for weights and optimizer state, the precision of bf16 updates (FSDP2's
            behaviour for a model cast to bf16 before sharding).
        init_fn: for a model built on the meta device, `fn(module)` initialises one module's own
            parameters and buffers (default: the module's `reset_parameters()`).
        memory_budget: bytes each compiled graph may allocate (gathered parameters and
            activations, as the planner estimates them). Default: on CUDA the free device memory
            (the least over the ranks) less a margin, capped at the greedy schedule's peak plus
            two of the graph's largest gathers; elsewhere the planner keeps the peak at the
            greedy schedule's. A budget below what the graph needs raises ZrsError naming the
            least feasible budget.
        scheduler: how the gathers, releases and prefetches of each graph are ordered: "search"
            (default; budget-aware list scheduling plus a search over prefetch positions and
            fused buckets), "greedy" (DeepCompile's fast_free_schedule rule, no budget, no
            fusion) or "none" (the order the zero3 pass produced, no prefetch).
        trace_dir: write each graph's planner IR, plan Chrome trace (open in
            https://ui.perfetto.dev) and memory-over-time PNG here, on rank 0. Default: the
            ZRS_PLAN_TRACE environment variable, else no trace.
        profile: give the planner measured times: each lowered graph runs once on real tensors
            of its shapes (collectives stubbed out) to time its compute nodes, and a short sweep
            of all-gather and reduce-scatter sizes fits the collectives' latency and bandwidth
            (the maximum over ranks, so every rank plans the same). False: analytic estimates.
        keep_for_backward: a training forward keeps the parameters it uses last (e.g. the
            output head and the last layer) gathered for the backward, which starts with them,
            instead of releasing them and gathering them again at once. It keeps at most two of
            the graph's largest gathers, within memory_budget when one is given. False releases
            every parameter at its last forward use (the least memory at the forward's end).
            Default (None): keep on several ranks; on one, where gathering again is a cast of
            the local shard and hides no communication, do not.
        separate_reduce_communicator: run the gradient reduce-scatters on a second communicator
            over the same ranks, so that they need not queue behind the all-gathers prefetched
            before them (NCCL runs one communicator's collectives in issue order). False: one
            communicator for both, which then never run at the same time.
        dynamic: passed to torch.compile. None (default): torch.compile's default (static
            sizes; a shape change recompiles once, with the changed sizes symbolic) while every
            rank's forward inputs have the same shapes, which the step check before each
            forward compares; from the first call where they differ, every size of the
            forward's tensor arguments is symbolic on every rank (the model's own buffers stay
            static), so that no rank ever compiles alone. True: every size of every tensor the
            forward reads is symbolic from the first compile.
        timeout: seconds any collective or meeting of this model waits for a peer: the
            all-gathers, the reduce-scatters, the rank checks at each compile and before each
            forward. A peer that stalls, dies or raises then gives every other rank a ZrsError
            naming the collective, the graph and the parameter (gloo; on NCCL the process
            group's watchdog ends the job at the timeout), and the model refuses to run on.
            Default: the process group's timeout (init_process_group's `timeout`).
        regions: compile each repeated block once and reuse its code for every layer: the
            children of an nn.ModuleList or nn.Sequential that share a class (a transformer's
            layers) become nested compile regions (`torch.compiler.nested_compile_region`),
            whose parameters zrs still gathers, prefetches and releases per layer. The first
            step's compile then grows with the distinct blocks, not the layers. A model whose
            blocks dynamo cannot capture as regions falls back to per-layer compilation (with a
            warning on the "zrs" logger). False: trace every layer on its own.
        offload: "optimizer": the fp32 master shards and the optimizer state live in host
            memory (pinned beside a GPU) and the optimizer steps there, as with `zrs.shard`;
            the compiled graphs gather from each shard's device copy in the compute dtype
            (docs/offload.md). "params": the compute-dtype shards on the host too; each gather
            copies its shards in first and frees them once read. Default: None (all on the
            device).

    Returns the same model object, sharded and compiled in place.
    """
    # The compiled path's modules (the dynamo backend imports AOTAutograd and, through it, half
    # of inductor: 0.3 s, about 1 s without cached bytecode) are imported by zrs.compile only,
    # not by `import zrs` and zrs.shard.
    from zrs.compiler.backend import BACKENDS, make_backend
    from zrs.compiler.forward import compile_forward
    from zrs.compiler.plan import SCHEDULERS, trace_dir_from_env

    prepare.check_choice("backend", backend, BACKENDS)
    prepare.check_choice("scheduler", scheduler, SCHEDULERS)
    precision = prepare.check_common(model, timeout, param_dtype, reduce_dtype, master_dtype)
    prepare.check_memory_budget(memory_budget)
    offload = prepare.check_offload(offload)
    topology = prepare.resolve_topology(process_group, mesh)
    world = topology.size
    if keep_for_backward is None:
        # One rank: the kept copy (a clone under inductor) costs what the cast it saves costs, and
        # it adds to the step's peak memory (BENCHMARKS.md).
        keep_for_backward = world > 1
    settings = {
        "backend": backend,
        "param_dtype": param_dtype,
        "reduce_dtype": reduce_dtype,
        "master_dtype": master_dtype,
        "memory_budget": memory_budget,
        "scheduler": scheduler,
        "profile": profile,
        "keep_for_backward": keep_for_backward,
        "separate_reduce_communicator": separate_reduce_communicator,
        "dynamic": dynamic,
        "timeout": timeout,
        "regions": regions,
        "offload": offload,
    }
    compiler_options = {
        "free_on_release": backend == "eager",
        "scheduler": scheduler,
        "memory_budget": memory_budget,
        "trace_dir": trace_dir_from_env(trace_dir),
        "profile": profile,
        "keep_for_backward": keep_for_backward,
    }

    # The recipe, each step one call into the layer that owns it (docs/architecture.md).
    links = prepare.agree_and_connect(model, topology, "zrs.compile", settings)
    state = prepare.make_state(links, precision, offload=offload, **compiler_options)
    prepare.shard_parameters(model, state, init_fn, regions)
    checkpointing.install_hooks(model)
    integrations.adopt_conventions(model, functools.partial(full_state_dict, model), state.job_rank)
    prepare.install_units(model, state, layered=False, limits={})
    state.compare_inputs = dynamic is None and (world > 1 or state.replicas > 1)
    inputs_agree = (lambda: state.inputs_agree) if state.compare_inputs else None
    forward = compile_forward(
        model, make_backend(state, backend), links.entry, dynamic, inputs_agree
    )
    prepare.install_forward(model, forward, "zrs.compile")
    return model


def save_cache_artifacts() -> bytes:
    """The compiled code of this process's `zrs.compile` models, to move to another machine:
    `torch.compiler.save_cache_artifacts()`'s entries with zrs's records of the same compiles
    (docs/compile-time.md). Each rank saves its own. Call after the first trained step."""
    from zrs.compiler.record import save_artifacts

    return save_artifacts()


def load_cache_artifacts(artifacts: bytes) -> None:
    """Load `zrs.save_cache_artifacts()`'s bytes into this machine's caches, before `zrs.compile`,
    so that its first compile is warm: with no rank meeting, from torch's cached code. A compile
    is warm only where every rank holds the same record; otherwise it is cold, never wrong."""
    from zrs.compiler.record import load_artifacts

    load_artifacts(artifacts)


def shard(
    model: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype | None = None,
    init_fn: InitFn | None = None,
    timeout: float | None = None,
    prefetch_numel: int | None = None,
    max_live_numel: int | None = None,
    max_reuse_distance: int | None = None,
    persist_numel: int | None = None,
    compile: bool | str = False,
    compile_root: bool = True,
    offload: str | None = None,
) -> nn.Module:
    """Shard `model` across the process group, exactly as `zrs.compile` does, and train it
    eagerly: no torch.compile, so nothing to capture and no compile time, and batches of any
    shape run as they come.

    Hooks on the model's *units* (each layer of a stack of repeated blocks, and each other
    module with parameters of its own) execute the decisions of a coordinator in zrs-core. The
    first step records the order in which units fetch their parameters; later steps follow
    that trace: before a unit's forward its parameters are gathered (one collective per unit)
    and the next units' parameters are prefetched; after it they are released unless they are
    used again soon; the backward gathers each unit's parameters again, prefetching by the
    reverse trace, and releases each parameter once its gradient is complete. Gradients go
    through the same bucketed, pre-divided reduce-scatter as the compiled path, into
    `param.grad`. When a step fetches units in another order, the coordinator warns once (on the
    "zrs" logger), stops prefetching for that step and records the order again. At the end of
    the first step the ranks compare their traces: a ZrsError names the first module that
    differs.

    Args (the sizes count elements of gathered parameters):
        process_group, mesh, param_dtype, reduce_dtype, master_dtype, init_fn, timeout: as for
            `zrs.compile`.
        prefetch_numel: elements prefetched ahead of the running unit, by the trace. Default:
            the largest unit's (one unit ahead).
        max_live_numel: elements that prefetches and parameters kept for reuse may hold
            gathered beyond what the running units need. Default: 3 x the largest unit's.
        max_reuse_distance: a parameter used again within this many gathered elements (by the
            trace, the backward included) stays gathered after its unit's forward: the last
            unit's parameters, which the backward starts with, are not gathered twice. Default:
            the largest unit's.
        persist_numel: parameters with fewer elements stay gathered across steps (they are
            gathered again only after an optimizer step). Default: 0 (none).
        compile: True (inductor) or the name of a torch.compile backend: compile the forward
            of each layer of a stack of repeated blocks (a transformer's layers) on its own, as
            FSDP2's users do, and the root's forward around the stacks: the embedding, the
            head and the loss become one graph. A submodule that runs a stack (a Hugging Face
            `*ForCausalLM` around its `*Model`) is a graph break there; a root that loops over
            its layers itself calls each as one opaque op of its graph (each layer called with
            tensors and Nones, returning a tensor or a tuple of them). Equal layers share one
            compile, so the first step costs about one block's compile, not the whole model's
            (docs/compile-time.md). The gathers, prefetches, releases and reduce-scatters stay
            the eager path's, around the compiled forwards; `zrs.compile` plans them inside one
            whole-model graph instead: a shorter step, a longer first one. Default: False
            (eager). torch.compile on a unit's module by hand works too, with its hooks run
            eagerly (a graph break at each).
        compile_root: with `compile`, compile the root's forward around the stacks too (as
            above). False compiles the layers only and runs the code around them eagerly, as
            FSDP2 + compile's per-layer recipe does: a second graph less to compile before the
            first step (about 3 s of it at the 1b and HF Llama 1.1B shapes on H200s), at the cost
            of the head's and the loss's activations, which the root's graph fuses (1.4-2 GiB
            more peak memory at those shapes; BENCHMARKS.md). Default: True.
        offload: "optimizer": the fp32 master shards and the optimizer state live in host
            memory (pinned beside a GPU), the GPU keeps each shard in the compute dtype, and a
            stock torch.optim.AdamW, Adam or SGD over `model.parameters()` steps on the host,
            in zrs-core, writing the compute-dtype copy in the same pass (docs/offload.md).
            `param.grad` is a host tensor. Other optimizers, GradScaler, zrs.GraphedStep and
            zrs.CapturedStep raise a ZrsError. "params": as "optimizer", and the compute-dtype
            shards live on the host too (the GPU holds a shard only from its gather's start to
            the gather's end, copied in on the gather's stream). Default: None (all on the
            device).

    Returns the same model object, sharded in place.
    """
    precision = prepare.check_common(model, timeout, param_dtype, reduce_dtype, master_dtype)
    limits = {
        "prefetch_numel": prefetch_numel,
        "max_live_numel": max_live_numel,
        "max_reuse_distance": max_reuse_distance,
        "persist_numel": persist_numel,
    }
    prepare.check_limits(limits)
    compile_backend = prepare.check_compile(compile)
    prepare.check_flag("compile_root", compile_root)
    offload = prepare.check_offload(offload)
    settings = {
        "api": "shard",
        "compile": compile_backend,
        "compile_root": compile_root,
        "offload": offload,
        "param_dtype": param_dtype,
        "reduce_dtype": reduce_dtype,
        "master_dtype": master_dtype,
        "timeout": timeout,
        **limits,
    }
    topology = prepare.resolve_topology(process_group, mesh)

    # The recipe, each step one call into the layer that owns it (docs/architecture.md).
    links = prepare.agree_and_connect(model, topology, "zrs.shard", settings)
    state = prepare.make_state(links, precision, offload=offload)
    prepare.shard_parameters(model, state, init_fn, regions=False)
    checkpointing.install_hooks(model)
    integrations.adopt_conventions(model, functools.partial(full_state_dict, model), state.job_rank)
    prepare.install_units(
        model,
        state,
        layered=True,
        limits=limits,
        compile_backend=compile_backend,
        compile_root=compile_root,
    )
    if compile_backend is not None:
        integrations.no_cache_in_training(model)
    prepare.install_forward(model, model._call_impl, "zrs.shard")
    return model


def __getattr__(name: str) -> object:
    # zrs.checkpoint imports torch.distributed.checkpoint (0.5 s): only when asked for, so that
    # `import zrs` stays short for a job that never saves (the time to the first step).
    if name == "checkpoint":
        from zrs.checkpointing import checkpoint

        globals()["checkpoint"] = checkpoint  # as importing a submodule sets it on the package
        return checkpoint
    raise AttributeError(f"module 'zrs' has no attribute {name!r}")
