"""Bad input raises a ZrsError that names the problem and the fix, never a silent wrong result:
dtype options, float64 models (kept in float64), partly-meta modules (real tensors keep their
values) and a memory budget below what a graph needs."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zrs
from _dist import run_workers
from zoo import LR, MLP, MOMENTUM, Batch, Reference, ZooModel, compare_params, train_reference
from zrs.compiler import pipeline
from zrs.runtime import state as runtime

# --- dtype options ------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["param_dtype", "reduce_dtype", "master_dtype"])
@pytest.mark.parametrize("value", [torch.int8, torch.int32, torch.bool, torch.complex64, "float32"])
def test_non_float_dtype_option_raises_before_sharding(option, value):
    model = nn.Linear(3, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(zrs.ZrsError, match=rf"{option} must be a floating-point torch\.dtype"):
        zrs.compile(model, backend="eager", **{option: value})
    assert type(model) is nn.Linear, "the model must not be sharded after the error"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_integer_parameter_raises_before_anything_is_sharded():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(zrs.ZrsError, match=r"'1\.steps' has dtype torch\.int64.*register_buffer"):
        zrs.compile(model, backend="eager")
    assert type(model[0]) is nn.Linear, "the first layer must not be sharded after the error"


def test_float64_mixed_with_float32_raises():
    model = nn.Sequential(nn.Linear(3, 4).double(), nn.Linear(4, 2))
    with pytest.raises(zrs.ZrsError, match=r"mixes float64 .* torch\.float32.*model\.double\(\)"):
        zrs.compile(model, backend="eager")
    assert type(model[0]) is nn.Linear


def test_master_dtype_sets_every_shard_and_the_default_reduce():
    """Mixed float64 and fp32 parameters are fine once master_dtype says what to keep."""
    model = nn.Sequential(nn.Linear(3, 4).double(), nn.Linear(4, 2))
    zrs.compile(model, backend="eager", master_dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model._zrs_state.reduce_dtype == torch.bfloat16
    model(torch.randn(5, 3, dtype=torch.bfloat16)).sum().backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}


# --- float64 models -----------------------------------------------------------------------------


def _double_batch(rank: int, step: int) -> Batch:
    g = torch.Generator().manual_seed(101 * rank + step)
    return (
        torch.randn(6, 7, generator=g, dtype=torch.float64),
        torch.randn(6, 5, generator=g, dtype=torch.float64),
    )


def _mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)  # in float64: the zoo's loss casts to fp32


DOUBLE_MLP = ZooModel("double_mlp", lambda: MLP().double(), _double_batch, _mse, seed=11)


@functools.cache
def _reference() -> Reference:
    return train_reference(DOUBLE_MLP, 2)


def test_float64_model_keeps_float64_single_process():
    model = zrs.compile(DOUBLE_MLP.build(), backend="eager")
    assert model._zrs_state.reduce_dtype == torch.float64
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    DOUBLE_MLP.loss(model, DOUBLE_MLP.batch(0, 0)).backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float64}
    # A full state dict loads back without a round trip through fp32.
    full = {k: v + 1e-12 for k, v in zrs.full_state_dict(model).items()}
    model.load_state_dict(full)
    for k, v in zrs.full_state_dict(model).items():
        assert v.dtype == torch.float64 and torch.equal(v, full[k]), k


def test_explicit_reduce_dtype_wins_over_the_float64_default():
    model = zrs.compile(DOUBLE_MLP.build(), backend="eager", reduce_dtype=torch.float32)
    assert model._zrs_state.reduce_dtype == torch.float32
    DOUBLE_MLP.loss(model, DOUBLE_MLP.batch(0, 0)).backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float64}


def _train_double(rank: int, world: int) -> dict:
    model = zrs.compile(DOUBLE_MLP.build(), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    dtypes = set()
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        DOUBLE_MLP.loss(model, DOUBLE_MLP.batch(rank, step)).backward()
        dtypes |= {(p.dtype, p.grad.dtype) for p in model.parameters()}
        opt.step()
    return {"state": zrs.full_state_dict(model), "dtypes": dtypes}


def test_float64_model_trains_like_unsharded_float64_on_two_ranks():
    ref = _reference()
    for rank, r in enumerate(run_workers(_train_double, 2, timeout=300)):
        assert r["dtypes"] == {(torch.float64, torch.float64)}, (rank, r["dtypes"])
        problems = compare_params(r["state"], ref.final, rtol=0.0, atol=1e-10)
        assert not problems, f"rank {rank}: " + "; ".join(problems)


def test_the_reference_moves_the_float64_parameters():
    """Guards the test above: training moves every parameter far beyond its tolerance."""
    ref = _reference()
    assert all((ref.final[k] - ref.init[k]).abs().max() > 1e-4 for k in ref.final)


# --- partly-meta modules ------------------------------------------------------------------------


def _with_meta_bias(layer: nn.Linear) -> nn.Linear:
    layer.bias = nn.Parameter(torch.empty_like(layer.bias, device="meta"))
    return layer


def test_real_weight_beside_a_meta_bias_keeps_its_values():
    torch.manual_seed(0)
    model = _with_meta_bias(nn.Linear(5, 3))
    pretrained = model.weight.detach().clone()
    zrs.compile(model, backend="eager")
    state = zrs.full_state_dict(model)
    assert torch.equal(state["weight"], pretrained)
    bound = 1 / math.sqrt(5)  # nn.Linear.reset_parameters
    assert state["bias"].abs().max() <= bound and state["bias"].abs().min() > 0


def test_init_fn_initialises_only_the_meta_tensors():
    model = nn.Sequential(_with_meta_bias(nn.Linear(5, 3)), nn.BatchNorm1d(3))
    pretrained = model[0].weight.detach().clone()
    bn = model[1]
    bn.running_mean.fill_(0.25)  # real buffers beside meta parameters
    bn.weight = nn.Parameter(torch.empty(3, device="meta"))
    bn.bias = nn.Parameter(torch.empty(3, device="meta"))

    def fill(module: nn.Module) -> None:  # writes every tensor of the module, real or not
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t.is_floating_point():
                nn.init.constant_(t, 0.5)

    zrs.compile(model, backend="eager", init_fn=fill)
    state = zrs.full_state_dict(model)
    assert torch.equal(state["0.weight"], pretrained)
    assert torch.equal(state["1.running_mean"], torch.full((3,), 0.25))
    for meta in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(state[meta], torch.full((3,), 0.5)), meta


class TiedHeadFirst(nn.Module):
    """The head (sharded first) shares its real weight with the embedding and has a meta bias."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 6)
        self.tok = nn.Embedding(6, 4)
        self.head.weight = self.tok.weight
        _with_meta_bias(self.head)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(idx))


def test_a_tie_to_a_real_weight_survives_partial_materialisation():
    torch.manual_seed(0)
    model = TiedHeadFirst()
    pretrained = model.tok.weight.detach().clone()
    zrs.compile(model, backend="eager")
    assert model.head._parameters["weight"] is model.tok._parameters["weight"]
    state = zrs.full_state_dict(model)
    assert torch.equal(state["tok.weight"], pretrained)
    assert torch.equal(state["head.weight"], pretrained)


# --- memory budget ------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).sum()


def _budget_error(model: nn.Module) -> str:
    """Run `model`: the message of the ZrsError that `except zrs.ZrsError` catches (not dynamo's
    BackendCompilerFailed)."""
    try:
        model(torch.randn(4, 6)).backward()
    except zrs.ZrsError as e:
        return str(e)
    finally:
        runtime.reset()
    pytest.fail("an infeasible budget was accepted")


def _least_budget(message: str) -> int:
    found = re.search(r"raise memory_budget to at least (\d+)", message)
    assert found, message
    return int(found.group(1))


def test_too_small_budget_raises_a_zrs_error_naming_the_least_budget():
    torch.manual_seed(0)
    message = _budget_error(zrs.compile(Net(), backend="eager", memory_budget=1))
    assert message.startswith("forward graph 0: memory budget of 1 bytes is infeasible"), message
    model = zrs.compile(Net(), backend="eager", memory_budget=_least_budget(message))
    model(torch.randn(4, 6)).backward()  # the named budget is enough


def test_too_small_budget_for_the_backward_graph_raises_a_zrs_error(monkeypatch):
    plan = pipeline.plan_graph

    def backward_budget_of_one_byte(graph, graph_id, *, is_backward, ctx):
        if is_backward:
            ctx = dataclasses.replace(ctx, budget=1)
        return plan(graph, graph_id, is_backward=is_backward, ctx=ctx)

    monkeypatch.setattr(pipeline, "plan_graph", backward_budget_of_one_byte)
    torch.manual_seed(0)
    message = _budget_error(zrs.compile(Net(), backend="eager", memory_budget=1 << 20))
    assert message.startswith("backward graph 0: memory budget of"), message
    assert _least_budget(message) > 1
