"""zrs: ZeRO-3 as a compiler for PyTorch training.

import zrs
model = zrs.compile(model)          # shards every parameter, compiles with torch.compile
opt = torch.optim.AdamW(model.parameters())   # the parameters are the local fp32 shards
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch.fx.experimental import _config as fx_config
from torch.utils._pytree import tree_map

from zrs import checkpoint, hf, kernels, options, runtime
from zrs import ops as _ops  # noqa: F401  (registers the torch.ops.zrs namespace)
from zrs._core import Registry, ZrsError
from zrs.compiler import BACKENDS, make_backend
from zrs.exchange import Peers, group_timeout
from zrs.passes.schedule import SCHEDULERS, trace_dir_from_env
from zrs.runtime import ZeroState
from zrs.sharding import InitFn, check_devices, drop_regions, shard_model
from zrs.state_dict import full_state_dict

__all__ = ["ZrsError", "checkpoint", "compile", "full_state_dict"]
__version__ = "0.1.0"


def _resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ZrsError(
            f"zrs.compile was called before torch.distributed.init_process_group, but "
            f"WORLD_SIZE={world}: call dist.init_process_group('nccl' on GPUs, 'gloo' on CPU) "
            "first, or pass process_group="
        )
    return None  # one process, no torch.distributed: collectives are local copies


def _resolve_device(model: nn.Module, group: dist.ProcessGroup | None) -> torch.device:
    device = check_devices(model)
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # NCCL needs this rank's GPU
    return device if device is not None else torch.device("cpu")


def _cast_inputs(dtype: torch.dtype):
    """Cast floating-point forward inputs to the compute dtype, as FSDP2's mixed precision does."""

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


def compile(
    model: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    backend: str = "inductor",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
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
) -> nn.Module:
    """Shard `model` across the process group and compile it with the zrs ZeRO-3 backend.

    Every parameter is flattened, padded to a multiple of the world size and cut into equal shards;
    the local fp32 shard replaces it as the module's `nn.Parameter`, so any torch.optim optimizer
    works on `model.parameters()`. Module code that reads a parameter gathers it; inside compiled
    graphs the gathers, releases and gradient reduce-scatters are scheduled by zrs.

    Args:
        process_group: the data-parallel group (default: the world group; none needed for one
            process).
        backend: "inductor" (default) or "eager" (run the lowered FX graphs without codegen).
        param_dtype: compute dtype of gathered parameters (e.g. torch.bfloat16); shards stay fp32
            (float64 in a float64 model).
        reduce_dtype: dtype of the gradient reduce-scatter (default fp32; float64 in a float64
            model).
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
        dynamic: passed to torch.compile. None (default): with several ranks True, every size
            of the forward's inputs is symbolic from the first compile, so that batches whose
            shapes change from step to step, or differ between the ranks, never make one rank
            compile alone; with one process torch.compile's default (a shape change recompiles
            once, with the changed sizes symbolic).
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

    Returns the same model object, sharded and compiled in place.
    """
    if backend not in BACKENDS:
        raise ZrsError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if scheduler not in SCHEDULERS:
        raise ZrsError(f"unknown scheduler {scheduler!r}: choose one of {', '.join(SCHEDULERS)}")
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise ZrsError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0
    ):
        raise ZrsError(
            f"memory_budget must be a positive number of bytes or None, not {memory_budget!r}"
        )
    options.check_dtype("param_dtype", param_dtype)
    options.check_dtype("reduce_dtype", reduce_dtype)
    options.check_param_dtypes(model)
    group = _resolve_group(process_group)
    device = _resolve_device(model, group)
    world = dist.get_world_size(group) if group is not None else 1
    if keep_for_backward is None:
        # One rank: the kept copy (a clone under inductor) costs what the cast it saves costs, and
        # it held 0.23 GiB at the peak of Llama 1b's step (one H200, session 13).
        keep_for_backward = world > 1
    entry = next(_ENTRIES)
    settings = {
        "backend": backend,
        "param_dtype": param_dtype,
        "reduce_dtype": reduce_dtype,
        "memory_budget": memory_budget,
        "scheduler": scheduler,
        "profile": profile,
        "keep_for_backward": keep_for_backward,
        "separate_reduce_communicator": separate_reduce_communicator,
        "dynamic": dynamic,
        "timeout": timeout,
        "regions": regions,
    }
    links = _Links(group, timeout, entry)
    if links.peers is not None:  # before any collective: a mismatch there hangs or aborts
        links.peers.agree(f"zrs.compile call {entry}", _describe(model, settings))
        links.connect(separate_reduce_communicator)
    state = ZeroState(
        group=group,
        world_size=world,
        rank=dist.get_rank(group) if group is not None else 0,
        device=device,
        param_dtype=param_dtype,
        reduce_dtype=options.default_reduce_dtype(model, reduce_dtype),
        registry=Registry(world),
        free_on_release=backend == "eager",
        timeout=links.timeout,
        gather_group=links.gather_group,
        reduce_group=links.reduce_group,
        control_group=links.control_group,
        scheduler=scheduler,
        memory_budget=memory_budget,
        trace_dir=trace_dir_from_env(trace_dir),
        profile=profile,
        keep_for_backward=keep_for_backward,
        peers=links.peers,
    )
    if device.type == "cuda":
        kernels.build_in_background()  # nvcc runs while dynamo and inductor trace the model
    shard_model(model, state, init_fn, regions)
    model._zrs_state = state
    hf.adopt_conventions(model)
    if param_dtype is not None:
        model.register_forward_pre_hook(_cast_inputs(param_dtype), with_kwargs=True)
    if dynamic is None and world > 1:
        dynamic = True
    _compile_in_place(model, make_backend(state, backend), entry, dynamic)
    return model


_log = logging.getLogger("zrs")
_ENTRIES = itertools.count()  # zrs.compile calls in this process: every rank counts alike


class _Links:
    """The communicators and the store meeting of one zrs.compile call, all with one timeout:
    `timeout` seconds, else the process group's own."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float | None, entry: int):
        self.gather_group = self.reduce_group = group
        self.control_group: dist.ProcessGroup | None = None
        self.peers: Peers | None = None
        if group is None:
            self.timeout = datetime.timedelta(minutes=30)
            return
        own = group_timeout(group)
        self.timeout = datetime.timedelta(seconds=timeout) if timeout is not None else own
        if dist.get_world_size(group) > 1:
            self.peers = Peers(group, f"{group.group_name}/{entry}", self.timeout)

    def connect(self, separate_reduce_communicator: bool) -> None:
        """Make the communicators: the all-gathers' (the group itself when its timeout is the
        one asked for), the reduce-scatters' (`separate_reduce_communicator`) and a gloo group
        for the host-side exchanges."""
        group = self.gather_group
        assert group is not None
        if group_timeout(group) != self.timeout:
            self.gather_group = runtime.new_group_like(group, self.timeout)
        self.reduce_group = self.gather_group
        if separate_reduce_communicator:
            self.reduce_group = runtime.new_group_like(group, self.timeout)
        self.control_group = runtime.new_group_like(group, self.timeout, backend="gloo")


def _describe(model: nn.Module, settings: dict[str, Any]) -> list[str]:
    """What every rank must agree on before sharding: each parameter (name, shape, dtype,
    requires_grad, whether on meta) and the options."""
    lines = [f"{k}={v}" for k, v in settings.items()]
    for name, p in model.named_parameters():
        where = "meta" if p.is_meta else "real"
        lines.append(f"{name} {list(p.shape)} {p.dtype} grad={p.requires_grad} {where}")
    return lines


def _compile_in_place(model: nn.Module, backend: Any, entry: int, dynamic: bool | None) -> None:
    """Compile `model` in place; if dynamo cannot capture a repeated block as a compile region,
    compile it again with every layer traced on its own (what `regions=False` does)."""
    compiled = _compiled_forward(model, backend, f"zrs_forward_{entry}", dynamic)

    state: ZeroState = model._zrs_state

    def forward(*args: Any, **kwargs: Any) -> Any:
        state.begin_forward(model.training)
        try:
            return call(*args, **kwargs)
        except Exception as e:
            state.abandon_step(e)
            raise

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        try:
            with hf.call_scope(model, args, kwargs):
                return compiled(*args, **kwargs)
        except Exception as e:
            ours = _zrs_error(e)
            if ours is not None and ours is not e:
                raise ours from e  # not dynamo's BackendCompilerFailed: `except ZrsError` works
            if ours is not None or not _raised_compiling(e) or not drop_regions(model):
                raise
            _log.warning(
                "zrs: the model's repeated blocks cannot be compiled once and reused (%s: %s); "
                "each layer is compiled on its own instead",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            compiled = _compiled_forward(model, backend, f"zrs_forward_{entry}_flat", dynamic)
            with hf.call_scope(model, args, kwargs):
                return compiled(*args, **kwargs)

    model._compiled_call_impl = forward


def _zrs_error(e: BaseException) -> ZrsError | None:
    """The ZrsError `e` is or wraps (dynamo wraps a backend's errors in BackendCompilerFailed)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ZrsError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__ or getattr(cur, "inner_exception", None)
    return None


_CONVERT_FRAME = os.path.join("torch", "_dynamo", "convert_frame.py")


def _raised_compiling(e: BaseException) -> bool:
    """True if `e` came out of dynamo compiling a frame (capture, AOTAutograd, inductor), not out
    of running compiled code: only then may a failure be the regions' (torch 2.11 fails on some
    regions that it inlines fine, e.g. an internal assertion at GPT-2's tanh GELU)."""
    if isinstance(e, TorchDynamoException):  # dynamo's own, often without its frames
        return True
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_CONVERT_FRAME):
            return True
        tb = tb.tb_next
    return False


def _compiled_forward(model: nn.Module, backend: Any, name: str, dynamic: bool | None) -> Any:
    """What `model.compile(backend=...)` does, but entered through a frame of zrs code.

    `nn.Module.compile` compiles `model._call_impl`, and dynamo (torch 2.11) captures nothing when
    the model's `forward` is torch.nn's own, e.g. an `nn.Sequential`: only the gather properties
    (zrs code) were compiled, as one tiny graph per parameter, and the model ran eagerly between
    them. Dynamo traces an entry frame outside torch and inlines `_call_impl` and `forward`.
    """
    call_impl = model._call_impl

    def zrs_forward(*args: Any, **kwargs: Any) -> Any:
        return call_impl(*args, **kwargs)

    # Dynamo keeps its compiled entries on the code object, and a second zrs.compile of the same
    # class and shapes passed the first one's guards (it ran with the first model's backend and
    # zero state). A code object of its own per model keeps their entries apart.
    zrs_forward.__code__ = zrs_forward.__code__.replace(co_name=name)
    compiled = torch.compile(zrs_forward, backend=backend, dynamic=dynamic)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Duck sizing gives two sizes that are equal at the first compile one symbol (batch 8,
        # length 8): a rank whose sizes differ then traces another graph, or recompiles alone
        # once they part. Each size gets its own symbol. Float attributes (a norm's epsilon)
        # are constants: with dynamic sizes dynamo (torch 2.11) passed them to a compile region
        # as tensors read with .item(), which AOTAutograd refused, so no region survived.
        with (
            fx_config.patch(use_duck_shape=not dynamic),
            torch._dynamo.config.patch(specialize_float=True),
        ):
            return compiled(*args, **kwargs)

    return forward
