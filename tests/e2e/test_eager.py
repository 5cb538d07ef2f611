"""zrs.shard, the eager path, in one process: the trace and its modes, what stays gathered when,
prefetching by the trace, activation checkpointing, gradient accumulation and persistent
parameters. Across ranks: test_correctness.py and test_hf_models.py (backend "shard") and
test_faults.py."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import zrs
from zoo import LR, MOMENTUM, spec_of
from zrs.runtime import grads


class Reorderable(nn.Module):
    """Three layers whose order a flag changes, the head reading the first layer's weight too
    (a parameter fetched by another module than its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 2)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = [1, 0, 2] if self.swap else [0, 1, 2]
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return self.head(x) + x @ self.layers[0].weight[:2].T


def _pair(build=Reorderable, **kwargs):
    torch.manual_seed(0)
    plain = build()
    model = zrs.shard(copy.deepcopy(plain), **kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (plain, model)]
    return plain, model, opts


def _step(model, opt, x, swap=False) -> torch.Tensor:
    model.swap = swap
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _assert_same(plain: nn.Module, model: nn.Module) -> None:
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)


def test_a_changed_order_warns_once_and_records_again(caplog):
    plain, model, (opt_p, opt_m) = _pair()
    coordinator = model._zrs_state.fetcher.coordinator
    assert coordinator.mode == "record"
    swaps = [False, False, True, False, False]
    modes = []
    with caplog.at_level(logging.WARNING, logger="zrs"):
        for step, swap in enumerate(swaps):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            torch.testing.assert_close(_step(model, opt_m, x, swap), _step(plain, opt_p, x, swap))
            modes.append(coordinator.mode)
    # the swap invalidates the trace; the next step records it again, the one after follows it
    assert modes == ["complete", "complete", "record", "complete", "complete"]
    warnings = [r.getMessage() for r in caplog.records if "recorded trace" in r.getMessage()]
    assert len(warnings) == 1, warnings  # the swapped step (the next one records)
    assert "layers.1" in warnings[0] and "layers.0" in warnings[0]
    _assert_same(plain, model)


def test_nothing_stays_gathered_but_what_the_backward_starts_with():
    _, model, (_, opt) = _pair()
    fetcher = model._zrs_state.fetcher
    x = torch.randn(4, 6)
    _step(model, opt, x)  # records the trace

    def gathered() -> set[str]:
        return {fetcher.handles[s].name for s, r in enumerate(fetcher.ready) if r}

    def storage() -> int:
        return sum(raw.untyped_storage().nbytes() for raw in fetcher.raws)

    loss = model(x).square().mean()
    # What the backward starts with stays gathered: the head, and the last layer (within
    # max_reuse_distance, the largest unit's numel, of its backward); also layers.0.weight, which
    # the root read after the layers: the trace counts the read at the root's activation, which
    # comes before layers.0's. The other layers were released, though autograd holds on to
    # their leaves: their storage is gone until their backward gathers them again.
    kept = {"head.weight", "head.bias", "layers.2.weight", "layers.2.bias", "layers.0.weight"}
    assert gathered() == kept
    assert storage() == sum(fetcher.raws[s].numel() * 4 for s, r in enumerate(fetcher.ready) if r)
    loss.backward()
    assert gathered() == set() and storage() == 0
    with torch.no_grad():
        model(x)
    assert gathered() == set() and storage() == 0


def test_the_second_step_prefetches_by_the_trace(monkeypatch):
    _, model, (_, opt) = _pair()
    fetcher = model._zrs_state.fetcher
    decisions: list[tuple] = []
    run = fetcher._run
    monkeypatch.setattr(fetcher, "_run", lambda fetch: (decisions.append(fetch), run(fetch))[1])
    x = torch.randn(4, 6)
    _step(model, opt, x)
    first = list(decisions)
    decisions.clear()
    _step(model, opt, x)
    assert not any(prefetch for _, _, prefetch, _ in first), "the recording step prefetches"
    issued = [fetcher.handles[s].name for issue, _, _, _ in decisions for s in issue]
    prefetched = {fetcher.handles[s].name for _, _, pre, _ in decisions for g in pre for s in g}
    # Following the trace, every unit's parameters were prefetched: the root's forward prefetches
    # the first layer's. Only the root's own read of layers.0.weight (after the layers ran, in
    # the trace at the root's position) is gathered on the spot.
    assert issued == ["layers.0.weight"], decisions
    assert prefetched == {n for n, _ in model.named_parameters()}, decisions


def test_gradients_are_packed_a_unit_at_a_time(monkeypatch):
    """The gradients autograd finishes wait for their unit's backward to end (or their bucket to
    fill) and are packed together: fewer pack kernels than parameters, the same weights."""
    plain, model, (opt_p, opt_m) = _pair()
    packed: list[int] = []
    reduce = grads.reduce_grads
    monkeypatch.setattr(grads, "reduce_grads", lambda *a: (packed.append(len(a[2])), reduce(*a))[1])
    x = torch.randn(4, 6)
    for swap in (False, False, True):
        packed.clear()
        _step(plain, opt_p, x, swap)
        _step(model, opt_m, x, swap)
        n_params = len(list(model.parameters()))
        assert sum(packed) == n_params and len(packed) < n_params, packed
    _assert_same(plain, model)


def test_a_backward_that_raised_leaves_no_gradient_behind():
    """The gradients a raising backward had finished (here all of them: one module, nothing
    packed before the end) are dropped with it, not packed into the next step's buckets."""
    plain, model, (opt_p, opt_m) = _pair(lambda: nn.Linear(6, 2))
    x = torch.randn(4, 6)

    def boom(_):
        raise RuntimeError("boom")

    raising = x.clone().requires_grad_(True)
    raising.register_hook(boom)  # after the module's backward, before the end
    with pytest.raises(RuntimeError, match="boom"):
        model(raising).square().mean().backward()
    assert model._zrs_state.fetcher.pending, "the case this test is for"
    opt_m.zero_grad(set_to_none=True)
    for _ in range(2):
        # The model first: any optimizer's step (the plain model's too) drops what zrs holds.
        _step(model, opt_m, x)
        _step(plain, opt_p, x)
    _assert_same(plain, model)


@pytest.mark.parametrize("compile", [False, "aot_eager"], ids=["eager", "compiled-layers"])
def test_activation_checkpointing_and_accumulation_match_the_plain_model(compile):
    """Also with each layer compiled: the checkpoint's recompute runs the compiled forward
    again inside the backward, between the layer's hooks."""
    spec = spec_of("hf_gpt2")
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    plain = spec.build()
    model = zrs.shard(copy.deepcopy(plain), compile=compile)
    for m in (plain, model):
        # transformers renamed gradient_checkpointing_enable (which now warns) in 5.x
        enable = getattr(m, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (plain, model)]
    for step in range(3):
        for m, opt in zip((plain, model), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            for micro in range(2):  # two micro-batches per step
                (spec.loss(m, spec.batch(micro, step)) / 2).backward()
            opt.step()
    _assert_same(plain, model)
    assert not any(model._zrs_state.fetcher.ready)
    if compile:
        assert counters["stats"]["unique_graphs"] >= 1, "no layer was compiled"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_one_torch_compile_per_layer_class(monkeypatch):
    """zrs.shard(compile=...) calls torch.compile once for a stack's forward function, not once
    per layer (each call copies inductor's configuration); a forward set on one instance gets
    its own, and the root's forward around the stack one more; the layers still train as the
    plain model does."""
    calls: list[object] = []
    original = torch.compile

    def counting(fn, **kwargs):
        calls.append(fn)
        return original(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", counting)
    torch.manual_seed(0)
    torch._dynamo.reset()
    plain = _Stack()
    model = copy.deepcopy(plain)
    lone = model.layers[-1]
    lone.forward = functools.partial(_Block.forward, lone)  # set on the instance
    model = zrs.shard(model, compile="aot_eager")
    assert len(calls) == 3, calls
    assert calls[0] is _Block.forward  # shared by the first three layers
    assert isinstance(calls[1], functools.partial)  # the instance's own
    assert calls[2].__func__ is _Stack.forward  # the root's loop, around the layers' calls
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (plain, model)]
    for _ in range(3):
        x = torch.randn(4, 6)
        _step(plain, opts[0], x)
        _step(model, opts[1], x)
    _assert_same(plain, model)


def test_persistent_parameters_stay_gathered_until_the_optimizer_step():
    plain, model, (opt_p, opt_m) = _pair(persist_numel=7)  # the biases (6) and the head's (2)
    fetcher = model._zrs_state.fetcher
    x = torch.randn(4, 6)
    model(x).square().mean().backward()
    kept = {fetcher.handles[s].name for s, r in enumerate(fetcher.ready) if r}
    assert kept == {"layers.0.bias", "layers.1.bias", "layers.2.bias", "head.bias"}
    opt_m.step()  # the shards change: the gathered copies are dropped
    assert not any(fetcher.ready)
    opt_m.zero_grad()
    plain(x).square().mean().backward()
    opt_p.step()
    opt_p.zero_grad()
    for step in range(2):
        _step(plain, opt_p, x + step)
        _step(model, opt_m, x + step)
    _assert_same(plain, model)


class LoraLayer(nn.Module):
    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))


class Lora(nn.Module):
    """Layers of a frozen base weight and a trainable low-rank adapter (LoRA); `probe` runs when
    the gradient of the first layer's output is complete."""

    def __init__(self, width: int = 8, rank: int = 2, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoraLayer(width, rank) for _ in range(layers))
        self.probe = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0 and self.probe is not None and x.requires_grad:
                x.register_hook(lambda _: self.probe())
        return x


def test_frozen_weights_go_when_their_layer_finished_its_backward():
    plain, model, (opt_p, opt_m) = _pair(Lora)
    fetcher = model._zrs_state.fetcher
    seen: list[set[str]] = []

    def gathered_bases() -> set[str]:
        ready = {fetcher.handles[s].name for s, r in enumerate(fetcher.ready) if r}
        return {n for n in ready if ".base." in n}

    model.probe = lambda: seen.append(gathered_bases())
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(_step(model, opt_m, x), _step(plain, opt_p, x))
        assert not any(fetcher.ready)
    _assert_same(plain, model)
    # When the first layer's backward starts, layers 2 and 3 have finished theirs (the
    # gradient of their inputs is complete): their base weights are released. Layer 1's ends
    # at this very moment; layer 0's inputs need no gradient, so its base stays to the end.
    for bases in seen:
        assert "layers.2.base.weight" not in bases and "layers.3.base.weight" not in bases, seen
        assert {"layers.0.base.weight", "layers.0.base.bias"} <= bases, seen


@pytest.mark.parametrize("name", ["prefetch_numel", "max_live_numel", "max_reuse_distance"])
def test_limits_must_be_counts(name):
    with pytest.raises(zrs.ZrsError, match=name):
        zrs.shard(nn.Linear(2, 2), **{name: -1})
