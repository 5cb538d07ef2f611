"""Workarounds for torch 2.11 internals that cost zrs's compile, each scoped to zrs's own compile.

Repeated blocks compile as nested regions (`invoke_subgraph`, docs/compiled-path.md). AOTAutograd
asks the region op for its schema at every call of every layer, in functionalization and again in
autograd, and torch builds that schema by tracing the whole block body anew
(`InvokeSubgraphHOP.gen_schema`). On GPT-2 XL (48 layers) that was 240 block traces per graph:
most of AOTAutograd's joint tracing, a large part of the first step (BENCHMARKS.md). Within one
compile, calls of one body with operands of one kind have one schema: it is built once.

AOTAutograd traces a body's backward once per kind of incoming gradient, keyed by the gradients'
metadata, where a symbolic size is compared as written: the last layer's gradient (storage
64*s0*s1, from the head) and every other layer's (64*s1*(s0 - 1) + 64*s1, the same number) were
two kinds, and the body's backward was traced and compiled twice. The key compares sizes by
value.

Inductor lowers an op it has no lowering for through an implicit fallback, registered the first
time it meets the op, and that first meeting formats every argument for a log line whether or not
the log is on: the whole IR of each input buffer, for an op such as `release_params` that takes a
layer's worth of tensors. At 12 layers that was about a quarter of the outer graphs' lowering on
the CPU. zrs registers the same fallback up front.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import sympy
import torch
from torch._guards import InvokeSubgraphCache
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
from torch._higher_order_ops.utils import FunctionalizeCtxWrapper
from torch._subclasses._fake_tensor_utils import _PySymInputStub


def register_inductor_fallbacks(ops: Iterable[torch._ops.OpOverload]) -> None:
    """Give each op the fallback inductor's implicit path would give it (the same layout
    constraint), before inductor meets it."""
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    for op in ops:
        if op not in lowerings:
            tag = get_layout_constraint_tag(op, with_default=True)
            make_fallback(op, layout_constraint=tag_to_layout_constraint(tag))


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


def _by_value(tangent_metadata: tuple) -> tuple:
    """The key with each symbolic size in one canonical form (expanded)."""
    return tuple(
        ("size", sympy.expand(m.value.node.expr))
        if isinstance(m, _PySymInputStub) and isinstance(m.value, torch.SymInt)
        else m
        for m in tangent_metadata
    )


@contextlib.contextmanager
def region_backwards_keyed_by_value() -> Iterator[None]:
    """While active, a body's backwards are looked up by the gradients' sizes' values."""
    get, add = InvokeSubgraphCache.get_lazy_bwd_entry, InvokeSubgraphCache.add_lazy_bwd_entry

    def get_by_value(self, identifier, tangent_metadata):
        return get(self, identifier, _by_value(tangent_metadata))

    def add_by_value(self, identifier, tangent_metadata, gmod):
        return add(self, identifier, _by_value(tangent_metadata), gmod)

    InvokeSubgraphCache.get_lazy_bwd_entry = get_by_value  # type: ignore[method-assign]
    InvokeSubgraphCache.add_lazy_bwd_entry = add_by_value  # type: ignore[method-assign]
    try:
        yield
    finally:
        InvokeSubgraphCache.get_lazy_bwd_entry = get  # type: ignore[method-assign]
        InvokeSubgraphCache.add_lazy_bwd_entry = add  # type: ignore[method-assign]
