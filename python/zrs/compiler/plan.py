"""Plan one lowered graph: size hints, the profile, the IR, the planner, the plan applied.

Runs right after the zero3 pass, on the lowered forward or backward graph (``pipeline.lower``).
Every input of the planner comes from the graph (meta shapes, constants), the options and the
world size; the rank check has already shown that the ranks lowered the same graph, and both
schedulers are deterministic (the search's refinement is bounded by a count of simulator runs,
not by wall clock), so every rank plans alone and arrives at the same order and groups; a digest
of the plan is still compared (``consistency.check_same_plan``). The automatic CUDA budget is the
least free memory over the ranks, read before inductor's cache lookup.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx

from zrs import _core
from zrs import planner as zplan
from zrs._core import ZrsError
from zrs.compiler.consistency import check_same_plan, signature
from zrs.compiler.ir import build_ir
from zrs.compiler.profile import profile_graph, recorded_hints, size_hints
from zrs.compiler.reorder import apply_plan
from zrs.runtime.exchange import all_gather_bytes

if TYPE_CHECKING:
    from zrs.compiler.record import Record

SCHEDULERS = ("search", "greedy", "none")


@dataclass(frozen=True)
class PlanContext:
    """Everything the pass needs besides the graph; equal on every rank."""

    scheduler: str = "search"
    budget: int | None = None  # bytes; None: the planner's default (greedy's peak)
    budget_source: str = "none"  # where the budget came from, for error messages
    budget_is_free_memory: bool = False  # automatic (CUDA): zrs-core caps it near greedy's peak
    world: int = 1
    device: str = "cpu"
    group: Any = None  # torch.distributed ProcessGroup, or None for one process
    rank: int = 0
    trace_dir: str | None = None
    # Cost model for the collectives: a preset name, a measured dict, or None for the default.
    # With offload it may hold the measured device-to-host link ("host").
    cost: str | dict[str, Any] | None = None
    # Offload: each reduce-scatter's shard goes to the host (the IR's `host_bytes`).
    host_copies: bool = False
    # offload="params": each all-gather stages its shard in from the host first.
    staged: bool = False
    # Hybrid sharding: each reduce-scatter's shard is then all-reduced across this many
    # replicas (the IR's `replicate_bytes`, the cost model's `replicas`).
    replicas: int = 1
    # Time the lowered graph's compute nodes once on real tensors (`zrs.compiler.profile`) on
    # `device`.
    profile: bool = False
    # The gradients' reduce dtype: a reduce-scatter moves numel x this, whatever the dtype of the
    # gradient handed to reduce_grad (the packing casts). None: the gradient's own dtype.
    reduce_dtype: torch.dtype | None = None
    # What this compile measured and agreed (compiler/record.py): written to on a cold compile,
    # read from on a warm one, where the pass meets no other rank.
    record: Record | None = None
    warm: bool = False

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def collective_cost(self) -> str:
        """The collectives' cost model (JSON) the planner plans with: the measured (else the
        device's default) one, with zrs-core's planning margin when there is more than one rank,
        and the replicas its all-reduces span. The link between replicas is the sweep's `inter`
        (compiler/sweeps.py); without one zrs-core times the all-reduce on the reduce-scatter's
        link."""
        cost = json.dumps(self.cost, sort_keys=True) if isinstance(self.cost, dict) else self.cost
        planned = _core.planning_cost(cost, self.device_type, self.world)
        if self.replicas > 1:
            planned = json.dumps({**json.loads(planned), "replicas": self.replicas})
        return planned

    def key(self) -> str:
        """What the plan depends on besides the graph: part of inductor's FX cache key."""
        cost = self.collective_cost()
        # The record's run id: a cold compile's entries serve the warm runs of its record only.
        run = f":run {self.record.run}" if self.record is not None else ""
        return (
            f"{self.scheduler}:{self.budget}:{self.world}:{self.device_type}:{cost}"
            f":{self.reduce_dtype}{run}"
        )


@dataclass
class Planned:
    """What the pass did, for tests and the trace."""

    ir: dict[str, Any]
    plan: dict[str, Any] | None
    prefetches: list[list[int]]  # ds_ids of each inserted prefetch_params_fused
    profile_s: float = 0.0  # wall seconds spent timing the graph's compute (zrs.compiler.profile)
    plan_s: float = 0.0  # wall seconds spent building the IR, planning and applying the plan


# --- planning ----------------------------------------------------------------------------------


def _digest(graph: fx.Graph) -> str:
    """The lowered graph, as every rank and every run of the same model lowers it."""
    return hashlib.sha256("\n".join(signature(graph)).encode()).hexdigest()


def graph_label(graph_id: int, is_backward: bool) -> str:
    """How errors name a compiled graph: "forward graph 0"."""
    return f"{'backward' if is_backward else 'forward'} graph {graph_id}"


def _plan(ir: dict[str, Any], ctx: PlanContext, detail: bool) -> dict[str, Any]:
    """One call to zrs-core: the budget (the user's, or the free memory capped near the greedy
    schedule's peak), the order and the fused groups of the graph."""
    out = _core.plan_compiled(
        json.dumps(ir),
        ctx.scheduler,
        ctx.budget,
        ctx.budget_is_free_memory,
        ctx.collective_cost(),
        detail,
    )
    return json.loads(out)


def _budget_error(
    e: _core.BudgetInfeasibleError, what: str, ctx: PlanContext
) -> _core.BudgetInfeasibleError:
    """zrs-core's error with the graph and where the budget came from; the same type and
    figures, so that a caller can read the least feasible budget (`minimal`)."""
    error = _core.BudgetInfeasibleError(
        f"{what}: {e}. The budget came from {ctx.budget_source}; pass "
        f"zrs.compile(..., memory_budget=BYTES) with at least {e.minimal} bytes, or "
        "memory_budget=None on CPU, or scheduler='greedy' to plan without a budget"
    )
    error.budget, error.minimal, error.base = e.budget, e.minimal, e.base
    return error


def _write_trace(
    ir, p, budget: int | None, ctx: PlanContext, graph_id: int, is_backward: bool
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


def plan_graph(
    graph: fx.Graph, graph_id: int, *, is_backward: bool, ctx: PlanContext
) -> Planned | None:
    """Plan the lowered `graph` and apply the plan in place; None for scheduler='none'."""
    if ctx.scheduler == "none":
        return None
    what = graph_label(graph_id, is_backward)
    t0 = time.perf_counter()
    entry = _digest(graph) if ctx.record is not None else ""
    if ctx.warm:  # what the ranks agreed before (compiler/record.py), and no meeting
        recorded = ctx.record.graphs.get(entry) if ctx.record is not None else None
        # Not recorded (a graph the earlier compile did not plan): sizes and costs by the
        # analytic rules, which are the same on every rank.
        hints = recorded_hints(graph, recorded["hints"]) if recorded else {}
        durations = recorded["durations"] if recorded else None
    else:
        hints = size_hints(graph, ctx.group)  # an exchange, only for a graph with symbolic sizes
        device = torch.device(ctx.device)
        durations = profile_graph(graph, device, ctx.group, hints) if ctx.profile else None
        if ctx.record is not None:
            kept = {"hints": {str(k): v for k, v in hints.items()}, "durations": durations}
            ctx.record.graphs[entry] = kept
    t1 = time.perf_counter()
    ir, nodes = build_ir(
        graph,
        device_type=ctx.device_type,
        world=ctx.world,
        durations=durations,
        is_backward=is_backward,
        reduce_dtype=ctx.reduce_dtype,
        hints=hints,
        host_copies=ctx.host_copies,
        staged=ctx.staged,
        replicas=ctx.replicas,
    )
    trace = bool(ctx.trace_dir) and ctx.rank == 0
    try:
        p = _plan(ir, ctx, detail=trace)
    except _core.BudgetInfeasibleError as e:
        raise _budget_error(e, what, ctx) from None
    except ZrsError as e:
        raise ZrsError(f"{what}: planning failed: {e}") from None
    budget = p["budget_bytes"]
    if not ctx.warm:  # from agreed inputs alone, a warm plan is the same on every rank
        check_same_plan(
            [f"budget {budget}", f"order {p['order']}", f"groups {p['groups']}"], ctx.group, what
        )
    prefetches = apply_plan(graph, nodes, p["order"], p["groups"], graph_id)
    if trace:
        _write_trace(ir, p, budget, ctx, graph_id, is_backward)
    return Planned(
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
    return _core.auto_budget(free)


def trace_dir_from_env(trace_dir: str | os.PathLike | None) -> str | None:
    """The trace directory: the option, else the ZRS_PLAN_TRACE environment variable."""
    if trace_dir is not None:
        return os.fspath(trace_dir)
    return os.environ.get("ZRS_PLAN_TRACE") or None
