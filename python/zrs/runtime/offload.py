"""Offload (issue 37, `zrs.shard(model, offload="optimizer")`): the fp32 master shards and the
optimizer state live in host memory (pinned beside a GPU), and the optimizer step runs there.

- Each parameter's `shard` and `param` (the DTensor users and optimizers see) are the host master;
  the device holds `ParamHandle.compute`, this rank's shard in the compute dtype, which the eager
  path's gathers read. The host step writes it; it is made again from the master after a
  `state_dict()` or `load_state_dict` (checkpointing/state_dict.py) or when one of the master's
  version counters moved (`ParamHandle.versions()`: a write through the DTensor parameter
  moves only its own).
- Reduced gradients come to the host as they are accumulated (`to_host`): `param.grad` is a host
  tensor, as the optimizer and `clip_grad_norm_` see it.
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
from collections.abc import Iterable

import torch

from zrs._core import ZrsError
from zrs.runtime import host_step
from zrs.runtime.handles import ParamHandle
from zrs.runtime.host_optim import HostOptimizer

CHOICES = ("optimizer",)


def host_threads() -> int:
    """This rank's share of the cores it may run on: the ranks of one host (torchrun's
    LOCAL_WORLD_SIZE) split them, so that their host updates do not oversubscribe the host."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class Offload:
    """One model's host side: the host optimizer's threads, and the gradients hidden from
    torch's update while a step runs."""

    def __init__(self, device: torch.device, threads: int | None = None) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = HostOptimizer.start(host_threads() if threads is None else threads)
        self.hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> grad
        self.staged: dict[int, torch.Tensor] = {}  # ds_id -> pinned compute-dtype copy
        self.copied: torch.cuda.Event | None = None  # the last step's copies to the device

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
        self.refresh([h])

    @staticmethod
    def refresh(hs: Iterable[ParamHandle]) -> None:
        """Copy each master whose version moved since its device copy was made."""
        for h in hs:
            version = h.versions()
            if h.compute is not None and h.compute_version != version:
                with torch.no_grad():
                    h.compute.copy_(h.shard, non_blocking=True)
                h.compute_version = version

    def to_host(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A reduced gradient shard (on the device) as a host tensor of `dtype`."""
        if grad.device.type == "cpu" and grad.dtype == dtype:
            return grad
        host = torch.empty(grad.shape, dtype=dtype, pin_memory=self.pinned)
        host.copy_(grad)  # from a GPU: synchronous, so the host update can read it
        return host

    def step(self, optimizer: torch.optim.Optimizer, handles: list[ParamHandle]) -> None:
        """Update on the host every parameter of `handles` that `optimizer` steps and that has
        a gradient, then hide those gradients from torch's own update."""
        by_param = {id(h.param): h for h in handles if h.compute is not None}
        mine = [
            (group, p)
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in by_param and p.grad is not None
        ]
        if not mine:
            return
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
        updated = []
        for group, p in mine:
            h = by_param[id(p)]
            copy = self._copy_target(h)
            host_step.update(self.host, optimizer, group, p, copy=copy)
            updated.append((h, copy))
            self.hidden[id(p)] = (p, p.grad)
            p.grad = None
        with torch.no_grad():
            for h, copy in updated:
                if copy is None:  # compute in fp32: the master itself is the copy
                    h.compute.copy_(h.shard, non_blocking=True)
                elif copy.device != h.compute.device:  # staged beside a GPU
                    h.compute.narrow(0, 0, h.local_numel).copy_(copy, non_blocking=True)
                h.compute_version = h.versions()
        if self.pinned:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def after_step(self) -> None:
        """Give back the gradients `step` hid (a user may read them after the step)."""
        for p, grad in self.hidden.values():
            p.grad = grad
        self.hidden.clear()

    def _copy_target(self, h: ParamHandle) -> torch.Tensor | None:
        """Where the host update writes the compute-dtype copy: the device copy itself on the
        host, a pinned staging buffer beside a GPU, nothing when the compute dtype is fp32."""
        assert h.compute is not None
        if h.compute.dtype == torch.float32:
            return None
        if h.compute.device.type == "cpu":
            return h.compute.narrow(0, 0, h.local_numel)
        staged = self.staged.get(h.ds_id)
        if staged is None:
            staged = self.staged[h.ds_id] = self.host_empty(h.shard_numel, h.compute.dtype)
        return staged.narrow(0, 0, h.local_numel)
