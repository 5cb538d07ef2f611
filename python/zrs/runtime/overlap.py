"""Offload's host update run during the backward (`zrs.OverlappedStep`, docs/offload.md).

Without it the host updates every offloaded parameter inside `optimizer.step()`, after the
backward. With it, each parameter's update starts as soon as its reduced gradient has reached
the host: a worker thread takes the gradients in the order they arrive, waits for each copy,
runs zrs-core's update (which releases the GIL, so the backward goes on issuing), and sends the
compute-dtype copy back on a stream of its own. With `max_norm` the updates wait for the end of
the backward, which computes the global norm and clips on the host first (or skips a step whose
norm is not finite).

With `accumulation_steps` = N, the first N - 1 backwards of a step accumulate their gradients
on the host as without overlap, and the updates run during the Nth: each waits for its
gradient's last copy and adds it (or, where something else must see the sum first, a clip or a
gradient hook, waits for the backward's end, where the sum is made).

The contract, checked rather than assumed: every N backwards are followed by the optimizer's
step before the next backward, and nothing changes the gradients or the hyperparameters in
between. `finish` (the step) raises a ZrsError on every rank that broke it, and a backward into
gradients already stepped raises at once.
"""

from __future__ import annotations

import math
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from zrs._core import ZrsError
from zrs.runtime import host_step
from zrs.runtime.handles import ParamHandle, local_tensor
from zrs.runtime.host_optim import HostOptimizer

# The hyperparameters an update reads: the step checks that none changed after it ran.
_READ = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "maximize")


class Staging(Protocol):
    """Where an update writes its compute-dtype copy, and how it reaches the device (Offload)."""

    def copy_target(self, h: ParamHandle) -> torch.Tensor | None: ...

    def send(self, h: ParamHandle, copy: torch.Tensor | None) -> None: ...


@dataclass(eq=False)
class Job:
    """One parameter's update in this backward."""

    h: ParamHandle
    group: dict  # its param group as of this backward (a copy: the step checks the original)
    arrived: torch.cuda.Event | None  # its gradient's copy to the host
    grad: torch.Tensor  # the `.grad` it read, which the step checks is still in place
    add: tuple[torch.Tensor, torch.Tensor] | None  # (arrived copy, the `.grad` it adds to)
    waits: bool  # for the backward's end: the gradient's sum is made there
    ready: threading.Event = field(default_factory=threading.Event)
    sent: torch.cuda.Event | None = None  # its compute-dtype copy is on the device
    read: tuple[int, int] = (-1, -1)  # the gradient's versions as the update may read it


class Overlap:
    """The updates of one optimizer's offloaded parameters during the backward."""

    def __init__(
        self,
        host: HostOptimizer,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        accumulation_steps: int,
        timeout: float,
        staging: Staging,
    ) -> None:
        self.host = host
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.accumulation_steps = accumulation_steps
        self.backwards = 0  # ended since the last step
        self.timeout = timeout
        self.staging = staging  # Offload: where each update writes its compute-dtype copy
        self.groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.jobs: dict[int, Job] = {}  # ds_id -> this backward's
        self.snapshots: dict[int, dict] = {}  # id(group) -> the copy this backward's updates read
        self.queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.released = threading.Event()  # the step's last backward ended (and clipped)
        self.skip = False  # with max_norm: this step's norm is not finite
        self.skipped = 0
        self.norm: float | None = None
        self.error: BaseException | None = None
        self.stream: torch.cuda.Stream | None = None
        # The worker holds this object weakly: a dropped model and optimizer are freed, and
        # their finalizer ends the worker.
        worker = threading.Thread(
            target=_work, args=(weakref.ref(self), self.queue), name="zrs-host-step", daemon=True
        )
        worker.start()
        weakref.finalize(self, self.queue.put, None)

    def stepped_by(self, optimizer: torch.optim.Optimizer) -> bool:
        return optimizer is self.optimizer

    def received(
        self,
        h: ParamHandle,
        arrived: torch.cuda.Event | None,
        add: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> bool:
        """`h`'s gradient for this backward is on its way to the host (`add`: a copy still in
        flight that the caller would add to the `.grad` at the backward's end): queue its
        update if this is the step's last backward. True if the update makes the add."""
        group = self.groups.get(id(h.param))
        if group is None or self.backwards + 1 < self.accumulation_steps:
            return False  # another optimizer's, or an earlier micro-batch: it accumulates
        if h.ds_id in self.jobs:
            raise ZrsError(
                f"zrs.OverlappedStep: a backward reached `{h.name}` after the "
                f"{self.accumulation_steps} of a step (accumulation_steps) and before the "
                "optimizer's step, but its update already ran. Call the step after every "
                f"{self.accumulation_steps} backwards"
            )
        grad = h.param.grad
        assert grad is not None
        # The update adds the last copy itself, unless something must see the sum before it
        # runs: the clip's norm or a gradient hook, both at the backward's end.
        hooks = bool(h.param._post_accumulate_grad_hooks)
        takes = add is not None and self.max_norm is None and not hooks
        seen = self.snapshots.get(id(group))
        if seen is None:  # tensors too: a scheduler may write a tensor lr in place
            seen = self.snapshots[id(group)] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items()
            }
        waits = add is not None and not takes
        job = Job(h, seen, arrived, grad, add if takes else None, waits, read=_versions(grad))
        self.jobs[h.ds_id] = job
        self.queue.put(job)
        return takes

    def backward_over(self, group: dist.ProcessGroup | None, world_size: int) -> None:
        """Every gradient of this backward has reached the host (and the accumulated ones are
        summed): after the step's last, with `max_norm` the global norm (over the ranks) and
        the clip; the updates that wait may start."""
        self.backwards += 1
        if self.backwards < self.accumulation_steps or self.released.is_set():
            return
        if self.max_norm is None:
            self.released.set()
            return
        grads = [local_tensor(j.grad) for j in self.jobs.values()]
        # A 0-d parameter is replicated: each rank holds the whole of it, counted once.
        weights = [1.0 if j.h.shape else 1.0 / world_size for j in self.jobs.values()]
        squares = torch.zeros((), dtype=torch.float64)
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            squares = sum(
                (n.double().square() * w for n, w in zip(norms, weights, strict=True)), squares
            )
        if group is not None and world_size > 1:
            dist.all_reduce(squares, group=group)
        norm = math.sqrt(squares.item())
        self.norm = norm
        if not math.isfinite(norm):
            self.skip = True
        else:
            # torch.nn.utils.clip_grad_norm_'s coefficient, clamped at 1 (then a no-op).
            coef = min(self.max_norm / (norm + 1e-6), 1.0)
            if coef < 1.0 and grads:
                torch._foreach_mul_(grads, coef)
                for job in self.jobs.values():
                    job.read = _versions(job.grad)
        self.released.set()

    def settle(self, hs: list[ParamHandle]) -> None:
        """Before a gather reads these handles' device copies: wait for their updates (CPU) and
        order the compute stream after their copies (GPU)."""
        for h in hs:
            job = self.jobs.get(h.ds_id)
            if job is not None:
                self._wait(job)
                if job.sent is not None:
                    torch.cuda.current_stream(job.sent.device).wait_event(job.sent)

    def finish(self) -> set[int]:
        """The optimizer's step: wait for this backward's updates, check the contract, order the
        compute stream after the copies; the ids of the parameters stepped (their gradients are
        consumed)."""
        jobs, self.jobs = list(self.jobs.values()), {}
        backwards, self.backwards = self.backwards, 0
        try:
            waiting = self.max_norm is not None or any(job.waits for job in jobs)
            early = waiting and bool(jobs) and not self.released.is_set()
            if early:  # let the waiting updates go, as skipped, before refusing
                self.skip = True
                self.released.set()
            for job in jobs:
                self._wait(job)
            if early:
                self._fail("the optimizer stepped before the backward ended")
            if 0 < backwards < self.accumulation_steps:
                self._fail(
                    f"the optimizer stepped after {backwards} of the step's "
                    f"{self.accumulation_steps} backwards (accumulation_steps), whose last "
                    "runs the updates. Step after every "
                    f"{self.accumulation_steps} backwards, or leave out the incomplete "
                    "accumulation"
                )
            if self.error is not None:
                error, self.error = self.error, None
                raise error
            for job in jobs:
                if job.h.param.grad is not job.grad or _versions(job.grad) != job.read:
                    self._fail(
                        f"the gradient of `{job.h.name}` changed after its update ran in the "
                        "backward (clip_grad_norm_, a scaler or a hook). Clip with "
                        "OverlappedStep(optimizer, max_norm=...)"
                    )
            for group in self.optimizer.param_groups:
                seen = self.snapshots.get(id(group))
                if seen is not None and _read(seen) != _read(group):
                    self._fail(
                        "a hyperparameter changed between the backward, whose updates read it, "
                        "and the step (an LR scheduler stepped before the optimizer?). Change "
                        "them after the step"
                    )
            for job in jobs:
                if job.sent is not None:
                    torch.cuda.current_stream(job.sent.device).wait_event(job.sent)
            if self.skip:
                self.skipped += 1
            return {id(job.h.param) for job in jobs}
        finally:
            self.snapshots.clear()
            self.released.clear()
            self.skip = False

    def close(self) -> None:
        self.queue.put(None)

    # --- the worker ---------------------------------------------------------------------------

    def run(self, job: Job) -> None:
        try:
            if self.error is None:
                self._update(job)
        except BaseException as e:  # raised to the user by the step
            self.error = e
        finally:
            job.ready.set()

    def _update(self, job: Job) -> None:
        if job.arrived is not None:
            job.arrived.synchronize()
        if job.add is not None:  # the last micro-batch's copy: the gradient's sum
            host, into = job.add
            into.add_(host)
            job.read = _versions(job.grad)
        if self.max_norm is not None or job.waits:
            if not self.released.wait(self.timeout):
                raise ZrsError("zrs.OverlappedStep: the backward did not end within the timeout")
            if self.skip:
                return
        h, group = job.h, job.group
        copy = self.staging.copy_target(h)
        host_step.update(self.host, self.optimizer, group, h.param, copy=copy)
        if job.arrived is not None:
            if self.stream is None:
                self.stream = torch.cuda.Stream(job.arrived.device)
            # After the gradient's copy, which came after every read of the old device copy.
            self.stream.wait_event(job.arrived)
            with torch.no_grad(), torch.cuda.stream(self.stream):
                self.staging.send(h, copy)
            job.sent = self.stream.record_event()
        else:
            with torch.no_grad():
                self.staging.send(h, copy)
        h.compute_version = h.versions()

    def _wait(self, job: Job) -> None:
        if not job.ready.wait(self.timeout):
            raise ZrsError(
                f"zrs.OverlappedStep: the host update of `{job.h.name}` did not finish within "
                f"{self.timeout:.0f} s"
            )

    def _fail(self, why: str) -> None:
        raise ZrsError(f"zrs.OverlappedStep: {why}")


def _work(overlap: weakref.ref[Overlap], jobs: queue.SimpleQueue[Job | None]) -> None:
    """The worker thread: each queued update in turn, until the queue's end (None)."""
    while True:
        job = jobs.get()
        alive = overlap()
        if job is None or alive is None:
            return
        alive.run(job)
        del alive, job  # nothing of the model held while waiting


def _versions(grad: torch.Tensor) -> tuple[int, int]:
    return (grad._version, local_tensor(grad)._version)


def _read(group: dict) -> tuple:
    return tuple(
        (k, v.item() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k in _READ
    )
