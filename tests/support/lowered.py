"""Lowered FX graphs of zoo models, for the compiler's unit tests, and checks on them."""

from __future__ import annotations

import operator
import random

import pytest
import torch
from torch import fx
from torch._inductor import config as inductor_config

import zrs
from zoo import spec_of
from zrs.compiler import pipeline
from zrs.compiler._fx import alias_closure, is_op
from zrs.runtime import state as runtime

OPS = torch.ops.zrs
RTOL, ATOL = 1e-5, 1e-6


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph`, owned by a module holding the regions' bodies it calls."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    owner = graph.owning_module
    return fx.GraphModule(owner, new).graph if owner is not None else new


def as_several_ranks(model: torch.nn.Module) -> torch.nn.Module:
    """A model zrs.compile'd in one process, lowered as several ranks' are: every gather stays a
    gather (with its release and plan), not a view of the shard. Before the first forward."""
    model._zrs_state.one_rank_views = False
    return model


def _lowered_graphs(model_name: str, backend: str) -> list[fx.Graph]:
    """Copies of the lowered (unscheduled) forward and backward graphs of one zoo model."""
    graphs: list[fx.Graph] = []
    lower = pipeline.lower_zero3

    def spy(graph, graph_id, *, is_backward, views):
        out = lower(graph, graph_id, is_backward=is_backward, views=views)
        graphs.append(copy_graph(graph))
        return out

    spec = spec_of(model_name)
    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "lower_zero3", spy)
    try:
        with inductor_config.patch(fx_graph_cache=False):
            model = as_several_ranks(zrs.compile(spec.build(), backend=backend, scheduler="none"))
            spec.loss(model, spec.batch(0, 0)).backward()
    finally:
        mp.undo()
        runtime.reset()
    return graphs


_GRAPHS: dict[tuple[str, str], list[fx.Graph]] = {}


def lowered(model_name: str, backend: str = "eager") -> list[fx.Graph]:
    key = (model_name, backend)
    if key not in _GRAPHS:
        _GRAPHS[key] = _lowered_graphs(model_name, backend)
    return [copy_graph(g) for g in _GRAPHS[key]]


def check_order(graph: fx.Graph) -> None:
    """Lint passes, every release follows every use of its gathered tensor, every prefetch
    precedes its members' gathers."""
    graph.lint()
    pos = {n: i for i, n in enumerate(graph.nodes)}
    waits = {}
    for n in graph.nodes:
        if is_op(n, "wait_allgather"):
            waits.setdefault(n.args[2], []).append(n)
    for rel in graph.find_nodes(op="call_function", target=OPS.release_param.default):
        # the wait of this gather: the last wait of its ds_id before the release
        wait = max((w for w in waits[rel.args[2]] if pos[w] < pos[rel]), key=pos.__getitem__)
        closure = alias_closure(wait)
        uses = {u for c in closure for u in c.users if not is_op(u, "release_param")}
        for u in list(uses):
            if isinstance(u.meta.get("val"), (tuple, list)):
                uses |= {g for g in u.users if g.target is operator.getitem}
        late = [u.name for u in uses if pos[u] > pos[rel]]
        assert not late, f"{rel.name} runs before uses {late}"
    for pf in graph.find_nodes(op="call_function", target=OPS.prefetch_params_fused.default):
        ids = set(pf.args[2])
        gathers = [
            n
            for n in graph.find_nodes(op="call_function", target=OPS.allgather_param.default)
            if n.args[2] in ids
        ]
        assert {n.args[2] for n in gathers} == ids
        assert all(pos[n] > pos[pf] for n in gathers), f"{pf.name} after a member's gather"


def random_topological(ir: dict, seed: int) -> list[int]:
    rng = random.Random(seed)
    nodes = ir["nodes"]
    indeg = [len(set(n["deps"])) for n in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for d in set(n["deps"]):
            users[d].append(i)
    ready = [i for i, d in enumerate(indeg) if d == 0]
    order = []
    while ready:
        i = ready.pop(rng.randrange(len(ready)))
        order.append(i)
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    assert len(order) == len(nodes), "the IR has a cycle"
    return order


def zrs_error(exc: BaseException) -> zrs.ZrsError | None:
    """The ZrsError behind an exception (dynamo wraps backend errors)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, zrs.ZrsError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__ or getattr(exc, "inner_exception", None)
    return None
