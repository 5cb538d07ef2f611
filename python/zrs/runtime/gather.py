"""The gathered parameters of the lowered ops: issue, wait and release each all-gather, and the
copies a training forward keeps for its backward.

Every table lives in the model's `StepState` (`zrs.runtime.step`, which also releases a hold and
frees the kept copies no gather took over); the registry decides whether a collective is needed and
when a buffer may be freed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zrs._core import ZrsError
from zrs.runtime import streams
from zrs.runtime.collectives import all_gather
from zrs.runtime.handles import ParamHandle, group_layout, handle, handles, names
from zrs.runtime.state import ZeroState
from zrs.runtime.step import Flat, StepState, drop_hold

Todo = list[tuple[ParamHandle, torch.Tensor, torch.dtype]]


@dataclass(eq=False)
class InFlight:
    """One issued all-gather, possibly fused over several parameters (rank-major layout)."""

    work: dist.Work | None
    send: torch.Tensor  # kept alive until the collective completes
    recv: torch.Tensor
    members: list[tuple[ParamHandle, int]]  # (handle, offset of its shard inside a rank block)
    block: int  # elements per rank block
    fused: bool  # True: `recv` still has to be unpacked into the members' buffers
    done: torch.cuda.Event | None = None  # on a side stream: the gather (and unpack) finished
    flat: Flat | None = None  # the members' group buffer (fused gathers)
    graph: int = field(init=False)  # the graph that issued it (error messages)

    def __post_init__(self) -> None:
        self.graph = self.state.step.graph

    @property
    def state(self) -> ZeroState:
        return self.members[0][0].state

    def describe(self) -> str:
        hs = [h for h, _ in self.members]
        return f"the all-gather of {names(hs)} in {self.state.graph_label(self.graph)}"

    def complete(self) -> None:
        streams.wait_for(self.done)
        self.state.wait(self.work, self.describe)
        offload = self.state.offload
        if offload is not None and offload.params:
            offload.unstage([h for h, _ in self.members])  # the collective has read them
        if not self.fused:
            return
        self.unpack()

    @torch.no_grad()  # the members' buffers are split views: autograd refuses in-place writes
    def unpack(self) -> None:
        state = self.state
        flat = self.flat
        assert flat is not None, "a fused gather lands in its group's flat buffer"
        # Storage held back at issue (issue_gather): allocate it now.
        flat.storage.resize_(flat.nbytes)
        torch.ops.zrs.unpack_rank_major(
            self.recv,
            state.world_size,
            [off for _, off in self.members],
            [h.shard_numel for h, _ in self.members],
            [state.step.buffers[h.ds_id] for h, _ in self.members],
        )


def _set_buffer(st: StepState, h: ParamHandle, buf: torch.Tensor) -> None:
    st.buffers[h.ds_id] = buf
    unpadded = buf if h.padded_numel == h.numel else buf.narrow(0, 0, h.numel)
    st.shaped[h.ds_id] = unpadded.view(h.shape)


def _shaped(h: ParamHandle) -> torch.Tensor:
    # A fresh view of a view made when the buffer was allocated: `view` needs no storage, so it
    # also works while a fused gather holds the buffer's storage back (narrow would not). Fresh:
    # an op called outside a compiled graph has its outputs marked by autograd's fallback, and
    # the stored view must not carry that into the next gather's output.
    return h.state.step.shaped[h.ds_id].view(h.shape)


def issue_gather(
    hs: list[ParamHandle], shards: list[torch.Tensor], dtypes: list[torch.dtype]
) -> None:
    """Start one all-gather for every handle whose registry says a collective is needed.

    Runs inside the zrs ops, below autograd: the shards need no `detach`."""
    if len(hs) == 1:
        _issue_one(hs[0], shards[0], dtypes[0])
        return
    if hs[0].state.offload is not None:
        hs[0].state.offload.refresh(hs)  # the device copies read below are the masters' latest
    todo = []
    for h, s, dt in zip(hs, shards, dtypes, strict=True):
        if h.state.step.kept and _claim_kept(h, dt):
            continue  # a forward's kept copy, and its hold, serve this gather
        if h.state.registry.start_gather(h.slot):
            todo.append((h, s, dt))
        else:
            _check_held_dtype(h, dt)
    if not todo:
        return
    state = todo[0][0].state
    st = state.step
    device = todo[0][1].device
    dtype = todo[0][2]
    if any(dt != dtype for _, _, dt in todo):
        raise ZrsError("a fused prefetch group mixes gather dtypes; the planner must split it")
    # The gathered buffers are read by the compute stream: allocated on it (zrs.runtime.streams).
    flat = None
    if len(todo) == 1:
        h = todo[0][0]
        _set_buffer(st, h, torch.empty(h.padded_numel, dtype=dtype, device=device))
    else:
        flat = _group_buffer(st, [h for h, _, _ in todo], dtype, device)
    side = state.gather_stream
    if side is None or state.world_size == 1:
        if flat is not None and state.world_size > 1:
            # A fused gather lands in its receive buffer and is unpacked at the first wait: until
            # then the members' buffer needs no memory. Holding it back keeps a prefetch in flight
            # at 1x its gathered bytes (plus the send block), as the planner counts it, not 2x.
            flat.storage.resize_(0)
        _stage(todo)
        flight = _start_gather(todo, state, dtype, device, flat, async_op=True)
        if flight is None:
            _unstage(todo)
            return
    else:
        with streams.running_on(side) as done:
            _stage(todo)
            flight = _start_gather(todo, state, dtype, device, flat, async_op=False)
            assert flight is not None
            if flight.fused:
                flight.unpack()  # on the side stream, off the compute stream's path
                flight.fused = False
        flight.done = done[0]
    for h, _, _ in todo:
        st.in_flight[h.ds_id] = flight


def _issue_one(h: ParamHandle, shard: torch.Tensor, dtype: torch.dtype) -> None:
    """`issue_gather` of one parameter: the per-parameter gathers of a plan (the large weights,
    which the planner does not fuse) take this path, so it does the least work per call."""
    state = h.state
    st = state.step
    if state.offload is not None:
        state.offload.refresh([h])
    if st.kept and _claim_kept(h, dtype):
        return
    if not state.registry.start_gather(h.slot):
        _check_held_dtype(h, dtype)
        return
    _set_buffer(st, h, torch.empty(h.padded_numel, dtype=dtype, device=shard.device))
    todo = [(h, shard, dtype)]
    side = state.gather_stream if state.world_size > 1 else None
    if side is None:
        # None at one rank: the shard is cast into its buffer, nothing is in flight
        _stage(todo)
        flight = _start_gather(todo, state, dtype, shard.device, None, async_op=True)
    else:
        with streams.running_on(side) as done:
            _stage(todo)
            flight = _start_gather(todo, state, dtype, shard.device, None, async_op=False)
        assert flight is not None  # several ranks: a collective is in flight
        flight.done = done[0]
    if flight is not None:
        st.in_flight[h.ds_id] = flight
    else:
        _unstage(todo)


def _stage(todo: Todo) -> None:
    """offload="params": bring the shards of `todo` to the device on the current stream."""
    offload = todo[0][0].state.offload
    if offload is not None and offload.params:
        offload.stage([h for h, _, _ in todo])


def _unstage(todo: Todo) -> None:
    offload = todo[0][0].state.offload
    if offload is not None and offload.params:
        offload.unstage([h for h, _, _ in todo])


def _check_held_dtype(h: ParamHandle, dtype: torch.dtype) -> None:
    """A gather of a parameter that is already gathered must want the same dtype."""
    held = h.state.step.buffers.get(h.ds_id)
    if held is not None and held.dtype != dtype:
        raise ZrsError(
            f"parameter `{h.name}` is already gathered in {held.dtype} and was gathered again "
            f"in {dtype} before its release; this is a zero3 pass bug"
        )


def _group_buffer(
    st: StepState, hs: list[ParamHandle], dtype: torch.dtype, device: torch.device
) -> Flat:
    """One buffer for the gathered members of a fused gather; each member's buffer a view."""
    starts, length = group_layout([h.padded_numel for h in hs], dtype.itemsize)
    buf = torch.empty(length, dtype=dtype, device=device)
    flat = Flat(buf, len(hs))
    for h, start in zip(hs, starts, strict=True):
        _set_buffer(st, h, buf.narrow(0, start, h.padded_numel))
        st.flat_of[h.ds_id] = flat
    return flat


@torch.no_grad()  # writes the group buffer under its members' views (see InFlight.unpack)
def _copy_in(todo: Todo, flat: Flat | None) -> None:
    """World 1: write the shards (cast) straight into their gathered buffers."""
    if flat is None:
        h, s, _ = todo[0]
        h.state.step.buffers[h.ds_id].copy_(s.reshape(-1))
        return
    # Into each member's own buffer: they sit at aligned starts, not packed tight (group_layout).
    buffers = [h.state.step.buffers[h.ds_id] for h, _, _ in todo]
    torch._foreach_copy_(buffers, [s.reshape(-1) for _, s, _ in todo])


def _start_gather(
    todo: Todo,
    state: ZeroState,
    dtype: torch.dtype,
    device: torch.device,
    flat: Flat | None,
    async_op: bool,
) -> InFlight | None:
    """Issue the all-gather of `todo` (one parameter straight into its buffer, or several packed
    rank-major into one receive buffer) on the current stream. One rank has nothing to
    communicate: the shards are cast into their buffers, and nothing is in flight (None)."""
    if state.world_size == 1:
        _copy_in(todo, flat)
        return None
    if len(todo) == 1:
        h, s, _ = todo[0]
        buf = state.step.buffers[h.ds_id]
        send = s.to(dtype).reshape(-1)
        work = all_gather(buf, send, state.gather_group, async_op=async_op)
        return InFlight(work, send, buf, [(h, 0)], h.shard_numel, fused=False, flat=flat)
    offsets = list(itertools.accumulate((h.shard_numel for h, _, _ in todo), initial=0))
    block = offsets[-1]
    send = torch.empty(block, dtype=dtype, device=device)
    torch.ops.zrs.pack_cast([s for _, s, _ in todo], send)
    recv = torch.empty(block * state.world_size, dtype=dtype, device=device)
    work = all_gather(recv, send, state.gather_group, async_op=async_op)
    members = [(h, off) for (h, _, _), off in zip(todo, offsets, strict=False)]
    return InFlight(work, send, recv, members, block, fused=True, flat=flat)


def allgather_param(
    shard: torch.Tensor, graph_id: int, ds_id: int, dtype: torch.dtype | None
) -> torch.Tensor:
    h = handle(ds_id)
    st = h.state.step
    st.graph = graph_id
    if ds_id in st.prefetched:
        st.prefetched.discard(ds_id)  # the prefetch already took this gather's holder
    else:
        _issue_one(h, shard, dtype or shard.dtype)
    return _shaped(h)


def issue_group(
    graph_id: int, shards: list[torch.Tensor], ds_ids: list[int], dtypes: list[torch.dtype]
) -> None:
    """Start one fused all-gather of a planned group (compiler/coalesce.py)."""
    hs = handles(ds_ids)
    hs[0].state.step.graph = graph_id
    issue_gather(hs, shards, dtypes)


def prefetch(
    graph_id: int, shards: list[torch.Tensor], ds_ids: list[int], dtypes: list[torch.dtype]
) -> None:
    hs = handles(ds_ids)
    st = hs[0].state.step
    st.graph = graph_id
    issue_gather(hs, shards, dtypes)
    st.prefetched.update(ds_ids)


def wait_gather(ds_ids: list[int]) -> None:
    """Wait for the gathers of `ds_ids` (one fused collective completes all its members)."""
    for h in handles(ds_ids):
        in_flight = h.state.step.in_flight
        flight = in_flight.get(h.ds_id) if in_flight else None
        if flight is not None:
            flight.complete()
            for m, _ in flight.members:
                del in_flight[m.ds_id]
        h.state.registry.finish_gather(h.slot)


def wait_group(ds_ids: list[int]) -> list[torch.Tensor]:
    """Wait for a group's gather; its members' gathered parameters."""
    wait_gather(ds_ids)
    return [_shaped(h) for h in handles(ds_ids)]


def release(ds_ids: list[int], keep: list[bool]) -> None:
    for h, kept in zip(handles(ds_ids), keep, strict=True):
        if kept:
            _keep(h)
        else:
            drop_hold(h)


# --- copies a training forward keeps for its backward (compiler/keep.py) --------------------------
# `StepState.kept`: ds_id -> the shard's version counter when the forward kept the gathered copy.
# The forward's hold stays in the registry, so the copy stays "available"; the parameter's next
# gather takes the copy and the hold over (normally the backward's first use), unless the shard
# changed since.


def _keep(h: ParamHandle) -> None:
    st = h.state.step
    if not h.state.free_on_release:
        # Inductor may reuse a buffer that it sees dead for the output of a later kernel of the
        # same graph: the copy kept for the backward must be one the graph never saw. A device
        # copy costs less than the gather over the link that it saves.
        _set_buffer(st, h, st.buffers[h.ds_id].clone())
        flat = st.flat_of.pop(h.ds_id, None)
        if flat is not None:
            flat.live -= 1  # inductor's own references free the group buffer
    st.kept[h.ds_id] = h.kept_stamp()


def _claim_kept(h: ParamHandle, dtype: torch.dtype) -> bool:
    """True when a kept copy of `h` serves a gather in `dtype`; a stale one (the shard changed,
    e.g. an optimizer step after a forward without backward, or another dtype) is freed."""
    st = h.state.step
    version = st.kept.pop(h.ds_id, None)
    if version is None:
        return False
    if version == h.kept_stamp() and st.buffers[h.ds_id].dtype == dtype:
        return True
    drop_hold(h)
    return False
