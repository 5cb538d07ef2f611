"""The compile work of a stack of identical layers grows with its distinct blocks, not its layers.

Counted, not timed: the block bodies AOTAutograd traces, the graphs inductor lowers and their FX
nodes, the block calls zrs's profile runs. The model compiles as several ranks do (`dynamic=True`, every gather a gather): at two
ranks each shard's size was a symbol of its own, which made every layer a body of its own, and
the first layer's input (an embedding's output) another (compiler/regions.py).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import pytest
import torch
from test_regions import Block
from torch import nn
from torch._dynamo.utils import compilation_time_metrics, counters
from torch._inductor import config as inductor_config
from torch._inductor.graph import GraphLowering

import zrs
from lowered import as_several_ranks
from zrs.compiler import profile
from zrs.prepare.forward import full_collections_deferred
from zrs.runtime import state as runtime

INVOKE = torch.ops.higher_order.invoke_subgraph
VOCAB, DIM = 64, 16


class Decoder(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@dataclass
class Work:
    body_traces: int  # AOTAutograd's joint traces of a block body
    bodies: set[str]  # the distinct bodies the lowered graphs call
    lowered: list[int]  # FX nodes of each graph inductor lowered, in order
    profiled_calls: int  # block calls the profile ran (the others took their time)


def _work(layers: int) -> Work:
    lowered: list[int] = []
    bodies: set[str] = set()
    timed: list[str] = []
    run, stop = GraphLowering.run, profile._Timer.stop

    def counting_run(self, *args):
        lowered.append(len(self.module.graph.nodes))
        calls = self.module.graph.find_nodes(op="call_function", target=INVOKE)
        bodies.update(c.args[0].target for c in calls)
        return run(self, *args)

    def counting_stop(self, name: str, begin) -> None:
        timed.append(name)
        stop(self, name, begin)

    torch._dynamo.reset()  # (clears the compile timers too)
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp, inductor_config.patch(fx_graph_cache=False):
        mp.setattr(GraphLowering, "run", counting_run)
        mp.setattr(profile._Timer, "stop", counting_stop)
        try:
            model = as_several_ranks(zrs.compile(Decoder(layers), backend="inductor", dynamic=True))
            model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
        finally:
            runtime.reset()
    traces = len(compilation_time_metrics.get("invoke_subgraph_trace_joint_graph", []))
    calls = sum(name.startswith("invoke_subgraph") for name in timed)
    return Work(traces, bodies, lowered, calls)


@pytest.mark.slow
def test_compile_work_is_flat_from_4_to_32_layers() -> None:
    few, many = _work(4), _work(32)
    assert few.body_traces == many.body_traces == 1, (few, many)
    # One block: its forward part, called by the forward graph, and its backward part.
    assert len(few.bodies) == len(many.bodies) == 2, (few.bodies, many.bodies)
    # Inductor lowers the same graphs: the forward and the backward, each with its one body.
    assert len(few.lowered) == len(many.lowered) == 4, (few.lowered, many.lowered)
    fw, body_fw, bw, body_bw = few.lowered
    assert many.lowered[1] == body_fw and many.lowered[3] == body_bw, "the bodies did not grow"
    # The profile runs each graph twice (a warm-up, then timed) and the block once in each.
    assert few.profiled_calls == many.profiled_calls == 4, (few, many)
    # The outer graphs hold the whole-model plan: per layer, the call and each of its six
    # parameters' gather, wait, release and gradient traffic; a few nodes, not a block's code.
    per_layer = [
        (m - f) / 28 for f, m in zip((fw, bw), (many.lowered[0], many.lowered[2]), strict=True)
    ]
    params = 6  # the block's norm, up and down weights and biases
    assert all(n <= 6 * params for n in per_layer), per_layer


class _CollectorProbe(nn.Module):
    """Notes the collector's thresholds inside its forward, keeps `churn` new lists alive while
    it runs (as a compile keeps its objects), and raises when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.seen: list[tuple[int, ...]] = []
        self.inside = False
        self.churn = 0
        self.fail = False

    @torch.compiler.disable
    def note(self) -> None:
        self.inside = True
        self.seen.append(gc.get_threshold())
        kept = [[] for _ in range(self.churn)]
        self.inside = False
        del kept
        if self.fail:
            raise ValueError("the forward failed")

    def forward(self, x):
        self.note()
        return self.lin(x)


def _prepared(probe: _CollectorProbe, prepare: str) -> nn.Module:
    return zrs.compile(probe, backend="eager") if prepare == "compile" else zrs.shard(probe)


@pytest.mark.parametrize("prepare", ["compile", "shard"])
def test_the_forward_defers_full_garbage_collections(prepare: str) -> None:
    """No automatic full collection inside zrs's forward (a compile makes millions of objects,
    and each full collection walks them all); the thresholds come back after it, raised or not."""
    before = gc.get_threshold()
    probe = _CollectorProbe()
    try:
        model = _prepared(probe, prepare)
        model(torch.randn(2, 3)).sum().backward()
        assert gc.get_threshold() == before
        probe.fail = True
        with pytest.raises(ValueError, match="the forward failed"):
            model(torch.randn(2, 3))
    finally:
        runtime.reset()
    assert gc.get_threshold() == before
    assert len(probe.seen) == 2, probe.seen
    for inside in probe.seen:
        assert inside[:2] == before[:2] and inside[2] > 1_000_000, (inside, before)


def test_the_outermost_block_restores_the_thresholds() -> None:
    """A nested forward leaves them raised for the outer one; another thread's block that began
    inside this one and ends after it leaves none raised for good."""
    before = gc.get_threshold()
    with full_collections_deferred():
        raised = gc.get_threshold()
        with full_collections_deferred():
            pass
        assert gc.get_threshold() == raised != before
    assert gc.get_threshold() == before
    outer, inner = full_collections_deferred(), full_collections_deferred()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    assert gc.get_threshold() == before


@pytest.mark.parametrize("prepare", ["compile", "shard"])
def test_a_forward_that_churned_ends_with_one_full_collection(prepare: str) -> None:
    """A forward that made as many young collections as would start a full one (a compile) runs
    that one full collection at its end, not at some later point (inside a CUDA graph capture);
    a forward that made few runs none."""
    full: list[bool] = []  # a full collection: whether it ran inside the churning call

    def on_collect(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(probe.inside)

    probe = _CollectorProbe()
    try:
        model = _prepared(probe, prepare)
        model(torch.randn(2, 3)).sum().backward()  # any compile, before the count
        gc.callbacks.append(on_collect)
        try:
            model(torch.randn(2, 3))
            quiet = list(full)
            probe.churn = 300_000  # about 40 young collections of generation 1
            model(torch.randn(2, 3))
        finally:
            gc.callbacks.remove(on_collect)
    finally:
        runtime.reset()
    assert quiet == [], quiet
    assert full == [False], full


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compile_says_what_it_is_compiling(backend: str, caplog) -> None:
    torch._dynamo.reset()
    with (
        caplog.at_level(logging.INFO, logger="zrs"),
        inductor_config.patch(fx_graph_cache=False),
    ):
        try:
            model = as_several_ranks(zrs.compile(Decoder(2), backend=backend, dynamic=True))
            model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
        finally:
            runtime.reset()
    said = [r.getMessage() for r in caplog.records if r.name == "zrs"]
    assert any(m.startswith("zrs: graph 0: compiling") and "1 repeated-block" in m for m in said)
    for what in ("forward graph 0", "backward graph 0", "graph 0"):
        started = [m for m in said if m.startswith(f"zrs: {what}: ") and "done in" not in m]
        assert started and f"zrs: {what}: done in" in " ".join(said), (what, said)


class CausalLM(nn.Module):
    """A Hugging Face-style causal LM: the stack runs in an inner model, and the head and the
    loss after that call, in the root's forward."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.model = Decoder(layers)
        self.head = self.model.head  # the inner model's own head is left out of its forward
        self.model.head = nn.Identity()

    def forward(self, tokens, labels):
        logits = self.head(self.model(tokens))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _layers_work(layers: int, build: type[nn.Module] = CausalLM) -> tuple[int, list[int]]:
    """zrs.shard(compile="inductor"): the graphs dynamo captured and the FX nodes of each graph
    inductor lowered, for one training step."""
    lowered: list[int] = []
    run = GraphLowering.run

    def counting_run(self, *args):
        lowered.append(len(self.module.graph.nodes))
        return run(self, *args)

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp, inductor_config.patch(fx_graph_cache=False):
        mp.setattr(GraphLowering, "run", counting_run)
        try:
            model = zrs.shard(build(layers), compile="inductor")
            tokens = torch.randint(0, VOCAB, (2, 8))
            out = model(tokens, tokens) if build is CausalLM else model(tokens).square().mean()
            out.backward()
        finally:
            runtime.reset()
    return counters["stats"]["unique_graphs"], lowered


@pytest.mark.slow
def test_compiled_layers_of_zrs_shard_compile_once_at_any_depth() -> None:
    """zrs.shard's compiled layers: one graph for the stack and one for the root's code after
    the inner model's call (the head and the loss), each a forward and a backward lowered, of
    the same sizes at 4 and at 32 layers; the embedding runs eagerly in the inner model."""
    few, many = _layers_work(4), _layers_work(32)
    assert few[0] == many[0] == 2, (few, many)
    assert len(few[1]) == 4 and few[1] == many[1], (few, many)


@pytest.mark.slow
def test_a_root_that_loops_compiles_a_few_nodes_a_layer_around_one_compiled_layer() -> None:
    """zrs.shard's compiled layers where the root's own forward loops over them: one graph for
    the stack, one for the root around the layers' calls (each an opaque op, a node or two),
    lowered as a forward and a backward each. The layer's graphs keep their sizes from 4 to 32
    layers; the root's grow by 3 forward and 4 backward nodes a layer (the op, its output and
    its token; zrs.compile's outer graphs: about 88 a layer, docs/compile-time.md)."""
    few, many = _layers_work(4, Decoder), _layers_work(32, Decoder)
    assert few[0] == many[0] == 2, (few, many)
    assert len(few[1]) == len(many[1]) == 4, (few, many)
    (root_fw, layer_fw, root_bw, layer_bw), (root_fw_32, layer_fw_32, root_bw_32, layer_bw_32) = (
        few[1],
        many[1],
    )
    assert (layer_fw, layer_bw) == (layer_fw_32, layer_bw_32), (few, many)
    assert root_fw_32 - root_fw <= 3 * 28 and root_bw_32 - root_bw <= 4 * 28, (few, many)


def test_compiling_a_model_without_a_stack_says_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="zrs"):
        try:
            zrs.shard(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), compile=True)
        finally:
            runtime.reset()
    said = [r.getMessage() for r in caplog.records if r.name == "zrs"]
    assert any("no stack of repeated layers" in m for m in said), said


@pytest.mark.parametrize("value", [3, "", None])
def test_compile_must_be_a_flag_or_a_backend_name(value) -> None:
    with pytest.raises(zrs.ZrsError, match="compile="):
        zrs.shard(nn.Linear(4, 2), compile=value)
