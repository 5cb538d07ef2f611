"""The order of the compiled path, written once.

For every graph dynamo captures (``backend.make_backend``), AOTAutograd partitions the joint graph
(``recompute``: gathers are recomputed, never saved for backward), then for the forward and the
backward alike:

1. ``check_graph``: every rank compiles this graph now, and it is the same graph on every rank
   (``consistency``), before inductor's cache lookup;
2. ``plan_context``: the planner's options, with the automatic CUDA budget (a collective) and,
   once per model, the timed collective sweep (``sweeps.measure_collectives``);
3. ``lower``, inductor's last post-grad pass (or the eager backend's compile step):
   ``zero3`` (gathers, waits, releases, gradient reduce-scatters) -> ``plan`` (size hints, the
   profile, ``ir``, the Rust planner, ``reorder``) -> ``keep`` (the forward's last gathers kept
   for the backward) -> ``grad_buckets`` (the backward's reduce-scatter buckets, in the planned
   order of gradients) -> ``coalesce`` (one op per fused group; last, so every decision above
   holds).
"""

from __future__ import annotations

import time
from typing import Any

from torch import fx

from zrs import planner as zplan
from zrs.compiler.coalesce import coalesce
from zrs.compiler.consistency import check_same_graph
from zrs.compiler.grad_buckets import plan_grad_buckets
from zrs.compiler.keep import keep_for_backward
from zrs.compiler.plan import PlanContext, device_budget, graph_label, plan_graph
from zrs.compiler.record import Record
from zrs.compiler.sweeps import measure_all_reduce, measure_collectives, measure_host_copies
from zrs.compiler.zero3 import lower_zero3
from zrs.runtime.state import ZeroState

# The files whose code decides what `lower` produces: part of inductor's FX cache key.
LOWERING_SOURCES = (
    "pipeline.py",
    "_fx.py",
    "zero3.py",
    "plan.py",
    "ir.py",
    "reorder.py",
    "keep.py",
    "grad_buckets.py",
    "coalesce.py",
)


def check_graph(state: ZeroState, graph_id: int, graph: fx.Graph, is_backward: bool) -> None:
    """Step 1: every rank compiles this graph now, and the same graph, or all raise."""
    what = graph_label(graph_id, is_backward)
    state.check_usable()
    t0 = time.perf_counter()
    with state.exchanging(f"the rank check of {what}"):
        if state.peers is not None:  # every rank compiles this graph now, or all raise
            state.peers.arrive(what)
        check_same_graph(graph, state.control_group, what)
    _spent(state, "rank_check", time.perf_counter() - t0)


def _spent(state: ZeroState, phase: str, seconds: float) -> None:
    state.compile_s[phase] = state.compile_s.get(phase, 0.0) + seconds


def _measure_host_link(state: ZeroState) -> None:
    """Offload beside a GPU: the gradients' copy link to the host, into the cost model (on the
    collectives' measured model, else the device's default)."""
    state.host_measured = True
    if state.device.type != "cuda":
        return  # the host is the device: nothing to copy over
    t0 = time.perf_counter()
    with state.exchanging("the host copy sweep"):
        link = measure_host_copies(state.control_group, state.device)
    state.compile_s["host_sweep"] = time.perf_counter() - t0
    if link is not None:
        base = state.cost_model or zplan.default_cost_model("cuda", state.world_size)
        state.cost_model = {**base, "host": link}


def _measure_links(state: ZeroState) -> dict[str, Any] | None:
    """The collectives' cost model from the sweeps: the shard group's all-gather and
    reduce-scatter, and with replicas their all-reduce (`inter`, on the device's default model
    where the shard group's sweep is not usable or has nothing to time); None: nothing fitted."""
    cost = None
    if state.world_size > 1:
        cost = measure_collectives(state.gather_group, state.control_group, state.device)
    if state.replicate_group is not None:
        inter = measure_all_reduce(state.replicate_group, state.control_group, state.device)
        if inter is not None:
            base = cost or zplan.default_cost_model(state.device.type, state.world_size)
            cost = {**base, "inter": inter}
    return cost


def plan_context(state: ZeroState, record: Record | None = None, warm: bool = False) -> PlanContext:
    """Step 2: the planner's options for one graph compile. Called on every rank before inductor's
    cache lookup: an automatic CUDA budget is a collective (the least free memory over ranks).
    Warm (`record`, compiler/record.py): the budget and the collectives' costs that the ranks
    agreed before, with no meeting."""
    budget, source = state.memory_budget, "memory_budget="
    if warm and record is not None:
        if budget is None and record.budget is not None:
            budget, source = record.budget, "the budget recorded by an earlier compile"
        elif budget is None:
            source = "the planner's default (the greedy schedule's peak)"
        state.cost_model, state.cost_measured = record.cost, True
        state.host_measured = True  # a measured host link came with the record
    elif budget is None and state.scheduler == "search" and state.device.type == "cuda":
        t0 = time.perf_counter()
        with state.exchanging("the exchange of the free device memory"):
            budget = device_budget(state.control_group, state.device)
        _spent(state, "budget", time.perf_counter() - t0)
        source = (
            "the free device memory (least over the ranks, less a margin), capped at the greedy "
            "schedule's peak plus two of the largest gathers"
        )
    elif budget is None:
        source = "the planner's default (the greedy schedule's peak)"
    profile = state.profile and state.scheduler != "none"
    communicates = state.world_size > 1 or state.replicas > 1
    if profile and not state.cost_measured and state.group is not None and communicates:
        t0 = time.perf_counter()
        with state.exchanging("the collective timing sweep"):
            state.cost_model = _measure_links(state)
        state.cost_measured = True
        state.compile_s["sweep"] = time.perf_counter() - t0
    if profile and state.offload is not None and not state.host_measured:
        _measure_host_link(state)
    if record is not None and not warm:
        record.budget = budget if state.memory_budget is None else None
        record.cost = state.cost_model
    return PlanContext(
        scheduler=state.scheduler,
        budget=budget,
        budget_source=source,
        budget_is_free_memory=state.memory_budget is None and budget is not None,
        world=state.world_size,
        device=str(state.device),
        group=state.control_group,
        rank=state.rank,
        trace_dir=state.trace_dir,
        cost=state.cost_model,
        host_copies=state.offload is not None,
        staged=state.offload is not None and state.offload.params,
        replicas=state.replicas,
        profile=profile,
        reduce_dtype=state.reduce_dtype,
        record=record,
        warm=warm,
    )


def lower(
    state: ZeroState,
    graph_id: int,
    graph: fx.Graph,
    is_backward: bool,
    keep: bool,
    ctx: PlanContext,
) -> None:
    """Step 3: the passes, in their order; each phase's wall time goes to `state.compile_s`."""
    t0 = time.perf_counter()
    lower_zero3(graph, graph_id, is_backward=is_backward, views=state.one_rank_views)
    t1 = time.perf_counter()
    planned = plan_graph(graph, graph_id, is_backward=is_backward, ctx=ctx)
    t2 = time.perf_counter()
    if keep:
        budget_left = None  # the automatic budget's allowance is the prefetch's (keep.py)
        if state.memory_budget is not None:
            peak = planned.plan["peak_bytes"] if planned is not None else state.memory_budget
            budget_left = state.memory_budget - peak
        keep_for_backward(graph, budget_left)
    t3 = time.perf_counter()
    shard_numels = {h.ds_id: h.shard_numel for h in state.handles}
    if is_backward:
        plan_grad_buckets(
            graph, shard_numels
        )  # after the plan: its order of gradients fills the buckets
    t4 = time.perf_counter()
    coalesce(graph, graph_id, shard_numels)  # last: one op per group, every decision above kept
    spent = {"lower": t1 - t0, "keep": t3 - t2, "buckets": t4 - t3}
    spent["coalesce"] = time.perf_counter() - t4
    if planned is not None:
        spent |= {"profile": planned.profile_s, "plan": planned.plan_s}
    for phase, seconds in spent.items():
        _spent(state, phase, seconds)
