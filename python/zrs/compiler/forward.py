"""The compiled forward of `zrs.compile`, the entry from a prepared model into the compiler: the
model's call compiled by torch.compile with the zrs backend (`backend.py`), compiled again with
every layer traced on its own when dynamo cannot capture a repeated block as a compile region.

It sits in the compiler, above `prepare/` and `integrations/`, because it depends on them: it
turns the regions that `prepare/sharding.py` made back into plain modules, and enters each
integration's `call_scope` around every compiled call. Nothing below imports it; `zrs.compile`
hands what it returns to `prepare.install_forward`, which runs it between the step checks
(docs/architecture.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch.fx.experimental import _config as fx_config
from torch.utils._pytree import tree_leaves

from zrs import integrations
from zrs._core import ZrsError
from zrs.prepare.sharding import drop_regions
from zrs.runtime.exchange import first_line

_log = logging.getLogger("zrs")


def compile_forward(
    model: nn.Module,
    backend: Any,
    entry: int,
    dynamic: bool | None,
    inputs_agree: Callable[[], bool] | None,
) -> Callable[..., Any]:
    """The model's call, compiled; if dynamo cannot capture a repeated block as a compile region,
    compiled again with every layer traced on its own (what `regions=False` does).

    `inputs_agree` (several ranks, dynamic=None): whether every rank's inputs had the same shapes
    at this call (the step check before it compares them). While they do, sizes are static, as
    in one process: every rank passes the same guards, and a shape change recompiles every rank
    at the same call. From the first call where they differ, every size of the forward's tensor
    arguments is symbolic, on every rank from that same call on, so that no rank recompiles alone
    (a compile meets the other ranks)."""
    flat = False
    symbolic = False
    compiled = _compiled_forward(model, backend, f"zrs_forward_{entry}", dynamic, symbolic)

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled, flat, symbolic
        if inputs_agree is not None and not symbolic and not inputs_agree():
            symbolic = True
            _log.info(
                "zrs: the ranks' inputs differ in shape: compiling again with symbolic sizes, "
                "kept from now on (dynamic=True starts with them)"
            )
            compiled = _compiled_forward(
                model, backend, _name(entry, flat, symbolic), dynamic, True
            )
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
                first_line(e),
            )
            flat = True
            name = _name(entry, flat, symbolic)
            compiled = _compiled_forward(model, backend, name, dynamic, symbolic)
            with integrations.call_scope(model, args, kwargs):
                return compiled(*args, **kwargs)

    return call


def _name(entry: int, flat: bool, symbolic: bool) -> str:
    """The compiled entry's code name: dynamo keeps each one's compiled graphs apart."""
    return f"zrs_forward_{entry}{'_flat' if flat else ''}{'_symbolic' if symbolic else ''}"


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
    model: nn.Module, backend: Any, name: str, dynamic: bool | None, symbolic: bool
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
        if symbolic:
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
            fx_config.patch(use_duck_shape=not (dynamic or symbolic)),
            torch._dynamo.config.patch(specialize_float=True),
        ):
            return compiled(*args, **kwargs)

    return forward
