"""Gradients: packed into buckets, reduce-scattered (mean over the ranks), all-reduced across
the replicas under hybrid sharding, accumulated into each parameter's `.grad`; the bucket being
filled and the reductions in flight live in the model's `StepState` (`zrs.runtime.step`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zrs.runtime import streams
from zrs.runtime.collectives import all_reduce, reduce_scatter
from zrs.runtime.grad_store import Key
from zrs.runtime.handles import ParamHandle, handles, local_tensor, names
from zrs.runtime.state import ZeroState

# Gradient buckets hold at most this many elements (per rank, all shards together); the
# compiler plans each backward's buckets within it (compiler/grad_buckets.py). 16M: about one
# 1b-preset layer per bucket. Each reduce-scatter costs CPU time to issue, and at 4M every large
# gradient of the 1b model was its own bucket (BENCHMARKS.md). Memory: (world x 16M) x reduce
# dtype per bucket, at most MAX_IN_FLIGHT_REDUCES + 1 buckets alive.
GRAD_BUCKET_NUMEL = 1 << 24
# Reduce-scatters in flight at most: a bucket fills while the previous one is reduced (double
# buffering); a third waits for the oldest, which bounds the gradient memory to a few buckets.
MAX_IN_FLIGHT_REDUCES = 2


@dataclass(eq=False)
class Bucket:
    """Gradients packed rank-major into `buf` (world, capacity): member i's shard for rank r sits
    at buf[r, off_i : off_i + shard_i], so one reduce-scatter of buf leaves each rank its shards
    side by side."""

    state: ZeroState
    buf: torch.Tensor
    members: list[tuple[ParamHandle, int]] = field(default_factory=list)  # (handle, column)
    used: int = 0  # columns filled
    region: Key | None = None  # one rank: `buf` is this region of the model's GradStore


@dataclass(eq=False)
class Reduce:
    work: dist.Work | None
    out: torch.Tensor
    members: list[tuple[ParamHandle, int]]
    packed: torch.Tensor  # the bucket, kept alive until the reduce-scatter has read it
    done: torch.cuda.Event | None = None  # on the reduce stream: the reduce-scatter finished
    region: Key | None = None  # `out` is this region of the model's GradStore
    graph: int = field(init=False)  # the graph that issued it (error messages)

    def __post_init__(self) -> None:
        self.graph = self.state.step.graph

    @property
    def state(self) -> ZeroState:
        return self.members[0][0].state

    def describe(self) -> str:
        hs = [h for h, _ in self.members]
        what = "reduce-scatter" if self.state.replicate_group is None else "reduction"
        return f"the gradient {what} of {names(hs)} in {self.state.graph_label(self.graph)}"


def reduce_scatter_full(h: ParamHandle, grad: torch.Tensor) -> torch.Tensor:
    """Synchronous reduce-scatter of one full gradient into this rank's shard (mean over ranks)."""
    state = h.state
    packed = torch.empty(
        state.world_size, h.shard_numel, dtype=state.reduce_dtype, device=grad.device
    )
    torch.ops.zrs.pack_grads([grad], state.world_size, [h.shard_numel], state.grad_scale, packed)
    if not h.shape:
        _replicate_scalar(packed)
    out = torch.empty(h.shard_numel, dtype=state.reduce_dtype, device=grad.device)
    work = reduce_scatter(out, packed.view(-1), state.reduce_group, async_op=True)
    state.wait(work, lambda: f"the gradient reduce-scatter of `{h.name}`")
    work = all_reduce(out, state.replicate_group, async_op=True)
    state.wait(work, lambda: f"the gradient all-reduce across replicas of `{h.name}`")
    return out.to(h.source.dtype)


def move_eager_grad(h: ParamHandle | None) -> None:
    """Autograd accumulated a gradient into the gathers' source (a gather run eagerly, outside
    a compiled graph): it belongs to the parameter (None: the model was dropped)."""
    if h is None:
        return
    grad, h.source.grad = h.source.grad, None
    if grad is not None:
        accumulate_grad(h, grad)


def reduce_grads(
    graph_id: int, grads: list[torch.Tensor], ds_ids: list[int], bucket_numels: list[int]
) -> None:
    """Pack gradients into their buckets, one kernel per run that fits in a bucket; reduce-scatter
    each bucket once full. `bucket_numels[i]`: the per-rank size of the bucket the compiler planned
    for gradient i (compiler/grad_buckets.py), 0 if unplanned (the bucket then holds up to
    GRAD_BUCKET_NUMEL)."""
    hs = handles(ds_ids)
    i = 0
    while i < len(hs):
        state = hs[i].state
        st = state.step
        st.graph = graph_id
        bucket = st.bucket
        if bucket is not None and bucket.used + hs[i].shard_numel > bucket.buf.size(1):
            _flush(state)
            bucket = None
        if bucket is None:
            cap = max(bucket_numels[i] or GRAD_BUCKET_NUMEL, hs[i].shard_numel)
            shape = (state.world_size, cap)
            # One rank: the packed bucket is the reduced gradient, so it is what stays in place.
            taken = _region(state, hs[i], shape, grads[i].device) if state.world_size == 1 else None
            if taken is None:
                buf = torch.empty(shape, dtype=state.reduce_dtype, device=grads[i].device)
                bucket = st.bucket = Bucket(state, buf)
            else:
                bucket = st.bucket = Bucket(state, taken[1], region=taken[0])
        start, end = bucket.used, i
        scalars = []  # columns of 0-d parameters
        while end < len(hs) and hs[end].state is state:
            if bucket.used + hs[end].shard_numel > bucket.buf.size(1):
                break
            bucket.members.append((hs[end], bucket.used))
            if not hs[end].shape:
                scalars.append(bucket.used)
            bucket.used += hs[end].shard_numel
            end += 1
        # Pack now (pre-divided, cast, zero padding): once this op returns, the compiled graph may
        # reuse the gradients' memory.
        cols = bucket.buf.narrow(1, start, bucket.used - start)
        torch.ops.zrs.pack_grads(
            grads[i:end],
            state.world_size,
            [h.shard_numel for h in hs[i:end]],
            state.grad_scale,
            cols,
        )
        for col in scalars:
            _replicate_scalar(bucket.buf.narrow(1, col, 1))
        _queue_final_callback(state)
        if bucket.used == bucket.buf.size(1):
            _flush(state)
        i = end


def bucket_room(state: ZeroState, bucket_numel: int) -> int:
    """Gradient columns (per rank) left before the bucket being filled is full; with none being
    filled, the capacity of the one a gradient planned into `bucket_numel` would start."""
    bucket = state.step.bucket
    if bucket is not None:
        return bucket.buf.size(1) - bucket.used
    return bucket_numel or GRAD_BUCKET_NUMEL


def _replicate_scalar(column: torch.Tensor) -> None:
    """A 0-d parameter is replicated (prepare/sharding.py): its packed gradient goes to every rank's
    block, not to rank 0's alone, so that the reduce-scatter leaves each rank the mean."""
    column.copy_(column[:1].expand_as(column))


def _flush(state: ZeroState) -> None:
    """Reduce-scatter the bucket being filled."""
    st = state.step
    bucket, st.bucket = st.bucket, None
    assert bucket is not None
    while len(st.reducing) >= MAX_IN_FLIGHT_REDUCES:
        _complete(st.reducing.pop(0))
    packed = bucket.buf
    if bucket.used < packed.size(1):
        # Partly filled (unplanned gradients, or a plan the calls did not follow): the rows are
        # strided and the collective needs them packed, a copy of the whole bucket.
        packed = packed.narrow(1, 0, bucket.used).contiguous()
    if state.world_size == 1:  # one shard: the packed bucket is the reduced gradient
        out = packed.view(-1)
        # The replicas' all-reduce (none with one replica), from the compute stream that packed.
        work = all_reduce(out, state.replicate_group, async_op=True)
        st.reducing.append(Reduce(work, out, bucket.members, packed, region=bucket.region))
        return
    taken = _region(state, bucket.members[0][0], (bucket.used,), packed.device)
    region, out = taken if taken is not None else (None, None)
    if out is None:
        out = torch.empty(bucket.used, dtype=state.reduce_dtype, device=packed.device)
    side = state.reduce_stream
    if side is None:
        work = reduce_scatter(out, packed.view(-1), state.reduce_group, async_op=True)
        if state.replicate_group is not None:
            work = _all_reduce_after(state, work, out, bucket.members)
        st.reducing.append(Reduce(work, out, bucket.members, packed, region=region))
        return
    with streams.running_on(side) as done:
        reduce_scatter(out, packed.view(-1), state.reduce_group, async_op=False)
        all_reduce(out, state.replicate_group, async_op=False)
    st.reducing.append(Reduce(None, out, bucket.members, packed, done[0], region))


def _all_reduce_after(
    state: ZeroState, first: dist.Work | None, out: torch.Tensor, members: list
) -> dist.Work | None:
    """Issue the replicas' all-reduce of `out` behind `first`, the reduce-scatter that writes it.
    Beside a GPU it waits on a stream of its own, so that the compute stream goes on with the
    backward; on the CPU (gloo) the host waits for the reduce-scatter first."""
    stream = state.replicate_stream
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        state.wait(
            first, lambda: f"the gradient reduce-scatter of {names([h for h, _ in members])}"
        )
        return all_reduce(out, state.replicate_group, async_op=True)


def _region(
    state: ZeroState, first: ParamHandle, shape: tuple[int, ...], device: torch.device
) -> tuple[Key, torch.Tensor] | None:
    """A region of the model's GradStore for a bucket starting with `first`, if it keeps its
    gradients in place (zrs.GraphedStep) and the region is free."""
    store = state.grad_store
    return None if store is None else store.take(first, shape, state.reduce_dtype, device)


def _complete(r: Reduce) -> None:
    """Wait for one reduce-scatter and accumulate its shards into the parameters' `.grad`."""
    streams.wait_for(r.done)
    r.state.wait(r.work, r.describe)
    # The members sit back to back from column 0, and the output holds exactly them.
    grads = r.out.split_with_sizes([h.shard_numel for h, _ in r.members])
    for (h, _), g in zip(r.members, grads, strict=True):
        accumulate_grad(h, g)
    if r.region is not None and r.state.grad_store is not None:
        r.state.grad_store.filled(r.region, [h for h, _ in r.members])


def accumulate_grad(h: ParamHandle, flat: torch.Tensor) -> None:
    """Add this rank's reduced gradient shard (flat, padded) to the parameter's `.grad`, then run
    the parameter's post-accumulate-grad hooks: its gradient for this backward is complete."""
    param = h.param
    if not param.requires_grad:
        # Frozen after zrs sharded it: the graphs compiled before still compute and reduce its
        # gradient, and no optimizer may step it.
        return
    local = flat if h.local_numel == h.shard_numel else flat.narrow(0, 0, h.local_numel)
    local = local.view(h.local_shape)
    offload = h.state.offload  # with it, the optimizer reads the gradient on the host
    grad = param.grad
    if grad is not None:
        # accumulation across micro-batches (add_ casts); with offload, once the copy arrives
        into = local_tensor(grad)
        if offload is None:
            into.add_(local)
        else:
            offload.to_host(local, param.dtype, into)
            offload.received(h, accumulated=True)
    else:
        if offload is not None:
            local = offload.to_host(local, param.dtype)
        # The reduce-scatter's output is the gradient: the .grad are views into it (no copy; the
        # output lives as long as any of its gradients).
        if local.dtype != param.dtype:
            store = h.state.grad_store
            local = local.to(param.dtype) if store is None else store.cast(h, local)
        param.grad = local if h.spec is None else DTensor(local, h.spec, requires_grad=False)
        if offload is not None:
            offload.received(h, accumulated=False)
    hooks = param._post_accumulate_grad_hooks
    if hooks:
        if offload is not None:
            offload.arrive()  # the hooks read the gradient
        for hook in tuple(hooks.values()):
            hook(param)


def finish_grads(state: ZeroState) -> None:
    """Reduce the last bucket, wait for every reduce-scatter and accumulate into the `.grad`s:
    this backward is over."""
    st = state.step
    st.finish_task = -1
    if st.bucket is not None:
        _flush(state)
    while st.reducing:
        _complete(st.reducing.pop(0))
    if state.offload is not None:
        state.offload.backward_over(state.control_group, state.world_size)
    state.step.drop_kept()
    state.backwards += 1


def _queue_final_callback(state: ZeroState) -> None:
    """Make sure the buckets are drained when autograd finishes this backward pass."""
    task = torch._C._current_graph_task_id()
    if task == -1 or state.step.finish_task == task:
        return  # not inside a backward (a direct call: end_backward finishes), or queued
    torch.autograd.Variable._execution_engine.queue_callback(lambda: finish_grads(state))
    state.step.finish_task = task


def end_backward(states: list[ZeroState]) -> None:
    """A backward graph ended: issue the partly filled buckets; finish now unless autograd's
    final callback will. A broken model is left alone: its reductions may wait on a dead
    communicator, and its next call raises anyway."""
    task = torch._C._current_graph_task_id()
    for state in states:
        st = state.step
        if state.broken is not None or (st.bucket is None and not st.reducing):
            continue
        if st.finish_task != -1 and st.finish_task == task:
            if st.bucket is not None:
                _flush(state)
        else:
            finish_grads(state)
