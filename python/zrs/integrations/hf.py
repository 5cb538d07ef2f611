"""Hugging Face conventions on a sharded model (`transformers.PreTrainedModel`, found by duck
typing: zrs does not import transformers).

A sharded parameter is a DTensor over the full shape, so `num_parameters()` counts full
parameters as it is. `save_pretrained(dir)` on the sharded instance is a collective, as
Accelerate's idiom has it (every rank calls it, `is_main_process` says who writes; zrs's default
is rank 0): every rank gathers the full tensors (`full_state`, zrs.full_state_dict bound to the
model: the ranks meet first, so a call on rank 0 alone raises ZrsError rather than waiting in a
gather) and the writer saves them. On a PEFT model (`peft.PeftModel`, found by duck typing too)
only the adapter's entries are gathered: PEFT itself says which, asked with the model's own
state dict, whose tensors it passes on by identity. With `state_dict=` given, the call is the
library's own. Another library's `save_pretrained` (one that takes no `state_dict` parameter,
and so may write the model's own, sharded, state dict whatever it is given) raises ZrsError
with the recipe, unless a state dict is passed. `from_pretrained` is a class method that builds a new, unsharded model: load
before zrs.compile, as with any model.

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
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from zrs._core import ZrsError

# zrs.full_state_dict bound to the model: keyword arguments rank0_only, cpu_offload, keys.
FullState = Callable[..., dict[str, torch.Tensor]]


def _save_pretrained(
    save: Any, model: nn.Module, full_state: FullState, rank: int, *args: Any, **kwargs: Any
) -> Any:
    """The library's save_pretrained, given the gathered tensors (see the module's docstring)."""
    signature = inspect.signature(save)
    bound = signature.bind(*args, **kwargs)
    arguments = bound.arguments
    if "state_dict" in signature.parameters:  # transformers'
        given = arguments
    elif _is_peft(model):  # PEFT takes it through **kwargs
        rest = next(n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD)
        given = arguments.setdefault(rest, {})
    elif kwargs.get("state_dict") is None:  # another library's: it may write its own state dict
        raise ZrsError(
            "save_pretrained() of this library on a zrs model needs the full tensors: state = "
            "zrs.full_state_dict(model, rank0_only=True, cpu_offload=True) on every rank, then "
            "on rank 0 save them with the library's own writer"
        )
    else:
        return save(*args, **kwargs)
    if given.get("state_dict") is None:
        writer = arguments.get("is_main_process", rank == 0)
        keys = _adapter_keys(model, arguments) if _is_peft(model) else None
        given["state_dict"] = full_state(rank0_only=not writer, cpu_offload=True, keys=keys)
        arguments["is_main_process"] = writer
    return save(*bound.args, **bound.kwargs)


def _is_peft(model: nn.Module) -> bool:
    return (
        "peft" in sys.modules and hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    )


def _adapter_keys(model: nn.Module, arguments: dict[str, Any]) -> list[str]:
    """The entries of `model.state_dict()` that PEFT saves for the adapters being saved, asked
    of PEFT with the local state dict: it passes the tensors it keeps on as they are. A value it
    computes instead (no entry of ours) makes every entry needed."""
    adapter_state = importlib.import_module("peft.utils.save_and_load").get_peft_model_state_dict
    local = model.state_dict()
    key_of = {id(value): key for key, value in local.items()}
    keys: set[str] = set()
    for name in arguments.get("selected_adapters") or list(model.peft_config):
        chosen = adapter_state(
            model,
            state_dict=local,
            adapter_name=name,
            save_embedding_layers=arguments.get("save_embedding_layers", "auto"),
        )
        for value in chosen.values():
            if id(value) not in key_of:
                return sorted(local)
            keys.add(key_of[id(value)])
    return sorted(keys)


def adopt_conventions(model: nn.Module, full_state: FullState, rank: int) -> None:
    """Give a sharded Hugging Face model's instance the methods above (no-op for other
    models). `full_state`: zrs.full_state_dict bound to `model`; `rank`: the model's rank."""
    save = getattr(model, "save_pretrained", None)
    if callable(save):
        model.save_pretrained = functools.partial(_save_pretrained, save, model, full_state, rank)
    if isinstance(getattr(type(model), "loss_function", None), property):
        model._loss_function = model.loss_function
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None and hasattr(model, "config"):
        _patch_masking(masking)
        model._zrs_hf_masks = True


def no_cache_in_training(model: nn.Module) -> None:
    """Compiled layers (zrs.shard's `compile`): a training call that does not name `use_cache`
    runs with `use_cache=False`, as transformers itself does under gradient checkpointing.
    Otherwise a model whose config says `use_cache=True` builds a KV cache in every training
    forward, which nothing reads, and each layer's compiled forward guards on its own layer
    of that cache (`is_initialized`): one recompile per layer, until dynamo's recompile limit
    (8) leaves the remaining layers eager."""
    if getattr(getattr(model, "config", None), "use_cache", None) is not True:
        return
    forward = model.forward
    parameters = inspect.signature(forward).parameters
    # PEFT's models pass **kwargs on to the base model's forward, which takes use_cache
    passes_on = _is_peft(model) and any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if "use_cache" not in parameters and not passes_on:
        return

    @functools.wraps(forward)
    def without_cache(*args: Any, **kwargs: Any) -> Any:
        if "use_cache" not in kwargs and model.training and torch.is_grad_enabled():
            kwargs["use_cache"] = False
        return forward(*args, **kwargs)

    model.forward = without_cache


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
