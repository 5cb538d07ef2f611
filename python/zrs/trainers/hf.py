"""Hugging Face's Trainer with zrs models: `Trainer`, transformers' own with its Accelerator and
its checkpoints made for a sharded model (docs/integrations.md).

- Its Accelerator is zrs's (`trainers/accelerate.py`): `prepare()` wraps the model in nothing.
- `save_model()` and the checkpoints' weights are the full weights, gathered on every rank and
  written by the main process (`save_pretrained(state_dict=...)`, as for FSDP's full state dict).
- The checkpoints' optimizer state is the full state, gathered on every rank; a resume gives each
  rank its rows of it, at any world size. The model's full weights load the same way (the model's
  own `load_state_dict` keeps each rank's rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import transformers

from zrs.checkpointing import full_state_dict, optimizer_state
from zrs.trainers.accelerate import Accelerator, is_sharded, load_full_weights


@contextlib.contextmanager
def _hook(optimizer: Any, register: str, hook: Callable[..., Any]) -> Iterator[None]:
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the optimizer
    handle = getattr(inner, register)(hook)
    try:
        yield
    finally:
        handle.remove()


class Trainer(transformers.Trainer):
    """`transformers.Trainer` for zrs models; the same arguments, the same calls."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Trainer builds accelerate's Accelerator itself, from its arguments; zrs's adds no state
        # but the load hook, so the built one becomes zrs's.
        self.accelerator.__class__ = Accelerator
        self.accelerator.register_load_state_pre_hook(load_full_weights)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = self.accelerator.unwrap_model(self.model)
        if state_dict is None and is_sharded(model):
            # Every rank reaches here (save_model calls it on each): the gather is collective.
            state_dict = full_state_dict(model, rank0_only=True, cpu_offload=True)
        super()._save(output_dir, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        full = optimizer_state.gather(inner, inner.state_dict())  # on every rank: collective
        with _hook(self.optimizer, "register_state_dict_post_hook", lambda _opt, _sd: full):
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with _hook(self.optimizer, "register_load_state_dict_pre_hook", optimizer_state.scatter):
            super()._load_optimizer_and_scheduler(checkpoint)


__all__ = ["Trainer"]
