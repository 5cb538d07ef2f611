"""The conventions of the libraries that models come from, on a sharded model: Hugging Face
transformers today (`hf.py`), found by duck typing, so that zrs imports no such library. The
recipe makes two calls into this layer: `adopt_conventions(model)` once the model is sharded, and
`call_scope(model, args, kwargs)` around each compiled call. An integration imports nothing of
zrs above `_core` (docs/architecture.md)."""

from __future__ import annotations

from torch import nn

from zrs.integrations import hf

__all__ = ["adopt_conventions", "call_scope"]


def adopt_conventions(model: nn.Module) -> None:
    """Give a sharded model the conventions of the library it comes from (no-op for others)."""
    hf.adopt_conventions(model)


# Around each compiled call of a model: what a library decides outside the graph. Hugging Face's
# alone today; a second integration's would be entered in the same `with`.
call_scope = hf.call_scope
