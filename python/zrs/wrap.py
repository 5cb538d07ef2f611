"""What `zrs.compile` does to a model, after its options are checked: the process group and
device, the communicators and the store meeting (`Links`), the agreement on the model, and the
compiled forward that checks every step and cleans up after a failed one."""

from __future__ import annotations

import datetime
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch.fx.experimental import _config as fx_config
from torch.utils._pytree import tree_leaves, tree_map

from zrs import integrations, options
from zrs._core import Registry, ZrsError
from zrs.runtime import kernels
from zrs.runtime.collectives import new_group_like
from zrs.runtime.exchange import Peers, group_timeout
from zrs.runtime.handles import LIVE
from zrs.runtime.state import ZeroState
from zrs.sharding import InitFn, check_devices, drop_regions, shard_model
from zrs.units import ROOT


def shard_in_place(
    model: nn.Module,
    api: str,
    settings: dict[str, Any],
    *,
    group: dist.ProcessGroup | None,
    init_fn: InitFn | None,
    regions: bool,
    **state_options: Any,
) -> tuple[ZeroState, int]:
    """What zrs.compile and zrs.shard share: agree on the model and `settings` across the ranks,
    make the communicators, shard every parameter. The model's state, and the call's number
    (every rank counts alike)."""
    device = resolve_device(model, group)
    world = dist.get_world_size(group) if group is not None else 1
    entry = next(LIVE.compile_calls)
    timeout = settings["timeout"]
    links = Links(group, timeout, entry)
    if links.peers is not None:  # before any collective: a mismatch there hangs or aborts
        links.peers.agree(f"{api} call {entry}", describe(model, settings))
        links.connect(settings.get("separate_reduce_communicator", True))
    param_dtype = settings["param_dtype"]
    master = options.master_dtype(model, settings["master_dtype"])
    state = ZeroState(
        group=group,
        world_size=world,
        rank=dist.get_rank(group) if group is not None else 0,
        device=device,
        param_dtype=param_dtype,
        master_dtype=master,
        reduce_dtype=options.default_reduce_dtype(master, settings["reduce_dtype"]),
        registry=Registry(world),
        timeout=links.timeout,
        gather_group=links.gather_group,
        reduce_group=links.reduce_group,
        control_group=links.control_group,
        peers=links.peers,
        **state_options,
    )
    if device.type == "cuda":
        kernels.build_in_background()  # nvcc runs while the model is sharded (and compiled)
    shard_model(model, state, init_fn, regions)
    model._zrs_state = state
    state.module = weakref.ref(model)
    integrations.adopt_conventions(model)
    if param_dtype is not None:
        model.register_forward_pre_hook(cast_inputs(param_dtype), with_kwargs=True)
    return state, entry


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ZrsError(
            f"zrs.compile (or zrs.shard) was called before torch.distributed.init_process_group, but "
            f"WORLD_SIZE={world}: call dist.init_process_group('nccl' on GPUs, 'gloo' on CPU) "
            "first, or pass process_group="
        )
    return None  # one process, no torch.distributed: collectives are local copies


def resolve_device(model: nn.Module, group: dist.ProcessGroup | None) -> torch.device:
    device = check_devices(model)
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # NCCL needs this rank's GPU
    return device if device is not None else torch.device("cpu")


def cast_inputs(dtype: torch.dtype):
    """Cast floating-point forward inputs to the compute dtype, as FSDP2's mixed precision does."""

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


_log = logging.getLogger("zrs")


class Links:
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
            self.gather_group = new_group_like(group, self.timeout)
        self.reduce_group = self.gather_group
        if separate_reduce_communicator:
            self.reduce_group = new_group_like(group, self.timeout)
        self.control_group = new_group_like(group, self.timeout, backend="gloo")


def describe(model: nn.Module, settings: dict[str, Any]) -> list[str]:
    """What every rank must agree on before sharding: each parameter (name, shape, dtype,
    requires_grad, whether on meta) and the options."""
    lines = [f"{k}={v}" for k, v in settings.items()]
    for name, p in model.named_parameters():
        where = "meta" if p.is_meta else "real"
        lines.append(f"{name} {list(p.shape)} {p.dtype} grad={p.requires_grad} {where}")
    return lines


def compile_in_place(
    model: nn.Module, backend: Any, entry: int, dynamic: bool | None, dynamic_inputs: bool
) -> None:
    """Compile `model` in place; if dynamo cannot capture a repeated block as a compile region,
    compile it again with every layer traced on its own (what `regions=False` does).
    `dynamic_inputs`: every size of the forward's tensor arguments is symbolic from the first
    compile (`_compiled_forward`)."""
    compiled = _compiled_forward(model, backend, f"zrs_forward_{entry}", dynamic, dynamic_inputs)

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        try:
            with integrations.call_scope(model, args, kwargs):
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
            flat = f"zrs_forward_{entry}_flat"
            compiled = _compiled_forward(model, backend, flat, dynamic, dynamic_inputs)
            with integrations.call_scope(model, args, kwargs):
                return compiled(*args, **kwargs)

    model._compiled_call_impl = guarded(model, call)


def guarded(model: nn.Module, call: Callable[..., Any]) -> Callable[..., Any]:
    """The model's forward: `call` between the step check and the root unit of the eager path
    (`units.py`); a forward that raises leaves nothing behind (`ZeroState.abandon_step`)."""
    state: ZeroState = model._zrs_state
    fetcher = state.fetcher
    assert fetcher is not None, "the eager path is installed before the forward"

    def forward(*args: Any, **kwargs: Any) -> Any:
        state.begin_forward(model.training)
        try:
            fetcher.begin(torch.is_grad_enabled())
            fetcher.enter(ROOT)
            out = call(*args, **kwargs)
            fetcher.exit(ROOT, out)
            fetcher.end()
            return out
        except Exception as e:
            state.abandon_step(e)
            raise

    return forward


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


def _compiled_forward(
    model: nn.Module, backend: Any, name: str, dynamic: bool | None, dynamic_inputs: bool
) -> Any:
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
        if dynamic_inputs:
            # The batch's sizes symbolic, the model's own tensors (buffers) static: what
            # dynamic=True gave minus a symbol for every buffer, which made the first compile at
            # several ranks twice as long on the CPU (docs/compile-time.md).
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    for dim in range(t.dim()):
                        torch._dynamo.maybe_mark_dynamic(t, dim)
        # Duck sizing gives two sizes that are equal at the first compile one symbol (batch 8,
        # length 8): a rank whose sizes differ then traces another graph, or recompiles alone
        # once they part. Each size gets its own symbol. Float attributes (a norm's epsilon)
        # are constants: with dynamic sizes dynamo (torch 2.11) passed them to a compile region
        # as tensors read with .item(), which AOTAutograd refused, so no region survived.
        with (
            fx_config.patch(use_duck_shape=not (dynamic or dynamic_inputs)),
            torch._dynamo.config.patch(specialize_float=True),
        ):
            return compiled(*args, **kwargs)

    return forward
