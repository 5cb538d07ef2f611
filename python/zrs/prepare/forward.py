"""The model's forward as zrs runs it, the recipe's last step: floating-point inputs cast to the
compute dtype, then a call (the compiled forward of `zrs.compile`, or the module's own for
`zrs.shard`) between the step check and the root unit of the eager path (`units.py`); a forward
that raises leaves nothing behind (`ZeroState.abandon_step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zrs.prepare.units import ROOT
from zrs.runtime.state import ZeroState


def install_forward(model: nn.Module, call: Callable[..., Any]) -> None:
    """Make `call` the model's forward (`nn.Module.__call__` runs `_compiled_call_impl` when it
    is set), guarded as above; with a param_dtype, cast the inputs to it."""
    state: ZeroState = model._zrs_state
    if state.param_dtype is not None:
        model.register_forward_pre_hook(cast_inputs(state.param_dtype), with_kwargs=True)
    model._compiled_call_impl = guarded(model, call)


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

    def forward(*args: Any, **kwargs: Any) -> Any:
        state.begin_forward(model.training, (args, kwargs))
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
