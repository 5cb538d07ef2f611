"""The conventions of the libraries that models come from, on a sharded model: Hugging Face
transformers and PEFT today (`hf.py`), found by duck typing, so that zrs imports no such
library. The recipe makes these calls into this layer: `adopt_conventions(model, full_state, rank)`
once the model is sharded, `call_scope(model, args, kwargs)` around each compiled call, and
`no_cache_in_training(model)` once zrs.shard compiled its layers. An
integration imports nothing of zrs above `_core`: what else it needs the recipe hands it
(docs/architecture.md)."""

from __future__ import annotations

from torch import nn

from zrs.integrations import hf

__all__ = ["adopt_conventions", "call_scope", "no_cache_in_training"]


def adopt_conventions(model: nn.Module, full_state: hf.FullState, rank: int) -> None:
    """Give a sharded model the conventions of the library it comes from (no-op for others).
    `full_state`: zrs.full_state_dict bound to `model` (a save gathers through it); `rank`:
    the model's rank in its group."""
    hf.adopt_conventions(model, full_state, rank)


# zrs.shard(compile=...): a training forward builds no KV cache, which would recompile each
# compiled layer (Hugging Face's alone today).
no_cache_in_training = hf.no_cache_in_training

# Around each compiled call of a model: what a library decides outside the graph. Hugging Face's
# alone today; a second integration's would be entered in the same `with`.
call_scope = hf.call_scope
