"""The dynamo backend: AOTAutograd with a ZeRO-3 partitioner, the zero3 pass, then codegen.

Each dynamo graph (a graph break gives several) gets its own graph_id, shared by its forward and
backward. The joint graph is partitioned with gathers marked must-recompute; the partitioned graphs
are checked for cross-rank agreement, then lowered and planned by `pipeline.lower` (`zero3.py`,
then `plan.py`: the planner's order and fused prefetches, then the later passes). With
`backend="inductor"` they run as inductor's last post-grad pass, so no inductor rewrite (e.g.
`mm + add -> addmm`) can move a use of a gathered parameter past its release; inductor's own
peak-memory reordering is then off, so the planned order (a prefetch before its members' gathers)
holds. With `backend="eager"` the lowered FX graphs run as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn

from zrs._core import ZrsError
from zrs.compiler import pipeline
from zrs.compiler.plan import PlanContext, graph_label
from zrs.compiler.profile import symints
from zrs.compiler.recompute import reroute_aliased_outputs, tag_gathers_for_recompute
from zrs.compiler.record import Record, agree, core_build, record_key
from zrs.compiler.regions import inline_regions, lift_region_gathers, resolve_gathers
from zrs.compiler.torch_fixes import (
    RECORDED_OUTPUTS,
    VIEW_OF_FIRST_INPUT,
    aot_graph_logs_only_when_read,
    fallbacks_without_fake_reruns,
    region_backwards_keyed_by_value,
    region_schemas_built_once,
    register_inductor_fallbacks,
)
from zrs.runtime.exchange import first_line
from zrs.runtime.ops import SCHEMAS
from zrs.runtime.state import ZeroState

BACKENDS = ("inductor", "eager")
_log = logging.getLogger("zrs")


@contextlib.contextmanager
def _progress(what: str, doing: str) -> Iterator[None]:
    """A long compile says what it is doing (INFO on the `zrs` logger; the main job shows it)."""
    _log.info("zrs: %s: %s", what, doing)
    t0 = time.perf_counter()
    yield
    _log.info("zrs: %s: done in %.1f s", what, time.perf_counter() - t0)


def _source_hash(*names: str) -> str:
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / n).read_bytes() for n in names)).hexdigest()


class ZeroPartitioner(CustomPartitionerFn):
    """Min-cut rematerialization that never saves a gathered parameter for backward. `run` (the
    compile record's, compiler/record.py) puts that record in AOTAutograd's cache key."""

    def __init__(self, run: str = "") -> None:
        self.run = run

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        tag_gathers_for_recompute(gm.graph)
        reroute_aliased_outputs(gm)
        kwargs.setdefault("compiler", "inductor")
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        return f"{_source_hash('recompute.py')}:{self.run}"


# (graph_id, is_backward, keep, lower, plan context, graph) of the graph inductor is
# compiling right now; keep: a training forward of a keep_for_backward model, which keeps its last
# gathered parameters for the backward (in the FX cache key with the rest).
_CURRENT: contextvars.ContextVar[tuple[int, bool, bool, Any, PlanContext, fx.Graph]] = (
    contextvars.ContextVar("zrs_current")
)


class ZeroLowering(CustomGraphPass):
    """`pipeline.lower` (zero3, plan and the later passes) as inductor's
    `post_grad_custom_post_pass`."""

    def __call__(self, graph: fx.Graph) -> None:
        _, is_backward, keep, lower, ctx, top = _CURRENT.get()
        if graph is top:  # inductor runs its post-grad passes on each block's body too
            lower(graph, is_backward, keep, ctx)

    def uuid(self) -> str:
        # graph_id and the planner's options are not in the graph before this pass runs, so they
        # must be in the cache key.
        graph_id, is_backward, keep, _, ctx, _ = _CURRENT.get()
        source = _source_hash(*pipeline.LOWERING_SOURCES)
        return f"{source}:{core_build()}:{graph_id}:{int(is_backward)}:{int(keep)}:{ctx.key()}"


LOWERING = ZeroLowering()


def make_backend(state: ZeroState, backend: str):
    """A dynamo backend for one `zrs.compile` call (`backend` is checked by the caller).

    It holds the model's state weakly: torch keeps every backend passed to torch.compile until
    `torch._dynamo.reset()` (`eval_frame.cached_backends`), and a strong reference there would
    keep every dropped model's state alive; so would the compiled graphs, which dynamo leaves in
    the globals of the module of the frame it compiled (`forward.py`). The runtime ops find the
    state through their ds_ids (`state.LIVE`), which are weak too."""
    state_ref = weakref.ref(state)
    del state

    def live() -> ZeroState:
        state = state_ref()
        if state is None:
            raise ZrsError("this zrs model was dropped; compile the model again with zrs.compile")
        return state

    def zrs_backend(gm: fx.GraphModule, example_inputs: list[Any]):
        state = live()
        regions = lift_region_gathers(gm)
        resolve_gathers(gm, example_inputs, lambda shard: state.ds_ids.get(id(shard)))
        graph_id = next(state.graph_ids)
        what = f"graph {graph_id}"
        key = record_key(state, gm.graph, backend)
        state.check_usable()
        with state.exchanging(f"the agreement on {what}'s compile record"):
            if state.peers is not None:  # every rank compiles this graph now, or all raise
                state.peers.arrive(graph_label(graph_id, False))
            # Inductor's cache off (fx_graph_cache=False, or TORCHINDUCTOR_FORCE_DISABLE_CACHES=1)
            # turns zrs's records off too: such a rank holds none, so every rank compiles cold,
            # and writes none.
            off = inductor_config.force_disable_caches or not inductor_config.fx_graph_cache
            record, warm = agree(key, None if off else Record.load(key), state.control_group)
        record = None if off else record
        try:
            nodes = len(gm.graph.nodes)
            how = "from the record of an earlier compile" if warm else "cold"
            with _progress(
                what, f"compiling {nodes} FX nodes, {regions} repeated-block bodies, {how}"
            ):
                compiled = _compile_graph(state, gm, example_inputs, graph_id, record, warm)
            if record is not None and not warm:
                record.save()
            return compiled
        except ZrsError:
            raise
        except Exception as e:
            if not regions:
                raise
            # AOTAutograd does not take every region (torch 2.11: symbolic sizes inside one
            # raised a data-dependent error); the same graph with each call inlined is the
            # per-layer compile, right if slower to build.
            _log.warning(
                "zrs: graph %d: the repeated blocks could not be compiled once (%s: %s); each "
                "layer is compiled on its own instead",
                graph_id,
                type(e).__name__,
                first_line(e),
            )
            inline_regions(gm)
            with _progress(what, "compiling again, each layer on its own"):
                # Cold, and not recorded: the record's key is the graph with its regions.
                return _compile_graph(state, gm, example_inputs, graph_id, None, False)

    def _compile_graph(
        state: ZeroState,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        graph_id: int,
        record: Record | None,
        warm: bool,
    ):
        def check(graph: fx.Graph, is_backward: bool) -> None:
            if not warm:  # warm: the ranks agreed on the dynamo graph's key (compiler/record.py)
                pipeline.check_graph(live(), graph_id, graph, is_backward)

        def lower(graph: fx.Graph, is_backward: bool, keep: bool, ctx: PlanContext) -> None:
            pipeline.lower(live(), graph_id, graph, is_backward, keep, ctx)

        def context() -> PlanContext:
            return pipeline.plan_context(live(), record, warm)

        keeps = state.keep_for_backward
        # The backward is compiled now, beside the forward, not lazily inside the first backward:
        # there its profile (real tensors of the graph's shapes) ran while the step's real saved
        # activations were live, and the first step peaked above every later one (BENCHMARKS.md;
        # benches/first_step_rss.py on the CPU). Compiled now, its automatic CUDA budget does not
        # count the saved activations twice (once as the planner's base bytes, once as memory
        # already taken).
        with (
            torch._functorch.config.patch(
                # With a record, the keys hold its run id: a cold compile's lookups miss, so no
                # rank skips the meetings in zrs's pass that the others wait in, and a warm one
                # meets no one (compiler/record.py). Without (compiling again, each layer on its
                # own), the cache stays off.
                enable_autograd_cache=record is not None,
                force_non_lazy_backward_lowering=True,
            ),
            region_schemas_built_once(),
            region_backwards_keyed_by_value(),
            aot_graph_logs_only_when_read(),
        ):
            partitioner = ZeroPartitioner(record.run if record is not None else "")
            args = (gm, example_inputs, graph_id, check, lower, context, keeps, partitioner)
            return (_inductor if backend == "inductor" else _eager)(*args)

    return zrs_backend


# Inductor options whose effect is decided by timing on each rank. shape_padding pads a matmul
# when a benchmark says padding is faster: on 2 GPUs one rank padded a 3x5 matmul and the other
# did not, and the rank check refused the differing graphs (tests/gpu, mlp and chunked models).
# force_shape_pad decides without a benchmark, the same on every rank: every matmul with a
# misaligned dimension is padded. Without padding, GPT-2's head (vocabulary 50257) ran cuBLAS's
# unaligned kernels, slower than the compiled one-GPU model's, which pads (BENCHMARKS.md).
SAME_ON_EVERY_RANK: dict[str, Any] = {"shape_padding": True, "force_shape_pad": True}


def _inductor(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    graph_id: int,
    check,
    lower,
    context,
    keeps,
    partitioner: ZeroPartitioner,
):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm: fx.GraphModule, inputs: list[Any], **kwargs: Any):
        is_backward = bool(kwargs.get("is_backward", False))
        keep = keeps and not is_backward and not kwargs.get("is_inference", False)
        check(gm.graph, is_backward)  # before inductor's cache lookup: every rank runs it
        ctx = context()  # likewise (the CUDA budget is a collective)
        patches: dict[str, Any] = {"post_grad_custom_post_pass": LOWERING, **SAME_ON_EVERY_RANK}
        if ctx.scheduler != "none":
            # Its topological sorts would undo the plan: how far a prefetch runs ahead of the
            # compute that needs it is no data dependency.
            patches["reorder_for_peak_memory"] = False
        if symints(inputs):
            # Inductor's mix-order reduction fuses only above a size, and with symbolic sizes it
            # guarded on the size: Llama 1b on varying lengths compiled a graph per side of each
            # threshold (BENCHMARKS.md). Non-strict mode decides without the size, hence no guard.
            patches["triton.mix_order_reduction_non_strict_mode"] = True
        if ctx.profile and ctx.world > 1 and ctx.record is None:
            # The profile inside the pass is exchanged between ranks: a cache hit on one rank
            # only (which skips the pass) would leave the others waiting in the exchange. With a
            # record, its run id in the key makes a cold compile's lookups miss everywhere.
            patches["fx_graph_cache"] = False
        token = _CURRENT.set((graph_id, is_backward, keep, lower, ctx, gm.graph))
        what = graph_label(graph_id, is_backward)
        try:
            # Patched per graph, not around compile_fx: the forward and the backward differ.
            with (
                inductor_config.patch(patches),
                _progress(what, "zrs's passes (lower, profile, plan) and inductor's codegen"),
            ):
                return compile_fx_inner(gm, inputs, **kwargs)
        finally:
            _CURRENT.reset(token)

    def ops(names):
        return [getattr(torch.ops.zrs, name).default for name in names]

    register_inductor_fallbacks(ops(SCHEMAS))
    with (
        inductor_config.patch(custom_partitioner_fn=partitioner, **SAME_ON_EVERY_RANK),
        fallbacks_without_fake_reruns(ops(RECORDED_OUTPUTS), ops(VIEW_OF_FIRST_INPUT)),
    ):
        return compile_fx(gm, example_inputs, inner_compile=inner)


def _eager(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    graph_id: int,
    check,
    lower,
    context,
    keeps,
    partitioner: ZeroPartitioner,
):
    def compiler(is_backward: bool, keep: bool):
        def run(gm: fx.GraphModule, inputs: list[Any]):
            check(gm.graph, is_backward)
            what = graph_label(graph_id, is_backward)
            with _progress(what, "zrs's passes (lower, profile, plan)"):
                lower(gm.graph, is_backward, keep, context())
            gm.recompile()
            return make_boxed_func(gm.forward)

        return run

    return aot_autograd(
        fw_compiler=compiler(False, keep=keeps),
        bw_compiler=compiler(True, keep=False),
        inference_compiler=compiler(False, keep=False),
        partition_fn=partitioner,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
