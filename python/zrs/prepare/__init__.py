"""Preparing a model for ZeRO-3, the steps of `zrs.compile` and `zrs.shard` below the compiler:
their options (`options.py`), the groups of a process group or a mesh (`mesh.py`), the device, agreement and communicators
(`links.py`), the
sharding of every parameter (`sharding.py`), the eager path's units (`units.py`) and the model's
forward (`forward.py`). Each step is one call from the recipe in `zrs/__init__.py`; this layer
imports only the runtime below it (docs/architecture.md)."""

from zrs.prepare.forward import install_forward
from zrs.prepare.links import agree_and_connect, make_state
from zrs.prepare.mesh import Topology, resolve_topology
from zrs.prepare.options import (
    Precision,
    check_choice,
    check_common,
    check_compile,
    check_flag,
    check_limits,
    check_memory_budget,
    check_offload,
)
from zrs.prepare.sharding import InitFn, shard_parameters
from zrs.prepare.units import install_units

__all__ = [
    "InitFn",
    "Precision",
    "Topology",
    "agree_and_connect",
    "check_choice",
    "check_common",
    "check_compile",
    "check_flag",
    "check_limits",
    "check_memory_budget",
    "check_offload",
    "install_forward",
    "install_units",
    "make_state",
    "resolve_topology",
    "shard_parameters",
]
