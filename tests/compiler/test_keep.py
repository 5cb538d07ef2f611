"""A training forward keeps its last-used gathered parameters for the backward (compiler/keep.py):
the backward gathers fewer parameters, the results do not change, nothing outlives the step, and
a kept copy is never used once its shard has changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._inductor import config as inductor_config

import zrs
from lowered import as_several_ranks
from zrs import _core
from zrs.runtime import gather
from zrs.runtime import state as runtime

BACKENDS = ["eager", "inductor"]


class Stack(nn.Module):
    """Four small layers and a wide head: the head and the last layers fit the allowance
    (two of the largest gathers), the first layers do not."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 32)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


@pytest.fixture
def gathered(monkeypatch):
    """ds_ids that went into a collective, in order (a fused gather counts each member)."""
    ids: list[int] = []
    start = gather._start_gather

    def spy(todo, *args, **kwargs):
        ids.extend(h.ds_id for h, _, _ in todo)
        return start(todo, *args, **kwargs)

    monkeypatch.setattr(gather, "_start_gather", spy)
    with inductor_config.patch(fx_graph_cache=False):  # a cache hit would skip the passes
        yield ids
    runtime.reset()


def _model(backend: str, keep: bool, **options: object) -> nn.Module:
    torch.manual_seed(0)
    return as_several_ranks(
        zrs.compile(Stack(), backend=backend, keep_for_backward=keep, **options)
    )


def _step(model: nn.Module, gathered: list[int], seed: int = 1) -> tuple[float, int, int]:
    """One forward and backward: (loss, gathers in the forward, gathers in the backward)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    before = len(gathered)
    loss = model(x).square().mean()
    forward = len(gathered) - before
    loss.backward()
    return loss.item(), forward, len(gathered) - before - forward


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backward_gathers_fewer_parameters_and_computes_the_same(gathered, backend):
    plain = _model(backend, keep=False)
    plain_loss, plain_fw, plain_bw = _step(plain, gathered)
    kept = _model(backend, keep=True)
    loss, fw, bw = _step(kept, gathered)
    assert fw == plain_fw == 10, "the forward gathers every parameter either way"
    assert bw < plain_bw, f"{bw} gathers in the backward with keep, {plain_bw} without"
    assert loss == pytest.approx(plain_loss, rel=0, abs=0)
    for a, b in zip(kept.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    # Nothing outlives the step: every kept copy was taken over or freed at the backward's end.
    state = kept._zrs_state
    assert not state.step.kept and not state.step.buffers
    assert all(state.registry.info(h.slot).holders == 0 for h in state.handles)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kept_copy_is_dropped_once_its_shard_changed(gathered, backend):
    """A forward without backward keeps copies; an in-place update of the shards (what an
    optimizer step does) makes them stale, and the next step gathers afresh."""
    plain, kept = _model(backend, keep=False), _model(backend, keep=True)
    for model in (plain, kept):
        model(torch.randn(4, 8)).sum()  # no backward: the kept copies stay
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    assert kept._zrs_state.step.kept, "the forward without a backward left its kept copies"
    assert _step(kept, gathered)[0] == _step(plain, gathered)[0]
    for a, b in zip(kept.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_an_optimizer_step_drops_the_kept_copies(gathered):
    model = _model("eager", keep=True)
    model(torch.randn(4, 8)).sum()
    state = model._zrs_state
    assert state.step.kept
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # no grads: the parameters stay as they are
    assert not state.step.kept and not state.step.buffers


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inference_forward_keeps_nothing(gathered, backend):
    model = _model(backend, keep=True)
    with torch.no_grad():
        model(torch.randn(4, 8))
    state = model._zrs_state
    assert not state.step.kept and not state.step.buffers


def test_the_kept_run_is_the_longest_suffix_within_the_allowance():
    releases = [(0, 100), (1, 80), (2, 80), (3, 200)]  # embedding, two layers, head
    # the allowance is two of the largest gathers, capped by what an explicit budget leaves
    assert _core.kept_for_backward(releases, 150) == [2, 3]
    assert _core.kept_for_backward(releases, 150, 280) == [2, 3]
    assert _core.kept_for_backward(releases, 150, 279) == [3]
    assert _core.kept_for_backward(releases, 150, 199) == []
    assert _core.kept_for_backward(releases, 150, -5) == []
    assert _core.kept_for_backward(releases, 99) == []


def test_an_explicit_budget_caps_what_the_forward_keeps(monkeypatch, gathered):
    from zrs.compiler import pipeline

    seen = {}
    keep = pipeline.keep_for_backward

    def spy(graph, budget_left):
        seen["budget_left"] = budget_left
        seen["kept"] = keep(graph, budget_left)
        return seen["kept"]

    monkeypatch.setattr(pipeline, "keep_for_backward", spy)
    _step(_model("eager", keep=True), gathered)
    assert seen["budget_left"] is None and seen["kept"]  # automatic: two of the largest gathers
    runtime.reset()
    _step(_model("eager", keep=True, memory_budget=1 << 30), gathered)
    assert seen["budget_left"] > 0 and seen["kept"]
