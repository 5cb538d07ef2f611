"""The planner IR from real lowered graphs (compiler/ir.py) and the measured profile
(compiler/profile.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import fx, nn
from torch._inductor import config as inductor_config

import zrs
from lowered import as_several_ranks, lowered
from zrs import _core
from zrs import planner as zplan
from zrs.compiler import ir as fx_ir
from zrs.compiler import plan as schedule
from zrs.compiler._fx import is_op, region_body
from zrs.runtime import state as runtime

OPS = torch.ops.zrs
RTOL, ATOL = 1e-5, 1e-6

# --- the IR --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt_tied", "conv_bn", "chunked", "used_twice"])
def test_ir_from_lowered_graph_validates(model):
    for graph in lowered(model):
        ir, nodes = fx_ir.build_ir(graph, device_type="cpu", world=2)
        assert len(ir["nodes"]) == len(nodes) == len(graph.nodes)
        kinds = [n["kind"] for n in ir["nodes"]]
        for op, kind in [
            (OPS.allgather_param, "allgather"),
            (OPS.wait_allgather, "wait"),
            (OPS.release_param, "release"),
            (OPS.reduce_grad, "reduce_scatter"),
        ]:
            assert kinds.count(kind) == len(graph.find_nodes(op="call_function", target=op.default))
        for i, spec in enumerate(ir["nodes"]):
            assert all(d < i for d in spec["deps"]), "ordering deps point backwards only"
            if spec["kind"] in ("allgather", "reduce_scatter"):
                assert spec["bytes"] > 0 and spec["ds_id"] == nodes[i].args[2]
            if spec["kind"] == "compute":
                assert spec["duration_us"] >= fx_ir.DEVICE_RATES["cpu"][2]
        json.dumps(ir)  # serializable
        for scheduler in ("greedy", "search"):
            p = zplan.plan(ir, scheduler, cost=_core.planning_cost(None, "cpu", 2), detail=False)
            assert sorted(p["order"]) == list(range(len(nodes)))


def test_profile_times_compute_nodes_on_real_tensors():
    from zrs.compiler.profile import profile_graph

    fw, bw = lowered("gpt_tied")[:2]
    for graph in (fw, bw):
        times = profile_graph(graph, torch.device("cpu"), None)
        assert times, "the profile ran"
        by_name = {n.name: n for n in graph.nodes}
        assert all(t > 0 for t in times.values())
        assert not any(str(by_name[name].target).startswith("zrs.") for name in times)
        mms = [n.name for n in graph.nodes if "mm" in str(n.target) and n.op == "call_function"]
        assert mms and all(m in times for m in mms), "every matmul was timed"
        ir, _ = fx_ir.build_ir(graph, durations=times)
        spec = {n["name"]: n for n in ir["nodes"]}
        assert all(spec[m]["duration_us"] == times[m] for m in mms)


def test_profile_makes_each_input_at_its_first_use(monkeypatch):
    """The backward is profiled inside the first backward, beside the real saved activations:
    its own copies of them must not all be live at once."""
    import weakref

    from zrs.compiler import profile

    live, peak = [0], [0]
    make = profile._real

    def counted(t, device, hints):
        out = make(t, device, hints)
        if isinstance(out, torch.Tensor):
            size = out.untyped_storage().nbytes()
            live[0] += size
            peak[0] = max(peak[0], live[0])
            weakref.finalize(out, lambda: live.__setitem__(0, live[0] - size))
        return out

    monkeypatch.setattr(profile, "_real", counted)
    bw = lowered("gpt_tied")[1]
    inputs = sum(
        t.untyped_storage().nbytes()
        for n in bw.find_nodes(op="placeholder")
        if isinstance(t := n.meta.get("val"), torch.Tensor)
    )
    assert profile.profile_graph(bw, torch.device("cpu"), None)
    assert live[0] == 0, "every tensor the profile made was freed"
    assert 0 < peak[0] < 0.6 * inputs, (peak[0], inputs)


def test_profile_frees_a_value_that_only_the_output_reads():
    """A forward returns its saved activations: the profile returns nothing, so each goes at its
    last use inside the graph instead of all of them staying live to the graph's end."""
    import weakref

    from zrs.compiler import profile

    made: list[weakref.ref] = []
    live_at_probe: list[list[bool]] = []

    def big(x: torch.Tensor) -> torch.Tensor:
        out = x.repeat(64, 1)
        made.append(weakref.ref(out))
        return out

    def probe(x: torch.Tensor) -> torch.Tensor:
        live_at_probe.append([r() is not None for r in made])
        return x.sum()

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(8, 8)
    saved = [g.call_function(big, (x,)) for _ in range(2)]
    g.output((*saved, g.call_function(probe, (x,))))
    assert profile.profile_graph(g, torch.device("cpu"), None)
    assert live_at_probe == [[False] * 2, [False] * 4], "run twice (warm-up, then timed)"


def test_ir_costs_matmuls_by_flops():
    graph = lowered("gpt_tied")[0]
    _, nodes = fx_ir.build_ir(graph, device_type="cuda", world=2)
    mms = [i for i, n in enumerate(nodes) if n.target in fx_ir._MATMULS]
    assert mms and all(fx_ir.flops(nodes[i]) > 0 for i in mms)
    # the layers are nested compile regions: their attention is costed inside the bodies
    bodies = [b for n in nodes if (b := region_body(n)) is not None]
    sdpa = [n for b in bodies for n in b.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa and all(fx_ir.flops(n) > 0 for n in sdpa)
    regions = [n for n in nodes if region_body(n) is not None]
    inner = [n for b in bodies for n in b.graph.nodes]
    assert sum(map(fx_ir.flops, regions)) == sum(map(fx_ir.flops, inner)) > 0
    # the measured-profile hook overrides the estimate
    ir2, _ = fx_ir.build_ir(graph, durations={nodes[mms[0]].name: 123.0})
    assert ir2["nodes"][mms[0]]["duration_us"] == 123.0


def test_ir_orders_side_effects():
    graph = lowered("conv_bn")[1]  # backward: reduce_grads and end_backward
    ir, nodes = fx_ir.build_ir(graph)
    end = next(i for i, n in enumerate(nodes) if is_op(n, "end_backward"))
    reduces = [i for i, n in enumerate(nodes) if is_op(n, "reduce_grad")]
    assert set(reduces) <= set(ir["nodes"][end]["deps"])
    fw = lowered("conv_bn")[0]  # forward: in-place copy_ of the batch-norm buffers
    ir, nodes = fx_ir.build_ir(fw)
    for i, n in enumerate(nodes):
        if n.target is torch.ops.aten.copy_.default:
            readers = [u for u in n.args[0].users if u is not n]
            assert all(
                nodes.index(r) in ir["nodes"][i]["deps"] for r in readers if r.op != "output"
            )


def test_ir_counts_a_reduce_scatter_in_the_reduce_dtype():
    """reduce_grad may receive a bf16 gradient (before autograd's upcast) that is reduced in fp32:
    the IR charges the reduce-scatter for what moves, numel x the reduce dtype's size."""
    graph = lowered("conv_bn")[1]

    def rs_bytes(**kwargs) -> list[int]:
        ir, _ = fx_ir.build_ir(graph, **kwargs)
        return [n["bytes"] for n in ir["nodes"] if n["kind"] == "reduce_scatter"]

    own = rs_bytes()
    assert own and all(b > 0 and b % 4 == 0 for b in own)  # the fp32 gradients themselves
    assert rs_bytes(reduce_dtype=torch.bfloat16) == [b // 2 for b in own]
    assert rs_bytes(reduce_dtype=torch.float64) == [b * 2 for b in own]


def test_with_offload_each_reduce_scatter_copies_its_rank_s_fp32_shard_to_the_host(tmp_path):
    """host_bytes: this rank's rows of the gradient (padded to whole shards), as an fp32
    master's gradient whatever the reduce dtype; the planner times their copies to the host,
    and its trace shows them."""
    import json

    import zrs.planner as zplan

    graph = lowered("conv_bn")[1]
    ir, _ = fx_ir.build_ir(graph, world=3, reduce_dtype=torch.bfloat16, host_copies=True)
    reduces = [n for n in ir["nodes"] if n["kind"] == "reduce_scatter"]
    assert reduces and all(n["host_bytes"] == -(-n["bytes"] // 2 // 3) * 4 for n in reduces)
    plain, _ = fx_ir.build_ir(graph, world=3)
    assert not any("host_bytes" in n for n in plain["nodes"])
    # A host link of 10 KB/s: the copies outlast the backward, whose end waits for them.
    host = zplan.fit_copy_link([(1 << 10, 1e5), (2 << 10, 2e5)])
    cost = {**zplan.cost_model("nvlink", 3), "host": host}
    with_copies = zplan.plan(ir, "greedy", cost=cost)
    without = zplan.plan(ir, "greedy", cost=zplan.cost_model("nvlink", 3))
    assert with_copies["host_copy_busy_us"] > 0 and without["host_copy_busy_us"] == 0
    assert with_copies["host_copy_busy_us"] > 10 * without["makespan_us"]
    assert with_copies["makespan_us"] > with_copies["host_copy_busy_us"]
    trace = json.loads(zplan.write_trace(ir, tmp_path / "t.json", "greedy", cost=cost).read_text())
    copies = [e for e in trace["traceEvents"] if e.get("cat") == "host_copy"]
    assert len(copies) == len(reduces) and all(e["dur"] > 0 for e in copies)


def test_backward_inputs_are_live_at_the_start_and_freed_at_their_last_reader():
    fw, bw = lowered("gpt_tied")
    ir_fw, _ = fx_ir.build_ir(fw)
    assert ir_fw["base_bytes"] == 0  # the forward's inputs belong to the caller
    ir, nodes = fx_ir.build_ir(bw, is_backward=True)
    inputs = [
        n for n in nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    shards = [n for n in inputs if any(is_op(u, "allgather_param") for u in n.users)]
    owned = [n for n in inputs if n not in shards]
    assert shards and owned
    expected = sum(fx_ir.nbytes(n.meta["val"]) for n in owned)
    assert ir["base_bytes"] == expected > 0
    # what the graph frees covers its own allocations and every owned input
    freed = sum(spec.get("free_bytes", 0) for spec in ir["nodes"])
    allocated = sum(spec.get("alloc_bytes", 0) for spec in ir["nodes"] if spec["kind"] == "compute")
    assert freed >= expected
    assert freed <= expected + allocated
    # a budget counts what the graph allocates on top of its inputs
    ctx = schedule.PlanContext(budget=1 << 30)
    assert schedule._plan(ir, ctx, detail=False)["budget_bytes"] == (1 << 30) + expected
    # the automatic (free-memory) budget stops near the greedy schedule's peak
    free = schedule.PlanContext(budget=1 << 40, budget_is_free_memory=True)
    greedy_peak = zplan.plan(ir, "greedy", None, free.collective_cost())["peak_bytes"]
    largest = max(spec["bytes"] for spec in ir["nodes"] if spec["kind"] == "allgather")
    allowance = _core.PREFETCH_ALLOWANCE_GATHERS * largest
    assert schedule._plan(ir, free, detail=False)["budget_bytes"] == greedy_peak + allowance
    # too little for the graph: a typed error in the user's terms (the inputs excluded)
    tight = schedule.PlanContext(budget=16, budget_is_free_memory=True)
    with pytest.raises(_core.BudgetInfeasibleError) as info:
        schedule._plan(ir, tight, detail=False)
    assert (info.value.budget, info.value.base) == (16, expected)
    assert info.value.minimal > 16


class _ConstantAndLengths(nn.Module):
    """A tensor constant made in forward (a `get_attr` in the graph), an in-place op on it, and a
    sequence length that dynamo makes symbolic."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
        scale.mul_(0.5)
        return (self.lin(x) * scale).sum(dim=1)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_profile_runs_constants_and_symbolic_sizes(monkeypatch, backend):
    """Every graph dynamo gives is profiled: constants (`_tensor_constant0` raised KeyError in
    the eager backend), in-place ops on them, and symbolic sizes at their hints."""
    from zrs.compiler import profile

    timed: list[tuple[dict, dict]] = []
    constants = []
    real = schedule.profile_graph

    def spy(graph, device, group, hints=None):
        constants.extend(graph.find_nodes(op="get_attr"))
        out = real(graph, device, group, hints)
        timed.append((out, dict(hints or {})))
        return out

    monkeypatch.setattr(schedule, "profile_graph", spy)
    torch.manual_seed(0)
    model = _ConstantAndLengths()
    ref = _ConstantAndLengths()
    ref.load_state_dict(model.state_dict())
    as_several_ranks(zrs.compile(model, backend=backend))
    try:
        with inductor_config.patch(fx_graph_cache=False):  # a cache hit skips the passes
            for length in (5, 9, 13):  # the second length makes the graph symbolic
                x = torch.randn(2, length, 4)
                torch.testing.assert_close(model(x), ref(x))
                model(x).sum().backward()
    finally:
        runtime.reset()
    assert all(t for t, _ in timed), "every graph had compute nodes timed"
    assert constants or backend == "inductor", "the eager backend's graph holds the constant"
    symbolic = [h for _, h in timed if h]
    assert symbolic and all(v in (9, 13) for h in symbolic for v in h.values()), timed
    assert profile.concrete(5, {}) == 5


def test_a_region_call_is_keyed_by_its_operands_sizes_at_the_hints():
    """The profile times a repeated block once per kind of operands: a size operand counts by
    its value, so calls with different sizes are timed apart."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from zrs.compiler.profile import _region_call_key

    env = ShapeEnv()
    short, long = (env.create_unbacked_symint() for _ in range(2))
    hints = {short.node.expr: 4, long.node.expr: 8}
    g = fx.Graph()
    body = g.get_attr("body")
    calls = []
    for size in (short, long, short):
        n = g.placeholder(f"n{len(calls)}")
        n.meta["val"] = size
        x = g.placeholder(f"x{len(calls)}")
        x.meta["val"] = torch.empty(2, 3)
        calls.append(g.call_function(torch.ops.higher_order.invoke_subgraph, (body, "id", x, n)))
    first, second, third = (_region_call_key(c, hints) for c in calls)
    assert first == third != second


def test_with_params_offload_each_gather_stages_its_shard_in_until_its_wait():
    """offload="params": each all-gather copies this rank's shard in from the host first
    (host_bytes, one shard of its gathered bytes); the staged bytes are allocated with the
    gather and freed at its wait (the simulator's memory follows each node's alloc and free);
    a slow host link makes the gathers, and the step, longer."""
    graph = lowered("conv_bn")[0]
    plain, _ = fx_ir.build_ir(graph, world=2)
    ir, _ = fx_ir.build_ir(graph, world=2, staged=True)
    pairs = list(zip(plain["nodes"], ir["nodes"], strict=True))
    gathers = [(p, n) for p, n in pairs if n["kind"] == "allgather"]
    assert gathers and all(n["host_bytes"] == -(-n["bytes"] // 2) for _, n in gathers)
    for p, n in gathers:
        assert n.get("alloc_bytes", 0) == p.get("alloc_bytes", 0) + n["host_bytes"]
    staged = {n["ds_id"]: n["host_bytes"] for _, n in gathers}
    for p, n in pairs:
        if n["kind"] == "wait":
            assert n.get("free_bytes", 0) == p.get("free_bytes", 0) + staged[n["ds_id"]]
        elif n["kind"] != "allgather":
            assert n == p
    host = zplan.fit_copy_link([(1 << 10, 1e5), (2 << 10, 2e5)])  # 10 KB/s
    cost = {**zplan.cost_model("nvlink", 2), "host": host}
    slow = zplan.plan(ir, "greedy", cost=cost)
    fast = zplan.plan(plain, "greedy", cost=cost)
    assert slow["makespan_us"] > 10 * fast["makespan_us"]


def test_with_replicas_each_reduce_scatter_all_reduces_its_shard_across_them(tmp_path):
    """Hybrid sharding: each reduce-scatter's shard of the gradient (one world-th of its bytes)
    is all-reduced across the replicas after it (replicate_bytes); nothing else in the IR
    changes, and the plan's step grows by the all-reduces, on a thread of their own in the
    trace."""
    graph = lowered("conv_bn")[1]
    plain, _ = fx_ir.build_ir(graph, world=2, is_backward=True)
    ir, _ = fx_ir.build_ir(graph, world=2, is_backward=True, replicas=4)
    pairs = list(zip(plain["nodes"], ir["nodes"], strict=True))
    reduces = [(p, n) for p, n in pairs if n["kind"] == "reduce_scatter" and n["bytes"]]
    # this rank's rows of the fp32 gradient: ceil(numel / 2) x 4 bytes
    assert reduces and all(n["replicate_bytes"] == -(-n["bytes"] // 8) * 4 for _, n in reduces)
    assert all(n == p for p, n in pairs if n["kind"] != "reduce_scatter")
    cost = zplan.cost_model("nvlink", 2)
    slow = zplan.cost_model("nop2p", 2)
    one = zplan.plan(ir, "greedy", cost=cost)
    hybrid = zplan.plan(ir, "greedy", cost={**cost, "replicas": 4, "inter": slow["allgather"]})
    assert hybrid["makespan_us"] > one["makespan_us"]
    assert one["makespan_us"] == zplan.plan(plain, "greedy", cost=cost)["makespan_us"]
    path = tmp_path / "plan.trace.json"
    zplan.write_trace(ir, str(path), "greedy", None, json.dumps({**cost, "replicas": 4}))
    events = json.loads(path.read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "all_reduce" in threads
    assert sum(e.get("cat") == "all_reduce" for e in events) == len(reduces)
