"""The timed sweeps of the links that feed the planner's cost model, once per model.

* `measure_collectives`: all-gather and reduce-scatter sizes on the shard group, fitted to
  latency + bytes / bandwidth (`zrs.planner.fit_cost_model`);
* `measure_all_reduce`: with hybrid sharding, the replicas' all-reduce (the cost model's `inter`
  link, `zrs.planner.fit_all_reduce_link`);
* `measure_host_copies`: offload's device-to-host copies (its `host` link).

Every rank runs each sweep at the same point; the ranks agree on the slowest times
(`profile.agree_max`), so that the planner sees the same numbers everywhere.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

from zrs import planner as zplan
from zrs._core import ZrsError
from zrs.compiler.profile import agree_max
from zrs.runtime import collectives

_log = logging.getLogger(__name__)

# Sizes of the collective sweep (full bytes, all ranks together) and repetitions per size.
SWEEP_BYTES = {
    "cuda": (1 << 16, 1 << 20, 8 << 20, 64 << 20),
    "cpu": (1 << 12, 1 << 16, 1 << 20, 4 << 20),
}
SWEEP_REPS = 3  # the fastest of these counts: noise (other processes, clocks) only adds time


def _timed(fn, args: tuple, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e6


def _fastest(fn, args: tuple, device: torch.device) -> float:
    """The fastest of SWEEP_REPS timed calls, after a warm-up (connection setup, NCCL channels)."""
    fn(*args)
    return min(_timed(fn, args, device) for _ in range(SWEEP_REPS))


def measure_collectives(
    group: dist.ProcessGroup, control: dist.ProcessGroup, device: torch.device
) -> dict[str, Any] | None:
    """Fit the planner's collective cost model to a short sweep on `group` (every rank calls
    this at the same point; the ranks agree on the times over `control`). Returns the cost model
    as a dict for `zrs.planner`, or None when the sweep cannot be fitted (then the planner uses
    its analytic default)."""
    world = dist.get_world_size(group)
    sizes = SWEEP_BYTES.get(device.type, SWEEP_BYTES["cpu"])
    samples: dict[str, list[float]] = {"allgather": [], "reduce_scatter": []}
    full_sizes = []
    with unset_fake_temporarily(), no_python_dispatcher():
        for full_bytes in sizes:
            per_rank = max(full_bytes // 4 // world, 1)
            full_sizes.append(per_rank * 4 * world)
            shard = torch.zeros(per_rank, dtype=torch.float32, device=device)
            full = torch.zeros(per_rank * world, dtype=torch.float32, device=device)
            for name, fn, args in (
                ("allgather", collectives.all_gather, (full, shard, group, False)),
                ("reduce_scatter", collectives.reduce_scatter, (shard, full, group, False)),
            ):
                samples[name].append(_fastest(fn, args, device))
    flat = agree_max(samples["allgather"] + samples["reduce_scatter"], control)
    n = len(sizes)
    try:
        model = zplan.fit_cost_model(
            list(zip(full_sizes, flat[:n], strict=True)),
            list(zip(full_sizes, flat[n:], strict=True)),
            world,
        )
    except ZrsError as e:
        # A sweep too noisy to fit (a busy CPU machine): every rank got the same numbers, so
        # every rank falls back alike.
        _log.info("collective sweep not usable (%s); using the analytic cost model", e)
        return None
    return model  # the fit rejects a non-positive or non-finite bandwidth itself


def measure_all_reduce(
    group: dist.ProcessGroup, control: dist.ProcessGroup, device: torch.device
) -> dict[str, Any] | None:
    """Hybrid sharding's link between replicas: a short sweep of all-reduces on `group` (each
    rank's replicate group; every group sweeps at once, as the backward's all-reduces run),
    fitted to a ring all-reduce's latency + bytes / bandwidth; the ranks agree on the slowest
    times over `control`. The cost model's `inter` link, or None when the sweep cannot be
    fitted (the planner then times the all-reduces on the reduce-scatter's link)."""
    sizes = SWEEP_BYTES.get(device.type, SWEEP_BYTES["cpu"])  # bytes each rank sums
    samples = []
    with unset_fake_temporarily(), no_python_dispatcher():
        for size in sizes:
            tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
            samples.append(_fastest(collectives.all_reduce, (tensor, group, False), device))
    agreed = agree_max(samples, control)
    try:
        return zplan.fit_all_reduce_link(
            list(zip(sizes, agreed, strict=True)), dist.get_world_size(group)
        )
    except ZrsError as e:
        _log.info("all-reduce sweep not usable (%s); timed on the reduce-scatter's link", e)
        return None


# Offload's device-to-host link: the sizes of its sweep (bytes a rank copies).
HOST_COPY_BYTES = (1 << 20, 8 << 20, 64 << 20)


def measure_host_copies(
    control: dist.ProcessGroup | None, device: torch.device
) -> dict[str, Any] | None:
    """Offload's copy link (device to pinned host memory), fitted to a short sweep that every
    rank of the host runs at once, as the backward's copies do (they share the host's memory and
    links); the ranks agree on the slowest times. The cost model's `host` link, or None when
    the sweep cannot be fitted."""
    samples = []
    with unset_fake_temporarily(), no_python_dispatcher():
        for size in HOST_COPY_BYTES:
            src = torch.empty(size, dtype=torch.uint8, device=device)
            dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            copy = functools.partial(dst.copy_, src, non_blocking=True)
            samples.append(_fastest(copy, (), device))
    agreed = agree_max(samples, control)
    try:
        return zplan.fit_copy_link(list(zip(HOST_COPY_BYTES, agreed, strict=True)))
    except ZrsError as e:
        _log.info("host copy sweep not usable (%s); the plan counts no host copies", e)
        return None
