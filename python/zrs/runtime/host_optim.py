"""The host optimizer's updates of CPU tensors (offload, issue 37): AdamW and SGD with momentum,
in ``torch.optim``'s order of operations, run by zrs-core's threads without the GIL
(``rust/zrs-core/src/optim``), each writing the updated parameters' compute-dtype copy in the
same pass.

The tensors are checked here (CPU, contiguous, dtype, length); the core checks their addresses
(aligned, no written buffer overlapping another) before it views them as slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import increment_version

from zrs import _core

_GRAD_DTYPES = (torch.float32, torch.bfloat16)
_COPY_DTYPES = (torch.bfloat16, torch.float16)


def _buffer(t: torch.Tensor, what: str, numel: int, dtypes: tuple[torch.dtype, ...]) -> int:
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != numel:
        raise _core.ZrsError(
            f"host optimizer: the {what} must be a contiguous CPU tensor of {numel} elements, "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            + ("" if t.is_contiguous() else " (not contiguous)")
        )
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise _core.ZrsError(f"host optimizer: the {what} must be {names}, got {t.dtype}")
    return t.data_ptr()


def _name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class HostOptimizer:
    """A pool of ``threads`` workers (0: one per core) that runs host updates."""

    pool: _core.HostPool

    @classmethod
    def start(cls, threads: int = 0, isa: str | None = None) -> HostOptimizer:
        return cls(_core.HostPool(threads, isa))

    def adamw(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        step: int,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        maximize: bool = False,
        copy: torch.Tensor | None = None,
    ) -> None:
        """The ``step``-th AdamW update (counting from 1) of the fp32 ``params`` in place."""
        n = params.numel()
        self.pool.adamw(
            step=step, lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]),
            eps=float(eps), weight_decay=float(weight_decay), maximize=maximize, numel=n,
            params=_buffer(params, "parameters", n, (torch.float32,)),
            grads=(_buffer(grads, "gradients", n, _GRAD_DTYPES), _name(grads)),
            exp_avg=_buffer(exp_avg, "exp_avg", n, (torch.float32,)),
            exp_avg_sq=_buffer(exp_avg_sq, "exp_avg_sq", n, (torch.float32,)),
            copy=self._copy(copy, n),
        )  # fmt: skip
        self._changed(params, exp_avg, exp_avg_sq, copy)

    def sgd(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        momentum_buffer: torch.Tensor | None,
        *,
        first: bool,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        copy: torch.Tensor | None = None,
    ) -> None:
        """One SGD update of the fp32 ``params`` in place; with a momentum, ``first`` says that
        ``momentum_buffer`` holds nothing yet (torch's ``None`` buffer)."""
        n = params.numel()
        buf = None
        if momentum_buffer is not None:
            buf = _buffer(momentum_buffer, "momentum buffer", n, (torch.float32,))
        elif momentum != 0.0:
            raise _core.ZrsError("host optimizer: SGD with momentum needs a momentum buffer")
        self.pool.sgd(
            first=first, lr=float(lr), momentum=float(momentum), dampening=float(dampening),
            weight_decay=float(weight_decay), nesterov=nesterov, maximize=maximize, numel=n,
            params=_buffer(params, "parameters", n, (torch.float32,)),
            grads=(_buffer(grads, "gradients", n, _GRAD_DTYPES), _name(grads)),
            momentum_buffer=buf, copy=self._copy(copy, n),
        )  # fmt: skip
        self._changed(params, momentum_buffer, copy)

    @staticmethod
    def _copy(copy: torch.Tensor | None, n: int) -> tuple[int, str] | None:
        if copy is None:
            return None
        return _buffer(copy, "compute-dtype copy", n, _COPY_DTYPES), _name(copy)

    @staticmethod
    def _changed(*tensors: torch.Tensor | None) -> None:
        # Written behind autograd's back: bump the version counters as an in-place op would.
        increment_version([t for t in tensors if t is not None])
