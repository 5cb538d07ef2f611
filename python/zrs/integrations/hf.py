"""Hugging Face conventions on a sharded model (`transformers.PreTrainedModel`, found by duck
typing: zrs does not import transformers).

A sharded parameter is a DTensor over the full shape, so `num_parameters()` counts full
parameters as it is. `save_pretrained(dir, ...)` on the sharded instance needs the full tensors,
`state_dict=zrs.full_state_dict(model, rank0_only=True, cpu_offload=True)` (a collective, on every
rank; then save on rank 0), else ZrsError: it would otherwise gather each tensor on whichever
ranks call it. `from_pretrained` is a class method that builds a new, unsharded model: load before
zrs.compile, as with any model.

Attention without a materialised mask. Eager transformers calls SDPA with `is_causal=True` (or,
bidirectional, no mask at all) when nothing is padded and the positions are not packed, which
lets SDPA take its fastest kernels. Traced whole, it cannot tell, since both are questions about
tensor values, and it never skips while tracing (transformers 5.17: never under dynamo; 5.23:
only where torch says it does not export, which torch 2.11's dynamo never says). So every
compiled HF model built its mask and attended through it, slower than FSDP2, whose blocks are
compiled while the mask code runs eagerly (BENCHMARKS.md), and variable lengths compiled a second
graph for the mask's alignment. zrs knows the answer outside the graph: a call without an
attention mask, positions or cache uses the model's own positions, an arange, so nothing is
padded or packed (`call_scope`, around each compiled call). For such calls the mask helpers skip
as eager transformers would; the answer reaches the graph as a guarded global, and every other
call keeps transformers' own decision.

The loss function is resolved once, before the model is compiled. Transformers' `loss_function`
property logs a warning (once per process) when the config names no loss type, and dynamo breaks
the graph at any logging call: the compile traced the whole forward, failed at the loss, and
traced it again up to there, which lengthened the first step (BENCHMARKS.md). The property reads
`_loss_function` first when it is set, so the model keeps its own choice of loss.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zrs._core import ZrsError


def _save_pretrained(save: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("state_dict") is None:
        raise ZrsError(
            "save_pretrained() on a zrs model needs the full tensors, gathered on every rank "
            "together: state = zrs.full_state_dict(model, rank0_only=True, cpu_offload=True) on "
            "every rank, then on rank 0 model.save_pretrained(directory, state_dict=state)"
        )
    return save(save_directory, *args, **kwargs)


def adopt_conventions(model: nn.Module) -> None:
    """Give a sharded Hugging Face model's instance the methods above (no-op for other models)."""
    save = getattr(model, "save_pretrained", None)
    if callable(save):
        model.save_pretrained = functools.partial(_save_pretrained, save)
    if isinstance(getattr(type(model), "loss_function", None), property):
        model._loss_function = model.loss_function
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None and hasattr(model, "config"):
        _patch_masking(masking)
        model._zrs_hf_masks = True


class _Positions:
    """Whether the compiled call running now has the model's own positions (see above)."""

    default = False


def _local_fits(kv_length: Any, local_attention_size: int | None) -> bool:
    return local_attention_size is None or kv_length < local_attention_size


def _patch_masking(masking: Any) -> None:
    """Once per process: transformers' mask helpers answer as eagerly for zrs's mask-free calls."""
    if getattr(masking, "_zrs_patched", False):
        return
    find_packed = masking.find_packed_sequence_indices
    ignore_causal = masking._ignore_causal_mask_sdpa
    ignore_bidirectional = masking._ignore_bidirectional_mask_sdpa

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if _Positions.default:
            return None  # an arange: one sequence per row
        return find_packed(position_ids)

    def _ignore_causal_mask_sdpa(
        padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None
    ):
        if _Positions.default and padding_mask is None:
            fits = _local_fits(kv_length, local_attention_size)
            return fits and (q_length == 1 or kv_length == q_length)
        return ignore_causal(
            padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size
        )

    def _ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
        if _Positions.default and padding_mask is None:
            return _local_fits(kv_length, local_attention_size)
        return ignore_bidirectional(padding_mask, kv_length, local_attention_size)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    masking._ignore_causal_mask_sdpa = _ignore_causal_mask_sdpa
    masking._ignore_bidirectional_mask_sdpa = _ignore_bidirectional_mask_sdpa
    masking._zrs_patched = True


# Keyword arguments that can pad, pack or offset some attention of the call (an encoder-decoder's
# `decoder_attention_mask` and `decoder_position_ids` included).
_MASK_INPUTS = ("attention_mask", "position_ids", "past_key_values", "cache_position")


@contextlib.contextmanager
def call_scope(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """Around one compiled call of `model`: says whether its positions are the model's own."""
    default = (
        getattr(model, "_zrs_hf_masks", False)
        and len(args) <= 1  # input_ids only, positionally; the rest by keyword
        and not any(v is not None and k.endswith(_MASK_INPUTS) for k, v in kwargs.items())
    )
    before, _Positions.default = _Positions.default, default
    try:
        yield
    finally:
        _Positions.default = before
