"""The eager path's all-gathers (`runtime/fetch.py`): started into the leaves' storage, one
collective per gathered dtype, and completed (waited for, unpacked) when a unit needs them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zrs.runtime.collectives import all_gather
from zrs.runtime.handles import ParamHandle, names
from zrs.runtime.state import ZeroState


@dataclass(eq=False)
class Flight:
    """One all-gather in flight: a parameter straight into its storage, or several packed
    rank-major into `recv` (`fused`), unpacked into theirs at the wait."""

    work: dist.Work | None
    send: torch.Tensor  # kept alive until the collective completes
    recv: torch.Tensor
    slots: list[int]
    offsets: list[int]  # each member's offset inside a rank block (fused)
    fused: bool


def start(
    state: ZeroState, hs: list[ParamHandle], raws: list[torch.Tensor], slots: list[int]
) -> Flight | None:
    """Allocate the storage of `slots`' (one dtype, `hs` their handles) and start their
    all-gather; None at one rank, where the shards are cast into place."""
    mine = [raws[s] for s in slots]
    for raw in mine:
        raw.untyped_storage().resize_(raw.numel() * raw.element_size())
    if state.offload is not None:
        state.offload.refresh(hs)
        state.offload.stage(hs)  # unstaged once the gather has read them (finish)
    shards = [h.source.detach() for h in hs]
    if state.world_size == 1:
        with torch.no_grad():
            torch._foreach_copy_(mine, shards)
        if state.offload is not None:
            state.offload.unstage(hs)
        return None
    dtype = mine[0].dtype
    if len(hs) == 1:
        send = shards[0].to(dtype)
        work = all_gather(mine[0], send, state.gather_group, async_op=True)
        return Flight(work, send, mine[0], slots, [0], fused=False)
    offsets = list(itertools.accumulate((h.shard_numel for h in hs), initial=0))
    send = torch.empty(offsets[-1], dtype=dtype, device=mine[0].device)
    torch.ops.zrs.pack_cast(shards, send)
    recv = torch.empty(offsets[-1] * state.world_size, dtype=dtype, device=send.device)
    work = all_gather(recv, send, state.gather_group, async_op=True)
    return Flight(work, send, recv, slots, offsets[:-1], fused=True)


def finish(
    state: ZeroState, flight: Flight, hs: list[ParamHandle], raws: list[torch.Tensor]
) -> None:
    """Wait for `flight` (`hs` its members' handles) and unpack it into their storage."""
    state.wait(flight.work, lambda: f"the all-gather of {names(hs)} (eager)")
    if state.offload is not None:
        state.offload.unstage(hs)
    if flight.fused:
        with torch.no_grad():
            torch.ops.zrs.unpack_rank_major(
                flight.recv,
                state.world_size,
                flight.offsets,
                [h.shard_numel for h in hs],
                [raws[s] for s in flight.slots],
            )
