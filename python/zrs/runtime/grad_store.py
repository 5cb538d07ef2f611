"""Reduced gradients at fixed addresses, for a captured optimizer step (`zrs.GraphedStep`).

Without it each backward's reduce-scatter writes into a fresh tensor and the `.grad`s are views of
it, so a gradient's address changes from step to step. A CUDA graph reads the addresses it was
captured with, so with a `GradStore` each bucket reduces into a *region* that stays allocated:
the same bucket (named by its first member and its size, which the plan fixes) lands at the same
address every step, and `.grad` set to None by `zero_grad()` comes back at the same place, at no
cost per step. The price is memory: the regions stay allocated through the forward, as gradients
kept by `zero_grad(set_to_none=False)` do. GraphedStep makes the store at the end of its warmup,
so the warmup's gradients come and go as without it. Inside `zrs.CapturedStep` the first backward
with a store is the capture's: the regions come from the captured step's memory pool, in blocks
that its forward's activations had used, and the step peaks where the uncaptured one does.

A region is reused only when nothing still holds it: every parameter that took its gradient from
it last has `.grad` None again. Otherwise (gradient accumulation over micro-batches, or
`zero_grad(set_to_none=False)`) the bucket reduces into a fresh tensor and is added to the
`.grad`s, which do not move. A reduction in another dtype than the parameters' (`reduce_dtype`)
is cast into a buffer kept per parameter, for the same reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from zrs.runtime.handles import ParamHandle

Key = tuple[int, int]  # (the bucket's first member's ds_id, elements per rank or capacity)


@dataclass(eq=False)
class Region:
    buf: torch.Tensor
    members: list[ParamHandle] = field(default_factory=list)  # whose .grad it became last
    busy: bool = False  # a bucket of the running backward is in it

    def free(self) -> bool:
        return not self.busy and all(h.param.grad is None for h in self.members)


@dataclass(eq=False)
class GradStore:
    regions: dict[Key, Region] = field(default_factory=dict)
    owner: dict[int, Key] = field(default_factory=dict)  # ds_id -> the region it took it from
    # ds_id -> its gradient in the parameter's dtype, when the reduction ran in another one
    casts: dict[int, torch.Tensor] = field(default_factory=dict)

    def cast(self, h: ParamHandle, reduced: torch.Tensor) -> torch.Tensor:
        """`reduced` (another dtype than the parameter's) cast into a buffer kept for `h`, so
        that the `.grad` it becomes stays at one address too. Only for a parameter whose `.grad`
        is None: nothing else reads the buffer then."""
        dtype = h.param.dtype
        buf = self.casts.get(h.ds_id)
        if buf is None or buf.shape != reduced.shape or buf.dtype != dtype:
            buf = self.casts[h.ds_id] = torch.empty_like(reduced, dtype=dtype)
        return buf.copy_(reduced)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer it holds now: a graph that writes them keeps them alive."""
        return [r.buf for r in self.regions.values()] + list(self.casts.values())

    def take(
        self, first: ParamHandle, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[Key, torch.Tensor] | None:
        """The region for a bucket that starts with `first`, of `shape`; None if it is held."""
        key = (first.ds_id, math.prod(shape))
        region = self.regions.get(key)
        if region is None or region.buf.dtype != dtype or region.buf.device != device:
            region = self.regions[key] = Region(torch.empty(key[1], dtype=dtype, device=device))
        elif not region.free():
            return None
        region.busy = True
        return key, region.buf.view(shape)

    def filled(self, key: Key, members: list[ParamHandle]) -> None:
        """The bucket in region `key` became these parameters' gradients. A region they took
        theirs from before belongs to a bucket layout that is gone (a recompile, another plan):
        drop it."""
        region = self.regions[key]
        region.busy = False
        region.members = members
        for h in members:
            old = self.owner.get(h.ds_id)
            stale = self.regions.get(old) if old is not None and old != key else None
            if stale is not None and not stale.busy:
                del self.regions[old]
            self.owner[h.ds_id] = key

    def reset(self) -> None:
        """The step stopped part-way: its buckets are dropped unfinished."""
        for region in self.regions.values():
            region.busy = False
