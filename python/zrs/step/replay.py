"""What zrs.GraphedStep and zrs.CapturedStep share: the copy kernels loaded and the GPU idle before
a capture, a capture with the garbage collector off, a replay run with the optimizers' step hooks
around it, and the hyperparameters a graph baked in, checked before each replay."""

from __future__ import annotations

import contextlib
import gc
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import (
    _global_optimizer_post_hooks,
    _global_optimizer_pre_hooks,
)

from zrs._core import ZrsError
from zrs.runtime import kernels

# Recaptures (gradients or optimizer state moved) after which the step stops capturing and runs
# eagerly, with a warning: something reallocates them every step.
MAX_RECAPTURES = 3


def settle_before_capture() -> None:
    """Before a capture: the copy kernels' background build joined, then the GPU idle. A graph
    replays whichever implementation of an op ran while it was captured, so a capture made while
    the build still ran would replay the torch copies for good (at 1b on two H200s, session 46:
    about 960 launches of torch's copy, scale, fill and other small kernels, 18.6 ms a step, where
    the uncaptured step ran 106 copy kernels in 4.4 ms and 108 others in 2.1 ms)."""
    kernels.wait()
    torch.cuda.synchronize()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No garbage collection inside a CUDA graph capture. A collection there runs the finalizers
    of whatever it frees inside the capture (a CUDA event or stream destroyed, a tensor with
    stream uses recorded, whose free queries an event), and the capture is invalidated
    (cudaErrorStreamCaptureInvalidated). Torch 2.11 no longer collects before a capture
    (`torch.compiler.config.force_cudagraph_gc`), so a collection that the heap's growth starts
    there is left to chance. Refcounting still frees, at once, what dies inside."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def replay_with_hooks(
    optimizers: list[torch.optim.Optimizer], replay: Callable[[], None], who: str
) -> None:
    """`replay` a graph that holds these optimizers' steps, with their step hooks (global and
    their own) run around it, as `optimizer.step()` runs them: zrs's own count the step."""
    for opt in optimizers:
        for hook in (
            *_global_optimizer_pre_hooks.values(),
            *opt._optimizer_step_pre_hooks.values(),
        ):
            if hook(opt, (), {}) is not None:
                raise ZrsError(
                    f"{who}: an optimizer step pre-hook returned new arguments, which a captured "
                    "step cannot take"
                )
    replay()
    for opt in optimizers:
        for hook in (
            *opt._optimizer_step_post_hooks.values(),
            *_global_optimizer_post_hooks.values(),
        ):
            hook(opt, (), {})


class Hyperparameters:
    """An optimizer's hyperparameters as a captured step baked them in: Python numbers by value,
    tensors by identity (the graph reads the tensor). `check` raises ZrsError when one changed."""

    def __init__(self, optimizer: torch.optim.Optimizer, who: str) -> None:
        self.optimizer = optimizer
        self.who = who
        self.fixed = [_hyperparameters(g) for g in optimizer.param_groups]

    def check(self) -> None:
        now = [_hyperparameters(g) for g in self.optimizer.param_groups]
        for i, (before, after) in enumerate(zip(self.fixed, now, strict=False)):
            for key in before.keys() | after.keys():
                old, new = before.get(key), after.get(key)
                same = old is new if isinstance(old, torch.Tensor) else _equal(old, new)
                if not same:
                    raise ZrsError(f"{self.who}: {_changed(i, key, old, new)}")
        if len(self.fixed) != len(now):
            raise ZrsError(
                f"{self.who}: the optimizer's param groups changed after the warmup "
                f"({len(self.fixed)} then {len(now)}); build a new {self.who} after "
                "add_param_group"
            )


def _equal(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """What a captured step bakes in: numbers by value, tensors by identity."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            out[key] = value  # compared by identity: the graph reads this tensor
        elif isinstance(value, numbers.Number | tuple):
            out[key] = value
    return out


def _changed(group: int, key: str, before: object, after: object) -> str:
    if isinstance(before, torch.Tensor):
        how = "was replaced by another object; update the tensor in place (fill_) instead"
    else:
        how = (
            f"changed from {before!r} to {after!r}, but the captured step keeps the value it was "
            f"captured with. Hold it as a tensor (e.g. {key}=torch.tensor({before!r})); "
            "schedulers update a tensor in place, which the graph reads"
        )
    return f"param group {group}'s {key!r} {how}"
