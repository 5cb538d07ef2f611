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

A fallback then reruns the op's fake kernel on fake copies of its inputs, in case inductor changed
their strides, to learn its outputs' layouts: each input made anew, each call dispatched through the
fake mode. That was most of the lowering of zrs's ops, which are most of the outer graphs' nodes
(the Hugging Face Llama shape: 772 of them, 6.4 s of a 105 s first step under cProfile on an
H200). zrs knows its ops' outputs without that: most are fixed by the arguments' values and
recorded in the FX graph, the others are a view of the first input.

AOTAutograd formats the joint, forward and backward graphs as text for its logs whether any log
reads them or not: 1.6 s of the same profile. zrs lets it only when one does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
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


# How inductor can know each zrs op's outputs without its fake kernel: the FX node's recorded
# value, where the outputs' layouts are fixed by the arguments' values (a gather's full parameter,
# a group's views of its new buffer, a token, nothing); or a view of the first input in the layout
# inductor gave it (what wait_allgather's and release_param's kernels return).
RECORDED_OUTPUTS = (
    "allgather_param",
    "allgather_params",
    "wait_allgathers",
    "prefetch_params_fused",
    "release_params",
    "reduce_grad",
    "reduce_grads",
    "end_backward",
)
VIEW_OF_FIRST_INPUT = ("wait_allgather", "release_param")


@contextlib.contextmanager
def fallbacks_without_fake_reruns(
    recorded: Iterable[torch._ops.OpOverload], views: Iterable[torch._ops.OpOverload]
) -> Iterator[None]:
    """While active, inductor's fallback for each op of `recorded` takes its outputs from the FX
    node's recorded value, and for each op of `views` makes its output a view of its first input,
    instead of rerunning the op's fake kernel on fake copies of every input."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    recorded, views = set(recorded), set(views)
    original = ir.FallbackKernel.__dict__.get("process_kernel")
    inherited = ir.FallbackKernel.process_kernel.__func__

    def process_kernel(cls, kernel, *args, **kwargs):
        node = V.graph.current_node
        ours = node is not None and node.target is kernel
        if not ours or not (kernel in views or (kernel in recorded and "val" in node.meta)):
            return inherited(cls, kernel, *args, **kwargs)
        flat, spec = pytree.tree_flatten({"args": args, "kwargs": kwargs})
        is_tensor = [isinstance(a, ir.IRNode) for a in flat]
        tensors = [cls.realize_input(a) for a, t in zip(flat, is_tensor, strict=True) if t]
        for x in tensors:
            if ir.is_storage_and_layout(x):
                ir.as_storage_and_layout(x, freeze=True)  # as inductor does: layouts stay put
        env = V.graph.sizevars.shape_env
        others = [
            env.create_symintnode(a, hint=None) if isinstance(a, sympy.Expr) else a
            for a, t in zip(flat, is_tensor, strict=True)
            if not t
        ]

        def unflatten(new_tensors, new_others):
            tensor_it, other_it = iter(new_tensors), iter(new_others)
            merged = [next(tensor_it) if t else next(other_it) for t in is_tensor]
            bound = pytree.tree_unflatten(merged, spec)
            return bound.get("args", []), bound.get("kwargs", {})

        if kernel in views:
            first = ir.ir_node_to_tensor(tensors[0], guard_shape=True)
            outputs = first.view_as(first)
        else:
            outputs = node.meta["val"]
        return outputs, tensors, others, unflatten, None  # zrs ops make no unbacked symbols

    ir.FallbackKernel.process_kernel = classmethod(process_kernel)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if original is None:
            del ir.FallbackKernel.process_kernel
        else:
            ir.FallbackKernel.process_kernel = original  # type: ignore[method-assign]


@contextlib.contextmanager
def aot_graph_logs_only_when_read() -> Iterator[None]:
    """While active, AOTAutograd formats its graphs for its logs only when a log is on: its
    artifact loggers (TORCH_LOGS) or the structured trace (TORCH_TRACE)."""
    from torch._functorch._aot_autograd import graph_compile
    from torch._logging._internal import LazyTraceHandler, trace_log

    log_joint, log_fw_bw = graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs

    def read() -> bool:
        # torch always installs a trace handler; it writes only once it has a folder.
        traced = any(
            not isinstance(h, LazyTraceHandler) or h.root_dir is not None or h.stream is not None
            for h in trace_log.handlers
        )
        loggers = (graph_compile.aot_joint_log, graph_compile.aot_graphs_log)
        return traced or any(g.isEnabledFor(logging.INFO) for g in loggers)

    def joint(*args, **kwargs):
        return log_joint(*args, **kwargs) if read() else None

    def fw_bw(*args, **kwargs):
        return log_fw_bw(*args, **kwargs) if read() else (None, None)

    graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs = joint, fw_bw
    try:
        yield
    finally:
        graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs = log_joint, log_fw_bw


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
