"""The model's forward as zrs runs it, the recipe's last step: floating-point inputs cast to the
compute dtype, then a call (the compiled forward of `zrs.compile`, or the module's own for
`zrs.shard`) between the step check and the root unit of the eager path (`units.py`), with
Python's full garbage collections deferred to its end; a forward that raises leaves nothing
behind (`ZeroState.abandon_step`)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zrs._core import ZrsError
from zrs.prepare.units import ROOT
from zrs.runtime.state import ZeroState


def install_forward(model: nn.Module, call: Callable[..., Any], api: str) -> None:
    """Make `call` the model's forward (`nn.Module.__call__` runs `_compiled_call_impl` when it
    is set), guarded as above; with a param_dtype, cast the inputs to it. `model.compile()`,
    which would put torch.compile's forward in its place, raises instead (`api`: the zrs
    function that prepared the model)."""
    state: ZeroState = model._zrs_state
    if state.param_dtype is not None:
        model.register_forward_pre_hook(cast_inputs(state.param_dtype), with_kwargs=True)
    model._compiled_call_impl = guarded(model, call)
    model.compile = refuse_compile(api)  # the instance's, before nn.Module's


def refuse_compile(api: str) -> Callable[..., None]:
    """`nn.Module.compile` sets `_compiled_call_impl`, the slot that holds zrs's forward: the
    step check and the root's gathers would be gone, and the first forward would read a
    parameter that nothing gathered."""
    how = (
        "zrs.compile already compiled its forward"
        if api == "zrs.compile"
        else "zrs.shard(model, compile=True) compiles each layer of its repeated stack around "
        "zrs's gathers (or zrs.compile(model) compiles the whole model); layer.compile() on a "
        "submodule works too, as does torch.compile(model)"
    )

    def compile(*args: Any, **kwargs: Any) -> None:
        raise ZrsError(
            f"model.compile() on a model prepared by {api} would replace zrs's forward (its step "
            f"check and the gathers of the model's own parameters) with torch.compile's: {how}."
        )

    return compile


def cast_inputs(dtype: torch.dtype):
    """Cast floating-point forward inputs to the compute dtype, as FSDP2's mixed precision does."""

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


def guarded(model: nn.Module, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` between the step check and the root unit of the eager path."""
    state: ZeroState = model._zrs_state
    fetcher = state.fetcher
    assert fetcher is not None, "the eager path is installed before the forward"

    # The runtime's side runs eagerly even under a user's torch.compile of the whole model: the
    # step check meets the other ranks, and the eager path's bookkeeping is no graph's.
    @torch.compiler.disable
    def check(inputs: tuple[tuple, dict]) -> None:
        state.begin_forward(model.training, inputs)

    @torch.compiler.disable
    def begin() -> None:
        fetcher.begin(torch.is_grad_enabled())
        fetcher.enter(ROOT)

    @torch.compiler.disable
    def end(out: Any) -> None:
        fetcher.exit(ROOT, out)
        fetcher.end()

    @torch.compiler.disable
    def abandon(e: Exception) -> None:
        state.abandon_step(e)

    def forward(*args: Any, **kwargs: Any) -> Any:
        check((args, kwargs))
        try:
            begin()
            with full_collections_deferred():
                out = call(*args, **kwargs)
            end(out)
            return out
        except Exception as e:
            abandon(e)
            raise

    return forward


# More young collections than any compile makes: no full collection starts inside the block.
_DEFERRED_FULL_THRESHOLD = 1 << 30


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """No automatic full (generation 2) garbage collection inside the block, and one at its end
    if the block made as many young collections as would have started one (a compile); the
    young generations still collect inside, and refcounting frees the rest at once.

    A compile (a first forward, a recompile, zrs.shard's compiled layers) makes millions of
    objects: FX nodes, fake tensors, sympy expressions. Each time the heap has grown by a
    quarter, a full collection walks all of it again; in the forward of a compile, most of the
    collector's time. The one at the end pays for the deferred ones, at a known point: left to
    the next automatic one, it ran inside a later CUDA graph capture (`zrs.GraphedStep`'s, in
    tests/gpu/test_captured_gpu.py), and what it freed there invalidated the capture. Torch
    2.11 runs only a young collection after a compile (`run_gc_after_compile`); pytorch/pytorch
    PR #193289 defers full collections inside dynamo in the same way. Python 3.14's incremental
    collector has no third threshold (it reads 0): nothing changes there."""
    thresholds = gc.get_threshold()
    if thresholds[2] in (0, _DEFERRED_FULL_THRESHOLD):
        # Python 3.14, or inside another block (a nested forward, or another thread's): the
        # outermost block restores the thresholds, so that none is left raised for good.
        yield
        return
    young_before = gc.get_count()[2]  # young (generation 1) collections since the last full one
    gc.set_threshold(thresholds[0], thresholds[1], _DEFERRED_FULL_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if gc.isenabled() and gc.get_count()[2] - young_before > thresholds[2]:
            gc.collect()
