"""Type stubs for ``zrs._core``, the Rust core of zrs (built from ``rust/zrs-py``)."""

from collections.abc import Sequence
from typing import Literal, final

class ZrsError(RuntimeError):
    """Raised for every error reported by the zrs core; the message says what to do."""

class BudgetInfeasibleError(ZrsError):
    """No plan fits the memory budget. ``plan_compiled`` reports it in the user's terms:
    ``budget`` and ``minimal`` exclude the ``base`` bytes live at the graph's start (``base`` is 0
    from ``plan_graph``, whose figures include them)."""

    budget: int
    """The budget that did not fit (bytes)."""
    minimal: int
    """The least feasible budget (bytes), in the same terms as ``budget``."""
    base: int
    """Bytes live at the graph's start (its ``base_bytes``), excluded from both figures."""

@final
class ParamInfo:
    """Read-only snapshot of one registered parameter."""

    @property
    def slot(self) -> int:
        """Its place in the registry (not the process-wide ds_id of the compiled graph's ops)."""
    @property
    def shape(self) -> tuple[int, ...]:
        """Full (unsharded) shape."""
    @property
    def numel(self) -> int: ...
    @property
    def shard_rows(self) -> int:
        """Rows of dim 0 each rank holds, ``ceil(shape[0] / world_size)`` (as ``torch.chunk``)."""
    @property
    def padded_numel(self) -> int:
        """``shard_rows`` rows for every rank: ``numel`` plus the padding past the last rows."""
    @property
    def shard_numel(self) -> int:
        """Elements each rank holds: ``padded_numel // world_size``."""
    @property
    def dtype(self) -> str: ...
    @property
    def requires_grad(self) -> bool: ...
    @property
    def status(self) -> Literal["partitioned", "in_flight", "available"]: ...
    @property
    def holders(self) -> int:
        """Gathers started and not yet released."""

@final
class Registry:
    """Sizes and gather state of every sharded parameter of one model, keyed by slot."""

    def __new__(cls, world_size: int) -> Registry:
        """Raises ZrsError if ``world_size`` is 0."""
    def register(self, shape: Sequence[int], dtype: str, requires_grad: bool = True) -> int:
        """Register a parameter under the next slot (0, 1, 2, ...) and return the slot."""
    def info(self, slot: int) -> ParamInfo: ...
    def local_rows(self, slot: int, rank: int) -> int:
        """Rows `rank` really holds: ``shard_rows``, fewer on the last ranks."""
    def start_gather(self, slot: int) -> bool:
        """Take a hold; True if an all-gather must be issued, False to reuse the copy in flight
        or available."""
    def finish_gather(self, slot: int) -> None:
        """Mark the all-gather complete (in flight -> available)."""
    def release(self, slot: int) -> bool:
        """Drop a hold; True if the caller must free the gathered buffer now (the last hold)."""
    def drop_all_gathers(self) -> int:
        """Forget every hold and gathered copy (after a failed step); how many were held."""

# --- planner (rust/zrs-core/src/plan; JSON in, JSON out, one call per graph) ---

def plan_graph(
    graph_json: str,
    scheduler: Literal["greedy", "search"] = "search",
    budget_bytes: int | None = None,
    cost: str | None = None,
    detail: bool = True,
) -> str:
    """Plan one planner-IR graph. ``cost``: "nvlink", "nop2p" or a cost-model JSON object.

    Returns JSON: order, groups (fused all-gathers), makespan_us, exposed_comm_us, peak_bytes,
    budget_bytes, within_budget, plan_us; with ``detail`` also start_us/end_us per node and the
    memory series mem_t_us/mem_bytes. Raises ZrsError for invalid graphs and
    BudgetInfeasibleError for an infeasible budget.

    The IR's ``allgather`` nodes may carry ``dtype`` (the gathered dtype, e.g.
    ``"torch.bfloat16"``): every fused group has at least two members, one dtype (no ``dtype``
    fuses only with no ``dtype``) and each ds_id at most once.
    """

def plan_compiled(
    graph_json: str,
    scheduler: Literal["greedy", "search"] = "search",
    budget_bytes: int | None = None,
    budget_is_free_memory: bool = False,
    cost: str | None = None,
    detail: bool = True,
) -> str:
    """Plan a graph that zrs.compile lowered, within its memory budget.

    ``budget_bytes`` counts what the graph allocates on top of its ``base_bytes`` (the user's
    ``memory_budget``, or with ``budget_is_free_memory`` the automatic ``auto_budget``, which is
    also capped at the greedy schedule's peak plus ``PREFETCH_ALLOWANCE_GATHERS`` of the graph's
    largest all-gather). None: the planner's default (the greedy peak for the search). ``cost``:
    normally ``planning_cost(...)``. Returns ``plan_graph``'s JSON; its ``budget_bytes`` is the
    planner's budget (``base_bytes`` included, capped). Raises BudgetInfeasibleError with
    ``budget``/``minimal`` excluding ``base`` (= ``base_bytes``).
    """

def planning_cost(cost: str | None, device_type: str, world: int) -> str:
    """The cost-model JSON a compiled graph is planned with: ``cost`` (a preset name or a
    cost-model JSON object; None: "nvlink" on "cuda", a gloo model "cpu_gloo" otherwise), with
    more than one rank made pessimistic (latency +250 us, bus bandwidth / 4, name + "+margin").
    """

def auto_budget(free_bytes: int) -> int:
    """The automatic memory budget for ``free_bytes`` of free device memory: less
    max(1 GiB, 10 %), rounded down to a multiple of 256 MiB, at least 0."""

PREFETCH_ALLOWANCE_GATHERS: int
"""How many of a graph's largest all-gather may be prefetched ahead (2): the automatic budget's
cap over the greedy peak and the forward's keep allowance."""

def compare_plans(graph_json: str, budget_bytes: int | None = None, cost: str | None = None) -> str:
    """Both schedulers; JSON with nodes, plan_ms, budget_bytes and greedy/search summaries."""

def chrome_trace(
    graph_json: str,
    scheduler: Literal["greedy", "search"] = "search",
    budget_bytes: int | None = None,
    cost: str | None = None,
) -> str:
    """Plan and return the Chrome-trace (Perfetto) JSON of the plan."""

def kept_for_backward(
    releases: Sequence[tuple[int, int]],
    largest_gather_bytes: int,
    budget_left: int | None = None,
) -> list[int]:
    """The parameters a training forward keeps gathered for its backward: the longest run of
    its last releases, ``(ds_id, gathered bytes)`` in execution order, within the allowance (a
    parameter counts at its last release). The allowance is ``PREFETCH_ALLOWANCE_GATHERS`` x
    ``largest_gather_bytes`` (the forward's largest gather), at most ``budget_left`` (an explicit
    memory budget less the forward's planned peak; negative counts as 0). Returned in release
    order."""

def grad_buckets(numels: Sequence[int], capacity: int) -> list[int]:
    """The per-rank elements of the bucket each gradient goes to, given the gradients' per-rank
    shard elements in the backward's order: consecutive gradients share a bucket while their sum
    stays within ``capacity``; a larger gradient gets one of its own."""

def synthetic_graph(n_nodes: int = 0, preset: str = "1b", world: int = 2) -> str:
    """A synthetic transformer training graph (planner IR JSON) of about ``n_nodes`` nodes."""

def cost_model(preset: str = "nvlink", world: int = 2) -> str:
    """A preset cost model as JSON: "nvlink" or "nop2p" (measured on 2xH200)."""

def fit_cost_model(
    allgather: Sequence[tuple[int, float]],
    reduce_scatter: Sequence[tuple[int, float]],
    world: int,
) -> str:
    """Fit latency + bytes/bandwidth from (full bytes, microseconds) samples; JSON."""

def fit_copy_link(samples: Sequence[tuple[int, float]]) -> str:
    """Fit a copy link (offload's device-to-host copies) from (bytes, microseconds); JSON."""

def fit_all_reduce_link(samples: Sequence[tuple[int, float]], ranks: int) -> str:
    """Fit an all-reduce's link across `ranks` (hybrid sharding's replicas, the cost model's
    `inter`) from (bytes each rank sums, microseconds); JSON."""

def default_cost_model(device_type: str, world: int) -> str:
    """The cost model `device_type` plans with when nothing was measured; JSON."""

# --- eager path (rust/zrs-core/src/eager; one call per module hook) ---

_Fetch = tuple[list[int], list[int], list[list[int]], tuple[int, int | None, int] | None]
"""What a hook does: ``(issue, wait, prefetch, diverged)``. ``issue``: released parameters
needed now (gather them in one fused collective and wait); ``wait``: needed now and in flight
from a prefetch (wait for them); ``prefetch``: start gathering these, one fused collective per
group (one group per upcoming unit activation, in order). The three are disjoint.
``diverged``: ``(position, expected unit or None, unit)`` once, when this forward departs from
the trace."""

@final
class Coordinator:
    """The eager path's parameter coordinator (DeepSpeed's PartitionedParameterCoordinator as a
    state machine): module hooks report what runs, it answers what to gather, prefetch, keep and
    release. Slots are parameters (0..n), units are modules that fetch parameters (0..m).

    The first step's forward is recorded (trace mode "record": gather on demand, release after
    each unit); at its end the recording becomes the trace ("complete"): later steps prefetch
    the units ahead (forward, then backward in reverse) and keep a parameter gathered when its
    next use is within ``max_reuse_distance`` elements. A forward that departs from the trace
    ("invalid") gathers on demand until its step ends; the next step records afresh. Raises
    ZrsError for unknown slots or units and for hooks out of place."""

    def __new__(
        cls,
        params: Sequence[tuple[int, int, bool]],
        units: Sequence[Sequence[int]],
        grad_bucket_numel: int,
        prefetch_numel: int | None = None,
        max_live_numel: int | None = None,
        max_reuse_distance: int | None = None,
        persist_numel: int | None = None,
    ) -> Coordinator:
        """``params``: ``(numel, shard_numel, requires_grad)`` per slot, numel gathered (padded)
        and shard_numel per rank. ``units``: each unit's own slots (possibly none; a slot may
        belong to several units, as tied weights do). Limits in gathered elements, defaulting
        from the largest unit's numel: ``prefetch_numel`` that (one unit ahead always fits),
        ``max_live_numel`` 3x that, ``max_reuse_distance`` that, ``persist_numel`` 0 (parameters
        of fewer elements are gathered once and kept until ``reset``)."""
    def begin_forward(self, training: bool) -> list[int]:
        """The root's forward starts; ``training``: a backward will follow. Ends a step still
        open (as ``end_backward`` would) and returns the slots to release; during a backward
        (an activation-checkpoint recompute) it does nothing."""
    def pre_forward(self, unit: int) -> _Fetch:
        """A unit's forward starts: its own parameters, and with a complete trace the prefetch
        of the units after it. After the forward returned it is a recompute: held for the
        backward, no prefetch."""
    def fetch(self, slot: int) -> _Fetch:
        """A read of a parameter outside a unit that owns it: held by the innermost running
        unit (recorded as its parameter) or, in a backward, by the backward. Raises ZrsError
        outside any forward or backward."""
    def post_forward(self, unit: int) -> list[int]:
        """A unit's forward returned: the slots to release (those its next use keeps gathered
        and persistent ones stay)."""
    def end_forward(self) -> list[int]:
        """The root's forward returned: without a backward to follow the step ends here and
        every non-persistent parameter is released; otherwise nothing."""
    def pre_backward(self, unit: int) -> _Fetch:
        """A unit's backward starts: what its last forward activation fetched, except
        parameters whose gradient is complete, and with a complete trace the prefetch of the
        units before it."""
    def grad_ready(self, slot: int) -> tuple[list[int], int]:
        """A parameter's gradient for this backward is complete: ``(release, bucket_numel)``:
        the slots to free (its own, and frozen ones whose every user finished its backward);
        the per-rank elements of its planned gradient bucket (0: none planned)."""
    def post_backward(self, unit: int) -> list[int]:
        """An activation of a unit finished its backward (its inputs' gradient is complete):
        the frozen slots no longer needed."""
    def end_backward(self) -> tuple[list[int], bool]:
        """The backward ended: the slots to release and ``recorded`` (the recording became the
        trace: compare ``trace_units``/``trace_params`` across ranks)."""
    def reset(self) -> list[int]:
        """The shards changed (an optimizer step) or the step failed: release everything,
        persistent parameters included; a partial recording is discarded, a trace kept."""
    @property
    def mode(self) -> Literal["record", "complete", "invalid"]: ...
    @property
    def live_numel(self) -> int:
        """Elements of the non-persistent parameters gathered or in flight."""
    def trace_units(self) -> list[int]:
        """The trace's units in forward order (empty while recording)."""
    def trace_params(self) -> list[tuple[int, int]]:
        """The trace's ``(position, slot)`` entries in order (empty while recording)."""
    def status(self, slot: int) -> Literal["released", "in_flight", "gathered"]: ...
    @property
    def prefetch_numel(self) -> int: ...
    @property
    def max_live_numel(self) -> int: ...
    @property
    def max_reuse_distance(self) -> int: ...
    @property
    def persist_numel(self) -> int: ...

HOST_ISA: Literal["avx512", "avx2", "baseline"]
"""The widest vector instructions the host optimizer's loops can use on this CPU."""

@final
class HostPool:
    """The threads that run the host optimizer's updates (``zrs.runtime.host_optim`` checks the
    tensors and passes their storage by address; the GIL is released during a step)."""

    def __init__(self, threads: int = 0, isa: str | None = None) -> None:
        """``threads`` workers (0: one per core); ``isa`` caps the instruction set
        (``avx512``, ``avx2``, ``baseline``), ``None`` takes the widest the CPU has."""
    @property
    def threads(self) -> int: ...
    @property
    def isa(self) -> Literal["avx512", "avx2", "baseline"]: ...
    def adamw(
        self,
        *,
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        maximize: bool,
        numel: int,
        params: int,
        grads: tuple[int, str],
        exp_avg: int,
        exp_avg_sq: int,
        copy: tuple[int, str] | None = None,
    ) -> None:
        """The ``step``-th AdamW update (from 1) of ``numel`` fp32 parameters at ``params``."""
    def sgd(
        self,
        *,
        first: bool,
        lr: float,
        momentum: float,
        dampening: float,
        weight_decay: float,
        nesterov: bool,
        maximize: bool,
        numel: int,
        params: int,
        grads: tuple[int, str],
        momentum_buffer: int | None = None,
        copy: tuple[int, str] | None = None,
    ) -> None:
        """One SGD update of ``numel`` fp32 parameters at ``params``."""
