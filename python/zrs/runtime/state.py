"""Runtime state behind the zrs ops: one model's `ZeroState`.

The Rust registry (`zrs._core.Registry`) decides *whether* a collective is needed and when a buffer
may be freed; this module owns the tensors and talks to torch.distributed. Every op in
`zrs.runtime.ops` resolves its `ds_id` through `LIVE` (`runtime/handles.py`). Everything one step
holds between the ops lives in the model's `StepState` (`ZeroState.step`, `runtime/step.py`), which
a step that stops part-way is reset as a unit from.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.utils._pytree import tree_flatten

from zrs._core import Registry, ZrsError
from zrs.runtime import streams
from zrs.runtime.additions import Additions
from zrs.runtime.exchange import Peers, all_gather_ints, first_line
from zrs.runtime.grad_store import GradStore
from zrs.runtime.handles import LIVE, ParamHandle
from zrs.runtime.offload import Offload
from zrs.runtime.step import StepState

_log = logging.getLogger("zrs")

# What the ranks compare before each forward (`ZeroState.begin_forward`), in this order.
STEP_COUNTERS = ("forward calls", "finished backwards", "optimizer steps", "training", "grad")


class EagerPath(Protocol):
    """What the model's state needs of its eager path (`zrs.runtime.fetch.Fetcher`, which builds
    on this module): whether it holds anything, and dropping what it holds."""

    def busy(self) -> bool: ...

    def reset(self) -> None: ...

    def forget(self) -> None: ...


@dataclass(eq=False)
class ZeroState:
    """One `zrs.compile` call: the process groups, the registry, the precision settings and the
    state of the running step."""

    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    device: torch.device
    param_dtype: torch.dtype | None
    master_dtype: torch.dtype  # every shard's (options.master_dtype)
    reduce_dtype: torch.dtype
    registry: Registry
    # Resize a released buffer's storage to 0 (the eager backend keeps every intermediate alive);
    # inductor may *reuse* a dead gathered buffer (seen on CUDA): a release drops a reference.
    free_on_release: bool = True
    # True (no master_dtype): each parameter computes and is saved in its own dtype.
    own_dtypes: bool = True
    # How long any collective or meeting of this model waits for a peer.
    timeout: datetime.timedelta = datetime.timedelta(minutes=30)
    # The all-gathers' and the reduce-scatters' communicators over `group`'s ranks (links.py).
    gather_group: dist.ProcessGroup | None = None
    reduce_group: dist.ProcessGroup | None = None
    # A gloo group over the job's ranks for host-side exchanges (rank and step checks, profile).
    control_group: dist.ProcessGroup | None = None
    # Hybrid sharding (docs/hybrid.md): the replicas' all-reduce communicator, the job, its mesh.
    replicate_group: dist.ProcessGroup | None = None
    job_group: dist.ProcessGroup | None = None
    device_mesh: DeviceMesh | None = None
    handles: list[ParamHandle] = field(default_factory=list)
    # id(shard) -> ds_id: traced gathers name their parameter by its shard (compiler/regions.py)
    ds_ids: dict[int, int] = field(default_factory=dict)
    graph_ids: itertools.count = field(default_factory=itertools.count)
    # The planner's options (compiler/plan.py): scheduler, budget in bytes, a trace directory.
    scheduler: str = "search"
    memory_budget: int | None = None
    trace_dir: str | None = None
    # Measure compute and collective times for the planner (zrs.compiler.profile), once.
    profile: bool = True
    # Training forwards keep their last-used gathered parameters for the backward (keep.py).
    keep_for_backward: bool = True
    cost_model: dict | None = None
    cost_measured: bool = False
    host_measured: bool = False  # offload's copy link, in cost_model["host"] (CUDA)
    # Wall seconds of zrs's own compile work by phase ("lower", "profile", "plan", "keep",
    # "buckets", "coalesce", the collective "sweep"), summed over graphs.
    compile_s: dict[str, float] = field(default_factory=dict)
    # Where the ranks meet outside the collectives (None for one rank).
    peers: Peers | None = None
    # The all-gathers' and reduce-scatters' side streams (`streams`); None: the compute stream.
    gather_stream: torch.cuda.Stream | None = field(init=False)
    reduce_stream: torch.cuda.Stream | None = field(init=False)
    # The parameters' DTensor mesh (None without torch.distributed: each a whole tensor).
    mesh: DeviceMesh | None = field(init=False)
    replicas: int = field(init=False)  # the replicate group's size (1: no hybrid sharding)
    # Where each all-reduce across replicas waits for its reduce-scatter (grads.py; CUDA).
    replicate_stream: torch.cuda.Stream | None = field(init=False)
    job_rank: int = field(init=False)  # this rank in `job_group`
    # One rank: a gather that casts nothing is a view of the shard (compiler/zero3.py); not with
    # offload, whose gather remakes a stale device copy. The compiler's tests turn it off.
    one_rank_views: bool = field(init=False)
    # A gloo group over `group`'s ranks for asynchronous checkpoint saves (zrs.checkpoint).
    checkpoint_group: dist.ProcessGroup | None = None
    step: StepState = field(default_factory=StepState)
    # The eager path (`runtime/fetch.py`): leaves read outside compiled graphs, their gathers.
    fetcher: EagerPath | None = None
    # Reduced gradients at fixed addresses for zrs.GraphedStep (None: fresh tensors each time).
    grad_store: GradStore | None = None
    # What the ranks compare before each forward (STEP_COUNTERS).
    forwards: int = 0
    backwards: int = 0
    optimizer_steps: int = 0
    # Whether the step check compares the input shapes (compiler/forward.py), and the outcome.
    compare_inputs: bool = False
    inputs_agree: bool = True
    # Why this model can no longer run: a collective failed or the ranks disagreed. Set once.
    broken: str | None = None
    # The module this state shards (zrs.CapturedStep reads its train/eval flags).
    module: weakref.ref[nn.Module] | None = None
    # Parameters registered after sharding, which zrs neither shards nor reduces.
    additions: Additions = field(default_factory=Additions)
    # zrs.shard(offload="optimizer"): the masters and the optimizer step on the host.
    offload: Offload | None = None

    def __post_init__(self) -> None:
        if self.gather_group is None:
            self.gather_group = self.group
        if self.reduce_group is None:
            self.reduce_group = self.gather_group
        self.one_rank_views = self.world_size == 1 and self.offload is None
        self.gather_stream = streams.side_stream(self.device, "gather")
        self.reduce_stream = streams.side_stream(self.device, "reduce")
        # Offloaded parameters are host tensors: their norms run on the gloo group's mesh.
        mesh_group, mesh_device = self.group, self.device.type
        if self.offload is not None and self.control_group is not None:
            mesh_group, mesh_device = self.control_group, "cpu"
        self.mesh = (
            DeviceMesh.from_group(mesh_group, mesh_device) if mesh_group is not None else None
        )
        if self.device_mesh is not None:
            self.mesh = self.device_mesh
        if self.job_group is None:
            self.job_group = self.group
        self.replicas = dist.get_world_size(self.replicate_group) if self.replicate_group else 1
        self.replicate_stream = None
        if self.replicas > 1 and self.device.type == "cuda":
            self.replicate_stream = torch.cuda.Stream(self.device)
        # This rank's place in the job: rank 0 of it alone writes what one rank writes.
        self.job_rank = dist.get_rank(self.job_group) if self.job_group is not None else 0
        LIVE.add(self)

    @property
    def grad_scale(self) -> float:
        """What each gradient is multiplied by before its reduce-scatter: the mean over every
        rank of the job, the reduce-scatter and the replicas' all-reduce both summing."""
        return 1.0 / (self.world_size * self.replicas)

    def placements(self, dim: int) -> list[Placement]:
        """A parameter's DTensor placements on `mesh`: its rows sharded, replicated across the
        replicas; a 0-d parameter replicated."""
        own: Placement = Shard(0) if dim else Replicate()
        return [Replicate(), own] if self.device_mesh is not None else [own]

    # --- failures ---------------------------------------------------------------------------

    def wait(self, work: dist.Work | None, what: Callable[[], str]) -> None:
        """Wait for a collective; if it fails (a peer stalled past the timeout, died, raised, or
        compiled a graph alone), raise a ZrsError naming `what()` and, where a peer left one,
        its reason; the model is unusable from then on."""
        if work is None:
            return
        try:
            work.wait()
        except Exception as exc:
            raise self.failed(what(), exc) from exc

    def failed(self, what: str, exc: BaseException) -> ZrsError:
        """The ZrsError for a failed collective or meeting; marks the model broken."""
        why = self.peers.explain() if self.peers is not None else None
        if why is None:
            cause = first_line(exc) or type(exc).__name__
            why = (
                f"a peer stalled past the timeout ({self.timeout.total_seconds():g} s), died, "
                f"or stopped issuing this model's collectives ({cause})"
            )
        message = f"rank {self.rank}: {what} failed: {why}"
        if self.broken is None:
            self.broken = (
                f"{message}. The ranks can no longer be trusted to agree: restart the job, from "
                "the last checkpoint"
            )
            if self.peers is not None:
                self.peers.note(message)
        return ZrsError(message)

    @contextlib.contextmanager
    def exchanging(self, what: str) -> Iterator[None]:
        """Turn a failed exchange or meeting in the block into the ZrsError of `failed`."""
        try:
            yield
        except ZrsError as exc:
            if self.broken is None:
                self.broken = str(exc)
            raise
        except (RuntimeError, dist.DistError) as exc:
            raise self.failed(what, exc) from exc

    def check_usable(self) -> None:
        if self.broken is not None:
            raise ZrsError(self.broken)

    def graph_label(self, graph: int) -> str:
        """`graph` (-1: none known) and the phase running now, for an error message."""
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        return f"graph {graph} ({phase})" if graph >= 0 else phase

    # --- steps ------------------------------------------------------------------------------

    def begin_forward(self, training: bool, inputs: object = None) -> None:
        """Start a call of the compiled model: refuse a broken model, clean up after a step that
        stopped part-way, and check that every rank is at the same call (STEP_COUNTERS); with
        `compare_inputs`, learn whether every rank's `inputs` have the same shapes."""
        self.check_usable()
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute inside the backward (activation checkpointing): mid-step
        if self.step.busy():
            self.recover(
                "the previous step stopped part-way (an exception in its forward or backward)"
            )
        self.forwards += 1
        self.step.graph = -1
        signature = input_signature(inputs) if self.compare_inputs else 0
        self._check_step(f"forward call {self.forwards}", training, signature)

    def replayed(self, forwards: int, backwards: int) -> None:
        """A captured step (`zrs.CapturedStep`) that ran `forwards` forward calls and `backwards`
        backwards of this model is about to be replayed: the device alone runs them, so count
        them here, as the ops did while it was captured, and check with the peers first (the
        replay's collectives are past any timeout once launched)."""
        self.check_usable()
        if self.step.busy():
            self.recover(
                "the previous step stopped part-way (an exception in its forward or backward)"
            )
        self.forwards += forwards
        self.backwards += backwards
        module = self.module() if self.module is not None else None
        training = module.training if module is not None else True
        self._check_step(f"the replay that ends at forward call {self.forwards}", training)

    def _check_step(self, what: str, training: bool, signature: int | None = None) -> None:
        """Every rank is at the same call (STEP_COUNTERS), or ZrsError on every rank; with a
        `signature` of the inputs (the same exchange), `inputs_agree` says if all are equal."""
        if self.control_group is None:
            return
        mine = [
            self.forwards,
            self.backwards,
            self.optimizer_steps,
            training,
            torch.is_grad_enabled(),
            signature or 0,
        ]
        try:
            everyone = all_gather_ints([int(v) for v in mine], self.control_group)
        except Exception as exc:
            raise self.failed(f"the step check before {what}", exc) from exc
        if signature is not None:
            self.inputs_agree = len({row[-1] for row in everyone}) == 1
        counters = [row[:-1] for row in everyone]
        if all(row == counters[0] for row in counters):
            return
        self._disagree(counters, what)

    def _disagree(self, everyone: list[list[int]], what: str) -> None:
        differ = [n for c, n in enumerate(STEP_COUNTERS) if len({row[c] for row in everyone}) > 1]
        table = "; ".join(
            f"rank {r}: " + ", ".join(f"{v} {n}" for v, n in zip(row, STEP_COUNTERS, strict=True))
            for r, row in enumerate(everyone)
        )
        # Under NCCL a peer that raised mid-step is found here, not at a collective: its reason.
        why = self.peers.notes() if self.peers is not None else None
        message = (
            f"the ranks disagree before {what} on the {' and '.join(differ)} "
            f"({table}{'; ' + why if why else ''}): a rank ran a forward, a backward or an "
            "optimizer.step() that the others did not (or one raised), or differs in "
            "model.train()/eval() or torch.no_grad(). Every rank must run the same steps; this "
            "job cannot go on: restart it, from the last checkpoint"
        )
        self.broken = message
        raise ZrsError(message)

    def registered(self, module: nn.Module, value: nn.Module | torch.Tensor) -> None:
        """`value` (a parameter or a submodule) was registered on `module` (`LIVE`'s hook)."""
        root = self.module() if self.module is not None else None
        if root is not None:  # None: not sharded yet, zrs's own registrations
            self.additions.note(root, module, value)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A torch.optim step is about to change the shards (`LIVE`'s hook): refuse to step a
        parameter registered into the model after zrs sharded it; free the copies kept for a
        backward and the eager path's gathered leaves, which would be stale."""
        root = self.module() if self.module is not None else None
        if root is not None and self.additions.added:
            sharded = {id(h.param) for h in self.handles}
            refusal = self.additions.refusal(root, optimizer, sharded)
            if refusal is not None:
                raise ZrsError(refusal)
        if self.step.kept:
            self.step.drop_kept()
        if self.fetcher is not None:
            self.fetcher.reset()
        if self.offload is not None:
            self.offload.step_after_its_hooks(optimizer, self.handles)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A torch.optim step that stepped this model's parameters is over."""
        if self.offload is not None:
            self.offload.after_step()

    def abandon_step(self, exc: BaseException) -> None:
        """The model's forward raised on this rank: wait for and drop what the step holds, and
        leave the reason for the peers."""
        if self.peers is not None and self.broken is None:
            self.peers.note(
                f"rank {self.rank} raised {type(exc).__name__}({first_line(exc)!r}) in forward call "
                f"{self.forwards}"
            )
        eager_busy = self.fetcher is not None and self.fetcher.busy()
        if self.broken is None and (self.step.busy() or eager_busy):
            # A failure here marks the model broken (the next call says why); `exc` is this
            # rank's own error, and it is what the caller sees.
            with contextlib.suppress(ZrsError):
                self.recover("the forward raised")

    def recover(self, reason: str) -> None:
        """Wait for the step's collectives in flight (the peers issued them too), then drop every
        gathered buffer, kept copy and gradient bucket, and every hold in the registry."""
        st, self.step = self.step, StepState()
        flights = {id(f): f for f in st.in_flight.values()}.values()
        try:
            if self.fetcher is not None:
                self.fetcher.reset()
            for flight in flights:
                flight.complete()
            for r in st.reducing:
                streams.wait_for(r.done)
                self.wait(r.work, lambda r=r: r.describe())
        finally:
            self.registry.drop_all_gathers()
            if self.grad_store is not None:
                self.grad_store.reset()
        _log.warning(
            "zrs: %s: dropped %d gathered parameters and %d gradient buckets; gradients already "
            "accumulated stay in .grad (zero them to skip the step)",
            reason,
            len(st.buffers),
            len(st.reducing) + (st.bucket is not None),
        )


def reset() -> None:
    """Forget every live model's step state at once, without waiting (tests)."""
    for state in LIVE.models():
        state.step = StepState()
        if state.fetcher is not None:
            state.fetcher.forget()
        state.registry.drop_all_gathers()


def input_signature(inputs: object) -> int:
    """A 64-bit digest of the forward's arguments as a static compile's guards see their tensors:
    the structure, each tensor's shape, strides, dtype, device type and requires_grad. Equal on
    ranks whose tensors pass the same guards (the device index left out). Other values count by
    their type only: ranks whose flags differ compile different graphs with sizes symbolic too,
    and the compile's rank check names the difference."""
    leaves, spec = tree_flatten(inputs)
    parts = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(f"{tuple(x.shape)}{x.stride()}{x.dtype}{x.device.type}{x.requires_grad}")
        else:
            parts.append(type(x).__qualname__)
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
