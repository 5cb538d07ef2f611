"""Bad input gets a clear ZrsError that names the problem and the fix, and loses no state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zrs
from _dist import run_workers


class NoParams(nn.Module):
    def forward(self, x):
        return x * 2


def test_model_without_parameters():
    with pytest.raises(zrs.ZrsError, match="has no parameters"):
        zrs.compile(NoParams())


def test_unknown_backend_leaves_the_model_untouched():
    model = nn.Linear(3, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(zrs.ZrsError, match="unknown backend 'tvm'"):
        zrs.compile(model, backend="tvm")
    assert type(model) is nn.Linear
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])


def test_compile_before_init_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(3, 4)
    with pytest.raises(zrs.ZrsError, match=r"before torch\.distributed\.init_process_group"):
        zrs.compile(model)
    assert model.weight.shape == (4, 3), "the model must not be sharded after the error"


def test_sharding_twice_is_refused():
    compiled = zrs.compile(nn.Linear(3, 4), backend="eager")
    sharded = zrs.shard(nn.Linear(3, 4))
    for again in (zrs.compile, zrs.shard):
        for model in (compiled, sharded):
            with pytest.raises(zrs.ZrsError, match=r"already sharded by zrs \(zrs\.compile or"):
                again(model)


def test_assigning_a_parameter_to_a_sharded_name_is_refused(monkeypatch):
    from zrs.runtime import collectives
    from zrs.runtime import state as runtime

    model = zrs.compile(nn.Linear(3, 2), backend="eager")
    gathers = []
    monkeypatch.setattr(collectives, "gather_full", lambda *a: gathers.append(a))
    shard = model._parameters["weight"]
    with pytest.raises(zrs.ZrsError, match=r"Linear\.weight: it is sharded by zrs\.compile"):
        model.weight = nn.Parameter(torch.zeros(2, 3))
    assert model._parameters["weight"] is shard, "the shard is kept"
    assert not gathers, "no gather (a collective) was run"
    model.extra = nn.Parameter(torch.zeros(1))  # other names register as usual
    assert "extra" in dict(model.named_parameters())
    runtime.reset()


def test_meta_model_without_reset_parameters():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

        def forward(self, x):
            return x * self.w

    with torch.device("meta"):
        model = Bare()
    with pytest.raises(zrs.ZrsError, match="init_fn"):
        zrs.compile(model)


class RankDependent(nn.Module):
    """Control flow that depends on the rank: each rank traces a different graph."""

    def __init__(self, rank: int):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = rank == 1

    def forward(self, x):
        y = self.lin(x)
        if self.extra:
            y = torch.tanh(y)
        return y.sum()


def _diverging_graphs(rank: int, world: int, backend: str) -> str:
    torch.manual_seed(0)
    model = zrs.compile(RankDependent(rank), backend=backend)
    try:
        model(torch.randn(2, 4)).backward()
    except Exception as exc:  # dynamo wraps backend errors; the message carries ours
        return str(exc)
    return "no error"


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_ranks_with_different_graphs_raise_instead_of_hanging(backend):
    messages = run_workers(_diverging_graphs, 2, backend, timeout=600)
    for msg in messages:
        assert "ranks captured different forward graph 0" in msg, msg
        assert "first difference is node #" in msg and "rank 1" in msg, msg


def _scaled(x, factor):
    return x * factor


def _graph_with_a_python_function(factor: float):
    from torch import fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(_scaled, (x, factor))
    graph.call_function(torch.sym_sum, ([y, y],))
    graph.output(y)
    return graph


def _compare_graphs(rank: int, world: int, factors: list[float]) -> str:
    import torch.distributed as dist

    from zrs.compiler.consistency import check_same_graph

    graph = _graph_with_a_python_function(factors[rank])
    try:
        check_same_graph(graph, dist.group.WORLD, "forward graph 0")
    except zrs.ZrsError as exc:
        return str(exc)
    return "same"


def test_the_rank_check_compares_functions_by_name_not_address():
    """Each process holds the same Python function at its own address: that is no difference.
    A real one (a constant) is still named."""
    assert run_workers(_compare_graphs, 2, [0.5, 0.5], timeout=120) == ["same", "same"]
    messages = run_workers(_compare_graphs, 2, [0.5, 0.25], timeout=120)
    for msg in messages:
        assert "first difference is node #1" in msg, msg
        assert "test_errors._scaled (%0, 0.5)" in msg and "0.25" in msg, msg


class LateBranch(nn.Module):
    """A Python flag that one rank flips later: that rank recompiles alone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, flag: bool):
        y = self.lin(x)
        return (torch.tanh(y) if flag else y).sum()


def _compiles_alone(rank: int, world: int) -> str:
    import datetime

    import torch.distributed as dist

    # The group's collectives give up after 30 s, the compile rendezvous after 10 s.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    model = zrs.compile(LateBranch(), process_group=group, backend="eager", timeout=10)
    try:
        for step in range(3):
            model(torch.randn(2, 4), rank == 1 and step == 2).backward()
    except Exception as exc:
        text = str(exc)
        return text if isinstance(exc, zrs.ZrsError) else f"{type(exc).__name__}: {text}"
    return "no error"


def test_a_rank_that_compiles_alone_raises_on_every_rank():
    """Rank 1 recompiles at step 2, rank 0 runs the graph compiled before: rank 1 waits in the
    rendezvous, rank 0 in a parameter all-gather. Both raise ZrsError naming the graph, instead
    of gloo aborting on mismatched collectives (or NCCL hanging)."""
    messages = run_workers(_compiles_alone, 2, timeout=240)
    for msg in messages:
        assert (
            "rank(s) [0] did not reach the compile of forward graph 1 within 10 s while rank 1 did"
            in msg
        ), messages
        assert "compiled a graph alone" in msg, messages


def _train_on_views(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Two steps on `X[rank]` (a view at another storage offset on each rank), then the same on
    clones of those batches (offset 0 everywhere)."""
    finals = []
    for copy in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
        zrs.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        tokens = torch.randint(0, 10, (world, 3, 5), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            x = tokens[rank].clone() if copy else tokens[rank]
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        finals.append({k: v.detach().clone() for k, v in zrs.full_state_dict(model).items()})
    return finals


def test_a_batch_at_another_storage_offset_on_each_rank_is_no_difference():
    """Dynamo gives rank 1's `X[1]` a storage-offset symbol that rank 0's `X[0]` lacks: the rank
    check passes and training equals that on copies."""
    for views, copies in run_workers(_train_on_views, 2, timeout=300):
        for name, value in views.items():
            torch.testing.assert_close(value, copies[name], rtol=0, atol=0)


def _replays_apart(rank: int, world: int) -> str:
    """One step, then a captured step's replay (`ZeroState.replayed`, as zrs.CapturedStep calls
    it) that counts one forward on rank 0 and two on rank 1."""
    from zrs.runtime.handles import LIVE

    model = zrs.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    model(torch.ones(3, 4)).sum().backward()
    (state,) = LIVE.models()
    try:
        state.replayed(1 + rank, 1)
    except zrs.ZrsError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_replay_different_steps_raise_before_the_replay():
    """The step check runs before each replay (its collectives are past any timeout once
    launched): ranks whose replays would differ both raise, naming the replay."""
    for msg in run_workers(_replays_apart, 2, timeout=120):
        assert "the ranks disagree before the replay that ends at forward call" in msg, msg
        assert "forward calls" in msg, msg


def test_model_compile_is_refused_and_keeps_zrs_forward():
    # nn.Module.compile would put torch.compile's forward where zrs's is (_compiled_call_impl)
    compiled = zrs.compile(nn.Linear(3, 4), backend="eager")
    sharded = zrs.shard(nn.Linear(3, 4))
    for model, api, fix in (
        (compiled, "zrs.compile", "already compiled"),
        (sharded, "zrs.shard", r"zrs\.shard\(model, compile=True\)"),
    ):
        forward = model._compiled_call_impl
        with pytest.raises(zrs.ZrsError, match=rf"model\.compile\(\) on a model prepared by {api}"):
            model.compile(backend="eager")
        with pytest.raises(zrs.ZrsError, match=fix):
            model.compile()
        assert model._compiled_call_impl is forward
        assert model(torch.ones(2, 3)).shape == (2, 4)


def test_a_forward_that_registers_a_module_compiles_model_after_model():
    """A module registered inside the forward runs zrs's registration hook; traced by dynamo it
    failed to compile (it guarded on the live models' weak sets by position: transformers'
    Mistral after Llama and Qwen2 in one process); kept from dynamo, it broke the graph there
    (transformers' `self.layers[:n]`). Under dynamo the hook does nothing: one graph a model."""
    import gc

    from torch._dynamo.utils import counters

    class Registers(nn.Module):
        def __init__(self, depth: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.tanh()  # graphs on both sides of a break at the slice
            for layer in self.layers[: len(self.layers)]:  # a new ModuleList registers each
                x = layer(x)
            return x

    for depth in (3, 2, 1):
        counters.clear()
        model = zrs.compile(Registers(depth), backend="eager")
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
        assert counters["stats"]["unique_graphs"] == 1
        del model
        gc.collect()
