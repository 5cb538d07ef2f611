"""The collectives the runtime issues, and the communicators they run on.

A group of None means a single process without torch.distributed: collectives become copies.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from zrs.runtime.exchange import keep_alive
from zrs.runtime.handles import ParamHandle


def all_gather(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    if group is None:
        out.copy_(inp)
        return None
    work = dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
    return _issued(work, async_op, out, inp)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    """Sum `tensor` in place across `group`; None: nothing to sum (one replica)."""
    if group is None:
        return None
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _issued(work, async_op, tensor)


def new_group_like(
    group: dist.ProcessGroup,
    timeout: datetime.timedelta,
    backend: str | None = None,
    family: list[list[int]] | None = None,
) -> dist.ProcessGroup:
    """Another communicator over `group`'s ranks (`backend`: the same as `group`'s by default)
    whose collectives wait `timeout` for a peer. `family`: the ranks of every group like
    `group` (the rows of its mesh dimension, `group` among them), which every rank makes alike.

    Where the groups cover the world, every rank makes each of them in the same order, and
    torch names them by its running count of groups, the same on every rank. Otherwise only the
    group's members take part (use_local_synchronization, so that subgroups work), and torch
    names the group by a hash of its ranks and of how many groups each member belongs to: a
    member that joined another subgroup before hashes another name, and both wait out the
    timeout.

    The gradient reduce-scatters get one of their own: NCCL runs a communicator's collectives one
    after another on one stream, in issue order, and on one communicator a reduce-scatter queued
    behind the backward's prefetched all-gathers; the compute stream, which waits for the oldest
    reduce-scatter when a third bucket fills (grads.MAX_IN_FLIGHT_REDUCES), stalled with it
    (BENCHMARKS.md). The planner already models gathers and reduce-scatters on separate streams."""
    ranks = dist.get_process_group_ranks(group)
    backend = backend or dist.get_backend(group)
    family = family or [ranks]
    if sorted(r for members in family for r in members) != list(range(dist.get_world_size())):
        return dist.new_group(
            ranks, timeout=timeout, backend=backend, use_local_synchronization=True
        )
    made = [dist.new_group(members, timeout=timeout, backend=backend) for members in family]
    return next(g for g, members in zip(made, family, strict=True) if set(members) == set(ranks))


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    if group is None:
        out.copy_(inp)
        return None
    work = dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _issued(work, async_op, out, inp)


def _issued(work: dist.Work, async_op: bool, *tensors: torch.Tensor) -> dist.Work | None:
    # Always issued async, to get the Work: it and its host tensors stay referenced for a while
    # (see zrs.runtime.exchange, a gloo worker thread must never drop their last reference).
    keep_alive(work, *tensors)
    if async_op:
        return work
    work.wait()
    return None


def gather_full(h: ParamHandle, shard: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Synchronous all-gather of one parameter (the functional op and full_state_dict use it)."""
    state = h.state
    state.check_usable()
    dtype = dtype or shard.dtype
    # An offloaded master is on the host: it is sent from the device.
    buf = torch.empty(h.padded_numel, dtype=dtype, device=state.device)
    send = shard.detach().to(state.device, dtype).reshape(-1)
    state.wait(
        all_gather(buf, send, state.gather_group, True), lambda: f"the all-gather of `{h.name}`"
    )
    return buf.narrow(0, 0, h.numel).view(h.shape)
