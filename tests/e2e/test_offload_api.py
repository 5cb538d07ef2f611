"""offload="optimizer" and "params" in one process, on zrs.shard and on zrs.compile (its eager
backend): the device copy follows every change of the host master (a step, a load, an in-place
write; with "params", the host's compute copy that each gather stages in),
gradients come back after the step, a resume continues as if uninterrupted, and what offload
cannot do raises a ZrsError."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import zrs


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


# zrs.compile's graphs gather from the device copy as the eager path does (runtime/gather.py);
# "-params": offload="params"
APIS = ("shard", "compile", "shard-params", "compile-params")


def _offloaded(model: nn.Module, api: str, **kw: object) -> nn.Module:
    entry, _, params = api.partition("-")
    offload = "params" if params else "optimizer"
    if entry == "compile":
        return zrs.compile(model, offload=offload, backend="eager", **kw)
    return zrs.shard(model, offload=offload, **kw)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = model(_batch(step)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("api", APIS)
def test_adamw_on_the_host_trains_as_torch_does_and_keeps_its_gradients(api):
    plain = _model()
    model = _offloaded(copy.deepcopy(plain), api)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, model)]
    for step in range(4):
        losses = []
        for m, opt in zip((plain, model), opts, strict=True):
            opt.zero_grad()
            loss = m(_batch(step)).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7)
        # the step hid the gradients from torch's own update only while it ran
        assert all(p.grad is not None for p in model.parameters())
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)
    assert {v.device.type for s in opts[1].state.values() for v in s.values()} == {"cpu"}


@pytest.mark.parametrize("api", APIS)
def test_a_loaded_state_reaches_the_device_copy(api):
    plain, other = _model(), _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model = _offloaded(copy.deepcopy(plain), api, param_dtype=torch.bfloat16)
    x = _batch(0)
    model(x)  # gathered once from the first copy
    model.load_state_dict(zrs.full_state_dict(zrs.shard(copy.deepcopy(other))))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = other(x)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_a_resume_from_the_optimizer_state_continues_exactly():
    base = _model()
    whole = zrs.shard(copy.deepcopy(base), offload="optimizer")
    opt = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    want = _train(whole, opt, range(6))

    first = zrs.shard(copy.deepcopy(base), offload="optimizer")
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    got = _train(first, opt_first, range(3))
    saved = (zrs.full_state_dict(first), copy.deepcopy(opt_first.state_dict()))
    resumed = zrs.shard(_model(), offload="optimizer")
    resumed.load_state_dict(saved[0])
    opt_resumed = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt_resumed.load_state_dict(saved[1])
    got += _train(resumed, opt_resumed, range(3, 6))
    assert got == want


def test_what_offload_refuses():
    with pytest.raises(zrs.ZrsError, match="pass None,"):
        zrs.shard(_model(), offload="cpu")
    with pytest.raises(zrs.ZrsError, match="fp32 masters on the host"):
        zrs.shard(_model(), offload="optimizer", master_dtype=torch.bfloat16)
    model = zrs.shard(_model(), offload="optimizer")
    model(_batch(0)).sum().backward()
    with pytest.raises(zrs.ZrsError, match="Adagrad has no host update"):
        torch.optim.Adagrad(model.parameters()).step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.found_inf = torch.zeros(())  # as torch.amp.GradScaler and zrs.GraphedStep hand it
    with pytest.raises(zrs.ZrsError, match="does not read the found_inf"):
        opt.step()


def test_the_ranks_of_a_host_split_its_cores(monkeypatch):
    from zrs.runtime import offload

    monkeypatch.setattr(offload.os, "sched_getaffinity", lambda _: set(range(32)), raising=False)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert offload.host_threads(cpu) == 12  # three quarters of 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert offload.host_threads(cpu) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert offload.host_threads(cpu) == 24
    # without torchrun's count, one rank a GPU beside a GPU
    monkeypatch.setattr(offload.torch.cuda, "device_count", lambda: 4)
    assert offload.host_threads(gpu) == 6
    monkeypatch.setenv("ZRS_OFFLOAD_THREADS", "5")
    assert offload.host_threads(cpu) == 5


# DCP warns that it assumes one process: that is this test's intent.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("api", APIS)
def test_a_dcp_resume_in_one_process_continues_exactly(tmp_path, api):
    """PyTorch's DCP recipe without torch.distributed (plain tensors); with DTensors on several
    ranks, DCP's load bumps no version counter of the masters it writes: tests/e2e/
    test_checkpoint.py resumes an offloaded run at world 2, and loads it at 1 and 3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def state(model, opt):
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    base = _model()
    first = _offloaded(copy.deepcopy(base), api)
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _train(first, opt, range(2))
    dcp.save(state(first, opt), checkpoint_id=str(tmp_path))
    want = _train(first, opt, range(2, 4))

    resumed = _offloaded(copy.deepcopy(base), api)
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    content = state(resumed, opt)
    dcp.load(content, checkpoint_id=str(tmp_path))
    set_state_dict(
        resumed, opt, model_state_dict=content["model"], optim_state_dict=content["optim"]
    )
    assert _train(resumed, opt, range(2, 4)) == want


@pytest.mark.parametrize("api", APIS)
def test_gradient_accumulation_adds_on_the_host(api):
    """Two micro-batches a step: the second backward adds into the host gradients."""
    plain = _model()
    model = _offloaded(copy.deepcopy(plain), api)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, model)]
    for step in range(3):
        for m, opt in zip((plain, model), opts, strict=True):
            opt.zero_grad(set_to_none=step != 1)  # kept and zeroed in place once
            for micro in range(2):
                (m(_batch(10 * step + micro)).square().mean() / 2).backward()
            opt.step()
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("api", APIS)
def test_a_step_given_a_closure_updates_with_the_gradients_the_closure_makes(api):
    """torch calls a closure inside step(), after the pre-hooks (Lightning passes its forward
    and backward so): the host update waited for it. It ran before the closure, on the last
    step's gradients, and Lightning trained 0.19 away from DDP without an error."""
    plain = _model()
    model = _offloaded(copy.deepcopy(plain), api)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, model)]
    for step in range(4):
        for m, opt in zip((plain, model), opts, strict=True):

            def closure(m=m, opt=opt, step=step):
                opt.zero_grad()
                loss = m(_batch(step)).square().mean()
                loss.backward()
                return loss

            loss = opt.step(closure) if step % 2 else opt.step(closure=closure)
            assert loss is not None and loss.requires_grad
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("api", APIS)
def test_a_parameter_read_outside_the_forward_gets_its_gradient_on_the_host(api):
    """Read outside the forward, a parameter is gathered eagerly from its device copy; the
    gradient through it joins the forward's on the host."""
    plain = _model()
    model = _offloaded(copy.deepcopy(plain), api)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, model)]
    for step in range(3):
        for m, opt in zip((plain, model), opts, strict=True):
            opt.zero_grad()
            (m(_batch(step)).square().mean() + m[0].weight.square().sum()).backward()
            assert {p.grad.device.type for p in m.parameters()} == {"cpu"}
            opt.step()
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("api", APIS)
def test_in_place_writes_to_the_dtensor_parameters_reach_the_device_copy(tmp_path, api):
    """With a process group the parameters are DTensors, and an in-place op on one runs below
    autograd on its local tensor: neither the master's version nor the local's moves, only the
    DTensor's own. The next forward must still read the written values."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        plain = _model()
        model = _offloaded(copy.deepcopy(plain), api, param_dtype=torch.bfloat16)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        x = _batch(0)
        model(x)  # gathered once from the first copy
        with torch.no_grad():
            (w0, b0, w1, b1), (pw0, pb0, pw1, pb1) = model.parameters(), plain.parameters()
            for mine, theirs in ((w0, pw0), (b1, pb1)):
                mine.mul_(0.5)
                theirs.mul_(0.5)
            b0.fill_(0.25)
            pb0.fill_(0.25)
            w1.to_local().add_(1.0)
            pw1.add_(1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = plain(x)
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def _overlapped(max_norm: float | None = None, api: str = "shard", **kw):
    model = _offloaded(_model(), api, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, zrs.OverlappedStep(opt, max_norm=max_norm)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_updates_during_the_backward_match_torch(max_norm, api):
    """zrs.OverlappedStep: the updates run as the gradients arrive (with max_norm after the
    backward, clipped as clip_grad_norm_ clips); the step returns the norm."""
    plain = _model()
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt, step = _overlapped(max_norm, api)
    for n in range(4):
        ref.zero_grad()
        plain(_batch(n)).square().mean().backward()
        want = (
            None
            if max_norm is None
            else torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
        )
        ref.step()
        opt.zero_grad()
        model(_batch(n)).square().mean().backward()
        norm = step()
        if max_norm is None:
            assert norm is None
        else:
            torch.testing.assert_close(torch.tensor(norm, dtype=torch.float32), want)
        assert all(p.grad is not None for p in model.parameters())
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_accumulated_updates_run_in_the_last_backward_as_torch_steps(max_norm, api):
    """accumulation_steps=3: two backwards add on the host, the updates run in the third (with
    max_norm after its global norm); gradients kept and zeroed in place (set_to_none=False)
    accumulate as well as set to None."""
    plain = _model()
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    model = _offloaded(_model(), api)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = zrs.OverlappedStep(opt, max_norm=max_norm, accumulation_steps=3)
    for n in range(3):
        for m, o in ((plain, ref), (model, opt)):
            o.zero_grad(set_to_none=n != 1)
            for micro in range(3):
                (m(_batch(10 * n + micro)).square().mean() / 3).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
        ref.step()
        step()
    full = zrs.full_state_dict(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_a_non_finite_norm_skips_the_overlapped_step():
    model, opt, step = _overlapped(max_norm=1.0)
    before = {k: v.clone() for k, v in zrs.full_state_dict(model).items()}
    opt.zero_grad()
    (model(_batch(0)).square().mean() * float("inf")).backward()
    assert not math.isfinite(step()) and step.skipped_steps == 1
    for k, v in zrs.full_state_dict(model).items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    opt.zero_grad()
    model(_batch(1)).square().mean().backward()
    step()
    assert step.skipped_steps == 1
    assert any(not torch.equal(v, before[k]) for k, v in zrs.full_state_dict(model).items())


def test_what_the_overlapped_step_refuses():
    model, opt, step = _overlapped()
    model(_batch(0)).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(zrs.ZrsError, match=r"changed after its update ran.*max_norm"):
        step()

    model, opt, step = _overlapped()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(_batch(0)).square().mean().backward()
    with pytest.warns(UserWarning, match="lr_scheduler.step"):
        sched.step()  # before the optimizer's step: the updates read the old lr
    with pytest.raises(zrs.ZrsError, match="hyperparameter changed"):
        step()

    model, opt, step = _overlapped()
    model(_batch(0)).square().mean().backward()
    with pytest.raises(zrs.ZrsError, match=r"after the 1 of a step.*before the optimizer"):
        model(_batch(1)).square().mean().backward()  # accumulation without accumulation_steps

    model = _offloaded(_model(), "shard")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zrs.OverlappedStep(opt, accumulation_steps=3)
    for micro in range(2):
        model(_batch(micro)).square().mean().backward()
    with pytest.raises(zrs.ZrsError, match="after 2 of the step's 3 backwards"):
        step()
    for bad in (0, 1.5, True):
        with pytest.raises(zrs.ZrsError, match="accumulation_steps must be a positive int"):
            zrs.OverlappedStep(opt, accumulation_steps=bad)

    # One norm a model: two models under one optimizer cannot clip together (nothing installed).
    first, second = _offloaded(_model(), "shard"), _offloaded(_model(), "shard")
    both = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    with pytest.raises(zrs.ZrsError, match="steps 2 zrs models"):
        zrs.OverlappedStep(both, max_norm=1.0)
    assert first._zrs_state.offload.overlap is None and second._zrs_state.offload.overlap is None

    # A gradient the last backward did not reach was left out of the norm: refused.
    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
            return self.a(x) + self.b(x) if both else self.a(x)

    model = _offloaded(Branches(), "shard")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zrs.OverlappedStep(opt, max_norm=1.0, accumulation_steps=2)
    for micro, both in enumerate((True, False)):
        model(_batch(micro), both).square().mean().backward()
    with pytest.raises(zrs.ZrsError, match=r"`b\.weight` has a gradient that the step's last"):
        step()

    with pytest.raises(zrs.ZrsError, match=r'offload="optimizer"'):
        zrs.OverlappedStep(torch.optim.AdamW(zrs.shard(_model()).parameters()))


def test_a_dropped_model_and_its_overlapped_step_are_freed():
    """The worker thread holds its updates weakly: dropping the model, the optimizer and the
    step frees the model's state (the host masters) and ends the worker."""
    import gc
    import threading
    import time
    import weakref

    def train() -> tuple[weakref.ref, weakref.ref]:
        model, opt, step = _overlapped()
        for n in range(2):
            model(_batch(n)).square().mean().backward()
            step()
            opt.zero_grad()
        return weakref.ref(model._zrs_state), weakref.ref(opt)

    before = set(threading.enumerate())
    state, opt = train()
    (worker,) = (t for t in threading.enumerate() if t not in before)
    gc.collect()
    assert state() is None and opt() is None
    deadline = time.monotonic() + 5
    while worker.is_alive():
        assert time.monotonic() < deadline, "the worker outlived its model"
        time.sleep(0.01)
