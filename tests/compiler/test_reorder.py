"""Applying a plan to a lowered graph (compiler/reorder.py): the order, one prefetch per group."""

from __future__ import annotations

import pytest
import torch

import zrs
from lowered import check_order, copy_graph, lowered, random_topological
from zrs import _core
from zrs import planner as zplan
from zrs.compiler import ir as fx_ir
from zrs.compiler import reorder
from zrs.compiler._fx import is_op

OPS = torch.ops.zrs
RTOL, ATOL = 1e-5, 1e-6

# --- applying plans ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt_tied", "conv_bn", "chunked", "used_twice", "frozen"])
def test_apply_plan_keeps_a_valid_order(model):
    for k, base in enumerate(lowered(model)):
        ir, _ = fx_ir.build_ir(base, world=2)
        cost = _core.planning_cost(None, "cpu", 2)
        orders = [zplan.plan(ir, s, cost=cost, detail=False) for s in ("greedy", "search")]
        orders += [{"order": random_topological(ir, seed), "groups": []} for seed in range(5)]
        for p in orders:
            graph = copy_graph(base)
            _, nodes = fx_ir.build_ir(graph, world=2)
            reorder.apply_plan(graph, nodes, p["order"], p["groups"], graph_id=0)
            check_order(graph)
            moved = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
            expect = [nodes[i] for i in p["order"] if nodes[i].op not in ("placeholder", "output")]
            assert [n for n in moved if not is_op(n, "prefetch_params_fused")] == expect, (
                f"graph {k}: not in the plan's order"
            )


def test_apply_plan_inserts_one_prefetch_per_group():
    graph = lowered("gpt_tied")[0]
    _, nodes = fx_ir.build_ir(graph, world=2)
    gathers = [i for i, n in enumerate(nodes) if is_op(n, "allgather_param")]
    half = len(gathers) // 2
    groups = [gathers[:half], gathers[half:]]
    inserted = reorder.apply_plan(graph, nodes, list(range(len(nodes))), groups, graph_id=0)
    check_order(graph)
    pfs = graph.find_nodes(op="call_function", target=OPS.prefetch_params_fused.default)
    assert len(pfs) == len(inserted) == 2
    for pf, members in zip(pfs, inserted, strict=True):
        assert list(pf.args[2]) == members
    # groups of one need no prefetch
    graph = lowered("gpt_tied")[0]
    _, nodes = fx_ir.build_ir(graph, world=2)
    reorder.apply_plan(graph, nodes, list(range(len(nodes))), [[g] for g in gathers], 0)
    assert not graph.find_nodes(op="call_function", target=OPS.prefetch_params_fused.default)


def test_apply_plan_rejects_a_non_permutation():
    graph = lowered("mlp")[0]
    _, nodes = fx_ir.build_ir(graph)
    with pytest.raises(zrs.ZrsError, match="not a permutation"):
        reorder.apply_plan(graph, nodes, [0] * len(nodes), [], graph_id=0)
