"""The zero3 pass really lowers both graphs, for both backends (one process, no group)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch._inductor import config as inductor_config

import zrs
from lowered import as_several_ranks
from zrs.compiler import pipeline
from zrs.compiler._fx import cast_dtype
from zrs.runtime import grads
from zrs.runtime import state as runtime

OPS = torch.ops.zrs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.b = nn.Linear(5, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.b(self.norm(torch.relu(self.a(x))))).sum()


def _count(graph: fx.Graph, op) -> int:
    return len(graph.find_nodes(op="call_function", target=op.default))


@pytest.fixture
def lowered(monkeypatch):
    graphs: dict[str, fx.Graph] = {}
    reduced: list[tuple[int, torch.dtype, int]] = []  # ds_id, gradient dtype, planned bucket
    lower, reduce_grads = pipeline.lower_zero3, grads.reduce_grads

    def spy_lower(graph, graph_id, *, is_backward, views):
        out = lower(graph, graph_id, is_backward=is_backward, views=views)
        copy = fx.Graph()  # as lowered: the later passes change `graph` in place
        copy.output(copy.graph_copy(graph, {}))
        graphs["bw" if is_backward else "fw"] = copy
        return out

    def spy_reduce(graph_id, gradients, ds_ids, bucket_numels):
        reduced.extend(zip(ds_ids, [g.dtype for g in gradients], bucket_numels, strict=True))
        reduce_grads(graph_id, gradients, ds_ids, bucket_numels)

    monkeypatch.setattr(pipeline, "lower_zero3", spy_lower)
    monkeypatch.setattr(grads, "reduce_grads", spy_reduce)
    with inductor_config.patch(fx_graph_cache=False):  # a cache hit would skip the pass
        yield graphs, reduced
    runtime.reset()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_graphs_are_lowered(lowered, backend, param_dtype):
    graphs, reduced = lowered
    torch.manual_seed(0)
    model = as_several_ranks(zrs.compile(Net(), backend=backend, param_dtype=param_dtype))
    model(torch.randn(4, 6)).backward()
    fw, bw = graphs["fw"], graphs["bw"]
    for g in (fw, bw):
        assert _count(g, OPS.gather) == 0 and _count(g, OPS.gather_grad) == 0
        assert _count(g, OPS.allgather_param) == _count(g, OPS.wait_allgather)
        assert _count(g, OPS.allgather_param) == _count(g, OPS.release_param) > 0
    assert _count(fw, OPS.allgather_param) == 8  # every parameter, frozen ones too
    trainable = [h.ds_id for h in model._zrs_state.handles if h.shard.requires_grad]
    assert _count(bw, OPS.reduce_grad) == len(trainable) and _count(bw, OPS.end_backward) == 1
    assert sorted(i for i, _, _ in reduced) == sorted(trainable), "every gradient was reduced"
    # A gradient that autograd would upcast reaches reduce_grad before the upcast (the packing
    # casts into the fp32 bucket): the weights' bf16 matmul gradients, not the norm's (computed
    # in fp32). Their .grad is still fp32, below.
    reduces = bw.find_nodes(op="call_function", target=OPS.reduce_grad.default)
    assert not [n for n in reduces if cast_dtype(n.args[0]) is not None]
    shapes = {h.ds_id: h.shape for h in model._zrs_state.handles}
    matrices = {d for i, d, _ in reduced if len(shapes[i]) == 2}
    assert matrices == {param_dtype or torch.float32}
    # One world: every gradient fits one planned bucket, sized to all of them together.
    sizes = {size for _, _, size in reduced}
    assert sizes == {sum(h.shard_numel for h in model._zrs_state.handles if h.shard.requires_grad)}
    if param_dtype is not None:  # fused downcast: gathered straight in bf16
        dtypes = {
            n.kwargs["dtype"]
            for n in fw.find_nodes(op="call_function", target=OPS.allgather_param.default)
        }
        assert dtypes == {param_dtype}
    for h in model._zrs_state.handles:
        assert (h.param.grad is not None) == h.shard.requires_grad
        assert h.param.grad is None or h.param.grad.dtype == torch.float32
        assert model._zrs_state.registry.info(h.slot).holders == 0, "every gather released"


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_rank_gathers_that_cast_nothing_are_views(lowered, backend):
    """One rank: the fp32 shards are the parameters, so no gather, release or gathered buffer;
    a view of each shard instead. The gradients still go to reduce_grad, and train as the
    gathers do (as several ranks lower them, in this process)."""
    graphs, _ = lowered
    losses, params = [], []
    for views in (True, False):
        torch.manual_seed(0)
        model = zrs.compile(Net(), backend=backend)
        model._zrs_state.one_rank_views = views
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            loss = model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params.append([p.detach().clone() for p in model.parameters()])
        if views:
            fw, bw = graphs["fw"], graphs["bw"]
            for g in (fw, bw):
                assert _count(g, OPS.allgather_param) == _count(g, OPS.release_param) == 0
            trainable = [h.ds_id for h in model._zrs_state.handles if h.shard.requires_grad]
            assert _count(bw, OPS.reduce_grad) == len(trainable)
            assert {h.param.grad is None for h in model._zrs_state.handles} == {True}
        runtime.reset()
    assert losses[:3] == losses[3:]
    for a, b in zip(*params, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_the_backward_is_compiled_with_the_forward(lowered, backend):
    """Compiled (and profiled) lazily, the backward's profile ran inside the first backward
    beside that step's real saved activations, and the first step's peak memory rose above every
    later step's. Compiled with the forward, nothing but the shards is live then."""
    graphs, _ = lowered
    model = as_several_ranks(zrs.compile(Net(), backend=backend))
    loss = model(torch.randn(4, 6))
    assert "bw" in graphs, "the backward was lowered before the first backward ran"
    lowered_bw = graphs["bw"]
    loss.backward()
    assert graphs["bw"] is lowered_bw, "and not again by the backward"
    assert all(h.param.grad is not None for h in model._zrs_state.handles if h.shard.requires_grad)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_nn_container_is_captured_whole(backend):
    """An nn.Sequential (forward defined in torch.nn) compiles into one graph with every gather
    in it, not one graph per parameter with eager compute in between."""
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    model = as_several_ranks(zrs.compile(model, backend=backend))
    with inductor_config.patch(fx_graph_cache=False):
        model(torch.randn(4, 6)).sum().backward()
    runtime.reset()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_the_compile_time_of_each_zrs_phase_is_recorded(lowered):
    model = as_several_ranks(zrs.compile(Net(), backend="eager"))
    model(torch.randn(4, 6)).backward()
    spent = model._zrs_state.compile_s
    assert {"lower", "profile", "plan", "keep"} <= spent.keys()
    assert all(s >= 0 for s in spent.values()) and spent["plan"] > 0
    assert "buckets" in spent  # the gradient buckets' planning, not counted under "keep"


def _cast_node(kwargs: dict) -> fx.Node:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, device="meta")
    return graph.call_function(torch.ops.aten._to_copy.default, (x,), kwargs)


def test_a_cast_that_names_its_own_device_is_still_a_cast():
    """AOT autograd's backward of a cast spells out the device and layout: still a plain cast
    (its input reaches reduce_grad before it). A move to another device, a layout change or a
    memory-format change is not a cast."""
    f32 = torch.float32
    assert cast_dtype(_cast_node({"dtype": f32})) == f32
    assert cast_dtype(_cast_node({"dtype": f32, "layout": torch.strided, "device": "meta"})) == f32
    assert cast_dtype(_cast_node({"dtype": f32, "device": None})) == f32
    assert cast_dtype(_cast_node({"dtype": f32, "device": "cpu"})) is None
    assert cast_dtype(_cast_node({"dtype": f32, "layout": torch.sparse_coo})) is None
    assert cast_dtype(_cast_node({"dtype": f32, "memory_format": torch.channels_last})) is None


def _chain(n: int) -> tuple[fx.Graph, fx.Graph]:
    """A forward that gathers `n` parameters one after another, and a backward that hands `n`
    parameter gradients to the zero3 pass (meta tensors: nothing runs)."""
    meta = torch.device("meta")
    fw, bw = fx.Graph(), fx.Graph()
    x = fw.placeholder("x")
    x.meta["val"] = torch.empty(4, 3, device=meta)
    shards = []
    for i in range(n):
        shards.append(fw.placeholder(f"shard{i}"))
        shards[-1].meta["val"] = torch.empty(5, device=meta)
    for i, shard in enumerate(shards):
        w = fw.call_function(OPS.gather.default, (shard, i, [3, 3]))
        w.meta["val"] = torch.empty(3, 3, device=meta)
        x = fw.call_function(torch.ops.aten.mm.default, (x, w))
        x.meta["val"] = torch.empty(4, 3, device=meta)
    fw.output((x,))
    grads = []
    for i in range(n):
        g = bw.placeholder(f"grad{i}")
        g.meta["val"] = torch.empty(3, 3, device=meta)
        grads.append(bw.call_function(OPS.gather_grad.default, (g, i)))
        grads[-1].meta["val"] = torch.empty(5, device=meta)
    bw.output(tuple(grads))
    return fw, bw


def _lines_run(fn) -> int:
    """Python lines executed by `fn()` (each loop iteration counts): a count of operations that
    is the same on every run, whatever the machine's speed."""
    import sys

    lines = [0]

    def trace(frame, event, arg):
        if event == "line":
            lines[0] += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return lines[0]


def test_lowering_is_linear_in_the_number_of_parameters():
    """The zero3 pass once rebuilt the graph's order per gather: 23 s of lowering at 5,000
    parameters. Ten times the parameters must cost about ten times the operations."""
    from zrs.compiler.zero3 import lower_zero3

    def cost(n: int) -> int:
        fw, bw = _chain(n)
        return _lines_run(
            lambda: (
                lower_zero3(fw, 0, is_backward=False, views=False),
                lower_zero3(bw, 0, is_backward=True, views=False),
            )
        )

    small, large = cost(500), cost(5000)
    assert large < 12 * small, (small, large)
