"""Coalesce a planned graph's per-parameter ops into one op per group: the host's work per step
then scales with the groups the planner fused, not with the parameters.

Every zrs op is a Python call on the host (dispatch, runtime bookkeeping, a kernel launch). At
~580 parameters (GPT-2 XL) the per-parameter `allgather_param`, `wait_allgather`, `release_param`
and `reduce_grad` calls, forward and backward, were thousands of calls per step, and the GPU
waited for the host for most of the step (BENCHMARKS.md). Runs last, after the plan, keep and
bucket passes, so the planned order and every decision stay as they are:

* a fused prefetch (`prefetch_params_fused`) and its members' `allgather_param`s become one
  `allgather_params`, which returns the members' gathered parameters;
* the members' `wait_allgather`s become one `wait_allgathers` at the first of them: one collective
  brings the whole group, so the first wait completes every member;
* the members' `release_param`s become one `release_params` at the last of them. The group's
  gathered parameters share one buffer (`runtime.gather.Flat`), freed when its last member is
  released, so releasing the others earlier freed nothing;
* consecutive `release_param`s of unfused parameters (a weight and its bias, used by one op)
  become one `release_params`;
* the `reduce_grad`s of one planned bucket become `reduce_grads` calls, each moved to the last
  gradient it takes, while the gradients it holds back meanwhile total at most the graph's largest
  gradient: the backward's peak grows by less than one more gradient, and the bucket is packed by
  one kernel per call.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
from torch import fx

from zrs.compiler._fx import OPS, is_op, val


def coalesce(graph: fx.Graph, graph_id: int, shard_numels: Mapping[int, int]) -> None:
    """Merge each fused group's ops, runs of adjacent releases and runs of reduce-scatters of one
    bucket into single ops; `shard_numels`: ds_id -> elements per rank."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    releases = _releases_by_gather(graph)
    for pf in list(graph.find_nodes(op="call_function", target=OPS.prefetch_params_fused.default)):
        _coalesce_group(graph, graph_id, pf, pos, releases)
    _coalesce_adjacent_releases(graph, graph_id)
    _coalesce_reduces(graph, graph_id, shard_numels)
    graph.lint()


def _getitem(graph: fx.Graph, src: fx.Node, k: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (src, k))
    item.meta["val"] = val(src)[k]
    return item


def _releases_by_gather(graph: fx.Graph) -> dict[fx.Node, fx.Node | None]:
    """Each `allgather_param`'s release: the next `release_param` of its parameter. None where
    another gather of the same parameter comes first (overlapping holds: left alone)."""
    open_gather: dict[int, fx.Node] = {}
    out: dict[fx.Node, fx.Node | None] = {}
    for n in graph.nodes:
        if is_op(n, "allgather_param"):
            ds_id = int(n.args[2])
            if ds_id in open_gather:
                out[open_gather[ds_id]] = None
            open_gather[ds_id] = n
            out[n] = None
        elif is_op(n, "release_param"):
            ag = open_gather.pop(int(n.args[2]), None)
            if ag is not None:
                out[ag] = n
    return out


def _coalesce_group(
    graph: fx.Graph,
    graph_id: int,
    pf: fx.Node,
    pos: dict[fx.Node, int],
    releases: dict[fx.Node, fx.Node | None],
) -> None:
    gathers = sorted((u for u in pf.users if is_op(u, "allgather_param")), key=pos.__getitem__)
    waits = [next(iter(ag.users), None) for ag in gathers]
    if len(gathers) != len(pf.users) or any(
        len(ag.users) != 1 or w is None or not is_op(w, "wait_allgather")
        for ag, w in zip(gathers, waits, strict=True)
    ):
        return  # not the shape `plan.py` builds: keep the per-parameter ops
    ds_ids = [int(ag.args[2]) for ag in gathers]
    with graph.inserting_before(pf):
        group = graph.call_function(
            OPS.allgather_params.default,
            (graph_id, [ag.args[0] for ag in gathers], ds_ids, [val(ag).dtype for ag in gathers]),
        )
        group.meta["val"] = val(pf)  # a token, as the prefetch's
    first_wait = min(waits, key=pos.__getitem__)
    with graph.inserting_before(first_wait):
        wait = graph.call_function(
            OPS.wait_allgathers.default,
            (group, graph_id, ds_ids, [val(ag).dtype for ag in gathers]),
        )
        wait.meta["val"] = [val(w) for w in waits]
        waited = [_getitem(graph, wait, k) for k in range(len(waits))]
    for w, item in zip(waits, waited, strict=True):
        w.replace_all_uses_with(item)
        graph.erase_node(w)
    for ag in gathers:
        graph.erase_node(ag)
    graph.erase_node(pf)
    rels = [releases.get(ag) for ag in gathers]
    if all(r is not None and not r.users for r in rels):
        _merge_releases(graph, graph_id, [r for r in rels if r is not None])


def _merge_releases(graph: fx.Graph, graph_id: int, rels: list[fx.Node]) -> None:
    """Replace `rels` by one `release_params` where the last of them was."""
    if len(rels) < 2:
        return
    last = max(rels)  # fx nodes compare by their place in the graph
    after: dict[fx.Node, None] = {}
    for r in rels:
        after[r.args[0]] = None
        after.update(dict.fromkeys(r.args[4]))
    with graph.inserting_after(last):
        graph.call_function(
            OPS.release_params.default,
            (
                list(after),
                graph_id,
                [int(r.args[2]) for r in rels],
                [bool(r.kwargs.get("keep", False)) for r in rels],
            ),
        )
    for r in rels:
        graph.erase_node(r)


def _coalesce_adjacent_releases(graph: fx.Graph, graph_id: int) -> None:
    run: list[fx.Node] = []
    for n in list(graph.nodes):
        if is_op(n, "release_param") and not n.users:
            run.append(n)
            continue
        _merge_releases(graph, graph_id, run)
        run = []


def _grad_bytes(n: fx.Node) -> int:
    g = val(n.args[0])
    return g.numel() * g.element_size() if isinstance(g, torch.Tensor) else 0


def _coalesce_reduces(graph: fx.Graph, graph_id: int, shard_numels: Mapping[int, int]) -> None:
    reduces = [n for n in graph.nodes if is_op(n, "reduce_grad")]
    if len(reduces) < 2:
        return
    allowance = max(_grad_bytes(n) for n in reduces)
    batches: list[list[fx.Node]] = [[]]
    size, fill = -1, 0  # the current planned bucket: its size (0: unplanned) and fill
    for n in reduces:
        # A planned bucket is a run of reduces with the same bucket_numel whose shards fill it.
        numel = int(n.kwargs.get("bucket_numel", 0))
        new_bucket = numel != size or 0 < size <= fill
        if new_bucket:
            size, fill = numel, 0
        batch = batches[-1]
        if batch and (new_bucket or sum(map(_grad_bytes, batch)) > allowance):
            batches.append([])
        batches[-1].append(n)
        fill += shard_numels[int(n.args[2])]
    for batch in batches:
        _merge_reduces(graph, graph_id, batch)


def _merge_reduces(graph: fx.Graph, graph_id: int, batch: list[fx.Node]) -> None:
    if len(batch) < 2:
        return
    with graph.inserting_after(batch[-1]):
        graph.call_function(
            OPS.reduce_grads.default,
            (
                [n.args[0] for n in batch],
                graph_id,
                [int(n.args[2]) for n in batch],
                [int(n.kwargs.get("bucket_numel", 0)) for n in batch],
            ),
        )
    for n in batch:
        graph.erase_node(n)
