"""zrs.GraphedStep on the CPU, where it runs its operations eagerly (the graphs: tests/gpu):
clipping and the non-finite skip match the plain loop bit for bit, gradients stay at fixed
addresses, and what a captured step cannot take raises. Across ranks: the zoo, clipped, against
the unsharded reference."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn

import zrs
from _dist import cached_run, reemit_warnings
from zoo import Case, case_outcome, compare_params, run_cases, spec_of, train_reference

MAX_NORM = 0.05  # below the zoo's gradient norms: every step clips
# Biases, tied, frozen and 0-d parameters, and a Hugging Face Llama on batches whose length
# changes every step.
MODELS = ("gpt_tied", "frozen", "scalar_param", "bias_stack", "hf_llama_varlen")
STEPS = 4  # two warmup steps, then the steps a GPU would replay


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    return torch.optim.AdamW(params, lr=torch.tensor(0.01), weight_decay=0.1, fused=True)


def _wrap(model: nn.Module, how: str) -> nn.Module:
    return zrs.shard(model) if how == "shard" else zrs.compile(model, backend="eager")


def _backward(model: nn.Module, step: int, poison: bool = False) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    if poison:  # an overflow in one gradient
        _local(next(model.parameters()).grad).view(-1)[0] = float("inf")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.parametrize("how", ["shard", "compile"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_matches_the_plain_clip_and_check_loop_bit_for_bit(how: str, kind: str) -> None:
    torch.manual_seed(0)
    plain = Net()
    model = _wrap(copy.deepcopy(plain), how)
    opt_p, opt_m = _optimizer(plain.parameters(), kind), _optimizer(model.parameters(), kind)
    step = zrs.GraphedStep(opt_m, max_norm=0.5)
    for i in range(6):
        poison = i == 3  # a warmup step skips on the host, a later one on the device
        for m, o in ((plain, opt_p), (model, opt_m)):
            o.zero_grad()
            _backward(m, i, poison)
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        if expected.isfinite():
            opt_p.step()
        got = step()
        assert torch.equal(got, expected) or (poison and not got.isfinite()), (i, got, expected)
    assert step.skipped_steps == 1
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        assert torch.equal(full[name], p.detach()), name
    if kind == "adamw":
        steps = {float(s["step"]) for s in opt_m.state.values()}
        assert steps == {5.0}, steps  # the skipped step did not count


def test_a_skipped_first_step_leaves_no_momentum_behind() -> None:
    torch.manual_seed(0)
    plain = Net()
    model = zrs.shard(copy.deepcopy(plain))
    opt_p, opt_m = _optimizer(plain.parameters(), "sgd"), _optimizer(model.parameters(), "sgd")
    step = zrs.GraphedStep(opt_m)
    for i in range(3):
        for m, o in ((plain, opt_p), (model, opt_m)):
            o.zero_grad()
            _backward(m, i, poison=i == 0)
        if i > 0:
            opt_p.step()
        step()
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        assert torch.equal(full[name], p.detach()), name


@pytest.mark.parametrize(
    ("set_to_none", "reduce_dtype"),
    [(True, None), (False, None), (True, torch.bfloat16), (False, torch.bfloat16)],
)
def test_gradients_stay_where_the_step_reads_them(
    set_to_none: bool, reduce_dtype: torch.dtype | None
) -> None:
    model = zrs.compile(Net(), backend="eager", reduce_dtype=reduce_dtype)
    opt = _optimizer(model.parameters(), "sgd")
    step = zrs.GraphedStep(opt)  # warmup 2: the graph reads the third step's gradients
    addresses = []
    for i in range(5):
        opt.zero_grad(set_to_none=set_to_none)
        _backward(model, i)
        if i < 2:  # the warmup's gradients come and go as without GraphedStep
            assert model._zrs_state.grad_store is None
        step()
        addresses.append([_local(p.grad).data_ptr() for p in model.parameters()])
    assert addresses[2:] == [addresses[2]] * 3


def test_gradients_accumulated_over_micro_batches_match() -> None:
    torch.manual_seed(0)
    plain = Net()
    model = zrs.compile(copy.deepcopy(plain), backend="eager")
    opt_p, opt_m = _optimizer(plain.parameters(), "sgd"), _optimizer(model.parameters(), "sgd")
    step = zrs.GraphedStep(opt_m, max_norm=0.5)
    for i in range(4):
        for m, o in ((plain, opt_p), (model, opt_m)):
            o.zero_grad()
            _backward(m, 2 * i)
            _backward(m, 2 * i + 1)  # added to the gradients the first left in place
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt_p.step()
        step()
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)


class FailsInBackward(Net):
    """Net whose backward raises, when asked to, once the head's gradients are in a bucket."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        if self.fail:
            x.register_hook(self._raise)
        return self.head(torch.tanh(self.layers[1](x)))

    @staticmethod
    def _raise(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")


def test_a_backward_that_raises_leaves_no_region_held(caplog) -> None:
    torch.manual_seed(0)
    plain = FailsInBackward()
    model = zrs.shard(copy.deepcopy(plain))
    opt_p, opt_m = _optimizer(plain.parameters(), "sgd"), _optimizer(model.parameters(), "sgd")
    step = zrs.GraphedStep(opt_m)
    for i in range(6):
        for m, o in ((plain, opt_p), (model, opt_m)):
            o.zero_grad()
            m.fail = i == 2
            if m.fail:
                with pytest.raises(RuntimeError, match="backward failed"):
                    _backward(m, i)
            else:
                _backward(m, i)
        if i == 2:
            regions = model._zrs_state.grad_store.regions.values()
            assert any(r.busy for r in regions)  # the dropped bucket's
            continue
        opt_p.step()
        step()
        store = model._zrs_state.grad_store
        assert (store is None) == (i == 0), i  # made by the last warmup call (i == 1)
        assert store is None or not any(r.busy for r in store.regions.values()), i
    assert "stopped part-way" in caplog.text  # the next forward recovered
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        assert torch.equal(full[name], p.detach()), name


def test_a_float_learning_rate_that_a_scheduler_changes_raises() -> None:
    model = zrs.shard(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    step = zrs.GraphedStep(opt)
    with pytest.raises(zrs.ZrsError, match=r"'lr' changed from 0.1 to 0.05.*torch.tensor\(0.1\)"):
        for i in range(6):
            opt.zero_grad()
            _backward(model, i)
            step()
            sched.step()


def test_a_tensor_learning_rate_follows_the_scheduler() -> None:
    torch.manual_seed(0)
    plain = Net()
    model = zrs.shard(copy.deepcopy(plain))
    opts = [
        torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
        for m in (plain, model)
    ]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    step = zrs.GraphedStep(opts[1])
    for i in range(6):
        for m, o in zip((plain, model), opts, strict=True):
            o.zero_grad()
            _backward(m, i)
        opts[0].step()
        step()
        for s in scheds:
            s.step()
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        assert torch.equal(full[name], p.detach()), name


def test_what_cannot_be_captured_raises() -> None:
    model = zrs.shard(Net())
    with pytest.raises(zrs.ZrsError, match="fused=True"):
        zrs.GraphedStep(torch.optim.SGD(model.parameters(), lr=0.1))
    opt = _optimizer(model.parameters(), "sgd")
    with pytest.raises(zrs.ZrsError, match="cuda_graphs=True needs CUDA"):
        zrs.GraphedStep(opt, cuda_graphs=True)
    with pytest.raises(zrs.ZrsError, match="max_norm"):
        zrs.GraphedStep(opt, max_norm=0.0)
    step = zrs.GraphedStep(opt, warmup=1)
    for i in range(3):
        opt.zero_grad()
        _backward(model, i)
        if i == 2:
            opt.param_groups[0]["lr"] = torch.tensor(0.1)
            with pytest.raises(zrs.ZrsError, match="'lr' changed"):
                step()
        else:
            step()


# --- across ranks: the zoo, clipped ------------------------------------------------------------


def _cases() -> list[Case]:
    return [
        Case(m, backend, steps=STEPS, graphed_step=True, max_norm=MAX_NORM)
        for backend in ("eager", "shard")
        for m in MODELS
    ]


@functools.cache
def _reference(model: str, world: int, max_norm: float | None):
    return train_reference(spec_of(model), world, steps=STEPS, max_norm=max_norm)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.key)
def test_clipped_zoo_matches_reference(world: int, case: Case) -> None:
    results = cached_run(("graphed", world), run_cases, world, _cases())
    per_rank = case_outcome(results, case.key)
    ref = _reference(case.model, world, MAX_NORM)
    unclipped = _reference(case.model, world, None)
    assert any(not torch.equal(ref.final[k], unclipped.final[k]) for k in ref.final), (
        "the clip never bit: lower MAX_NORM"
    )
    for rank, r in enumerate(per_rank):
        for step, (got, exp) in enumerate(zip(r["losses"], ref.losses, strict=True)):
            assert math.isclose(got, exp[rank], rel_tol=1e-5, abs_tol=1e-6), (rank, step)
        reemit_warnings(r["warnings"], where=f"rank {rank}, {case.key}")
    problems = compare_params(per_rank[0]["state"], ref.final, rtol=1e-5, atol=1e-6)
    assert not problems, "\n".join(problems)
