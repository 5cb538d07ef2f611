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

import copy
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from zrs import planner as zplan
from zrs._core import ZrsError
from zrs.compiler.consistency import check_same_plan
from zrs.compiler.ir import build_ir
from zrs.compiler.profile import profile_graph, size_hints
from zrs.compiler.reorder import apply_plan
from zrs.runtime.exchange import all_gather_bytes

SCHEDULERS = ("search", "greedy", "none")

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
