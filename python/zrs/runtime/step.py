"""What one step of a compiled model holds between the zrs ops (`StepState`), and the release of a
gathered parameter's hold on its buffer.

The modules above fill the step: `gather` its gathered buffers, all-gathers in flight and kept
copies, `grads` its gradient bucket and reduce-scatters in flight. This module names only what the
model's state (`zrs.runtime.state`) needs of their objects, as protocols, so that it imports
neither of them (docs/architecture.md, the runtime's tiers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from zrs.runtime.handles import ParamHandle, handle


class Gathering(Protocol):
    """An all-gather in flight (`gather.InFlight`): a step that stops part-way completes it."""

    def complete(self) -> None: ...


class Reducing(Protocol):
    """A reduce-scatter in flight (`grads.Reduce`): a step that stops part-way waits for it."""

    work: dist.Work | None
    done: torch.cuda.Event | None

    def describe(self) -> str: ...


@dataclass(eq=False)
class Flat:
    """The one buffer a fused gather's members are views of, freed when the last one is
    released (`free_on_release`): one allocation per group, not one per parameter."""

    buf: torch.Tensor
    live: int  # members whose buffer is still a view of it

    @property
    def storage(self) -> torch.UntypedStorage:
        return self.buf.untyped_storage()

    @property
    def nbytes(self) -> int:  # also while its storage is held back (resized to 0)
        return self.buf.numel() * self.buf.element_size()


@dataclass(eq=False)
class StepState:
    """What a step of one compiled model holds between the zrs ops: the gathered buffers, the
    collectives in flight, the copies a forward kept for its backward, the gradient buckets. A
    step that stops part-way (an exception in its forward or backward) leaves some of it behind;
    `ZeroState.recover` waits for what is in flight and replaces the whole object."""

    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # ds_id -> gathered, padded
    shaped: dict[int, torch.Tensor] = field(default_factory=dict)  # ds_id -> its shaped view
    in_flight: dict[int, Gathering] = field(default_factory=dict)  # ds_id -> its collective
    prefetched: set[int] = field(default_factory=set)  # gathered by a prefetch, not yet claimed
    flat_of: dict[int, Flat] = field(default_factory=dict)  # ds_id -> its fused group's buffer
    # ds_id -> the shard's version counter when a forward kept the gathered copy (keep.py)
    kept: dict[int, int] = field(default_factory=dict)
    bucket: object | None = None  # the gradient bucket being filled (`grads.Bucket`)
    reducing: list[Reducing] = field(default_factory=list)  # issued reduce-scatters, oldest first
    # The autograd graph task whose final callback finishes the gradients (-1: none queued). A
    # task id, not a flag: a backward that raised never runs its callback.
    finish_task: int = -1
    graph: int = -1  # the graph whose op ran last (for error messages)

    def busy(self) -> bool:
        """True if it holds more than kept copies: only a step that stopped part-way does."""
        held = len(self.buffers) > len(self.kept)
        return held or bool(self.in_flight or self.prefetched or self.bucket or self.reducing)

    def drop_kept(self) -> None:
        """Free the kept copies no gather took over (`gather._keep` kept them): the backward did
        not use them, or a torch.optim step is about to change the shards."""
        kept = self.kept
        for ds_id in list(kept):
            del kept[ds_id]
            drop_hold(handle(ds_id))


def drop_hold(h: ParamHandle) -> None:
    """Release one hold on `h`'s gathered buffer; the last frees it (`gather.release`)."""
    if h.state.registry.release(h.slot):
        st = h.state.step
        buf = st.buffers.pop(h.ds_id)
        del st.shaped[h.ds_id]
        flat = st.flat_of.pop(h.ds_id, None)
        if not h.state.free_on_release:
            return
        # The graph's remaining aliases of the buffer are dead: the release follows the last use.
        if flat is None:
            buf.untyped_storage().resize_(0)
        else:
            flat.live -= 1
            if flat.live == 0:
                flat.storage.resize_(0)
