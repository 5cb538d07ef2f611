"""Plan a backward graph's gradient buckets: which consecutive `reduce_grad`s share one
reduce-scatter.

The runtime packs gradients rank-major into a bucket, `(world, capacity)`, and reduce-scatters it
when full. Filled on the fly at a fixed capacity, nearly every bucket was reduced partly full
(the next gradient did not fit), and a partly full bucket's rows must be copied together first:
at 7b that copy cost more than packing the gradients (BENCHMARKS.md). Planned here, from the
graph's planned order of gradients (`zrs._core.grad_buckets`), every `reduce_grad` carries its
bucket's exact size (`bucket_numel`) and the runtime allocates each bucket at that size, so it is
reduced full, without a copy. The graph alone decides, so every
rank plans the same buckets. A `reduce_grad` without a planned size (`bucket_numel=0`) still
fills a bucket of `grads.GRAD_BUCKET_NUMEL`, reduced partly full if need be.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from zrs import _core
from zrs.compiler._fx import is_op
from zrs.runtime import grads


def plan_grad_buckets(
    graph: fx.Graph, shard_numels: Mapping[int, int], capacity: int | None = None
) -> list[int]:
    """Set `bucket_numel` on every `reduce_grad` of `graph` (buckets of at most `capacity`
    elements per rank, default `grads.GRAD_BUCKET_NUMEL`; `shard_numels`: ds_id -> elements per
    rank); returns the sizes in graph order."""
    capacity = grads.GRAD_BUCKET_NUMEL if capacity is None else capacity
    reduces = [n for n in graph.nodes if is_op(n, "reduce_grad")]
    sizes = _core.grad_buckets([shard_numels[int(n.args[2])] for n in reduces], capacity)
    for n, size in zip(reduces, sizes, strict=True):
        n.update_kwarg("bucket_numel", size)
    return sizes
