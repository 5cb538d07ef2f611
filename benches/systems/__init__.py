"""The systems that benches/step.py trains, one family a module, each with its builders and its
piece of the registry (system name -> builder):

  zrs.py         zrs, zrs_graphed, zrs_captured, zrs_eager, zrs_shard_compile, zrs_offload,
                 zrs_offload_overlap, zrs_params_overlap
  fsdp2.py       fsdp2_eager, fsdp2_compile
  single.py      single, single_amp (the one-GPU bounds)
  deepspeed.py   deepspeed_zero3, deepcompile, deepspeed_offload (only where deepspeed imports;
                 imported lazily)
  common.py      what the builders share: ModelSpec, Ctx, Built, the optimizer and the step

This merges the pieces: BUILDERS and ALL_SYSTEMS, in the order of --help and of the tables."""

from __future__ import annotations

from collections.abc import Callable

from systems import deepspeed, fsdp2, single, zrs
from systems.common import Built, Ctx
from systems.deepspeed import DEEPSPEED_SYSTEMS, deepspeed_available

BUILDERS: dict[str, Callable[[Ctx], Built]] = {
    **zrs.BUILDERS,
    **fsdp2.BUILDERS,
    **single.BUILDERS,
    **deepspeed.BUILDERS,
}
ALL_SYSTEMS = tuple(BUILDERS)


# Asked for by name only: the optimizer on the host is another comparison (issue 37).
OFFLOAD_SYSTEMS = (
    "zrs_offload",
    "zrs_offload_overlap",
    "zrs_params_overlap",
    "deepspeed_offload",
)


def default_systems() -> list[str]:
    return [
        s
        for s in ALL_SYSTEMS
        if s not in OFFLOAD_SYSTEMS and (s not in DEEPSPEED_SYSTEMS or deepspeed_available())
    ]
