"""Process-wide state behind the zrs ops: parameter handles, gathered buffers, gradient buckets.

The Rust registry (`zrs._core.Registry`) decides *whether* a collective is needed and when a buffer
may be freed; this module owns the tensors and talks to torch.distributed. Every op in
`zrs.ops` resolves its `ds_id` here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zrs import streams
from zrs._core import Registry, ZrsError
from zrs.exchange import CompileRendezvous, keep_alive

# Gradient buckets hold at most this many elements (per rank, all shards together); the
# compiler plans each backward's buckets within it (passes/grad_buckets.py). 16M: about one
# 1b-preset layer per bucket. Each reduce-scatter costs ~0.1-0.15 ms of CPU to issue (2xH200
# profile); at 4M every large gradient of the 1b model was its own bucket, 115 reduce-scatters
# per step. Memory: (world x 16M) x reduce dtype per bucket, at most MAX_IN_FLIGHT_REDUCES + 1
# buckets alive.
GRAD_BUCKET_NUMEL = 1 << 24


@dataclass(eq=False)
class ZeroState:
    """One `zrs.compile` call: the process group, its registry and the precision settings."""

    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    device: torch.device
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype
    registry: Registry
    # Resize a released buffer's storage to 0 (the eager backend, whose FX code keeps every
    # intermediate alive until the graph returns). Inductor frees its buffers at their last use
    # itself and may *reuse* a dead gathered buffer as the output of a later kernel (seen on CUDA:
    # a weight-gradient mm wrote into the gathered weight's buffer), so there the release only
    # drops the runtime's reference.
    free_on_release: bool = True
    # The gradient reduce-scatters' own communicator over the same ranks (`reduce_group_of`).
    reduce_group: dist.ProcessGroup | None = None
    handles: list[ParamHandle] = field(default_factory=list)
    # id(shard) -> ds_id: traced gathers name their parameter by its shard (passes/regions.py)
    ds_ids: dict[int, int] = field(default_factory=dict)
    graph_ids: itertools.count = field(default_factory=itertools.count)
    # Schedule pass (passes.schedule): "search", "greedy" or "none"; budget in bytes or None;
    # directory for per-graph Chrome traces and memory plots, or None.
    scheduler: str = "search"
    memory_budget: int | None = None
    trace_dir: str | None = None
    # Measure compute and collective times for the planner (zrs.profile); the fitted collective
    # cost model is measured once, at the first graph compile.
    profile: bool = True
    # Training forwards keep their last-used gathered parameters for the backward (passes/keep.py).
    keep_for_backward: bool = True
    cost_model: dict | None = None
    cost_measured: bool = False
    # Wall seconds of zrs's own compile work, summed over graphs (compiler): "lower", "profile",
    # "plan", "keep", "buckets", "coalesce" and the collective "sweep"; dynamo and inductor take
    # the rest.
    compile_s: dict[str, float] = field(default_factory=dict)
    # Where the ranks meet before each graph compile (None for one rank).
    rendezvous: CompileRendezvous | None = None
    # Collectives on side streams (zrs.streams), decided once: the ops ask on every call.
    comm_streams: bool = field(init=False)
    # The parameters' DTensor mesh over `group` (None without torch.distributed: then each
    # parameter is the whole tensor).
    mesh: DeviceMesh | None = field(init=False)
    # A gloo group over `group`'s ranks for asynchronous checkpoint saves (zrs.checkpoint).
    checkpoint_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.reduce_group is None:
            self.reduce_group = self.group
        self.comm_streams = streams.enabled(self.device)
        self.mesh = (
            DeviceMesh.from_group(self.group, self.device.type) if self.group is not None else None
        )

    def wait(self, work: dist.Work | None) -> None:
        """Wait for a collective; when it fails because a peer compiled a graph that this rank
        did not, raise the ZrsError that says so instead of the transport's error."""
        if work is None:
            return
        try:
            work.wait()
        except Exception as exc:
            why = self.rendezvous.explain() if self.rendezvous is not None else None
            if why is None:
                raise
            raise ZrsError(why) from exc


@dataclass(eq=False)
class ParamHandle:
    """What the ops need about one sharded parameter, keyed by its global `ds_id`.

    Two tensors share the shard's storage: `shard`, the flat, padded leaf that the gathers read
    (the graphs' input), and `param`, the module's parameter that users and optimizers see: a
    DTensor `Shard(0)` over the full shape whose local tensor is this rank's real rows (the whole
    tensor, plain, without torch.distributed). Gradients land in `param.grad`."""

    ds_id: int
    local_id: int
    state: ZeroState
    shard: torch.Tensor
    param: nn.Parameter
    shape: tuple[int, ...]
    numel: int
    padded_numel: int
    shard_numel: int
    local_numel: int  # this rank's real elements: the first of `shard`, the rest is padding
    local_shape: tuple[int, ...]
    spec: DTensorSpec | None  # the parameter's (and its gradient's) DTensor spec


_HANDLES: dict[int, ParamHandle] = {}


def add_handle(
    state: ZeroState, shard: torch.Tensor, param: nn.Parameter, local_id: int
) -> ParamHandle:
    info = state.registry.info(local_id)
    local = param.to_local() if isinstance(param, DTensor) else param
    h = ParamHandle(
        ds_id=len(_HANDLES),
        local_id=local_id,
        state=state,
        shard=shard,
        param=param,
        shape=tuple(info.shape),
        numel=info.numel,
        padded_numel=info.padded_numel,
        shard_numel=info.shard_numel,
        local_numel=local.numel(),
        local_shape=tuple(local.shape),
        spec=param._spec if isinstance(param, DTensor) else None,
    )
    _HANDLES[h.ds_id] = h
    state.handles.append(h)
    state.ds_ids[id(shard)] = h.ds_id
    return h


def handles(ds_ids: list[int]) -> list[ParamHandle]:
    try:
        return [_HANDLES[i] for i in ds_ids]
    except KeyError:
        return [handle(i) for i in ds_ids]  # raises for the unknown one


def handle(ds_id: int) -> ParamHandle:
    try:
        return _HANDLES[ds_id]
    except KeyError:
        raise ZrsError(
            f"unknown parameter ds_id {ds_id}: no zrs.compile call in this process registered it; "
            "compile the model with zrs.compile(model) before running it"
        ) from None


# --- collectives ------------------------------------------------------------------------------
# A group of None means a single process without torch.distributed: collectives become copies.


def all_gather(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    if group is None:
        out.copy_(inp)
        return None
    work = dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
    return _issued(work, async_op, out, inp)


def reduce_group_of(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A second communicator over `group`'s ranks for the bucketed gradient reduce-scatters.

    NCCL runs a communicator's collectives one after another on one stream, in issue order. On
    one communicator a reduce-scatter queued behind the backward's prefetched all-gathers, and
    the compute stream, which waits for the oldest reduce-scatter when a third bucket fills
    (MAX_IN_FLIGHT_REDUCES), stalled with it: 10.7 ms per step on 2xH200 without P2P (profile,
    session 5). The planner already models gathers and reduce-scatters on separate streams.
    Only the group's members take part (use_local_synchronization), so subgroups work too."""
    if group is None or dist.get_world_size(group) == 1:
        return group
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend=dist.get_backend(group), use_local_synchronization=True)


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
    # (see zrs.exchange, a gloo worker thread must never drop their last reference).
    keep_alive(work, *tensors)
    if async_op:
        return work
    work.wait()
    return None


def gather_full(h: ParamHandle, shard: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Synchronous all-gather of one parameter (the functional op and full_state_dict use it)."""
    dtype = dtype or shard.dtype
    buf = torch.empty(h.padded_numel, dtype=dtype, device=shard.device)
    h.state.wait(all_gather(buf, shard.detach().to(dtype).reshape(-1), h.state.group, True))
    return buf.narrow(0, 0, h.numel).view(h.shape)


def reduce_scatter_full(h: ParamHandle, grad: torch.Tensor) -> torch.Tensor:
    """Synchronous reduce-scatter of one full gradient into this rank's shard (mean over ranks)."""
    state = h.state
    packed = torch.empty(
        state.world_size, h.shard_numel, dtype=state.reduce_dtype, device=grad.device
    )
    torch.ops.zrs.pack_grads(
        [grad], state.world_size, [h.shard_numel], 1.0 / state.world_size, packed
    )
    if not h.shape:
        _replicate_scalar(packed)
    out = torch.empty(h.shard_numel, dtype=state.reduce_dtype, device=grad.device)
    state.wait(reduce_scatter(out, packed.view(-1), state.group, async_op=True))
    return out.to(h.shard.dtype)


def move_eager_grad(h: ParamHandle) -> None:
    """Autograd accumulated a gradient into the flat shard (a gather run eagerly, outside a
    compiled graph): it belongs to the parameter."""
    grad, h.shard.grad = h.shard.grad, None
    if grad is not None:
        accumulate_grad(h, grad)


# --- gathered parameters (lowered ops) ---------------------------------------------------------


@dataclass(eq=False)
class _InFlight:
    """One issued all-gather, possibly fused over several parameters (rank-major layout)."""

    work: dist.Work | None
    send: torch.Tensor  # kept alive until the collective completes
    recv: torch.Tensor
    members: list[tuple[ParamHandle, int]]  # (handle, offset of its shard inside a rank block)
    block: int  # elements per rank block
    fused: bool  # True: `recv` still has to be unpacked into the members' buffers
    done: torch.cuda.Event | None = None  # on a side stream: the gather (and unpack) finished
    flat: _Flat | None = None  # the members' group buffer (fused gathers)

    def complete(self) -> None:
        streams.wait_for(self.done)
        self.members[0][0].state.wait(self.work)
        if not self.fused:
            return
        self.unpack()

    @torch.no_grad()  # the members' buffers are split views: autograd refuses in-place writes
    def unpack(self) -> None:
        world = self.members[0][0].state.world_size
        flat = self.flat
        assert flat is not None, "a fused gather lands in its group's flat buffer"
        # Storage held back at issue (issue_gather): allocate it now.
        flat.storage.resize_(flat.nbytes)
        torch.ops.zrs.unpack_rank_major(
            self.recv,
            world,
            [off for _, off in self.members],
            [h.shard_numel for h, _ in self.members],
            [_BUFFERS[h.ds_id] for h, _ in self.members],
        )


@dataclass(eq=False)
class _Flat:
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


_BUFFERS: dict[int, torch.Tensor] = {}  # ds_id -> gathered padded flat buffer
_IN_FLIGHT: dict[int, _InFlight] = {}  # ds_id -> the collective that fills its buffer
_PREFETCHED: set[int] = set()  # gathered by prefetch_params_fused, holder not yet claimed
_FLAT_OF: dict[int, _Flat] = {}  # ds_id -> the group buffer its gathered buffer is a view of


_SHAPED: dict[int, torch.Tensor] = {}  # ds_id -> the parameter's view of its buffer


def _set_buffer(h: ParamHandle, buf: torch.Tensor) -> None:
    _BUFFERS[h.ds_id] = buf
    unpadded = buf if h.padded_numel == h.numel else buf.narrow(0, 0, h.numel)
    _SHAPED[h.ds_id] = unpadded.view(h.shape)


def _shaped(h: ParamHandle) -> torch.Tensor:
    # A fresh view of a view made when the buffer was allocated: `view` needs no storage, so it
    # also works while a fused gather holds the buffer's storage back (narrow would not). Fresh:
    # an op called outside a compiled graph has its outputs marked by autograd's fallback, and
    # the stored view must not carry that into the next gather's output.
    return _SHAPED[h.ds_id].view(h.shape)


def issue_gather(
    hs: list[ParamHandle], shards: list[torch.Tensor], dtypes: list[torch.dtype]
) -> None:
    """Start one all-gather for every handle whose registry says a collective is needed.

    Runs inside the zrs ops, below autograd: the shards need no `detach`."""
    if len(hs) == 1:
        _issue_one(hs[0], shards[0], dtypes[0])
        return
    todo = []
    for h, s, dt in zip(hs, shards, dtypes, strict=True):
        if _KEPT and _claim_kept(h, dt):
            continue  # a forward's kept copy, and its hold, serve this gather
        if h.state.registry.start_gather(h.local_id):
            todo.append((h, s, dt))
        else:
            _check_held_dtype(h, dt)
    if not todo:
        return
    state = todo[0][0].state
    device = todo[0][1].device
    dtype = todo[0][2]
    if any(dt != dtype for _, _, dt in todo):
        raise ZrsError("a fused prefetch group mixes gather dtypes; the planner must split it")
    # The gathered buffers are read by the compute stream: allocated on it (zrs.streams).
    flat = None
    if len(todo) == 1:
        h = todo[0][0]
        _set_buffer(h, torch.empty(h.padded_numel, dtype=dtype, device=device))
    else:
        flat = _group_buffer([h for h, _, _ in todo], dtype, device)
    side = streams.side_stream(device, "gather") if state.comm_streams else None
    if side is None or state.world_size == 1:
        if flat is not None and state.world_size > 1:
            # A fused gather lands in its receive buffer and is unpacked at the first wait: until
            # then the members' buffer needs no memory. Holding it back keeps a prefetch in flight
            # at 1x its gathered bytes (plus the send block), as the planner counts it, not 2x.
            flat.storage.resize_(0)
        flight = _start_gather(todo, state, dtype, device, flat, async_op=True)
        if flight is None:
            return
    else:
        with streams.running_on(side) as done:
            flight = _start_gather(todo, state, dtype, device, flat, async_op=False)
            assert flight is not None
            if flight.fused:
                flight.unpack()  # on the side stream, off the compute stream's path
                flight.fused = False
        flight.done = done[0]
    for h, _, _ in todo:
        _IN_FLIGHT[h.ds_id] = flight


def _issue_one(h: ParamHandle, shard: torch.Tensor, dtype: torch.dtype) -> None:
    """`issue_gather` of one parameter: the per-parameter gathers of a plan (the large weights,
    which the planner does not fuse) take this path, so it does the least work per call."""
    if _KEPT and _claim_kept(h, dtype):
        return
    state = h.state
    if not state.registry.start_gather(h.local_id):
        _check_held_dtype(h, dtype)
        return
    _set_buffer(h, torch.empty(h.padded_numel, dtype=dtype, device=shard.device))
    todo = [(h, shard, dtype)]
    several = state.world_size > 1 and state.comm_streams
    side = streams.side_stream(shard.device, "gather") if several else None
    if side is None:
        # None at one rank: the shard is cast into its buffer, nothing is in flight
        flight = _start_gather(todo, state, dtype, shard.device, None, async_op=True)
    else:
        with streams.running_on(side) as done:
            flight = _start_gather(todo, state, dtype, shard.device, None, async_op=False)
        assert flight is not None  # several ranks: a collective is in flight
        flight.done = done[0]
    if flight is not None:
        _IN_FLIGHT[h.ds_id] = flight


def _check_held_dtype(h: ParamHandle, dtype: torch.dtype) -> None:
    """A gather of a parameter that is already gathered must want the same dtype."""
    if h.ds_id in _BUFFERS and _BUFFERS[h.ds_id].dtype != dtype:
        raise ZrsError(
            f"parameter ds_id {h.ds_id} is already gathered in {_BUFFERS[h.ds_id].dtype} and "
            f"was gathered again in {dtype} before its release; this is a zero3 pass bug"
        )


def _group_buffer(hs: list[ParamHandle], dtype: torch.dtype, device: torch.device) -> _Flat:
    """One buffer for the gathered members of a fused gather; each member's buffer a view."""
    sizes = [h.padded_numel for h in hs]
    buf = torch.empty(sum(sizes), dtype=dtype, device=device)
    flat = _Flat(buf, len(hs))
    for h, view in zip(hs, buf.split_with_sizes(sizes), strict=True):
        _set_buffer(h, view)
        _FLAT_OF[h.ds_id] = flat
    return flat


@torch.no_grad()  # writes the group buffer under its members' views (see _InFlight.unpack)
def _copy_in(todo: list[tuple[ParamHandle, torch.Tensor, torch.dtype]], flat: _Flat | None) -> None:
    """World 1: write the shards (cast) straight into their gathered buffers."""
    if flat is None:
        h, s, _ = todo[0]
        _BUFFERS[h.ds_id].copy_(s.reshape(-1))
        return
    torch.ops.zrs.pack_cast([s for _, s, _ in todo], flat.buf)


def _start_gather(
    todo: list[tuple[ParamHandle, torch.Tensor, torch.dtype]],
    state: ZeroState,
    dtype: torch.dtype,
    device: torch.device,
    flat: _Flat | None,
    async_op: bool,
) -> _InFlight | None:
    """Issue the all-gather of `todo` (one parameter straight into its buffer, or several packed
    rank-major into one receive buffer) on the current stream. One rank has nothing to
    communicate: the shards are cast into their buffers, and nothing is in flight (None)."""
    if state.world_size == 1:
        _copy_in(todo, flat)
        return None
    if len(todo) == 1:
        h, s, _ = todo[0]
        buf = _BUFFERS[h.ds_id]
        send = s.to(dtype).reshape(-1)
        work = all_gather(buf, send, state.group, async_op=async_op)
        return _InFlight(work, send, buf, [(h, 0)], h.shard_numel, fused=False, flat=flat)
    offsets = list(itertools.accumulate((h.shard_numel for h, _, _ in todo), initial=0))
    block = offsets[-1]
    send = torch.empty(block, dtype=dtype, device=device)
    torch.ops.zrs.pack_cast([s for _, s, _ in todo], send)
    recv = torch.empty(block * state.world_size, dtype=dtype, device=device)
    work = all_gather(recv, send, state.group, async_op=async_op)
    members = [(h, off) for (h, _, _), off in zip(todo, offsets, strict=False)]
    return _InFlight(work, send, recv, members, block, fused=True, flat=flat)


def allgather_param(shard: torch.Tensor, ds_id: int, dtype: torch.dtype | None) -> torch.Tensor:
    h = _HANDLES.get(ds_id) or handle(ds_id)
    if ds_id in _PREFETCHED:
        _PREFETCHED.discard(ds_id)  # the prefetch already took this gather's holder
    else:
        _issue_one(h, shard, dtype or shard.dtype)
    return _shaped(h)


def issue_group(shards: list[torch.Tensor], ds_ids: list[int], dtypes: list[torch.dtype]) -> None:
    """Start one fused all-gather of a planned group (passes/coalesce.py)."""
    issue_gather(handles(ds_ids), shards, dtypes)


def prefetch(shards: list[torch.Tensor], ds_ids: list[int], dtypes: list[torch.dtype]) -> None:
    issue_gather(handles(ds_ids), shards, dtypes)
    _PREFETCHED.update(ds_ids)


def wait_gather(ds_ids: list[int]) -> None:
    """Wait for the gathers of `ds_ids` (one fused collective completes all its members)."""
    for h in handles(ds_ids):
        flight = _IN_FLIGHT.get(h.ds_id) if _IN_FLIGHT else None
        if flight is not None:
            flight.complete()
            for m, _ in flight.members:
                del _IN_FLIGHT[m.ds_id]
        h.state.registry.finish_gather(h.local_id)


def wait_group(ds_ids: list[int]) -> list[torch.Tensor]:
    """Wait for a group's gather; its members' gathered parameters."""
    wait_gather(ds_ids)
    return [_shaped(h) for h in handles(ds_ids)]


def release(ds_ids: list[int], keep: list[bool]) -> None:
    for h, kept in zip(handles(ds_ids), keep, strict=True):
        if kept:
            _keep(h)
        else:
            _drop_hold(h)


def _drop_hold(h: ParamHandle) -> None:
    if h.state.registry.release(h.local_id):
        buf = _BUFFERS.pop(h.ds_id)
        del _SHAPED[h.ds_id]
        flat = _FLAT_OF.pop(h.ds_id, None)
        if not h.state.free_on_release:
            return
        # The graph's remaining aliases of the buffer are dead: the release follows the last use.
        if flat is None:
            buf.untyped_storage().resize_(0)
        else:
            flat.live -= 1
            if flat.live == 0:
                flat.storage.resize_(0)


# --- copies a training forward keeps for its backward (passes/keep.py) ---------------------------
# ds_id -> the shard's version counter when the forward kept the gathered copy. The forward's
# hold stays in the registry, so the copy stays "available"; the parameter's next gather takes
# the copy and the hold over (normally the backward's first use), unless the shard changed since.
_KEPT: dict[int, int] = {}


def _keep(h: ParamHandle) -> None:
    if not h.state.free_on_release:
        # Inductor may reuse a buffer that it sees dead for the output of a later kernel of the
        # same graph: the copy kept for the backward must be one the graph never saw. A device
        # copy (~0.1 ms for a 1b model's head and last layer) against a gather over the link.
        _set_buffer(h, _BUFFERS[h.ds_id].clone())
        flat = _FLAT_OF.pop(h.ds_id, None)
        if flat is not None:
            flat.live -= 1  # inductor's own references free the group buffer
    _KEPT[h.ds_id] = h.shard._version


def _claim_kept(h: ParamHandle, dtype: torch.dtype) -> bool:
    """True when a kept copy of `h` serves a gather in `dtype`; a stale one (the shard changed,
    e.g. an optimizer step after a forward without backward, or another dtype) is freed."""
    version = _KEPT.pop(h.ds_id, None)
    if version is None:
        return False
    if version == h.shard._version and _BUFFERS[h.ds_id].dtype == dtype:
        return True
    _drop_hold(h)
    return False


def drop_kept() -> None:
    """Free the kept copies no gather took over (the backward did not use them)."""
    for ds_id in list(_KEPT):
        del _KEPT[ds_id]
        _drop_hold(handle(ds_id))


_optimizer_hook: object = None


def drop_kept_before_optimizer_steps() -> None:
    """Also free the kept copies before every torch.optim step (hooked once per process): a step
    is where shards change, and one that writes through `.data` bumps no version counter, which
    `_claim_kept` checks."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: drop_kept()
        )


# --- gradient buckets -------------------------------------------------------------------------


@dataclass(eq=False)
class _Bucket:
    """Gradients packed rank-major into `buf` (world, capacity): member i's shard for rank r sits
    at buf[r, off_i : off_i + shard_i], so one reduce-scatter of buf leaves each rank its shards
    side by side."""

    state: ZeroState
    buf: torch.Tensor
    members: list[tuple[ParamHandle, int]] = field(default_factory=list)  # (handle, column)
    used: int = 0  # columns filled


@dataclass(eq=False)
class _Reduce:
    work: dist.Work | None
    out: torch.Tensor
    members: list[tuple[ParamHandle, int]]
    packed: torch.Tensor  # the bucket, kept alive until the reduce-scatter has read it
    done: torch.cuda.Event | None = None  # on the reduce stream: the reduce-scatter finished


_BUCKETS: dict[tuple[int, torch.dtype], _Bucket] = {}
_REDUCING: list[_Reduce] = []
_callback_queued = False
# Reduce-scatters in flight at most: a bucket fills while the previous one is reduced (double
# buffering); a third waits for the oldest, which bounds the gradient memory to a few buckets.
MAX_IN_FLIGHT_REDUCES = 2


def reduce_grads(grads: list[torch.Tensor], ds_ids: list[int], bucket_numels: list[int]) -> None:
    """Pack gradients into their buckets, one kernel per run that fits in a bucket; reduce-scatter
    each bucket once full. `bucket_numels[i]`: the per-rank size of the bucket the compiler planned
    for gradient i (passes/grad_buckets.py), 0 if unplanned (the bucket then holds up to
    GRAD_BUCKET_NUMEL)."""
    hs = handles(ds_ids)
    i = 0
    while i < len(hs):
        state = hs[i].state
        key = (id(state), state.reduce_dtype)
        bucket = _BUCKETS.get(key)
        if bucket is not None and bucket.used + hs[i].shard_numel > bucket.buf.size(1):
            _flush(key)
            bucket = None
        if bucket is None:
            cap = max(bucket_numels[i] or GRAD_BUCKET_NUMEL, hs[i].shard_numel)
            buf = torch.empty(
                state.world_size, cap, dtype=state.reduce_dtype, device=grads[i].device
            )
            bucket = _BUCKETS[key] = _Bucket(state, buf)
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
            1.0 / state.world_size,
            cols,
        )
        for col in scalars:
            _replicate_scalar(bucket.buf.narrow(1, col, 1))
        _queue_final_callback()
        if bucket.used == bucket.buf.size(1):
            _flush(key)
        i = end


def _replicate_scalar(column: torch.Tensor) -> None:
    """A 0-d parameter is replicated (sharding.py): its packed gradient goes to every rank's
    block, not to rank 0's alone, so that the reduce-scatter leaves each rank the mean."""
    column.copy_(column[:1].expand_as(column))


def _flush(key: tuple[int, torch.dtype]) -> None:
    bucket = _BUCKETS.pop(key)
    while len(_REDUCING) >= MAX_IN_FLIGHT_REDUCES:
        _complete(_REDUCING.pop(0))
    state, dtype = bucket.state, key[1]
    packed = bucket.buf
    if bucket.used < packed.size(1):
        # Partly filled (unplanned gradients, or a plan the calls did not follow): the rows are
        # strided and the collective needs them packed, a copy of the whole bucket.
        packed = packed.narrow(1, 0, bucket.used).contiguous()
    if state.world_size == 1:  # one rank: the packed bucket is the reduced gradient
        _REDUCING.append(_Reduce(None, packed.view(-1), bucket.members, packed))
        return
    out = torch.empty(bucket.used, dtype=dtype, device=packed.device)
    side = streams.side_stream(packed.device, "reduce") if state.comm_streams else None
    if side is None:
        work = reduce_scatter(out, packed.view(-1), state.reduce_group, async_op=True)
        _REDUCING.append(_Reduce(work, out, bucket.members, packed))
        return
    with streams.running_on(side) as done:
        reduce_scatter(out, packed.view(-1), state.reduce_group, async_op=False)
    _REDUCING.append(_Reduce(None, out, bucket.members, packed, done[0]))


def _complete(r: _Reduce) -> None:
    """Wait for one reduce-scatter and accumulate its shards into the parameters' `.grad`."""
    streams.wait_for(r.done)
    r.members[0][0].state.wait(r.work)
    # The members sit back to back from column 0, and the output holds exactly them.
    grads = r.out.split_with_sizes([h.shard_numel for h, _ in r.members])
    for (h, _), g in zip(r.members, grads, strict=True):
        accumulate_grad(h, g)


def accumulate_grad(h: ParamHandle, flat: torch.Tensor) -> None:
    """Add this rank's reduced gradient shard (flat, padded) to the parameter's `.grad`, then run
    the parameter's post-accumulate-grad hooks: its gradient for this backward is complete."""
    param = h.param
    local = flat if h.local_numel == h.shard_numel else flat.narrow(0, 0, h.local_numel)
    local = local.view(h.local_shape)
    if param.grad is None:
        # The reduce-scatter's output is the gradient: the .grad are views into it (no copy; the
        # output lives as long as any of its gradients).
        if local.dtype != param.dtype:
            local = local.to(param.dtype)
        param.grad = local if h.spec is None else DTensor(local, h.spec, requires_grad=False)
    else:
        grad = param.grad
        # accumulation across micro-batches (add_ casts)
        (grad._local_tensor if isinstance(grad, DTensor) else grad).add_(local)
    hooks = param._post_accumulate_grad_hooks
    if hooks:
        for hook in tuple(hooks.values()):
            hook(param)


def flush_grads() -> None:
    for key in list(_BUCKETS):
        _flush(key)


def finish_grads() -> None:
    """Wait for every reduce-scatter and accumulate into the shards' `.grad`."""
    global _callback_queued
    _callback_queued = False
    flush_grads()
    while _REDUCING:
        _complete(_REDUCING.pop(0))
    drop_kept()


def _queue_final_callback() -> None:
    """Make sure the buckets are drained when autograd finishes this backward pass."""
    global _callback_queued
    if _callback_queued:
        return
    try:
        torch.autograd.Variable._execution_engine.queue_callback(finish_grads)
    except RuntimeError:
        return  # not inside a backward pass (a direct call): end_backward finishes instead
    _callback_queued = True


def end_backward() -> None:
    """Issue the partly filled buckets; finish now unless autograd's final callback will."""
    flush_grads()
    if not _callback_queued:
        finish_grads()


def reset() -> None:
    """Drop all in-flight state (tests, and recovery after an exception mid-step)."""
    global _callback_queued
    _BUFFERS.clear()
    _SHAPED.clear()
    _IN_FLIGHT.clear()
    _PREFETCHED.clear()
    _FLAT_OF.clear()
    _KEPT.clear()
    _BUCKETS.clear()
    _REDUCING.clear()
    _callback_queued = False
