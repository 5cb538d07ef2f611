"""Fault scenarios for the multi-process tests and `benches/faults.py`: each runs on every rank of a
process group, injects one fault (an exception, a disagreement, a stopped or killed rank) and
reports per rank what zrs raised and how long after the fault.

A scenario returns a dict per rank: `error` (the text of the first exception caught, "" if none),
`kind` (its class name), `seconds` (from the fault to that exception) and scenario-specific
entries. The timeout is the zrs.compile `timeout=` of every model built here.

Every scenario takes `device`: "cpu" for a gloo group, "cuda" for an NCCL group (this rank's GPU,
the current device). The models and every batch go there. Under NCCL the batches are copied to
the GPU before the fault: a copy from pageable host memory waits for the stream, and a collective
that a lost peer never joins blocks the stream for good (docs/faults.md). Nothing here reads a GPU
value on the host after a fault for the same reason.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import zrs
from zrs.runtime.exchange import group_timeout

STEPS = 6
LR, MOMENTUM = 0.1, 0.9


# Under NCCL a rank whose peer is lost keeps launching work behind a collective that never ends;
# its host must not block meanwhile, or zrs's step check never runs. With the peer stopped at step
# 1, the survivor's host sat in its first gradient accumulation (`add_`, the first of its kind in
# the process) until the watchdog ended it (2 H100s, stacks dumped at the deadline). A first launch
# loads the kernel's module (CUDA's lazy loading, torch's default), and we take that load to wait
# for the device. So each scenario whose survivor must run on past a lost collective faults at
# this step, after every kernel ran once (docs/faults.md).
LOST_PEER_STEP = 2


class Fault(RuntimeError):
    """The exception the scenarios inject."""


class _Trigger:
    """A module between two layers: raises, stops or kills this rank when armed, in the forward
    or in the backward. Called eagerly (a graph break), so that it acts between compiled graphs."""

    def __init__(self) -> None:
        self.forward: Callable[[], None] | None = None
        self.backward: Callable[[], None] | None = None


class _Hook(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, trigger: _Trigger) -> torch.Tensor:
        ctx.trigger = trigger
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        act, ctx.trigger.backward = ctx.trigger.backward, None
        if act is not None:
            act()
        return grad, None


@torch.compiler.disable
def _fire(x: torch.Tensor, trigger: _Trigger) -> torch.Tensor:
    act, trigger.forward = trigger.forward, None
    if act is not None:
        act()
    return _Hook.apply(x, trigger)


# Whether the next tripwire call raises (once). A host-side flag, not a tensor: reading a GPU value
# would sync the host with the device, and an out-of-range index on CUDA is a device-side assert
# that ends the process, not an exception.
_TRIPWIRE = {"armed": False}


@torch.library.custom_op("zrs_faults::tripwire", mutates_args=())
def tripwire(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x`, or an IndexError once `arm_tripwire` was called: an op that raises on the
    host in the middle of a compiled graph, on any device."""
    if _TRIPWIRE["armed"]:
        _TRIPWIRE["armed"] = False
        raise IndexError("the tripwire inside the second graph")
    return x.clone()


@tripwire.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


tripwire.register_autograd(lambda ctx, grad: grad)


def arm_tripwire() -> None:
    """Make the next `tripwire` call (in the next forward of a Net) raise."""
    _TRIPWIRE["armed"] = True


class Net(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        if extra:
            self.extra = nn.Linear(4, 4)  # registered last: only this rank has it
        self.trigger = _Trigger()

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        x = torch.relu(self.first(x))
        x = _fire(x, self.trigger)
        # Inside the second graph: armed, it raises half-way, the head's gather possibly in flight.
        x = tripwire(torch.relu(self.second(x)))
        if branch:  # data-dependent control flow on one rank: a graph only it compiles
            x = x * 2
        return self.head(x)


class Swapped(nn.Module):
    """Two layers of one shape, run in the opposite order with `swap`."""

    def __init__(self, swap: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, then = (self.b, self.a) if self.swap else (self.a, self.b)
        return then(first(x))


def on(device: str) -> torch.device:
    """`device` as a torch.device: "cuda" is this rank's GPU (the current device)."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def build(
    timeout: float | None, backend: str = "eager", device: str = "cpu", **kwargs: Any
) -> tuple[Net, torch.optim.Optimizer]:
    """Net on `device` under zrs.compile with `backend`, or under zrs.shard (`backend="shard"`);
    either with offload="optimizer" after "-offload" ("shard-offload", "eager-offload"), or
    offload="params" after "-params"."""
    torch.manual_seed(0)
    net = Net().to(on(device))
    api, _, offload = backend.partition("-")
    if offload:
        kwargs["offload"] = "optimizer" if offload == "offload" else offload
    if api == "shard":
        model = zrs.shard(net, timeout=timeout, **kwargs)
    else:
        model = zrs.compile(net, backend=api, timeout=timeout, **kwargs)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def batch(rank: int, step: int, rows: int = 6, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(rows, 8, generator=g).to(on(device))


def batches(rank: int, steps: int, device: str, rows: Callable[[int], int] = lambda _: 6) -> list:
    """This rank's batches of `steps` steps on `device`, made before any fault (module docstring)."""
    return [batch(rank, step, rows(step), device) for step in range(steps)]


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def mark_fault(name: str) -> None:
    _store().set(f"fault/{name}", repr(time.time()))


def since_fault(name: str) -> float:
    """Seconds since a rank marked the fault `name`; infinite if none did (the case raised
    before its fault), never a wait on the store."""
    key = f"fault/{name}"
    if not _store().check([key]):
        return float("inf")
    return time.time() - float(_store().get(key).decode())


def _record(name: str, exc: BaseException) -> dict[str, Any]:
    return {"error": str(exc), "kind": type(exc).__name__, "seconds": since_fault(name)}


def _raise(message: str) -> Callable[[], None]:
    def act() -> None:
        raise Fault(message)

    return act


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()
    ]


# --- every rank raises in one phase: a clean recovery -------------------------------------------


def all_ranks_raise(
    rank: int, world: int, timeout: float, backend: str = "eager", device: str = "cpu"
) -> dict[str, Any]:
    """Every rank raises in the forward between graphs (step 1), the backward (step 2), the
    optimizer step (step 3) and the forward inside a graph (step 4), catches it and skips the
    batch; the parameters must equal those of a run that skipped those batches cleanly. Also
    reports the timeouts of the model's communicators."""
    failing, failing_opt = build(timeout, backend, device)
    clean, clean_opt = build(timeout, backend, device)
    xs = batches(rank, STEPS, device)

    def refuse(*_: Any) -> None:
        raise Fault("optimizer step refused")

    caught = []
    for step in range(STEPS):
        for model, opt, faulty in ((failing, failing_opt, True), (clean, clean_opt, False)):
            opt.zero_grad()
            if not faulty and step in (1, 2, 3, 4):
                continue  # the clean skip
            if faulty and step == 1:
                model.trigger.forward = _raise("forward")
            if faulty and step == 2:
                model.trigger.backward = _raise("backward")
            hook = opt.register_step_pre_hook(refuse) if faulty and step == 3 else None
            if faulty and step == 4:
                arm_tripwire()  # raises inside the second graph
            try:
                model(xs[step]).square().mean().backward()
                opt.step()
            except Fault as e:
                caught.append(str(e))
                opt.zero_grad()
            except (IndexError, RuntimeError) as e:
                caught.append(f"in graph: {type(e).__name__}")
                opt.zero_grad()
            if hook is not None:
                hook.remove()
    same = all(torch.equal(a, b) for a, b in zip(_params(failing), _params(clean), strict=True))
    state = failing._zrs_state
    groups = [state.gather_group, state.reduce_group, state.control_group]
    timeouts = [group_timeout(g).total_seconds() for g in groups if g is not None]
    busy = state.step.busy() or state.fetcher.busy()
    return {"caught": caught, "same": same, "busy": busy, "timeouts": timeouts}


# --- one rank raises ----------------------------------------------------------------------------


def assert_recovered(r: dict[str, Any]) -> None:
    """An `all_ranks_raise` result: each phase's error caught, and the run equal to a clean skip
    with nothing of the step left behind."""
    assert r["caught"][:3] == ["forward", "backward", "optimizer step refused"], r["caught"]
    assert len(r["caught"]) == 4 and r["caught"][3].startswith("in graph: "), r["caught"]
    assert r["same"], "the parameters differ from those of a run that skipped the batches"
    assert not r["busy"]


def one_rank_raises(
    rank: int, world: int, timeout: float, phase: str, backend: str = "eager", device: str = "cpu"
) -> dict[str, Any]:
    """Rank 1 raises in `phase` ("forward", "backward" or "optimizer") at step 1; every rank
    catches what it gets and goes on with the next batch, as a skip-on-error loop does."""
    model, opt = build(timeout, backend, device)
    xs = batches(rank, 4, device)
    name = f"one_rank_{phase}"
    errors: list[dict[str, Any]] = []

    def fail() -> None:
        mark_fault(name)
        raise Fault(f"injected in the {phase}")

    for step in range(4):
        opt.zero_grad()
        armed = rank == 1 and step == 1
        if armed and phase == "forward":
            model.trigger.forward = fail
        if armed and phase == "backward":
            model.trigger.backward = fail
        hook = (
            opt.register_step_pre_hook(lambda *_: fail())
            if armed and phase == "optimizer"
            else None
        )
        try:
            model(xs[step]).square().mean().backward()
            opt.step()
        except Exception as e:
            errors.append(_record(name, e))
        if hook is not None:
            hook.remove()
    return {"errors": errors}


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.boom = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.boom:
            raise Fault("injected in a compiled layer")
        return torch.relu(self.lin(x))


class _Stack(nn.Module):
    """Three layers of a stack in a submodule (zrs.shard(compile=...) compiles them, and the
    root's code around the submodule's call: the head) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(_Layer() for _ in range(3)))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


class _LoopStack(_Stack):
    """The same, its root's own forward looping over the layers (each call an opaque op of the
    root's compiled graph)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def one_rank_raises_in_a_compiled_layer(
    rank: int, world: int, timeout: float, loop: bool
) -> dict[str, Any]:
    """zrs.shard(compile="aot_eager"): at step 1 rank 1's middle layer raises inside its
    compiled forward (recompiled on that rank alone for the flag), called from the root's
    compiled forward (`loop`: from inside the root's graph, by its opaque op); every rank goes
    on with the next batch, as a skip-on-error loop does. Also returns the graphs the ranks
    compiled and whether the root's forward was compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = zrs.shard((_LoopStack if loop else _Stack)(), timeout=timeout, compile="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    xs = batches(rank, 4, "cpu")
    name = "one_rank_compiled_layer"
    errors: list[dict[str, Any]] = []
    for step in range(4):
        opt.zero_grad()
        model.layers[1].boom = rank == 1 and step == 1
        if model.layers[1].boom:
            mark_fault(name)
        try:
            model(xs[step]).square().mean().backward()
            opt.step()
        except Exception as e:
            errors.append(_record(name, e))
    return {
        "errors": errors,
        "graphs": counters["stats"]["unique_graphs"],
        "root_compiled": "forward" in vars(model),
    }


# --- disagreements ------------------------------------------------------------------------------


def _expect_error(name: str, run: Callable[[], None]) -> dict[str, Any]:
    try:
        run()
    except Exception as e:
        return _record(name, e)
    return {"error": "", "kind": "", "seconds": 0.0}


# Each disagreement case and what its ZrsError says on every rank.
DISAGREEMENTS = {
    "extra_parameter": "extra.weight",
    "parameter_order": "layers.",
    "memory_budget": "memory_budget=",
    "extra_forward": "disagree",
    "one_rank_steps": "optimizer steps",
    "eval_on_one_rank": "training",
    "shape_on_one_rank": "compile",
    "branch_on_one_rank": "compile",
    "module_order_on_one_rank": "module b fetched b.weight, b.bias",
}


def disagreements(
    rank: int,
    world: int,
    timeout: float,
    cases: tuple[str, ...] | None = None,
    device: str = "cpu",
    mesh: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Ranks that differ in the model, the options, the forwards, the optimizer steps, the
    mode or a branch; each case with fresh models, its fault marked at the call where the ranks
    part. Every case must raise on every rank (`DISAGREEMENTS` says how). `cases`: the names of
    the cases to run (default all, in their order); `mesh`: every model on this 2-D mesh (a
    zoo `Case.mesh` spec) instead of the world's group."""
    from zoo import make_mesh

    out = {}
    case = ""
    dev = on(device)
    where: dict[str, Any] = {"mesh": make_mesh(mesh, device)} if mesh else {}

    def mark() -> None:
        mark_fault(case)

    def extra_parameter() -> None:
        net = Net(extra=rank == 1).to(dev)
        mark()
        zrs.compile(net, backend="eager", timeout=timeout, **where)

    def parameter_order() -> None:
        model = nn.Module()
        names = ["a", "b"] if rank == 0 else ["b", "a"]
        model.layers = nn.ModuleDict({n: nn.Linear(4, 4 if n == "a" else 8) for n in names})
        model.to(dev)
        mark()
        zrs.compile(model, backend="eager", timeout=timeout, **where)

    def memory_budget() -> None:
        mark()
        budget = (rank + 1) << 30
        zrs.compile(Net().to(dev), backend="eager", timeout=timeout, memory_budget=budget, **where)

    def extra_forward() -> None:
        model, opt = build(timeout, device=device, **where)
        xs = batches(rank, 3, device)
        for step in range(3):
            model(xs[step]).sum().backward()
            if step == 1:
                mark()
                if rank == 0:  # one more micro-batch on rank 0
                    model(xs[step]).sum().backward()
            opt.step()

    def one_rank_steps() -> None:
        model, opt = build(timeout, device=device, **where)
        xs = batches(rank, 3, device)
        for step in range(3):
            model(xs[step]).sum().backward()
            if step == 1:
                mark()
            if rank == 0 or step != 1:
                opt.step()

    def eval_on_one_rank() -> None:
        model, _ = build(timeout, device=device, **where)
        xs = batches(rank, 2, device)
        model(xs[0]).sum().backward()
        mark()
        model.train(rank == 1)
        with torch.no_grad():
            model(xs[1])

    def shape_on_one_rank() -> None:
        model, opt = build(timeout, device=device, **where)
        # A size of 1 is never symbolic: rank 1 recompiles alone at LOST_PEER_STEP.
        lone = LOST_PEER_STEP
        xs = batches(
            rank, lone + 2, device, rows=lambda step: 1 if rank == 1 and step == lone else 6
        )
        for step in range(lone + 2):
            if step == lone:
                mark()
            model(xs[step]).sum().backward()
            opt.step()

    def module_order_on_one_rank() -> None:
        """zrs.shard: the same modules, run in another order on rank 1 from the first step."""
        model = zrs.shard(Swapped(swap=rank == 1).to(dev), timeout=timeout, **where)
        x = torch.ones(2, 4, device=dev)
        mark()
        model(x).sum().backward()

    def branch_on_one_rank() -> None:
        model, opt = build(timeout, device=device, **where)
        xs = batches(rank, 3, device)
        for step in range(3):
            if step == 1:
                mark()
            model(xs[step], branch=rank == 1 and step == 1).sum().backward()
            opt.step()

    every = {
        "extra_parameter": extra_parameter,
        "parameter_order": parameter_order,
        "memory_budget": memory_budget,
        "extra_forward": extra_forward,
        "one_rank_steps": one_rank_steps,
        "eval_on_one_rank": eval_on_one_rank,
        "shape_on_one_rank": shape_on_one_rank,
        "branch_on_one_rank": branch_on_one_rank,
        "module_order_on_one_rank": module_order_on_one_rank,
    }
    chosen = list(every) if cases is None else cases
    for case in chosen:
        # Dynamo remembers per code object which sizes changed (automatic dynamic): after a
        # case where the ranks' shapes differed, each rank's memory of Net.forward differs, and
        # the next case's first compile would differ between the ranks before its fault.
        torch._dynamo.reset()
        dist.barrier()  # every case starts together
        out[case] = _expect_error(case, every[case])
    return out


# --- a rank stops or dies -----------------------------------------------------------------------


def peer_lost(
    rank: int,
    world: int,
    timeout: float,
    how: str,
    group_timeout: bool = False,
    device: str = "cpu",
    mesh: str | None = None,
) -> dict[str, Any]:
    """Rank 1 stops (SIGSTOP, `how="stop"`) or is killed (SIGKILL, `how="kill"`) in its backward
    at LOST_PEER_STEP (2); the surviving ranks must raise within the timeout, and refuse to run on.
    `group_timeout`: the timeout is the process group's (`new_group(timeout=)`), not zrs's;
    `mesh`: the model on this 2-D mesh (a zoo `Case.mesh` spec).

    Under gloo the survivor's first error comes in the step of the fault (its collective waits on
    the host) and the next at step 3; under NCCL the first comes from the step check before step
    3 (the host does not wait in NCCL collectives) and the next at step 4."""
    if group_timeout:
        group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
        model, opt = build(None, device=device, process_group=group)
    elif mesh is not None:
        from zoo import make_mesh

        model, opt = build(timeout, device=device, mesh=make_mesh(mesh, device))
    else:
        model, opt = build(timeout, device=device)
    xs = batches(rank, LOST_PEER_STEP + 3, device)
    name = f"peer_{how}"

    def lose() -> None:
        mark_fault(name)
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

    first: dict[str, Any] = {}
    for step in range(LOST_PEER_STEP + 3):
        if rank == 1 and step == LOST_PEER_STEP:
            model.trigger.backward = lose
        try:
            model(xs[step]).square().mean().backward()
            opt.step()
        except Exception as e:
            if first:
                return {
                    **first,
                    "next": str(e),
                    "next_seconds": since_fault(name) - first["seconds"],
                }
            first = _record(name, e)
    return first


def replay_lost(rank: int, world: int, timeout: float, device: str = "cuda") -> dict[str, Any]:
    """zrs.CapturedStep (CUDA only): rank 1 stops (SIGSTOP) after the step check before its
    first replay, before launching it. Rank 0's replay then waits in its collectives on the GPU,
    where no process group's watchdog sees them, and its host waits for the loss (`.item()`).
    The replay watch aborts the communicators at the timeout, the host read returns, and the
    next step raises ZrsError (and so does every later one)."""
    model, opt = build(timeout, device=device)
    xs = batches(rank, 5, device)
    name = "replay_lost"

    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = zrs.CapturedStep(train_step, warmup=1)
    for i in range(2):  # eager, then the capture
        step(xs[i]).item()

    def lose(*_: object) -> None:
        mark_fault(name)
        os.kill(os.getpid(), signal.SIGSTOP)

    if rank == 1:
        opt.register_step_pre_hook(lose)  # run by the replay, right before its launch
    try:
        step(xs[2]).item()  # blocks until the replay ends: aborted at the timeout
        step(xs[3])
    except Exception as e:
        first = _record(name, e)
        try:
            step(xs[4])
        except Exception as again:
            first["next"] = str(again)
        return first
    return {"error": "", "kind": "", "seconds": since_fault(name)}


# --- several scenarios in one process group -----------------------------------------------------


def in_turn(
    rank: int, world: int, calls: list[tuple[str, Callable[..., Any], tuple]]
) -> dict[str, Any]:
    """Run `fn(rank, world, *args)` for each `(key, fn, args)` of `calls` in turn, each scenario
    with its own models, all ranks starting each together (a barrier on a gloo group, which no
    stuck GPU collective can hold up); {key: its result, or {"failed": traceback} if it raised}.

    Under NCCL only the last scenario may leave a collective that a peer never joins: it blocks
    the stream of every later step, and the NCCL watchdog takes the process down a while after
    its timeout (docs/faults.md)."""
    sync = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    for key, fn, args in calls:
        dist.barrier(group=sync)
        try:
            out[key] = fn(rank, world, *args)
        except Exception:
            out[key] = {"failed": traceback.format_exc()}
    return out
