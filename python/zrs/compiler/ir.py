"""The planner IR of a lowered FX graph (``docs/planner.md``): one IR node per FX node, in the
graph's order, but for the unread symbolic inputs that only some ranks have
(``_fx.rank_local_inputs``).

* ``allgather_param`` -> ``allgather`` (``bytes``: the gathered tensor, numel x itemsize;
  ``dtype``: the gathered dtype, which the planner fuses only with its like);
  ``wait_allgather`` -> ``wait``; ``release_param`` -> ``release``; ``reduce_grad`` ->
  ``reduce_scatter`` (``bytes``: the full gradient in the reduce dtype; with offload,
  ``host_bytes``: this rank's shard copied to the host; hybrid, ``replicate_bytes``: that shard
  all-reduced across replicas); ``prefetch_params_fused``, ``end_backward``, placeholders, the
  output, ``getitem`` and views -> ``other`` (no time); every other node -> ``compute``.
* **Durations** (``estimate_us``) are analytic: ``floor + max(flops / FLOPS, bytes / BW)``,
  FLOPs for mm / addmm / bmm / baddbmm / convolution(+backward) / scaled-dot-product attention
  (+backward) from the meta shapes, bytes = inputs + outputs, rates per device type in
  ``DEVICE_RATES``. A measured profile (``compiler.profile``) replaces them. Collectives get no
  duration: the planner's cost model times them.
* **Memory**: a node that produces a new tensor allocates its output bytes; the bytes are freed
  at the last user (in the graph's order before planning) of the output and of every view of it,
  never if the output node uses it (returned or saved for backward). Views, ``getitem``, ops
  whose output aliases an input and placeholders allocate nothing. A backward graph's inputs are
  live at its start (``base_bytes``) and freed at their last readers.
* **Deps**: the FX data deps, plus ordering deps so the planner cannot reorder illegally: a
  release after every use of its gathered tensor (through views, and every ``getitem`` of a
  tuple-returning use); one parameter's gathers, waits and releases in their order;
  ``reduce_grad`` after the previous ``reduce_grad``; every other impure node (end_backward,
  in-place ops, random ops) after the previous one; ``end_backward`` after every ``reduce_grad``;
  an in-place op after the earlier readers of what it mutates, and later readers after it. Only
  edges that point backwards in the original order are added, so the IR stays acyclic and the
  original order is always a valid plan.

Symbolic sizes count at their hint, the largest over the ranks (``profile.size_hints``), so every
rank builds the same IR.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from zrs.compiler._fx import (
    alias_closure,
    is_op,
    is_view,
    rank_local_inputs,
    region_body,
    tensors_in,
    val,
)
from zrs.compiler.profile import SYMBOLIC_DIM, SizeHints, concrete

# Analytic compute rates per device type: (FLOP/s, bytes/s, floor in microseconds). CUDA is an
# H100/H200-class GPU in bf16 (the planner's synthetic graphs use the same figures); CPU is a
# couple of cores in fp32. They only need to rank nodes sensibly against each other and against
# the collectives; a measured profile replaces them.
DEVICE_RATES: dict[str, tuple[float, float, float]] = {
    "cuda": (700e12, 3e12, 3.0),
    "cpu": (50e9, 10e9, 2.0),
}
# Collectives on CPU (gloo over loopback / TCP): a rough latency + bandwidth model.
_FREE_OPS = (operator.getitem,)
_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}
_ADD_MATMULS = {torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}

# --- sizes -------------------------------------------------------------------------------------


def _dim(d: Any, hints: SizeHints | None = None) -> int:
    return concrete(d, hints) if hints else d if isinstance(d, int) else SYMBOLIC_DIM


def _numel(t: torch.Tensor, hints: SizeHints | None = None) -> int:
    return math.prod(_dim(d, hints) for d in t.shape)


def nbytes(t: Any, hints: SizeHints | None = None) -> int:
    """Bytes of tensor `t` (symbolic sizes at their hint); 0 for anything else."""
    return _numel(t, hints) * t.dtype.itemsize if isinstance(t, torch.Tensor) else 0


# --- durations ---------------------------------------------------------------------------------


def _shape_of(n: Any, hints: SizeHints | None) -> list[int]:
    t = val(n) if isinstance(n, fx.Node) else None
    return [_dim(d, hints) for d in t.shape] if isinstance(t, torch.Tensor) else []


def _attention_flops(q: list[int], k: list[int], v: list[int]) -> float:
    if len(q) < 2 or len(k) < 2 or len(v) < 1:
        return 0.0
    batch = math.prod(q[:-2])
    return 2.0 * batch * q[-2] * k[-2] * (q[-1] + v[-1])


def flops(node: fx.Node, hints: SizeHints | None = None) -> float:
    """Floating-point operations of the big ops (0 for the rest); a region's are its body's."""
    body = region_body(node)
    if body is not None:
        return sum(flops(n, hints) for n in body.graph.nodes)
    target, args = node.target, node.args

    if target in _MATMULS:
        a, b = (args[1], args[2]) if target in _ADD_MATMULS else (args[0], args[1])
        sa, sb = _shape_of(a, hints), _shape_of(b, hints)
        if len(sa) < 2 or len(sb) < 2:
            return 0.0
        return 2.0 * math.prod(sa) * sb[-1]  # [.., m, k] @ [.., k, n]
    name = str(target)
    if target is torch.ops.aten.convolution.default:
        w, out = _shape_of(args[1], hints), _shape_of(node, hints)
        if len(w) < 3 or not out:
            return 0.0
        transposed = bool(args[6]) if len(args) > 6 else False
        work = math.prod(_shape_of(args[0], hints)) if transposed else math.prod(out)
        return 2.0 * work * w[1] * math.prod(w[2:])
    if target is torch.ops.aten.convolution_backward.default:
        grad_out, w = _shape_of(args[0], hints), _shape_of(args[2], hints)
        if len(w) < 3 or not grad_out:
            return 0.0
        return 2.0 * 2.0 * math.prod(grad_out) * w[1] * math.prod(w[2:])
    if "attention" in name and ("scaled_dot_product" in name or "efficient" in name):
        if "backward" in name:  # (grad_out, query, key, value, ...): about 2.5x the forward
            return 2.5 * _attention_flops(
                _shape_of(args[1], hints), _shape_of(args[2], hints), _shape_of(args[3], hints)
            )
        return _attention_flops(
            _shape_of(args[0], hints), _shape_of(args[1], hints), _shape_of(args[2], hints)
        )
    return 0.0


def estimate_us(node: fx.Node, device_type: str, hints: SizeHints | None = None) -> float:
    """Analytic device time of one compute node: floor + max(flops / FLOPS, bytes / BW); a
    region's is the sum over its body's compute nodes."""
    body = region_body(node)
    if body is not None:
        inner = [n for n in body.graph.nodes if _kind(n) == "compute"]
        return sum(estimate_us(n, device_type, hints) for n in inner)
    rate, bandwidth, floor = DEVICE_RATES.get(device_type, DEVICE_RATES["cuda"])
    moved = sum(nbytes(val(a), hints) for a in node.all_input_nodes)
    moved += sum(nbytes(t, hints) for t in tensors_in(val(node)))
    return floor + max(flops(node, hints) / rate, moved / bandwidth) * 1e6


# --- the IR ------------------------------------------------------------------------------------


def _aliases_input(node: fx.Node) -> bool:
    """The node's output is (a view of) one of its inputs: it allocates nothing."""
    if node.op != "call_function":
        return True
    if node.target in _FREE_OPS or is_view(node):
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _mutated(node: fx.Node) -> list[fx.Node]:
    """Inputs that `node` writes in place (`Tensor(a!)` arguments)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out: list[fx.Node] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        items = value if isinstance(value, (list, tuple)) else [value]
        out += [v for v in items if isinstance(v, fx.Node)]
    return out


def _kind(node: fx.Node) -> str:
    if node.op != "call_function":
        return "other"
    for op, kind in (
        ("allgather_param", "allgather"),
        ("wait_allgather", "wait"),
        ("release_param", "release"),
        ("reduce_grad", "reduce_scatter"),
        ("prefetch_params_fused", "other"),
        ("end_backward", "other"),
    ):
        if is_op(node, op):
            return kind
    if node.target in _FREE_OPS or is_view(node):
        return "other"
    return "compute"


def _release_uses(rel: fx.Node, wait: fx.Node) -> set[fx.Node]:
    """Every node that reads the gathered tensor behind `rel`: users of the wait and its views,
    and the getitems of tuple-returning users."""
    closure = alias_closure(wait)
    uses = {u for c in closure for u in c.users} | set(closure[1:])
    for u in list(uses):
        if isinstance(val(u), (tuple, list)):
            uses |= {g for g in u.users if g.target is operator.getitem}
    uses.discard(rel)
    return {u for u in uses if not is_op(u, "release_param")}


# zrs's own ops are ordered by their own rules below, not by the chain of impure nodes: chaining
# a gather after the previous parameter's release would forbid every prefetch.
_PARAM_OPS = ("allgather_param", "wait_allgather", "release_param")


def _ordering_deps(nodes: list[fx.Node], index: dict[fx.Node, int], deps: list[set[int]]) -> None:
    def add(after: fx.Node, before: fx.Node) -> None:
        i, j = index[after], index[before]
        if j < i:  # only backwards edges: the original order stays a valid plan, no cycles
            deps[i].add(j)

    last_wait: dict[int, fx.Node] = {}
    last_param_op: dict[int, fx.Node] = {}  # ds_id -> its previous gather / wait / release
    prev_impure: fx.Node | None = None
    prev_reduce: fx.Node | None = None
    reduces: list[fx.Node] = []
    for n in nodes:
        if any(is_op(n, op) for op in _PARAM_OPS):
            ds_id = n.args[2]
            if ds_id in last_param_op:  # one parameter's gather, wait, release stay in order
                add(n, last_param_op[ds_id])
            last_param_op[ds_id] = n
            if is_op(n, "wait_allgather"):
                last_wait[ds_id] = n
            elif is_op(n, "release_param") and ds_id in last_wait:
                for u in _release_uses(n, last_wait[ds_id]):
                    add(n, u)
            continue
        if n.op != "call_function" or not n.is_impure() or is_op(n, "prefetch_params_fused"):
            continue
        if is_op(n, "reduce_grad"):  # the buckets fill in the graph's order of gradients
            if prev_reduce is not None:
                add(n, prev_reduce)
            prev_reduce = n
            reduces.append(n)
            continue
        if prev_impure is not None:
            add(n, prev_impure)
        prev_impure = n
        if is_op(n, "end_backward"):
            for r in reduces:
                add(n, r)
        for m in _mutated(n):
            for c in alias_closure(m):
                for u in c.users:
                    if u is not n:
                        add(n, u)  # earlier readers first
                        add(u, n)  # later readers after the write


def _last_reader(holders: list[fx.Node], index: dict[fx.Node, int], default: fx.Node):
    """The last node that reads any of `holders` through views; None if the value is returned
    (it outlives the graph)."""
    users: set[fx.Node] = set()
    for h in holders:
        closure = alias_closure(h)
        users |= {u for c in closure for u in c.users} - set(closure)
    users = {u for u in users if not is_op(u, "release_param")}
    if any(u.op == "output" for u in users):
        return None
    return max(users, key=index.__getitem__, default=default)


def _consumed_inputs(
    nodes: list[fx.Node], index: dict[fx.Node, int], free: list[int], hints: SizeHints
) -> int:
    """Bytes of the backward graph's inputs that it frees as it goes, added to `free` at each
    input's last reader; returns their total (live when the graph starts).

    The compiled backward owns its saved activations and incoming gradients: AOTAutograd clears
    the saved tensors and inductor drops each input after its last use. Without them the planner
    sees an empty device at the start of the backward, where the activations peak, and prefetches
    every layer there for free. Parameter shards (read by all-gathers) live on in the module."""
    live = 0
    for n in nodes:
        if n.op != "placeholder" or not isinstance(val(n), torch.Tensor):
            continue
        if any(is_op(u, "allgather_param") for u in n.users):
            continue
        last = _last_reader([n], index, default=n)
        size = nbytes(val(n), hints)
        if last is None or size == 0:
            continue
        live += size
        free[index[last]] += size
    return live


def _memory(
    nodes: list[fx.Node], index: dict[fx.Node, int], hints: SizeHints
) -> tuple[list[int], list[int]]:
    alloc, free = [0] * len(nodes), [0] * len(nodes)
    for i, n in enumerate(nodes):
        if _kind(n) != "compute" or _aliases_input(n):
            continue
        v = val(n)
        if isinstance(v, torch.Tensor):
            parts = [(v, [n])]
        elif isinstance(v, (tuple, list)):
            getitems = [u for u in n.users if u.target is operator.getitem]
            parts = [
                (t, [g for g in getitems if g.args[1] == k])
                for k, t in enumerate(v)
                if isinstance(t, torch.Tensor)
            ]
        else:
            continue
        for t, holders in parts:
            size = nbytes(t, hints)
            if size == 0:
                continue
            alloc[i] += size
            last = _last_reader(holders, index, default=n)
            if last is not None:  # else returned or saved for backward: outlives the graph
                free[index[last]] += size
    return alloc, free


def build_ir(
    graph: fx.Graph,
    *,
    device_type: str = "cpu",
    world: int = 1,
    durations: Mapping[str, float] | None = None,
    is_backward: bool = False,
    reduce_dtype: torch.dtype | None = None,
    hints: SizeHints | None = None,
    host_copies: bool = False,
    staged: bool = False,
    replicas: int = 1,
) -> tuple[dict[str, Any], list[fx.Node]]:
    """The planner IR of a lowered graph, and the FX node behind each IR index.

    ``durations`` (node name -> microseconds) overrides the analytic estimate: the hook for a
    measured profile. A backward graph's inputs are live at its start (``base_bytes``) and
    freed at their last readers. ``hints`` size the symbolic dimensions (``profile.size_hints``,
    the same on every rank); without them each counts as ``SYMBOLIC_DIM``. ``host_copies``
    (offload): each reduce-scatter's shard of the gradient then goes to the host as an fp32
    master's gradient (``host_bytes``). ``staged`` (offload="params"): each all-gather first
    copies its shard in from the host (``host_bytes``), held from the gather to its wait.
    ``replicas`` (hybrid sharding): each reduce-scatter's shard is then all-reduced across them
    (``replicate_bytes``).
    """
    hints = hints or {}
    local = rank_local_inputs(graph)  # unread inputs some ranks lack: every rank's IR alike
    nodes = [n for n in graph.nodes if n not in local]
    index = {n: i for i, n in enumerate(nodes)}
    deps = [{index[a] for a in n.all_input_nodes if a in index} for n in nodes]
    _ordering_deps(nodes, index, deps)
    alloc, free = _memory(nodes, index, hints)
    base = _consumed_inputs(nodes, index, free, hints) if is_backward else 0
    specs = []
    staging: dict[int, int] = {}  # ds_id -> the bytes its gather staged, freed at its wait
    for i, n in enumerate(nodes):
        kind = _kind(n)
        spec: dict[str, Any] = {"name": n.name, "kind": kind, "deps": sorted(deps[i])}
        if kind in ("allgather", "wait", "release", "reduce_scatter"):
            spec["ds_id"] = int(n.args[2])
        if kind == "allgather":
            spec["bytes"] = nbytes(val(n), hints)
            if isinstance(val(n), torch.Tensor):  # the planner fuses only gathers of one dtype
                spec["dtype"] = str(val(n).dtype)
            if staged and spec["bytes"]:
                shard = -(-spec["bytes"] // max(world, 1))
                spec["host_bytes"] = staging[spec["ds_id"]] = shard
                alloc[i] += shard
        elif kind == "wait" and spec["ds_id"] in staging:
            free[i] += staging.pop(spec["ds_id"])
        elif kind == "reduce_scatter":
            grad = val(n.args[0])
            numel = _numel(grad, hints) if isinstance(grad, torch.Tensor) else 0
            spec["bytes"] = numel * (reduce_dtype or grad.dtype).itemsize if numel else 0
            if host_copies and numel:
                spec["host_bytes"] = -(-numel // max(world, 1)) * 4  # this rank's fp32 rows
            if replicas > 1 and numel:
                itemsize = (reduce_dtype or grad.dtype).itemsize
                spec["replicate_bytes"] = -(-numel // max(world, 1)) * itemsize
        elif kind == "compute":
            us = durations.get(n.name) if durations is not None else None
            spec["duration_us"] = (
                float(us) if us is not None else estimate_us(n, device_type, hints)
            )
        if alloc[i]:
            spec["alloc_bytes"] = alloc[i]
        if free[i]:
            spec["free_bytes"] = free[i]
        specs.append(spec)
    return {"nodes": specs, "budget_bytes": None, "base_bytes": base, "world": max(world, 1)}, nodes
