"""The compute profile that feeds the planner, once per lowered graph.

`profile_graph`: the device time of every compute node of a lowered graph, from running the graph
once on real tensors of its shapes with the zrs collectives stubbed out (a gather becomes an
uninitialised buffer, nothing is communicated). Integer inputs are zeros, so embeddings and
index ops stay in range; a node that cannot run on such data keeps the analytic estimate.
Constants the graph holds (`get_attr`) run as copies, so in-place ops cannot touch them;
symbolic sizes run at their hints (`size_hints`). A repeated block's body (a region call,
compiler/regions.py) runs once per kind of operands; its other layers' calls take that time
and stub outputs, so the profile's work grows with the distinct blocks, not with the layers.

The links' timed sweeps are `compiler/sweeps.py`. Timings differ a little between ranks; the
planner must see the same numbers everywhere (a different plan on one rank pairs its collectives
with other ranks' different ones): the ranks exchange their measurements and all take the
element-wise maximum (`agree_max`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.distributed as dist
from torch import fx
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from zrs.compiler._fx import INVOKE_SUBGRAPH, OPS, rank_local_inputs, val
from zrs.runtime.exchange import all_gather_bytes

_log = logging.getLogger(__name__)

_STUB_ALIAS = {OPS.wait_allgather.default, OPS.release_param.default}
_STUB_NONE = {
    OPS.prefetch_params_fused.default,
    OPS.reduce_grad.default,
    OPS.end_backward.default,
}


# --- agreeing on measurements -------------------------------------------------------------------


def agree_max(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """The element-wise maximum of every rank's `values` (the same length on every rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    rows = [json.loads(b) for b in all_gather_bytes(json.dumps(values).encode(), group)]
    return [max(col) for col in zip(*rows, strict=True)]


# --- symbolic sizes -----------------------------------------------------------------------------

# A symbolic size that has no hint (data-dependent) counts as this many elements.
SYMBOLIC_DIM = 64
# sympy symbol -> the size every rank uses for it
SizeHints = Mapping[Any, int]


def symints(value: Any) -> list[torch.SymInt]:
    """The symbolic sizes and strides in `value` (a tensor, a SymInt, or lists of them)."""
    if isinstance(value, torch.SymInt):
        return [value]
    if isinstance(value, torch.Tensor):
        return [d for d in (*value.shape, *value.stride()) if isinstance(d, torch.SymInt)]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in symints(v)]
    return []


def _input_symbols(graph: fx.Graph) -> dict[str, tuple[Any, Any]]:
    """Name -> (symbol, its shape env) of every symbol in the graph's shared inputs."""
    symbols: dict[str, tuple[Any, Any]] = {}
    local = rank_local_inputs(graph)
    for n in graph.find_nodes(op="placeholder"):
        if n in local:
            continue
        for s in symints(val(n)):
            for sym in s.node.expr.free_symbols:
                symbols.setdefault(str(sym), (sym, s.node.shape_env))
    return symbols


def recorded_hints(graph: fx.Graph, recorded: dict[str, int]) -> dict[Any, int]:
    """`size_hints` as a record kept them (by symbol name), for this graph's symbols."""
    return {sym: recorded[name] for name, (sym, _) in _input_symbols(graph).items()}


def size_hints(graph: fx.Graph, group: dist.ProcessGroup | None) -> dict[Any, int]:
    """The size of every symbol in the graph's inputs: this rank's hint, the largest over the
    ranks (an exchange, only when there are symbols; every rank has the same graph).

    Ranks that see different lengths hold different hints; the planner must size the graph
    alike everywhere, and the largest plans for the worst case."""
    symbols = _input_symbols(graph)
    if not symbols:
        return {}
    names = sorted(symbols)
    mine = []
    for name in names:
        sym, env = symbols[name]
        hint = env.backed_var_to_val.get(sym) if env is not None else None
        mine.append(float(hint) if hint is not None else float(SYMBOLIC_DIM))
    agreed = agree_max(mine, group)
    return {symbols[name][0]: int(v) for name, v in zip(names, agreed, strict=True)}


def concrete(d: Any, hints: SizeHints | None) -> int:
    """A size as an int: itself, or a symbolic one evaluated at `hints`."""
    if isinstance(d, int):
        return d
    if isinstance(d, torch.SymInt) and hints:
        expr = d.node.expr.xreplace({s: sympy.Integer(v) for s, v in hints.items()})
        if expr.is_number:
            return int(expr)
    return SYMBOLIC_DIM


# --- compute profile ----------------------------------------------------------------------------


def _real(t: Any, device: torch.device, hints: SizeHints) -> Any:
    """A real value like the fake `t`: tensors of its sizes at `hints` (random floats, zero
    integers), symbolic ints at their hints."""
    if isinstance(t, (tuple, list)):
        return type(t)(_real(x, device, hints) for x in t)
    if isinstance(t, torch.SymInt):
        return concrete(t, hints)
    if not isinstance(t, torch.Tensor):
        return t
    shape = [concrete(d, hints) for d in t.shape]
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.randn(shape, dtype=t.dtype, device=device)
    return torch.zeros(shape, dtype=t.dtype, device=device)


def _constant(graph: fx.Graph, n: fx.Node, device: torch.device, hints: SizeHints) -> Any:
    """A copy of the constant a `get_attr` node reads (an in-place op may write to it)."""
    value: Any = graph.owning_module
    for part in str(n.target).split("."):
        value = getattr(value, part, None)
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        return value.detach().clone()
    return _real(val(n) if value is None or isinstance(value, FakeTensor) else value, device, hints)


class _Timer:
    """Device time of a region: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, Any, Any]] = []
        self.times: dict[str, float] = {}
        self.copies: dict[str, str] = {}  # name -> the name whose time it takes

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, name: str, begin: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((name, begin, end))
        else:
            self.times[name] = (time.perf_counter() - begin) * 1e6

    def same_as(self, name: str, timed: str) -> None:
        self.copies[name] = timed

    def result(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            for name, begin, end in self.pending:
                self.times[name] = begin.elapsed_time(end) * 1e3
        for name, timed in self.copies.items():
            if timed in self.times:
                self.times[name] = self.times[timed]
        return self.times


def _region_call_key(n: fx.Node, hints: SizeHints) -> tuple | None:
    """What a region call's time depends on: its body and its operands' kinds at `hints`."""
    if n.target is not INVOKE_SUBGRAPH or not isinstance(n.args[0], fx.Node):
        return None
    kinds = []
    for a in n.args[2:]:
        v = val(a) if isinstance(a, fx.Node) else a
        if isinstance(v, torch.Tensor):
            kinds.append((v.dtype, tuple(concrete(d, hints) for d in v.shape)))
        elif isinstance(v, torch.SymInt):
            kinds.append((int, concrete(v, hints)))  # a size: its value at `hints`
        else:
            kinds.append((type(v), v if isinstance(v, (int, float, bool)) else None))
    return (n.args[0].target, *kinds)


def _run_once(graph: fx.Graph, device: torch.device, hints: SizeHints) -> dict[str, float]:
    nodes = list(graph.nodes)
    # Where each value is read last by a node that runs. The output node does not count: the
    # profile returns nothing, so a forward's saved activations go at their last use inside the
    # graph, not all together at its end (the real step keeps them; the profile has no need to).
    last_use = {}
    for i, n in enumerate(nodes):
        if n.op != "output":
            for a in n.all_input_nodes:
                last_use[a] = i
    env: dict[fx.Node, Any] = {}

    def value(a: fx.Node) -> Any:
        # An input becomes a real tensor at its first use, not all at the top (and goes at its
        # last): made all at once, a backward's copies of every saved activation were live
        # together, more than the graph itself ever holds.
        if a not in env and a.op == "placeholder":
            env[a] = _real(val(a), device, hints)
        elif a not in env and a.op == "get_attr":
            env[a] = _constant(graph, a, device, hints)
        return env[a]

    timer = _Timer(device)
    timed_regions: dict[tuple, str] = {}  # a region call's key -> the call timed for it
    for i, n in enumerate(nodes):
        if n.op == "call_function":
            region = _region_call_key(n, hints)
            if region in timed_regions:
                # Another layer of a block already timed: its time, and outputs of the shapes.
                env[n] = _real(val(n), device, hints)
                timer.same_as(n.name, timed_regions[region])
            elif n.target is OPS.allgather_param.default:
                env[n] = _real(val(n), device, hints)
            elif n.target in _STUB_ALIAS:
                env[n] = value(n.args[0])
            elif n.target in _STUB_NONE:
                env[n] = None
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), value)
                begin = timer.start()
                try:
                    env[n] = n.target(*args, **kwargs)
                except Exception:
                    env[n] = _real(val(n), device, hints)  # keeps the analytic estimate
                else:
                    timer.stop(n.name, begin)
                    if region is not None:
                        timed_regions[region] = n.name
        for a in n.all_input_nodes:
            if last_use.get(a) == i:
                env.pop(a, None)
        if n not in last_use:
            env.pop(n, None)  # read by nothing that runs
    return timer.result()


def profile_graph(
    graph: fx.Graph,
    device: torch.device,
    group: dist.ProcessGroup | None,
    hints: SizeHints | None = None,
) -> dict[str, float]:
    """Microseconds per compute node name, agreed over the ranks; symbolic sizes run at
    `hints` (`size_hints`). Runs the graph twice and keeps the second run."""
    hints = hints or {}
    with unset_fake_temporarily(), no_python_dispatcher(), torch.no_grad():
        state = torch.random.get_rng_state()
        cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        try:
            _run_once(graph, device, hints)  # warm-up: library handles, caches, allocator
            times = _run_once(graph, device, hints)
        finally:
            torch.random.set_rng_state(state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
    names = [n.name for n in graph.nodes if n.op == "call_function"]
    # -1: not timed (a stub, or it raised); the maximum keeps any rank's measurement.
    agreed = agree_max([times.get(name, -1.0) for name in names], group)
    return {name: t for name, t in zip(names, agreed, strict=True) if t >= 0}
