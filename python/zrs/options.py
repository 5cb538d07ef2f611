"""The dtype decisions of `zrs.compile`: which dtypes it accepts, shards in and reduces in.

By default shards are fp32 master weights, whatever the parameters' float dtype, except for a
float64 model, which keeps float64 throughout (shards, gathers and, unless told otherwise, the
gradient reduce). `master_dtype=` chooses the shards' dtype instead, e.g. bfloat16 for a model
trained wholly in bf16, as FSDP2 trains a model cast to bf16 before `fully_shard`.
"""

from __future__ import annotations

import torch
from torch import nn

from zrs._core import ZrsError

# The dtypes that the gathers, the gradient packing (CUDA kernels included) and the collectives
# handle: runtime.ops._SCALAR_TYPES and the DtypeCodes of zrs/cuda/zrs_kernels.cu.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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
