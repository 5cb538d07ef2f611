"""Accelerate with zrs models: `Accelerator`, Accelerate's own with four changes for a sharded
model (docs/integrations.md).

- `prepare()` leaves a sharded model where it is and wraps it in nothing: DDP cannot hold
  DTensor parameters, and zrs reduces the gradients itself (Trainer prepares models sharded at
  load time the same way: `evaluation_mode=True` keeps only the autocast wrapper).
- `get_state_dict(model)` of a sharded model is its full tensors on the CPU of the main process
  (`zrs.full_state_dict(rank0_only=True, cpu_offload=True)`); every rank must call it.
- `save_state()` writes the sharded optimizers' state as full tensors, gathered from every rank,
  and the models' full weights: the one file per object that the main process writes holds every
  rank's rows, not the main process's alone.
- `load_state()` gives each rank its rows of those full tensors, at any world size.

`Accelerator(state_dict_type="sharded")` instead writes each sharded model and each optimizer
over its parameters as a torch.distributed.checkpoint folder in the state's directory
(`zrs_model_<i>`, `zrs_optimizer_<i>`, by their index in `prepare`'s order): every rank writes its
rows, no host holds the whole model, and `load_state` reshards them to any world size. Everything
else (other models and optimizers, schedulers, samplers, RNG states) is saved as Accelerate saves
it. `get_state_dict` still returns the full weights.

Gradient accumulation (`accumulate()`), `backward()` and `clip_grad_norm_()` need no change:
zrs reduce-scatters each backward's gradients into the shards' `.grad`, where they accumulate,
and the clip all-reduces the DTensor gradients' norms.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import accelerate
import torch
from torch import nn

from zrs._core import ZrsError
from zrs.checkpointing import checkpoint, full_state_dict, optimizer_state
from zrs.checkpointing.optimizer_rows import sharded_params

STATE_DICT_TYPES = ("full", "sharded")


def is_sharded(model: nn.Module) -> bool:
    """Whether zrs sharded `model` (or the module a torch.compile wrapper holds)."""
    return getattr(getattr(model, "_orig_mod", model), "_zrs_state", None) is not None


def _own_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied parameters as tensors of their own: safetensors refuses two keys of one storage."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        out[key] = value.clone() if id(value) in seen else value
        seen.add(id(value))
    return out


class _FullWeights:
    """What `load_state` hands Accelerate in place of a sharded model: safetensors' `load_model`
    reads the storage of each tensor of `state_dict()`, which a DTensor has none of. The full
    weights it loads go to the model's `load_state_dict`, where each rank keeps its rows."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: torch.empty(0) for key in self.model.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, **_: Any) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict)


def check_state_dict_type(value: str) -> str:
    if value not in STATE_DICT_TYPES:
        raise ZrsError(
            f"state_dict_type={value!r}: zrs's checkpoints are 'full' (full tensors in the "
            "library's own files) or 'sharded' (torch.distributed.checkpoint folders)"
        )
    return value


def unwrapped(obj: Any) -> Any:
    """The module inside a torch.compile wrapper, or the optimizer inside Accelerate's."""
    if isinstance(obj, nn.Module):
        return getattr(obj, "_orig_mod", obj)
    return getattr(obj, "optimizer", obj)


def owner(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> nn.Module:
    """The sharded model whose parameters `optimizer` updates (torch.distributed.checkpoint names
    an optimizer's state by its model's parameter names)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if params <= {id(p) for p in model.parameters()}:
            return model
    raise ZrsError(
        "a sharded checkpoint saves an optimizer with the model whose parameters it updates, and "
        "this optimizer's span several models or none that was prepared: save with "
        "state_dict_type='full', or give each model an optimizer of its own"
    )


def load_full_weights(models: list[Any], input_dir: str) -> None:
    """Accelerate's load-state hook: every sharded model is loaded as `_FullWeights`."""
    for i, model in enumerate(models):
        if is_sharded(model):
            models[i] = _FullWeights(model)


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` for zrs models; the same arguments, the same calls."""

    zrs_state_dict_type = "full"

    def __init__(self, *args: Any, state_dict_type: str = "full", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zrs_state_dict_type = check_state_dict_type(state_dict_type)
        self.register_load_state_pre_hook(load_full_weights)

    def prepare_model(
        self,
        model: nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> nn.Module:
        if is_sharded(model):
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return super().prepare_model(model, device_placement, evaluation_mode)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        inner = self.unwrap_model(model)
        if is_sharded(inner):
            return _own_tensors(full_state_dict(inner, rank0_only=True, cpu_offload=True))
        return super().get_state_dict(model, unwrap)

    def save_state(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> str:
        if self.zrs_state_dict_type == "sharded":
            with self._sharded_aside(checkpoint.save, "register_save_state_pre_hook"):
                return super().save_state(output_dir, *args, **kwargs)
        with self._optimizer_hooks("register_state_dict_post_hook", optimizer_state.gather):
            return super().save_state(output_dir, *args, **kwargs)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        if self.zrs_state_dict_type == "sharded":
            with self._sharded_aside(checkpoint.load, "register_load_state_pre_hook"):
                return super().load_state(input_dir, **kwargs)
        with self._optimizer_hooks("register_load_state_dict_pre_hook", optimizer_state.scatter):
            return super().load_state(input_dir, **kwargs)

    @contextlib.contextmanager
    def _sharded_aside(self, save_or_load: Callable[..., Any], register: str) -> Iterator[None]:
        """While the block runs, Accelerate sees neither the sharded models nor the optimizers
        over their parameters; a state hook, which every rank runs with the state's directory,
        saves or loads those as checkpoint folders (`save_or_load` is `checkpoint.save` or
        `checkpoint.load`)."""
        models = {i: unwrapped(m) for i, m in enumerate(self._models) if is_sharded(m)}
        optimizers = {
            i: unwrapped(o) for i, o in enumerate(self._optimizers) if sharded_params(unwrapped(o))
        }
        pairs = {i: owner(o, list(models.values())) for i, o in optimizers.items()}

        def hook(_models: list, *rest: Any) -> None:
            folder = rest[-1]  # save hooks get (models, weights, dir), load hooks (models, dir)
            for i, model in models.items():
                save_or_load(os.path.join(folder, f"zrs_model_{i}"), model)
            for i, optimizer in optimizers.items():
                path = os.path.join(folder, f"zrs_optimizer_{i}")
                save_or_load(path, pairs[i], optimizer, weights=False)

        kept = self._models, self._optimizers
        self._models = [m for i, m in enumerate(kept[0]) if i not in models]
        self._optimizers = [o for i, o in enumerate(kept[1]) if i not in optimizers]
        handle = getattr(self, register)(hook)
        try:
            yield
        finally:
            handle.remove()
            self._models, self._optimizers = kept

    @contextlib.contextmanager
    def _optimizer_hooks(
        self, register: str, convert: Callable[[torch.optim.Optimizer, dict], dict]
    ) -> Iterator[None]:
        """`convert` on the state dicts of the prepared optimizers while the block runs."""
        handles = []
        for prepared in self._optimizers:
            inner = getattr(prepared, "optimizer", prepared)
            handles.append(getattr(inner, register)(convert))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
