"""Offload (issue 37, `zrs.shard(model, offload="optimizer")`): the fp32 master shards and the
optimizer state live in host memory (pinned beside a GPU), and the optimizer step runs there.
`offload="params"` keeps the compute-dtype shards on the host as well (`stage`, `unstage`).

- Each parameter's `shard` and `param` (the DTensor users and optimizers see) are the host master;
  the device holds `ParamHandle.compute`, this rank's shard in the compute dtype, which the eager
  path's gathers read. The host step writes it; it is made again from the master after a
  `state_dict()` or `load_state_dict` (checkpointing/state_dict.py) or when one of the master's
  version counters moved (`ParamHandle.versions()`: a write through the DTensor parameter
  moves only its own).
- Reduced gradients come to the host as their reduce-scatters finish (`to_host`): beside a GPU
  each bucket's copy runs on a copy stream of its own, and nothing on the host waits for it
  until the backward ends (`arrive`), so the GPU's queue never drains for it. `param.grad` is
  a host tensor, as the optimizer and `clip_grad_norm_` see it.
- The user's stock optimizer (torch.optim.AdamW, Adam or SGD over `model.parameters()`) keeps
  its `step()`: before it runs, `step` updates every offloaded parameter with a gradient on the
  host (zrs-core, `host_step.py`), writing the compute-dtype copy in the same pass, and hides
  those gradients from torch's own update, which then has nothing to do; `after_step` gives them
  back.

The parameters' DTensor mesh is a gloo group's over the host (`ZeroState`): a DTensor op on a
host gradient (a norm for clipping) runs its collective there.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zrs._core import ZrsError
from zrs.runtime import host_step
from zrs.runtime.handles import ParamHandle
from zrs.runtime.host_optim import HostOptimizer
from zrs.runtime.overlap import Overlap

THREADS_ENV = "ZRS_OFFLOAD_THREADS"


def host_threads(device: torch.device) -> int:
    """Three quarters of this rank's share of the cores it may run on: the ranks of one host
    (torchrun's LOCAL_WORLD_SIZE; without it, one a GPU beside a GPU) split them, and each
    leaves a quarter of its share to the threads that keep its GPU fed (its own, CUDA's and
    NCCL's, which poll). With all of the share, the 1b step at 2 ranks on 32 cores took 383 ms;
    with 12 threads a rank, 305 ms (BENCHMARKS.md, session 36). ZRS_OFFLOAD_THREADS sets it."""
    if os.environ.get(THREADS_ENV):
        return max(1, int(os.environ[THREADS_ENV]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    ranks = int(local) if local else torch.cuda.device_count() if device.type == "cuda" else 1
    share = (cores or 1) // max(1, ranks)
    return max(1, share * 3 // 4)


@dataclass(eq=False)
class Arrival:
    """A gradient's copy to the host, in flight on the copy stream."""

    done: torch.cuda.Event
    source: torch.Tensor  # on the device: kept until the copy has read it


class Offload:
    """One model's host side: the host optimizer's threads, and the gradients hidden from
    torch's update while a step runs."""

    def __init__(
        self, device: torch.device, threads: int | None = None, params: bool = False
    ) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.params = params  # offload="params": the compute-dtype copies on the host too
        self.host = HostOptimizer.start(host_threads(device) if threads is None else threads)
        self.hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> grad
        self.staged: dict[int, torch.Tensor] = {}  # ds_id -> pinned compute-dtype copy
        self.copied: torch.cuda.Event | None = None  # the last step's copies to the device
        self.copy_stream = torch.cuda.Stream(device) if self.pinned else None  # to the host
        # The copies in flight, in the order the one copy stream runs them, and the accumulated
        # gradients to add once they have arrived (host copy, the `.grad` it adds to).
        self.arriving: deque[Arrival] = deque()
        self.adds: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.overlap: Overlap | None = None  # zrs.OverlappedStep: the updates in the backward
        # optimizer -> the pre-hook of its own that runs `step` (`step_after_its_hooks`)
        self.hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, object] = (
            weakref.WeakKeyDictionary()
        )

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self.pinned)

    def attach(self, h: ParamHandle) -> None:
        """Give `h` (its shard already on the host) its device copy in the compute dtype."""
        if h.shard.dtype != torch.float32:
            raise ZrsError(
                f"offload keeps fp32 masters on the host; `{h.name}` has {h.shard.dtype} "
                "masters. Leave master_dtype unset (fp32) with offload"
            )
        h.compute = torch.empty(h.shard_numel, dtype=h.compute_dtype, device=self.device)
        if self.params:
            # Storage only while staged; the graphs never read it but through the gather ops.
            h.compute.untyped_storage().resize_(0)
            h.host_compute = (
                h.shard
                if h.compute_dtype == h.shard.dtype
                else self.host_empty(h.shard_numel, h.compute_dtype)
            )
        # The gathers' input in place of the shard (zrs.compile's graphs take it as the
        # shard): its gradient is the parameter's, and its size stays out of dynamo's symbols.
        h.compute.requires_grad_(h.shard.requires_grad)
        torch._dynamo.mark_static(h.compute)
        h.state.ds_ids[id(h.compute)] = h.ds_id
        self.refresh([h])

    def overlap_with(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        accumulation_steps: int,
        timeout: float,
    ) -> Overlap:
        """Run `optimizer`'s updates during the backward from now on (zrs.OverlappedStep)."""
        if self.overlap is not None:
            same = (self.overlap.max_norm, self.overlap.accumulation_steps) == (
                max_norm,
                accumulation_steps,
            )
            if self.overlap.stepped_by(optimizer) and same:
                return self.overlap
            self.overlap.close()
        self.overlap = Overlap(self.host, optimizer, max_norm, accumulation_steps, timeout, self)
        return self.overlap

    def refresh(self, hs: list[ParamHandle]) -> None:
        """Before a gather reads the device copies of `hs`: wait for their updates running in
        the backward, then copy each master whose version moved since its copy was made."""
        if self.overlap is not None:
            self.overlap.settle(hs)
        for h in hs:
            version = h.versions()
            if h.compute is None or h.compute_version == version:
                continue
            with torch.no_grad():
                if h.host_compute is None:
                    h.compute.copy_(h.shard, non_blocking=True)
                elif h.host_compute is not h.shard:
                    h.host_compute.copy_(h.shard)
            h.epoch += 1
            h.compute_version = version

    def stage(self, hs: list[ParamHandle]) -> None:
        """offload="params": give each device copy of `hs` storage and copy its host copy in,
        on the current stream (a gather's: the gather stream beside a GPU), before a gather
        reads it. `unstage` frees it once the gather has read it."""
        if not self.params:
            return
        with torch.no_grad():
            for h in hs:
                assert h.compute is not None and h.host_compute is not None
                h.stages += 1
                if h.stages == 1:
                    storage = h.compute.untyped_storage()
                    storage.resize_(h.shard_numel * h.compute.element_size())
                elif h.staged_epoch == h.epoch:
                    continue  # staged for a gather still reading it, and current
                # (a copy staged before the host copy changed is one a stopped step left)
                h.compute.copy_(h.host_compute, non_blocking=True)
                h.staged_epoch = h.epoch

    def unstage(self, hs: list[ParamHandle]) -> None:
        """The gathers that `stage` served have read the device copies of `hs` (on the stream
        their storage came from, or one that stream waits for): free the storage."""
        if not self.params:
            return
        for h in hs:
            assert h.compute is not None
            h.stages -= 1
            if h.stages == 0:
                h.compute.untyped_storage().resize_(0)

    def to_host(
        self, grad: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A reduced gradient shard as a host tensor of `dtype`, or added to `into` (a host
        gradient) if given. From a GPU the copy is in flight until `arrive()`."""
        if grad.device.type == "cpu":
            # A tensor of its own, as a GPU's pinned copy is: the reduced gradients are views of
            # one bucket, whose shared version counter would move with every sibling's write.
            return grad.to(dtype, copy=True) if into is None else into.add_(grad)
        assert self.copy_stream is not None
        host = torch.empty(grad.shape, dtype=dtype, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(grad, non_blocking=True)
        # Keep each source until its copy has read it; let go of the oldest ones that have.
        while self.arriving and self.arriving[0].done.query():
            self.arriving.popleft()
        self.arriving.append(Arrival(self.copy_stream.record_event(), grad))
        if into is None:
            return host
        self.adds.append((host, into))
        return into

    def received(self, h: ParamHandle, accumulated: bool) -> None:
        """`h`'s gradient for this backward is set (or, `accumulated`, added to its `.grad`)."""
        if self.overlap is None:
            return
        arrived = self.arriving[-1].done if self.arriving else None
        # An add still waiting for its copy (beside a GPU) is the one `to_host` just queued.
        add = self.adds[-1] if accumulated and self.adds else None
        if self.overlap.received(h, arrived, add):
            self.adds.pop()  # the update adds it once the copy has arrived

    def backward_over(self, group: dist.ProcessGroup | None, world_size: int) -> None:
        """The backward is over: every gradient has reached the host."""
        self.arrive()
        if self.overlap is not None:
            self.overlap.backward_over(group, world_size)

    def arrive(self) -> None:
        """Wait for the gradients' copies to the host (the backward is over, or a hook reads
        them) and add the accumulated ones."""
        if self.arriving:
            self.arriving[-1].done.synchronize()  # one stream: the last is done after the rest
            self.arriving.clear()
        for host, into in self.adds:
            into.add_(host)
        self.adds.clear()

    def step_after_its_hooks(
        self, optimizer: torch.optim.Optimizer, handles: list[ParamHandle]
    ) -> None:
        """Have `step` run after `optimizer`'s own pre-hooks. torch runs the global pre-hooks
        (zrs's, which calls this) before an optimizer's own, so zrs keeps a hook of its own on
        the optimizer, moved behind the others each step: a user's pre-hook that raises leaves
        the masters as it leaves torch's parameters, untouched."""
        hooks = optimizer._optimizer_step_pre_hooks
        handle = self.hooks.get(optimizer)
        if handle is None or handle.id not in hooks:
            mine = {id(h.param) for h in handles}
            if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
                return  # another model's optimizer: no hook that would hold this one
            self.hooks[optimizer] = optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: self._pre_step(opt, handles, args, kwargs)
            )
        else:
            hooks.move_to_end(handle.id)

    def _pre_step(
        self,
        optimizer: torch.optim.Optimizer,
        handles: list[ParamHandle],
        args: tuple,
        kwargs: dict,
    ) -> tuple[tuple, dict] | None:
        """The pre-hook: `step`, after the closure if the step was given one. torch calls a
        closure inside `step()`, after the pre-hooks (Lightning passes its forward and backward
        so): the update needs the gradients it makes, so the closure runs here, first, and torch's
        step gets one that returns its loss. `args` starts with the optimizer (torch's)."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.step(optimizer, handles)
            return None
        with torch.enable_grad():
            loss = closure()
        self.step(optimizer, handles)
        ran = lambda: loss  # noqa: E731  (the closure torch calls now)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": ran}
        return (args[0], ran, *args[2:]), kwargs

    def step(self, optimizer: torch.optim.Optimizer, handles: list[ParamHandle]) -> None:
        """Update on the host every parameter of `handles` that `optimizer` steps and that has
        a gradient, then hide those gradients from torch's own update."""
        stepped: set[int] = set()
        if self.overlap is not None and self.overlap.stepped_by(optimizer):
            stepped = self.overlap.finish()  # updated during the backward
        by_param = {id(h.param): h for h in handles if h.compute is not None}
        mine, done = [], []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in stepped:
                    done.append(p)
                elif id(p) in by_param and p.grad is not None:
                    mine.append((group, p))
        if mine and stepped and self.overlap is not None and self.overlap.max_norm is not None:
            raise ZrsError(
                f"zrs.OverlappedStep(max_norm=...): `{by_param[id(mine[0][1])].name}` has a "
                "gradient that the step's last backward did not reach (an earlier micro-batch "
                "or a gradient set by hand), which its global norm left out. Clip with "
                "torch.nn.utils.clip_grad_norm_ and call optimizer.step() instead"
            )
        for p in done:
            self.hidden[id(p)] = (p, p.grad)
            p.grad = None
        if not mine:
            return
        self.arrive()
        host_step.check_supported(optimizer)
        if (
            getattr(optimizer, "found_inf", None) is not None
            or getattr(optimizer, "grad_scale", None) is not None
        ):
            raise ZrsError(
                "offload runs the optimizer step on the host, which does not read the found_inf "
                "or grad_scale that torch.amp.GradScaler and zrs.GraphedStep hand a fused "
                "optimizer; with offload, train in bf16 without GradScaler, clip with "
                "torch.nn.utils.clip_grad_norm_ and call optimizer.step() directly"
            )
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffers' last copies have left
        for group, p in mine:
            h = by_param[id(p)]
            copy = self.copy_target(h)
            host_step.update(self.host, optimizer, group, p, copy=copy)
            self.hidden[id(p)] = (p, p.grad)
            p.grad = None
            # Sent now: the copy engine moves it while the host updates the next parameter.
            with torch.no_grad():
                self.send(h, copy)
            h.compute_version = h.versions()
        if self.pinned:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def after_step(self) -> None:
        """Give back the gradients `step` hid (a user may read them after the step)."""
        for p, grad in self.hidden.values():
            p.grad = grad
        self.hidden.clear()

    @staticmethod
    def send(h: ParamHandle, copy: torch.Tensor | None) -> None:
        """Copy `h`'s updated master to its device copy: `copy` (the compute-dtype rows the
        update wrote), or the master itself when the compute dtype is fp32. offload="params":
        the update wrote the host copy, which the next gather stages in."""
        assert h.compute is not None
        if h.host_compute is not None:
            h.epoch += 1
        elif copy is None:
            h.compute.copy_(h.shard, non_blocking=True)
        elif copy.device != h.compute.device:  # staged beside a GPU
            h.compute.narrow(0, 0, h.local_numel).copy_(copy, non_blocking=True)

    def copy_target(self, h: ParamHandle) -> torch.Tensor | None:
        """Where the host update writes the compute-dtype copy: the device copy itself on the
        host, a pinned staging buffer beside a GPU, nothing when the compute dtype is fp32."""
        assert h.compute is not None
        if h.compute.dtype == torch.float32:
            return None
        if h.host_compute is not None:
            return h.host_compute.narrow(0, 0, h.local_numel)
        if h.compute.device.type == "cpu":
            return h.compute.narrow(0, 0, h.local_numel)
        staged = self.staged.get(h.ds_id)
        if staged is None:
            staged = self.staged[h.ds_id] = self.host_empty(h.shard_numel, h.compute.dtype)
        return staged.narrow(0, 0, h.local_numel)
