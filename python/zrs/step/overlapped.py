"""`zrs.OverlappedStep`: offload's host update run during the backward (runtime/overlap.py)."""

from __future__ import annotations

import torch

from zrs._core import ZrsError
from zrs.runtime import host_step
from zrs.runtime.handles import LIVE
from zrs.runtime.overlap import Overlap


class OverlappedStep:
    """The optimizer step of a model prepared with `offload="optimizer"` (`zrs.shard` or
    `zrs.compile`), run on the host during the backward: each parameter's update starts as soon as its reduced
    gradient has reached the host, and its compute-dtype copy goes back to the GPU while the
    backward goes on. Call it where you would call `optimizer.step()`::

        step = zrs.OverlappedStep(optimizer, max_norm=1.0)
        for batch in data:
            loss = model(batch)
            loss.backward()  # the host updates run here
            step()  # waits for the last of them
            optimizer.zero_grad()

    With `max_norm` the updates wait for the end of the backward, which clips the gradients to
    it by their global norm (as `torch.nn.utils.clip_grad_norm_` does) or skips the step when
    the norm is inf or NaN (`skipped_steps`); the call returns the norm.

    With `accumulation_steps` = N, each step follows N backwards (micro-batches): the first
    N - 1 add their gradients on the host, and the updates run during the last one::

        for i, batch in enumerate(data):
            (model(batch) / N).backward()
            if (i + 1) % N == 0:
                step()
                optimizer.zero_grad()

    The updates run before the step is called, so the step must follow each backward with the
    gradients as it left them. A ZrsError on the step names what broke that: a gradient that
    changed after its update read it (`clip_grad_norm_`: pass `max_norm` instead), a
    hyperparameter changed between the backward and the step (a scheduler stepped first), a
    step after fewer than N backwards, and, at once, a backward after N before the step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = None,
        accumulation_steps: int = 1,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ZrsError(f"OverlappedStep takes a torch.optim.Optimizer, not {optimizer!r}")
        if max_norm is not None and not max_norm > 0:
            raise ZrsError(f"max_norm must be a positive number or None, not {max_norm!r}")
        if isinstance(accumulation_steps, bool) or not (
            isinstance(accumulation_steps, int) and accumulation_steps >= 1
        ):
            raise ZrsError(
                f"accumulation_steps must be a positive int (backwards a step), not "
                f"{accumulation_steps!r}"
            )
        host_step.check_supported(optimizer)
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        states = [s for s in LIVE.models() if any(id(h.param) in ids for h in s.handles)]
        # Checked before any model's updates move into its backward.
        if not states:
            raise ZrsError("OverlappedStep: the optimizer steps no parameter of a zrs model")
        if any(s.offload is None for s in states):
            raise ZrsError(
                "OverlappedStep runs the optimizer's host update during the backward, but "
                "this optimizer steps a model sharded without offload. Prepare it with "
                'offload="optimizer" (zrs.shard or zrs.compile), or call optimizer.step()'
            )
        if max_norm is not None and len(states) > 1:
            # Each model's backward ends on its own, and so would each one's norm.
            raise ZrsError(
                "OverlappedStep(max_norm=...) clips by one model's global norm, but this "
                f"optimizer steps {len(states)} zrs models. Give each model an optimizer of its "
                "own, or clip with torch.nn.utils.clip_grad_norm_ and call optimizer.step()"
            )
        self.optimizer = optimizer
        self.overlaps: list[Overlap] = []
        for state in states:
            assert state.offload is not None
            timeout = state.timeout.total_seconds()
            overlap = state.offload.overlap_with(optimizer, max_norm, accumulation_steps, timeout)
            self.overlaps.append(overlap)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm (with `max_norm`)."""
        return max(o.skipped for o in self.overlaps)

    def __call__(self) -> float | None:
        """The optimizer's step; with `max_norm`, returns the gradients' global norm."""
        self.optimizer.step()
        norms = [o.norm for o in self.overlaps if o.norm is not None]
        return norms[0] if norms else None
