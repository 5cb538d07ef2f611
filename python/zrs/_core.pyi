"""Type stubs for ``zrs._core``, the Rust core of zrs (built from ``rust/zrs-py``)."""

from collections.abc import Sequence
from typing import Literal, final

class ZrsError(RuntimeError):
    """Raised for every error reported by the zrs core; the message says what to do."""

@final
class ParamInfo:
    """Read-only snapshot of one registered parameter."""

    @property
    def ds_id(self) -> int: ...
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
    def persistent(self) -> bool:
        """Whether the gathered copy is kept between uses."""
    @property
    def requires_grad(self) -> bool: ...
    @property
    def status(self) -> Literal["partitioned", "in_flight", "available"]: ...
    @property
    def gathered_valid(self) -> bool:
        """Whether the gathered copy (in flight or available) reflects the current shards."""
    @property
    def holders(self) -> int:
        """Gathers started and not yet released."""

@final
class Registry:
    """Sizes and gather state of every sharded parameter, keyed by ds_id."""

    def __new__(cls, world_size: int) -> Registry:
        """Raises ZrsError if ``world_size`` is 0."""
    @property
    def world_size(self) -> int: ...
    def register(
        self,
        shape: Sequence[int],
        dtype: str,
        persistent: bool = False,
        requires_grad: bool = True,
    ) -> int:
        """Register a parameter under the next free ds_id and return it."""
    def info(self, ds_id: int) -> ParamInfo: ...
    def local_rows(self, ds_id: int, rank: int) -> int:
        """Rows `rank` really holds: ``shard_rows``, fewer on the last ranks."""
    def start_gather(self, ds_id: int) -> bool:
        """Take a hold; True if an all-gather must be issued, False to reuse a valid copy."""
    def finish_gather(self, ds_id: int) -> None:
        """Mark the all-gather complete (in flight -> available)."""
    def release(self, ds_id: int) -> bool:
        """Drop a hold; True if the caller must free the gathered buffer now."""
    def invalidate(self, ds_id: int) -> None:
        """Mark the gathered copy stale (the shard changed)."""
    def invalidate_all(self) -> None:
        """``invalidate`` every parameter, e.g. after an optimizer step."""
    def drop_all_gathers(self) -> int:
        """Forget every hold and gathered copy (after a failed step); how many were held."""
    def set_uses(self, graph_id: int, ds_id: int, n: int) -> None:
        """Record how many nodes of graph ``graph_id`` use the parameter."""
    def uses(self, graph_id: int, ds_id: int) -> int:
        """Uses recorded for graph ``graph_id``; 0 if none."""
    def ids(self) -> list[int]:
        """Registered ds_ids in increasing order."""
    def __len__(self) -> int: ...
    def __contains__(self, ds_id: int, /) -> bool: ...
    def total_numel(self) -> int: ...
    def total_shard_numel(self) -> int: ...

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
    memory series mem_t_us/mem_bytes. Raises ZrsError for invalid graphs and infeasible budgets.
    """

def compare_plans(graph_json: str, budget_bytes: int | None = None, cost: str | None = None) -> str:
    """Both schedulers; JSON with nodes, plan_ms, budget_bytes and greedy/search summaries."""

def chrome_trace(
    graph_json: str,
    scheduler: Literal["greedy", "search"] = "search",
    budget_bytes: int | None = None,
    cost: str | None = None,
) -> str:
    """Plan and return the Chrome-trace (Perfetto) JSON of the plan."""

def kept_for_backward(releases: Sequence[tuple[int, int]], allowance: int) -> list[int]:
    """The parameters a training forward keeps gathered for its backward: the longest run of
    its last releases, ``(ds_id, gathered bytes)`` in execution order, within ``allowance`` bytes
    (a parameter counts at its last release). Returned in release order."""

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
