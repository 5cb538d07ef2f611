"""An optimizer's state of a sharded parameter is one rank's rows: a mark that says which.

A torch.optim optimizer keeps the state of a sharded parameter (SGD's momentum, AdamW's moments)
as a DTensor of this rank's rows. `torch.save(optimizer.state_dict())` on one rank and a load on
every rank (what Accelerate's `save_state` and Trainer's checkpoints do) would hand every rank
rank 0's rows, and nothing in torch would notice. zrs cannot hook the load of an optimizer it
never saw, so the state carries the evidence itself: after an optimizer's first step, each sharded
parameter's state gets `zrs_rows`, a DTensor sharded like the parameter's rows that holds each
row's global index. A torch.save moves it with the moments, so the rows a file holds are known
where it is loaded; torch.distributed.checkpoint reshards it with them, so a resharded load keeps
it true. Before each step, a state loaded since the last check is compared with the rows this
rank owns (one host read after a load, none otherwise), and a mismatch raises `ZrsError`.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from zrs._core import ZrsError
from zrs.runtime.handles import LIVE, ParamHandle

ROWS = "zrs_rows"  # the key of the mark in a parameter's optimizer state


def sharded_params(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, ParamHandle]]:
    """The optimizer's parameters that live models shard by rows, with their handles."""
    by_param = {
        id(h.param): h
        for state in LIVE.models()
        for h in state.handles
        if h.spec is not None and h.shape
    }
    return [
        (p, by_param[id(p)])
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) in by_param
    ]


def _first_row(h: ParamHandle) -> int:
    return h.state.rank * h.state.registry.info(h.slot).shard_rows


def _rows_mark(h: ParamHandle, like: torch.Tensor) -> DTensor:
    """The global index of each of this rank's rows, sharded as the parameter's rows are."""
    first = _first_row(h)
    local = torch.arange(first, first + h.local_shape[0], device=like.device).to(like.dtype)
    assert h.spec is not None
    return DTensor.from_local(
        local,
        h.spec.mesh,
        h.state.placements(1),
        run_check=False,
        shape=(h.shape[0],),
        stride=(1,),
    )


class OptimizerRows:
    """The mark's two hooks on every torch.optim step, and the marks already checked."""

    def __init__(self) -> None:
        self.hooks: list[RemovableHandle] = []
        # id -> mark, for the marks already compared (a tensor's == is elementwise: no set)
        self.checked: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def install(self) -> None:
        if not self.hooks:
            self.hooks = [
                register_optimizer_step_pre_hook(self.check),
                register_optimizer_step_post_hook(self.mark),
            ]

    def mark(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        """After a step: give each sharded parameter's state its mark (the first step only:
        an optimizer initialises a state that is empty, so the mark cannot come before). Not
        inside a CUDA graph's capture, whose eager steps before it made the marks."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        for p, h in sharded_params(optimizer):
            state = optimizer.state.get(p)
            like = (
                next((v for v in state.values() if isinstance(v, DTensor)), None) if state else None
            )
            if like is not None and ROWS not in state:
                state[ROWS] = mark = _rows_mark(h, like)
                self.checked[id(mark)] = mark

    def check(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        """Before a step: compare the marks loaded since the last check with this rank's rows.
        Not while a CUDA graph captures the step (zrs.GraphedStep): no host read is allowed
        there, and its eager steps before the capture have checked them."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        unchecked = []
        for p, h in sharded_params(optimizer):
            mark = optimizer.state.get(p, {}).get(ROWS)
            if isinstance(mark, torch.Tensor) and self.checked.get(id(mark)) is not mark:
                unchecked.append((h, mark))
        if not unchecked:
            return
        locals_ = [m.to_local() if isinstance(m, DTensor) else m for _, m in unchecked]
        # One host read for all of them: the first of each mark's rows and its length.
        firsts = torch.stack(
            [t.reshape(-1)[0].float() if t.numel() else t.new_full((), -1.0).float()
             for t in locals_]
        ).tolist()  # fmt: skip
        for (h, mark), local, first in zip(unchecked, locals_, firsts, strict=True):
            rows = h.local_shape[0]
            expected = float(_first_row(h)) if rows else -1.0
            if local.numel() != rows or first != float(
                torch.tensor(expected).to(local.dtype).item()
            ):
                saved = "no rows" if not local.numel() else f"rows from {int(first)}"
                raise ZrsError(
                    f"the optimizer state of `{h.name}` holds {saved} ({local.numel()} rows), "
                    f"but rank {h.state.rank} of {h.state.world_size} owns {rows} rows from "
                    f"{_first_row(h)}: a sharded model's optimizer state_dict() is one rank's "
                    "part, and this one was saved by another rank or at another world size (a "
                    "torch.save on one rank loaded on every rank). Save and load with "
                    "torch.distributed.checkpoint (zrs.checkpoint.save / load, or "
                    "get_state_dict / set_state_dict), or torch.save each rank's own "
                    "optimizer.state_dict() and load it on that rank"
                )
            self.checked[id(mark)] = mark


OPTIMIZER_ROWS = OptimizerRows()
