"""Workarounds for torch 2.11 internals that cost zrs's compile, each scoped to zrs's own compile.

Repeated blocks compile as nested regions (`invoke_subgraph`, docs/compiled-path.md). AOTAutograd
asks the region op for its schema at every call of every layer, in functionalization and again in
autograd, and torch builds that schema by tracing the whole block body anew
(`InvokeSubgraphHOP.gen_schema`). On GPT-2 XL (48 layers) that was 240 block traces per graph:
most of AOTAutograd's joint tracing, a large part of the first step (BENCHMARKS.md). Within one
compile, calls of one body with operands of one kind have one schema: it is built once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
from torch._higher_order_ops.utils import FunctionalizeCtxWrapper


def _operand_key(o: Any) -> tuple:
    if isinstance(o, torch.Tensor):
        return (type(o), o.dtype, tuple(str(s) for s in o.shape), o.requires_grad)
    if isinstance(o, int):
        return (int, o)
    return (type(o),)


@contextlib.contextmanager
def region_schemas_built_once() -> Iterator[None]:
    """While active, each (region body, identifier, operand kinds) builds its schema once."""
    original = InvokeSubgraphHOP.gen_schema
    built: dict[tuple, tuple[Any, Any]] = {}

    def gen_schema(self, subgraph, identifier, *operands):
        body = subgraph.subgraph if isinstance(subgraph, FunctionalizeCtxWrapper) else subgraph
        if not isinstance(body, torch.fx.GraphModule):
            return original(self, subgraph, identifier, *operands)
        key = (id(body), type(subgraph), identifier, *map(_operand_key, operands))
        hit = built.get(key)
        if hit is None:
            # The body is held with its schema, so that its id is not reused meanwhile.
            hit = built[key] = (body, original(self, subgraph, identifier, *operands))
        return hit[1]

    InvokeSubgraphHOP.gen_schema = gen_schema  # type: ignore[method-assign]
    try:
        yield
    finally:
        InvokeSubgraphHOP.gen_schema = original  # type: ignore[method-assign]
