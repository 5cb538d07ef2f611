"""The options of `zrs.compile` and `zrs.shard`: their checks, and the dtype decisions (which
dtypes they accept, shard in and reduce in).

By default shards are fp32 master weights, whatever the parameters' float dtype, except for a
float64 model, which keeps float64 throughout (shards, gathers and, unless told otherwise, the
gradient reduce). `master_dtype=` chooses the shards' dtype instead, e.g. bfloat16 for a model
trained wholly in bf16, as FSDP2 trains a model cast to bf16 before `fully_shard`. Each parameter
is gathered in `param_dtype`, or else in its own dtype (`ParamHandle.compute_dtype`); a
`master_dtype` converts the whole model to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from zrs._core import ZrsError

# The dtypes that the gathers, the gradient packing (CUDA kernels included) and the collectives
# handle: runtime.ops._SCALAR_TYPES and the DtypeCodes of zrs/cuda/zrs_kernels.cu.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Precision:
    """The dtypes of one model: gathered parameters' (None: each parameter's own, or the shards'
    when master_dtype converted the model), the shards' and the gradient reduce's."""

    param: torch.dtype | None
    master: torch.dtype
    reduce: torch.dtype
    own: bool  # each parameter keeps its own dtype (no master_dtype converts the model)


def check_common(
    model: nn.Module,
    timeout: float | None,
    param: torch.dtype | None,
    reduce: torch.dtype | None,
    master: torch.dtype | None,
) -> Precision:
    """Check the options `zrs.compile` and `zrs.shard` share (`timeout` and the param_dtype,
    reduce_dtype and master_dtype options), and decide the model's dtypes."""
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise ZrsError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    check_dtype("param_dtype", param)
    check_dtype("reduce_dtype", reduce)
    check_dtype("master_dtype", master)
    check_param_dtypes(model, master)
    shards = master_dtype(model, master)
    return Precision(param, shards, default_reduce_dtype(shards, reduce), own=master is None)


def check_choice(name: str, value: str, choices: Iterable[str]) -> None:
    """Raise unless `value` (the `name` option) is one of `choices`."""
    if value not in choices:
        raise ZrsError(f"unknown {name} {value!r}: choose one of {', '.join(choices)}")


def check_memory_budget(memory_budget: object) -> None:
    """Raise unless `memory_budget` is a positive number of bytes or None."""
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0
    ):
        raise ZrsError(
            f"memory_budget must be a positive number of bytes or None, not {memory_budget!r}"
        )


def check_compile(compile: object) -> str | None:
    """`zrs.shard`'s `compile` as a torch.compile backend name (None: eager)."""
    if compile is True:
        return "inductor"
    if compile is False:
        return None
    if isinstance(compile, str) and compile:
        return compile
    raise ZrsError(
        f"compile={compile!r}: pass True (inductor), False, or a torch.compile backend's name"
    )


def check_flag(name: str, value: object) -> None:
    """Raise unless the option `name` is True or False."""
    if not isinstance(value, bool):
        raise ZrsError(f"{name}={value!r}: pass True or False")


def check_offload(offload: object) -> str | None:
    """`zrs.shard`'s `offload`: None, "optimizer" or "params" (docs/offload.md)."""
    if offload is None or offload in ("optimizer", "params"):
        return offload  # type: ignore[return-value]
    raise ZrsError(f'offload={offload!r}: pass None, "optimizer" or "params"')


def check_limits(limits: dict[str, object]) -> None:
    """Raise unless each of `zrs.shard`'s `limits` is a number of elements or None."""
    for name, value in limits.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ZrsError(
                f"{name} must be a number of elements (an int >= 0) or None, not {value!r}"
            )


def check_dtype(name: str, value: object) -> None:
    """Raise unless `value` (the `name` option) is None or one of FLOAT_DTYPES."""
    if value is None or value in FLOAT_DTYPES:
        return
    choices = ", ".join(str(d) for d in FLOAT_DTYPES)
    raise ZrsError(
        f"{name} must be a floating-point torch.dtype ({choices}) or None, not {value!r}: "
        f"pass e.g. {name}=torch.bfloat16, or leave it out for the default"
    )


def check_param_dtypes(model: nn.Module, master_dtype: torch.dtype | None) -> None:
    """Raise for a parameter that cannot be sharded (not floating point), and, unless
    `master_dtype` sets the shards' dtype, for float64 parameters mixed with other float dtypes
    (the shards and the reduce have one precision)."""
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            raise ZrsError(
                f"parameter {name!r} has dtype {param.dtype}, which zrs cannot shard: parameters "
                "must be floating point (the master shards are fp32, fp64 for a float64 model); "
                "register non-float state as a buffer instead (module.register_buffer)"
            )
    dtypes = {p.dtype for p in model.parameters()}
    if master_dtype is None and torch.float64 in dtypes and len(dtypes) > 1:
        others = ", ".join(sorted(str(d) for d in dtypes - {torch.float64}))
        raise ZrsError(
            f"the model mixes float64 parameters with {others} ones: zrs keeps float64 shards "
            "for a float64 model and fp32 ones otherwise, not both. Cast the model to one dtype "
            "first: model.double() for float64 training, or model.float() (and param_dtype= "
            "for a lower compute precision), or pass master_dtype= to keep every shard in one "
            "dtype"
        )


def master_dtype(model: nn.Module, requested: torch.dtype | None) -> torch.dtype:
    """The dtype of every shard (the master weights, and so the optimizer's parameters):
    `requested` if given; else float64 for a model whose parameters are all float64 (narrowing
    them would lose the precision the model asked for), fp32 otherwise."""
    if requested is not None:
        return requested
    dtypes = {p.dtype for p in model.parameters()}
    return torch.float64 if dtypes == {torch.float64} else torch.float32


def default_reduce_dtype(master: torch.dtype, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """`reduce_dtype` if given; else the shards' dtype `master`."""
    return master if reduce_dtype is None else reduce_dtype
