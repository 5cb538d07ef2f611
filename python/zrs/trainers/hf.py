"""Hugging Face's Trainer with zrs models: `Trainer`, transformers' own with its Accelerator and
its checkpoints made for a sharded model (docs/integrations.md).

- Its Accelerator is zrs's (`trainers/accelerate.py`): `prepare()` wraps the model in nothing.
- `save_model()` and the checkpoints' weights are the full weights, gathered on every rank and
  written by the main process (`save_pretrained(state_dict=...)`, as for FSDP's full state dict).
- The checkpoints' optimizer state is the full state, gathered on every rank; a resume gives each
  rank its rows of it, at any world size. The model's full weights load the same way (the model's
  own `load_state_dict` keeps each rank's rows).

`Trainer(..., state_dict_type="sharded")` writes the checkpoints' weights and optimizer state as
torch.distributed.checkpoint folders instead (`zrs_model`, `zrs_optimizer`): every rank writes its
rows and no host holds the whole model; a resume reshards them to any world size. Its
`optimizer.pt` then holds only a pointer to its folder, with no parameter groups, so that
transformers' own Trainer refuses it rather than resuming without the optimizer's state.
`save_model()` called by the user still writes the full weights, a model `from_pretrained` reads.
A checkpoint is loaded as it was written, whichever `state_dict_type` the resuming run has.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers

from zrs.checkpointing import checkpoint, full_state_dict, optimizer_state
from zrs.trainers.accelerate import (
    Accelerator,
    check_state_dict_type,
    is_sharded,
    load_full_weights,
    unwrapped,
)

MODEL_DIR, OPTIMIZER_DIR = "zrs_model", "zrs_optimizer"
_POINTER = "zrs_sharded_state"  # the key of optimizer.pt's pointer to its folder


@contextlib.contextmanager
def _hook(optimizer: Any, register: str, hook: Callable[..., Any]) -> Iterator[None]:
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the optimizer
    handle = getattr(inner, register)(hook)
    try:
        yield
    finally:
        handle.remove()


class Trainer(transformers.Trainer):
    """`transformers.Trainer` for zrs models; the same arguments, the same calls, and
    `state_dict_type` ("full" or "sharded") for its checkpoints."""

    def __init__(self, *args: Any, state_dict_type: str = "full", **kwargs: Any) -> None:
        self.zrs_state_dict_type = check_state_dict_type(state_dict_type)
        super().__init__(*args, **kwargs)

    def _sharded_model(self) -> torch.nn.Module | None:
        """The model, when zrs shards it and the checkpoints are sharded."""
        model = unwrapped(self.accelerator.unwrap_model(self.model))
        return model if self.zrs_state_dict_type == "sharded" and is_sharded(model) else None

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Trainer builds accelerate's Accelerator itself, from its arguments; zrs's adds no state
        # but the load hook, so the built one becomes zrs's.
        self.accelerator.__class__ = Accelerator
        self.accelerator.register_load_state_pre_hook(load_full_weights)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        model = self._sharded_model()
        if _internal_call and model is not None and output_dir is not None:
            checkpoint.save(os.path.join(output_dir, MODEL_DIR), model)  # every rank: collective
            return
        super().save_model(output_dir, _internal_call)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        folder = os.path.join(resume_from_checkpoint, MODEL_DIR)
        if os.path.isdir(folder):
            target = unwrapped(self.accelerator.unwrap_model(model or self.model))
            checkpoint.load(folder, target)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is not None and os.path.isdir(os.path.join(best, MODEL_DIR)):
            self._load_from_checkpoint(best)
            return
        super()._load_best_model()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = self.accelerator.unwrap_model(self.model)
        if state_dict is None and is_sharded(model):
            # Every rank reaches here (save_model calls it on each): the gather is collective.
            state_dict = full_state_dict(model, rank0_only=True, cpu_offload=True)
        super()._save(output_dir, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        inner = unwrapped(self.optimizer)
        model = self._sharded_model()
        if model is not None:  # every rank reaches here: the save is collective
            checkpoint.save(os.path.join(output_dir, OPTIMIZER_DIR), model, inner, weights=False)
            saved = {"state": {}, "param_groups": [], _POINTER: OPTIMIZER_DIR}
        else:
            saved = optimizer_state.gather(inner, inner.state_dict())  # on every rank: collective
        with _hook(self.optimizer, "register_state_dict_post_hook", lambda _opt, _sd: saved):
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, resume_from: str | None) -> None:
        def load(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
            if _POINTER not in state_dict:
                return optimizer_state.scatter(optimizer, state_dict)
            assert resume_from is not None
            model = unwrapped(self.accelerator.unwrap_model(self.model))
            path = os.path.join(resume_from, state_dict[_POINTER])
            checkpoint.load(path, model, optimizer, weights=False)  # every rank: collective
            return optimizer.state_dict()  # what it loaded, loaded again

        with _hook(self.optimizer, "register_load_state_dict_pre_hook", load):
            super()._load_optimizer_and_scheduler(resume_from)


__all__ = ["Trainer"]
