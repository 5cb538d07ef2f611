"""Hugging Face conventions on a sharded model (`transformers.PreTrainedModel`, found by duck typing:
zrs does not import transformers).

A sharded parameter is this rank's flat shard, so the model's own `num_parameters()` counts shards
and `save_pretrained()` writes them. On the sharded instance:

* `num_parameters(only_trainable=False, exclude_embeddings=False)` counts the full parameters;
* `save_pretrained(dir, ...)` needs the full tensors: `state_dict=zrs.full_state_dict(model)` (a
  collective, on every rank), else ZrsError. `from_pretrained` is a class method that builds a new,
  unsharded model: load before zrs.compile, as with any model.

The loss function is resolved once, before the model is compiled. Transformers' `loss_function`
property logs a warning (once per process) when the config names no loss type, and dynamo breaks
the graph at any logging call: the compile traced the whole forward, failed at the loss, and
traced it again up to there (20 s of GPT-2 XL's first step on an H200). The property reads
`_loss_function` first when it is set, so the model keeps its own choice of loss.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from zrs import runtime
from zrs._core import ZrsError


def _num_parameters(
    model: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False
) -> int:
    counted: set[int] = set()
    total = 0
    for module in model.modules():
        if exclude_embeddings and isinstance(module, nn.Embedding):
            counted.update(ds_id for ds_id, _, _ in getattr(module, "_zrs_params", {}).values())
            continue
        for ds_id, _, _ in getattr(module, "_zrs_params", {}).values():
            h = runtime.handle(ds_id)
            if ds_id in counted or (only_trainable and not h.shard.requires_grad):
                continue
            counted.add(ds_id)
            total += h.numel
    return total


def _save_pretrained(save: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("state_dict") is None:
        raise ZrsError(
            "save_pretrained() on a zrs model would write each rank's flat parameter shards. "
            "Gather the full tensors first (a collective: call it on every rank) and save them "
            "from one rank: state = zrs.full_state_dict(model); then on rank 0 "
            "model.save_pretrained(directory, state_dict=state)"
        )
    return save(save_directory, *args, **kwargs)


def adopt_conventions(model: nn.Module) -> None:
    """Give a sharded Hugging Face model's instance the methods above (no-op for other models)."""
    if callable(getattr(model, "num_parameters", None)):
        model.num_parameters = functools.partial(_num_parameters, model)
    save = getattr(model, "save_pretrained", None)
    if callable(save):
        model.save_pretrained = functools.partial(_save_pretrained, save)
    if isinstance(getattr(type(model), "loss_function", None), property):
        model._loss_function = model.loss_function
