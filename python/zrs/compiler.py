"""The dynamo backend: AOTAutograd with a ZeRO-3 partitioner, the zero3 pass, then codegen.

Each dynamo graph (a graph break gives several) gets its own graph_id, shared by its forward and
backward. The joint graph is partitioned with gathers marked must-recompute; the partitioned graphs
are lowered by `passes.zero3`, checked for cross-rank agreement, and handed to inductor
(`backend="inductor"`) or run as FX code (`backend="eager"`).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from zrs.passes.consistency import check_same_graph
from zrs.passes.recompute import tag_gathers_for_recompute
from zrs.passes.zero3 import lower_zero3
from zrs.runtime import ZeroState, handle

BACKENDS = ("inductor", "eager")


class ZeroPartitioner(CustomPartitionerFn):
    """Min-cut rematerialization that never saves a gathered parameter for backward."""

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        tag_gathers_for_recompute(gm.graph)
        kwargs.setdefault("compiler", "inductor")
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        src = Path(__file__).with_name("passes") / "recompute.py"
        return hashlib.sha256(src.read_bytes()).hexdigest()


PARTITIONER = ZeroPartitioner()


def _lower(state: ZeroState, graph_id: int, gm: fx.GraphModule, is_backward: bool) -> None:
    lowered = lower_zero3(gm, graph_id, is_backward=is_backward)
    for ds_id, n in lowered.uses.items():
        state.registry.set_uses(graph_id, handle(ds_id).local_id, n)
    what = f"{'backward' if is_backward else 'forward'} graph {graph_id}"
    check_same_graph(gm.graph, state.group, what)


def make_backend(state: ZeroState, backend: str):
    """A dynamo backend for one `zrs.compile` call (`backend` is checked by the caller)."""

    def zrs_backend(gm: fx.GraphModule, example_inputs: list[Any]):
        graph_id = next(state.graph_ids)
        lower = functools.partial(_lower, state, graph_id)
        # A cache hit would skip the partitioner and the zero3 pass (and the rank check).
        with torch._functorch.config.patch(enable_autograd_cache=False):
            if backend == "inductor":
                return _inductor(gm, example_inputs, lower)
            return _eager(gm, example_inputs, lower)

    return zrs_backend


def _inductor(gm: fx.GraphModule, example_inputs: list[Any], lower):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm: fx.GraphModule, inputs: list[Any], **kwargs: Any):
        lower(gm, bool(kwargs.get("is_backward", False)))
        return compile_fx_inner(gm, inputs, **kwargs)

    with inductor_config.patch(custom_partitioner_fn=PARTITIONER):
        return compile_fx(gm, example_inputs, inner_compile=inner)


def _eager(gm: fx.GraphModule, example_inputs: list[Any], lower):
    def compiler(is_backward: bool):
        def run(gm: fx.GraphModule, inputs: list[Any]):
            lower(gm, is_backward)
            return make_boxed_func(gm.forward)

        return run

    return aot_autograd(
        fw_compiler=compiler(False),
        bw_compiler=compiler(True),
        partition_fn=PARTITIONER,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
