"""Plan the lowered graph with the Rust planner and apply the plan to the FX graph.

Runs right after the zero3 pass (``passes.zero3``), on the lowered forward or backward graph:

1. **IR.** ``build_ir`` turns the graph into the planner's JSON IR (``docs/planner.md``), one IR
   node per FX node, same index:

   * ``allgather_param`` -> ``allgather`` (``bytes``: the gathered tensor, numel x itemsize);
     ``wait_allgather`` -> ``wait``; ``release_param`` -> ``release``; ``reduce_grad`` ->
     ``reduce_scatter`` (``bytes``: the full gradient); ``prefetch_params_fused``,
     ``end_backward``, placeholders, the output, ``getitem`` and views -> ``other`` (no time);
     every other node -> ``compute``.
   * **Durations** (``estimate_us``) are analytic: ``floor + max(flops / FLOPS, bytes / BW)``,
     FLOPs for mm / addmm / bmm / baddbmm / convolution(+backward) / scaled-dot-product attention
     (+backward) from the meta shapes, bytes = inputs + outputs. The constants per device type are
     in ``DEVICE_RATES``. Collectives get no duration: the planner's cost model times them
     (``default_cost``: the measured ``nvlink`` preset on CUDA, a rough gloo model on CPU).
   * **Memory**: a node that produces a new tensor allocates its output bytes; the bytes are
     freed at the last user (in the graph's order before planning) of the output and of every
     view of it, never if the output node uses it (returned or saved for backward). Views,
     ``getitem``, ops whose output aliases an input and placeholders allocate nothing. Gathers
     allocate and releases free by the planner's defaults.
   * **Deps**: the FX data deps, plus ordering deps so the planner cannot reorder illegally: a
     release after every use of its gathered tensor (through views, and every ``getitem`` of a
     tuple-returning use); one parameter's gathers, waits and releases in their order;
     ``reduce_grad`` after the previous ``reduce_grad``; every other impure node (end_backward,
     in-place ops, random ops) after the previous one; ``end_backward`` after every
     ``reduce_grad``; an
     in-place op after the earlier readers of what it mutates, and later readers after it. Only
     edges that point backwards in the original order are added, so the IR stays acyclic and the
     original order is always a valid plan.

2. **Plan.** ``zrs.plan.plan(ir, scheduler, budget, cost)`` returns a topological ``order`` of
   the IR and fused prefetch ``groups``.

3. **Apply.** ``apply_plan`` moves the FX nodes into the plan's order (placeholders stay first,
   the output last) and, for each group of two or more all-gathers (split by gather dtype, each
   parameter once, see ``FUSE_DOWNCAST_GATHERS``), inserts one
   ``zrs.prefetch_params_fused(graph_id, shards, ds_ids, dtypes)`` right before the group's first
   ``allgather_param``. The members' ``allgather_param`` nodes stay where the plan puts them and
   take their buffer from the prefetch; each takes the prefetch's (empty) output as its
   ``prefetched`` argument, a data edge without which inductor scheduled a prefetch after one of
   its members (the member then gathered alone and the prefetch's claim on it leaked). With
   ``backend="inductor"`` the compiler turns inductor's peak-memory reordering off: the plan's
   prefetch positions (how far ahead of their members' compute) are no data dependency, and its
   topological sorts would move them.

Rank agreement: every input of the planner comes from the graph (meta shapes, constants), the
options and the world size; symbolic sizes count at their hint, the largest over the ranks
(``profile.size_hints``), so every rank sizes them alike. Both
schedulers are deterministic (the search's local refinement is bounded by a count of simulator
runs, not by wall clock), and the rank check has already shown that the ranks lowered the same
graph, so every rank plans alone and arrives at the same order and buckets. The CUDA budget is
the minimum of the ranks' free memory, read before inductor's cache lookup.

Measured profile: with ``zrs.compile(profile=True)`` (the default) the compute durations come
from ``zrs.profile.profile_graph`` (the lowered graph run once on real tensors, collectives
stubbed, the maximum over ranks) and the collectives from a fitted sweep
(``zrs.profile.measure_collectives``, once per ``zrs.compile``); the analytic estimates above
remain for nodes that could not run and for ``profile=False``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import operator
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._guards import detect_fake_mode

from zrs import plan as zplan
from zrs._core import ZrsError
from zrs.exchange import all_gather_bytes
from zrs.passes._nodes import OPS, alias_closure, is_op, is_view, region_body, tensors_in, val
from zrs.passes.consistency import check_same_plan
from zrs.profile import SYMBOLIC_DIM, SizeHints, concrete, profile_graph, size_hints

SCHEDULERS = ("search", "greedy", "none")

# Analytic compute rates per device type: (FLOP/s, bytes/s, floor in microseconds). CUDA is an
# H100/H200-class GPU in bf16 (the planner's synthetic graphs use the same figures); CPU is a
# couple of cores in fp32. They only need to rank nodes sensibly against each other and against
# the collectives; a measured profile replaces them.
DEVICE_RATES: dict[str, tuple[float, float, float]] = {
    "cuda": (700e12, 3e12, 3.0),
    "cpu": (50e9, 10e9, 2.0),
}
# Collectives on CPU (gloo over loopback / TCP): a rough latency + bandwidth model.
CPU_GLOO_LINK = {"latency_us": 50.0, "bus_gbps": 5.0}
# Free device memory that an automatic (CUDA) budget leaves unused, and its rounding.
BUDGET_MARGIN_BYTES = 1 << 30
BUDGET_MARGIN_FRACTION = 0.1
BUDGET_ROUND_BYTES = 256 << 20
# The automatic CUDA budget is also capped at the greedy schedule's peak plus this many of the
# graph's largest all-gather: prefetching further ahead buys little (the planner's estimates are
# rough, so a far prefetch is a guess) and costs real memory (a fused gather in flight also holds
# its send block, which the planner does not count). Without the cap the search spent the free
# memory: 18.3 GiB peak on 2xH200 (1b) against FSDP2's 17.7.
PREFETCH_ALLOWANCE_GATHERS = 2
# Fuse gathers that downcast (param_dtype) into prefetch groups too; the groups are split by
# gather dtype. False keeps them single (a switch for bisecting).
FUSE_DOWNCAST_GATHERS = True

_FREE_OPS = (operator.getitem,)
_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}
_ADD_MATMULS = {torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}


@dataclass(frozen=True)
class ScheduleContext:
    """Everything the pass needs besides the graph; equal on every rank."""

    scheduler: str = "search"
    budget: int | None = None  # bytes; None: the planner's default (greedy's peak)
    budget_source: str = "none"  # where the budget came from, for error messages
    budget_is_free_memory: bool = False  # automatic (CUDA): capped by PREFETCH_ALLOWANCE_GATHERS
    world: int = 1
    device: str = "cpu"
    group: Any = None  # torch.distributed ProcessGroup, or None for one process
    rank: int = 0
    trace_dir: str | None = None
    # Cost model for the collectives: a preset name, a dict, or None for `default_cost`.
    cost: str | dict[str, Any] | None = None
    # Time the lowered graph's compute nodes once on real tensors (`zrs.profile`) on `device`.
    profile: bool = False
    # The gradients' reduce dtype: a reduce-scatter moves numel x this, whatever the dtype of the
    # gradient handed to reduce_grad (the packing casts). None: the gradient's own dtype.
    reduce_dtype: torch.dtype | None = None

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def collective_cost(self) -> str | dict[str, Any]:
        """The collectives' cost model the planner plans with: the measured (else default) one,
        made pessimistic with `planning_margin` when there is more than one rank."""
        cost = self.cost if self.cost is not None else default_cost(self.device_type, self.world)
        return planning_margin(cost, self.world)

    def key(self) -> str:
        """What the plan depends on besides the graph: part of inductor's FX cache key."""
        cost = self.collective_cost()
        cost = json.dumps(cost, sort_keys=True) if isinstance(cost, dict) else cost
        return (
            f"{self.scheduler}:{self.budget}:{self.world}:{self.device_type}:{cost}"
            f":{self.reduce_dtype}"
        )


@dataclass
class Scheduled:
    """What the pass did, for tests and the trace."""

    ir: dict[str, Any]
    plan: dict[str, Any] | None
    prefetches: list[list[int]]  # ds_ids of each inserted prefetch_params_fused
    profile_s: float = 0.0  # wall seconds spent timing the graph's compute (zrs.profile)
    plan_s: float = 0.0  # wall seconds spent building the IR, planning and applying the plan


# --- sizes -------------------------------------------------------------------------------------


def _dim(d: Any, hints: SizeHints | None = None) -> int:
    return concrete(d, hints) if hints else d if isinstance(d, int) else SYMBOLIC_DIM


def _numel(t: torch.Tensor, hints: SizeHints | None = None) -> int:
    return math.prod(_dim(d, hints) for d in t.shape)


def _bytes(t: Any, hints: SizeHints | None = None) -> int:
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
    moved = sum(_bytes(val(a), hints) for a in node.all_input_nodes)
    moved += sum(_bytes(t, hints) for t in tensors_in(val(node)))
    return floor + max(flops(node, hints) / rate, moved / bandwidth) * 1e6


def default_cost(device_type: str, world: int) -> str | dict[str, Any]:
    """The analytic cost model of the collectives when nothing was measured."""
    if device_type == "cuda":
        return "nvlink"
    return {
        "name": "cpu_gloo",
        "world": max(world, 1),
        "allgather": dict(CPU_GLOO_LINK),
        "reduce_scatter": dict(CPU_GLOO_LINK),
    }


# Pessimism of the planning model. A sweep times each collective alone; in a training step a
# gather shares the SMs and HBM with compute and waits for the slowest rank to reach it. On
# 2xH200 (1b preset), plans made with the sweep's own numbers issued most gathers just in time
# (median lead 0.2 ms of compute) and 43 of the 47 ms of NCCL time per step ran with nothing
# beside it; FSDP2's gathers in the same step moved data at ~110 GB/s, a quarter of the sweep's
# bus bandwidth. So the planner sees collectives 4x slower plus 250 us each: gathers are issued
# ~6 ms of compute ahead, fused per layer, for ~0.2 GiB more peak (benches/results/, docs).
PLAN_LATENCY_SLACK_US = 250.0
PLAN_BANDWIDTH_DERATE = 4.0


def planning_margin(cost: str | dict[str, Any], world: int) -> str | dict[str, Any]:
    """`cost` with each collective's latency raised by PLAN_LATENCY_SLACK_US and its bandwidth
    divided by PLAN_BANDWIDTH_DERATE (unchanged on one rank: nothing is communicated)."""
    if world <= 1:
        return cost
    model = copy.deepcopy(cost) if isinstance(cost, dict) else zplan.cost_model(cost, world)
    for link in ("allgather", "reduce_scatter"):
        model[link]["latency_us"] += PLAN_LATENCY_SLACK_US
        model[link]["bus_gbps"] /= PLAN_BANDWIDTH_DERATE
    model["name"] = f"{model.get('name', 'custom')}+margin"
    return model


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
        size = _bytes(val(n), hints)
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
            size = _bytes(t, hints)
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
) -> tuple[dict[str, Any], list[fx.Node]]:
    """The planner IR of a lowered graph, and the FX node behind each IR index.

    ``durations`` (node name -> microseconds) overrides the analytic estimate: the hook for a
    measured profile. A backward graph's inputs are live at its start (``base_bytes``) and
    freed at their last readers. ``hints`` size the symbolic dimensions (``profile.size_hints``,
    the same on every rank); without them each counts as ``SYMBOLIC_DIM``.
    """
    hints = hints or {}
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    deps = [{index[a] for a in n.all_input_nodes} for n in nodes]
    _ordering_deps(nodes, index, deps)
    alloc, free = _memory(nodes, index, hints)
    base = _consumed_inputs(nodes, index, free, hints) if is_backward else 0
    specs = []
    for i, n in enumerate(nodes):
        kind = _kind(n)
        spec: dict[str, Any] = {"name": n.name, "kind": kind, "deps": sorted(deps[i])}
        if kind in ("allgather", "wait", "release", "reduce_scatter"):
            spec["ds_id"] = int(n.args[2])
        if kind == "allgather":
            spec["bytes"] = _bytes(val(n), hints)
        elif kind == "reduce_scatter":
            grad = val(n.args[0])
            spec["bytes"] = (
                _numel(grad, hints) * (reduce_dtype or grad.dtype).itemsize
                if isinstance(grad, torch.Tensor)
                else 0
            )
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


# --- applying a plan ---------------------------------------------------------------------------


def _reorder(graph: fx.Graph, nodes: list[fx.Node], order: list[int]) -> None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    for i in order:
        n = nodes[i]
        if n.op in ("placeholder", "output"):
            continue
        if anchor is None:
            first = next(iter(graph.nodes))
            if first is not n:
                first.prepend(n)
        elif anchor.next is not n:
            anchor.append(n)
        anchor = n


def _downcast(ag: fx.Node) -> bool:
    shard = val(ag.args[0])
    return not isinstance(shard, torch.Tensor) or shard.dtype != val(ag).dtype


def _prefetch_groups(
    members: list[fx.Node], pos: dict[fx.Node, int]
) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Split one planner group into runtime groups: one dtype each, each parameter once, every
    shard defined before the group's first gather. Returns (first gather, members)."""
    by_dtype: dict[torch.dtype, list[fx.Node]] = {}
    seen: set[int] = set()
    for ag in sorted(members, key=pos.__getitem__):
        if ag.args[2] in seen or not isinstance(val(ag), torch.Tensor):
            continue
        if not FUSE_DOWNCAST_GATHERS and _downcast(ag):
            continue
        seen.add(ag.args[2])
        by_dtype.setdefault(val(ag).dtype, []).append(ag)
    out = []
    for group in by_dtype.values():
        first = group[0]
        group = [ag for ag in group if pos[ag.args[0]] < pos[first]]
        if len(group) >= 2:
            out.append((first, group))
    return out


def apply_plan(
    graph: fx.Graph,
    nodes: list[fx.Node],
    order: list[int],
    groups: list[list[int]],
    graph_id: int,
) -> list[list[int]]:
    """Reorder `graph` to `order` (IR indices) and insert one prefetch per fused group.

    Returns the ds_ids of each inserted `prefetch_params_fused`.
    """
    if sorted(order) != list(range(len(nodes))):
        raise ZrsError(
            f"graph {graph_id}: the planner's order is not a permutation of the graph's "
            f"{len(nodes)} nodes; this is a planner bug, please report it (scheduler='none' "
            "works around it)"
        )
    _reorder(graph, nodes, order)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    inserted = []
    for group in groups:
        members = [nodes[i] for i in group if is_op(nodes[i], "allgather_param")]
        for first, sub in _prefetch_groups(members, pos):
            with graph.inserting_before(first):
                pf = graph.call_function(
                    OPS.prefetch_params_fused.default,
                    (graph_id, [ag.args[0] for ag in sub], [ag.args[2] for ag in sub]),
                    {"dtypes": [val(ag).dtype for ag in sub] if FUSE_DOWNCAST_GATHERS else None},
                )
            shard = val(sub[0].args[0])
            with detect_fake_mode([shard]) or contextlib.nullcontext():
                pf.meta["val"] = shard.new_empty(0)
            for ag in sub:  # a data edge: inductor must not schedule the prefetch after them
                ag.update_kwarg("prefetched", pf)
            inserted.append([int(ag.args[2]) for ag in sub])
    graph.lint()
    return inserted


# --- planning ----------------------------------------------------------------------------------


def graph_label(graph_id: int, is_backward: bool) -> str:
    """How errors name a compiled graph: "forward graph 0"."""
    return f"{'backward' if is_backward else 'forward'} graph {graph_id}"


def _graph_budget(ir: dict[str, Any], ctx: ScheduleContext) -> int | None:
    """The planner's budget counts what is live at the graph's start (``base_bytes``); the
    user's and the automatic budget count what the graph allocates on top. The automatic one is
    also capped near the greedy schedule's peak (PREFETCH_ALLOWANCE_GATHERS)."""
    if ctx.budget is None:
        return None
    budget = ctx.budget + ir["base_bytes"]
    if ctx.budget_is_free_memory:
        greedy = zplan.plan(ir, "greedy", None, ctx.collective_cost())
        largest = max((n["bytes"] for n in ir["nodes"] if n["kind"] == "allgather"), default=0)
        budget = min(budget, greedy["peak_bytes"] + PREFETCH_ALLOWANCE_GATHERS * largest)
    return budget


def _plan_local(
    ir: dict[str, Any], ctx: ScheduleContext, budget: int | None, detail: bool
) -> dict[str, Any]:
    return zplan.plan(ir, ctx.scheduler, budget, ctx.collective_cost(), detail=detail)


def _budget_error(msg: str, what: str, ctx: ScheduleContext, base: int) -> ZrsError:
    if base:
        msg += (
            f" (these figures include the {base} bytes of inputs live at the graph's start; "
            "memory_budget counts only what the graph allocates on top of them)"
        )
    return ZrsError(
        f"{what}: {msg}. The budget came from {ctx.budget_source}; pass "
        "zrs.compile(..., memory_budget=BYTES) with at least that many bytes, or "
        "memory_budget=None on CPU, or scheduler='greedy' to plan without a budget"
    )


def _write_trace(
    ir, p, budget: int | None, ctx: ScheduleContext, graph_id: int, is_backward: bool
) -> None:
    out = Path(ctx.trace_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"graph{graph_id}_{'bw' if is_backward else 'fw'}"
    cost = ctx.collective_cost()
    Path(f"{stem}.ir.json").write_text(json.dumps({**ir, "budget_bytes": budget}))
    zplan.write_trace(ir, f"{stem}.trace.json", ctx.scheduler, budget, cost)
    plans = [p]
    if ctx.scheduler != "greedy":
        plans.insert(0, zplan.plan(ir, "greedy", budget, cost, detail=True))
    zplan.plot_memory(plans, f"{stem}.memory.png")


def schedule_graph(
    graph: fx.Graph, graph_id: int, *, is_backward: bool, ctx: ScheduleContext
) -> Scheduled | None:
    """Plan the lowered `graph` and apply the plan in place; None for scheduler='none'."""
    if ctx.scheduler == "none":
        return None
    what = graph_label(graph_id, is_backward)
    t0 = time.perf_counter()
    hints = size_hints(graph, ctx.group)  # an exchange, only for a graph with symbolic sizes
    device = torch.device(ctx.device)
    durations = profile_graph(graph, device, ctx.group, hints) if ctx.profile else None
    t1 = time.perf_counter()
    ir, nodes = build_ir(
        graph,
        device_type=ctx.device_type,
        world=ctx.world,
        durations=durations,
        is_backward=is_backward,
        reduce_dtype=ctx.reduce_dtype,
        hints=hints,
    )
    trace = bool(ctx.trace_dir) and ctx.rank == 0
    try:
        budget = _graph_budget(ir, ctx)  # plans the greedy order when capping a CUDA budget
        p = _plan_local(ir, ctx, budget, detail=trace)
    except ZrsError as e:
        if "infeasible" in str(e):
            raise _budget_error(str(e), what, ctx, ir["base_bytes"]) from None
        raise ZrsError(f"{what}: planning failed: {e}") from None
    check_same_plan(
        [f"budget {budget}", f"order {p['order']}", f"groups {p['groups']}"], ctx.group, what
    )
    prefetches = apply_plan(graph, nodes, p["order"], p["groups"], graph_id)
    if trace:
        _write_trace(ir, p, budget, ctx, graph_id, is_backward)
    return Scheduled(
        ir=ir,
        plan=p,
        prefetches=prefetches,
        profile_s=t1 - t0,
        plan_s=time.perf_counter() - t1,
    )


# --- the budget --------------------------------------------------------------------------------


def device_budget(group: Any, device: torch.device) -> int:
    """Free memory of `device`, the least over the ranks, less a margin, rounded down."""
    free, _ = torch.cuda.mem_get_info(device)
    if group is not None and dist.get_world_size(group) > 1:
        everyone = all_gather_bytes(free.to_bytes(8, "little"), group)
        free = min(int.from_bytes(b, "little") for b in everyone)
    budget = free - max(BUDGET_MARGIN_BYTES, int(free * BUDGET_MARGIN_FRACTION))
    return max(budget // BUDGET_ROUND_BYTES * BUDGET_ROUND_BYTES, 0)


def trace_dir_from_env(trace_dir: str | os.PathLike | None) -> str | None:
    """The trace directory: the option, else the ZRS_PLAN_TRACE environment variable."""
    if trace_dir is not None:
        return os.fspath(trace_dir)
    return os.environ.get("ZRS_PLAN_TRACE") or None
