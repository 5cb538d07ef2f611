"""`zrs.GraphedStep`: the optimizer step, global-norm clipping and the non-finite check as one
CUDA graph, captured once and replayed every step (docs/cuda-graphs.md).

An eager optimizer step over DTensor shards is a few hundred small host calls; the GPU waits for
them (4 ms of a 96 ms step at 1b on one H200, BENCHMARKS.md). Replayed, the step costs one launch
and no host synchronisation: the norm, the decision to skip a non-finite step and the learning
rate all stay on the device.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops._pointwise_ops import list_pointwise_strategy
from torch.distributed.tensor._ops.utils import register_op_strategy
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from zrs._core import ZrsError
from zrs.runtime.grad_store import GradStore
from zrs.runtime.handles import LIVE, local_tensor
from zrs.step.replay import (
    MAX_RECAPTURES,
    Hyperparameters,
    collector_paused,
    replay_with_hooks,
    settle_before_capture,
)

_log = logging.getLogger("zrs")


def _shard_fused_sgd() -> None:
    """DTensor has sharding rules for the fused Adam and AdamW kernels but none for fused SGD
    (torch 2.11), so `SGD(fused=True)` over sharded parameters raises. It is as elementwise over
    its lists as the fused Adam is: the same rule."""
    aten = torch.ops.aten
    for op in (aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr):
        register_op_strategy(op, schema_info=RuntimeSchemaInfo(needs_pytree=True))(
            list_pointwise_strategy
        )


_shard_fused_sgd()


class GraphedStep:
    """Clip, check and step `optimizer` as one CUDA graph.

    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4), fused=True)
    step = zrs.GraphedStep(opt, max_norm=1.0)
    for batch in data:
        model(batch).backward()
        norm = step()          # the global gradient norm, a device tensor (no host sync)
        opt.zero_grad()
    ```

    Each call computes the global norm of the gradients (over every rank: the parameters are
    DTensors), clips them to `max_norm` if given, and steps the optimizer unless the norm is
    inf or NaN, a decision taken on the device (the fused optimizers' `found_inf`), the same on
    every rank (`check_finite=False` leaves the check out). `skipped_steps` counts the steps
    skipped. The first `warmup` calls run eagerly
    (they create the optimizer state); the next one captures the graph, and later calls replay
    it, running the optimizer's step hooks around it as `optimizer.step()` would.

    What a graph cannot do, and the error or behaviour instead:
    - The optimizer must be fused (`fused=True`): only the fused kernels skip a step on the
      device. Otherwise ZrsError.
    - A hyperparameter held as a Python number is baked into the graph: changing one after the
      warmup (a scheduler setting `lr` to a float) raises ZrsError. Hold it as a tensor
      (`lr=torch.tensor(3e-4)`): schedulers update a tensor in place, which the graph reads.
    - The gradients and the optimizer state must stay where they were captured. zrs keeps each
      model's reduced gradients at fixed addresses for this (`runtime/grad_store.py`), so
      `zero_grad()` (set to None) and `zero_grad(set_to_none=False)` both work. When they move
      anyway (a recompile that plans other buckets, `optimizer.load_state_dict`), the next call
      captures again; after MAX_RECAPTURES recaptures it warns and runs eagerly from then on.

    On the CPU, or with `cuda_graphs=False`, every call runs the same operations eagerly: the
    same numbers, bit for bit, without the graph.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        check_finite: bool = True,
        warmup: int = 2,
        cuda_graphs: bool | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ZrsError(f"GraphedStep takes a torch.optim.Optimizer, not {optimizer!r}")
        unfused = [i for i, g in enumerate(optimizer.param_groups) if not g.get("fused")]
        if unfused:
            raise ZrsError(
                f"GraphedStep needs a fused optimizer, but param group(s) {unfused} of "
                f"{type(optimizer).__name__} are not fused: only the fused kernels can skip a "
                "non-finite step on the device. Construct it with fused=True "
                "(torch.optim.AdamW, Adam, SGD and Adagrad have it)"
            )
        if max_norm is not None and not max_norm > 0:
            raise ZrsError(f"max_norm must be a positive number or None, not {max_norm!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ZrsError(f"warmup must be an int >= 1 (eager steps before capture), not {warmup}")
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.norm_type = norm_type
        # No clip and no check: the step alone, and no pass over the gradients for their norm
        # (1 ms at 1b on one H200); `__call__` then returns a norm of 0.
        self.check_finite = check_finite
        self.warmup = warmup
        params = list(self._params())
        if not params:
            raise ZrsError("GraphedStep: the optimizer has no parameters that require grad")
        device = local_tensor(params[0]).device
        self.graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.graphs and device.type != "cuda":
            raise ZrsError(f"cuda_graphs=True needs CUDA parameters; these are on {device}")
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.norm = torch.zeros((), dtype=torch.float32, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.calls = 0
        self.recaptures = 0
        # The captured step: its parts' graph replays and, between them, the norm's all-reduce.
        self.graph: list[Callable[[], None]] | None = None
        self.captured: list[tuple[torch.Tensor, int]] = []  # (param, its grad's address)
        self.fixed: Hyperparameters | None = None  # taken after the warmup
        optimizer.register_load_state_dict_post_hook(lambda _opt: self._forget())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm (reads the device: a host sync)."""
        return int(self.skipped.item())

    def __call__(self) -> torch.Tensor:
        """One optimizer step; returns the global gradient norm (before clipping), a tensor that
        the next call overwrites (clone it to keep it)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Inside zrs.CapturedStep: the step's graph records these operations.
            self._run_capturable()
            return self.norm
        self.calls += 1
        if self.calls <= self.warmup:
            self._run()
            if self.calls == self.warmup:
                self._keep_grads_in_place()
            return self.norm
        if self.fixed is None:
            self.fixed = Hyperparameters(self.optimizer, "zrs.GraphedStep")
        self.fixed.check()
        if not self.graphs:
            self._run()
            return self.norm
        if self.graph is None or not self._still_captured():
            self._capture()
        else:
            self._replay()
        return self.norm

    def _keep_grads_in_place(self) -> None:
        """From the next backward on, every zrs model this optimizer trains reduces its
        gradients into regions that stay allocated (runtime/grad_store.py), where the graph reads
        them. Not before: through the warmup the gradients come and go as without GraphedStep.
        Inside zrs.CapturedStep, whose capture is the next backward, the regions then come from
        the captured step's memory pool, in blocks its forward's activations had used; made
        earlier, they stayed allocated beside those activations (one set of gradient shards
        above the uncaptured step's peak)."""
        ids = {id(p) for p in self._params()}
        for state in LIVE.models():
            if state.grad_store is None and any(id(h.param) in ids for h in state.handles):
                state.grad_store = GradStore()

    # --- the step ---------------------------------------------------------------------------

    def _params(self) -> Iterator[torch.Tensor]:
        for group in self.optimizer.param_groups:
            yield from (p for p in group["params"] if p.requires_grad)

    def _run(self) -> None:
        """The step's operations, eagerly (or all under one capture: zrs.CapturedStep)."""
        for _, part in self._parts():
            part()

    def _parts(self) -> list[tuple[bool, Callable[[], None]]]:
        """The step as its parts in order, each `(capturable, call)`. The all-reduce of the
        norm across ranks stays out of the graphs: NCCL work replayed from a graph is outside
        the watchdog's timeout (a stalled peer would hang the replay), and a graph that holds
        NCCL work keeps its communicator from being freed, so that `destroy_process_group()`
        waits forever while the step object lives."""
        if self.max_norm is None and not self.check_finite:
            return [(True, self.optimizer.step)]
        params = [p for p in self._params() if p.grad is not None]
        pools = _norm_pools(params)
        if all(group is None for group, _ in pools):  # nothing to reduce across ranks
            return [(True, lambda: self._clip_check_step(params, None))]
        partials = [self.norm.new_zeros(()) for _ in pools]  # each pool's, fixed for the graphs
        inf = self.norm_type == float("inf")

        def local() -> None:
            for partial, (_, grads) in zip(partials, pools, strict=True):
                norm = get_total_norm(grads, self.norm_type, foreach=True).float()
                partial.copy_(norm if inf else norm.pow(self.norm_type))

        def reduce() -> None:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            for partial, (group, _) in zip(partials, pools, strict=True):
                if group is not None:
                    dist.all_reduce(partial, op=op, group=group)

        def finish() -> None:
            stacked = torch.stack(partials)
            norm = stacked.max() if inf else stacked.sum().pow(1.0 / self.norm_type)
            self._clip_check_step(params, norm)

        return [(True, local), (False, reduce), (True, finish)]

    def _clip_check_step(self, params: list[torch.Tensor], norm: torch.Tensor | None) -> None:
        """Clip to `norm` (None: the norm of `params`' gradients on this rank alone), check
        it and step."""
        if norm is None:
            norm = get_total_norm([p.grad for p in params], self.norm_type, foreach=True)
            if self.max_norm is not None:
                clip_grads_with_norm_(params, self.max_norm, norm, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
        elif self.max_norm is not None:  # as clip_grads_with_norm_, on the local shards
            coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_([local_tensor(p.grad) for p in params], coef)
        self.norm.copy_(norm)
        self.found_inf.copy_(norm.isfinite().logical_not())
        self.skipped.add_(self.found_inf.to(torch.int64))
        if any(not self.optimizer.state.get(p) for p in params) and bool(self.found_inf):
            # A parameter's first step (warmup): a fused SGD step skipped on the device would
            # still create its momentum buffer, uninitialised (torch 2.11), and use it next time.
            # So the first step of a parameter looks at the norm on the host (one sync).
            return
        self.optimizer.found_inf = self.found_inf  # read by the fused kernels, as GradScaler does
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    @contextlib.contextmanager
    def _capturable(self) -> Iterator[None]:
        """Mark the param groups capturable while a graph records them. The fused kernels
        ignore `capturable`; torch's capture check reads it."""
        groups = self.optimizer.param_groups
        saved = [g.get("capturable") for g in groups]
        try:
            for g in groups:
                if "capturable" in g:
                    g["capturable"] = True
            yield
        finally:
            for g, flag in zip(groups, saved, strict=True):
                if flag is not None:
                    g["capturable"] = flag

    def _run_capturable(self) -> None:
        """`_run` inside a capture that zrs.CapturedStep holds."""
        with self._capturable():
            self._run()

    def _capture(self) -> None:
        if self.graph is not None:
            self.recaptures += 1
            if self.recaptures > MAX_RECAPTURES:
                warnings.warn(
                    f"zrs.GraphedStep: the gradients or the optimizer state moved {self.recaptures} "
                    "times since the first capture, so the step runs without a CUDA graph from "
                    "now on. Keep the .grad tensors (zero_grad() is fine; do not assign new ones) "
                    "and the optimizer state in place",
                    stacklevel=3,
                )
                self.graphs = False
                self.graph = None
                self._run()
                return
            _log.info("zrs.GraphedStep: capturing again (gradients or optimizer state moved)")
        replays: list[Callable[[], None]] = []
        pool = None
        settle_before_capture()
        for capturable, part in self._parts():
            if not capturable:
                replays.append(part)
                continue
            graph = torch.cuda.CUDAGraph()
            with (
                collector_paused(),
                torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"),
                self._capturable(),
            ):
                part()
            pool = graph.pool() if pool is None else pool
            replays.append(graph.replay)
        self.graph = replays
        self.captured = [
            (p, local_tensor(p.grad).data_ptr()) for p in self._params() if p.grad is not None
        ]
        self._replay_parts()  # capture only recorded the step: run it

    def _replay_parts(self) -> None:
        assert self.graph is not None
        for replay in self.graph:
            replay()

    def _replay(self) -> None:
        assert self.graph is not None
        replay_with_hooks([self.optimizer], self._replay_parts, "zrs.GraphedStep")

    def _still_captured(self) -> bool:
        """Every gradient is where the graph reads it, and no other parameter has one."""
        with_grad = [p for p in self._params() if p.grad is not None]
        if len(with_grad) != len(self.captured):
            return False
        return all(
            p is q and local_tensor(p.grad).data_ptr() == ptr
            for p, (q, ptr) in zip(with_grad, self.captured, strict=True)
        )

    def _forget(self) -> None:
        """The optimizer loaded a state dict: its state tensors are new."""
        if self.graph is not None:
            self.graph = None
            self.calls = min(self.calls, self.warmup)  # capture at the next call


def _norm_pools(params: list[torch.Tensor]) -> list[tuple[Any, list[torch.Tensor]]]:
    """`params`' local gradients by what their norm is reduced over: `(process group, grads)`
    for each mesh they are sharded on, `(None, grads)` for those whole on this rank (plain
    tensors, and replicated ones such as zrs's 0-d parameters), whose norm counts once."""
    pools: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if not isinstance(grad, DTensor) or grad.device_mesh.size() == 1:
            pools.setdefault(None, []).append(local_tensor(grad))
            continue
        mesh, placements = grad.device_mesh, grad.placements
        if all(isinstance(pl, Replicate) for pl in placements):
            pools.setdefault(None, []).append(local_tensor(grad))
        elif mesh.ndim == 1 and isinstance(placements[0], Shard):
            pools.setdefault(mesh, []).append(local_tensor(grad))
        else:
            raise ZrsError(
                "zrs.GraphedStep clips gradients that are sharded over one mesh dimension (as "
                "zrs shards them), replicated, or plain tensors; one is a DTensor placed "
                f"{placements} on a {mesh.ndim}-d mesh. Clip it with "
                "torch.nn.utils.clip_grad_norm_ and step the optimizer directly"
            )
    return [(None if key is None else key.get_group(), grads) for key, grads in pools.items()]
