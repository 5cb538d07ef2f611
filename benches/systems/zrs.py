"""The zrs systems: zrs (zrs.compile), zrs_graphed (its AdamW step one CUDA graph, zrs.GraphedStep),
zrs_captured (the whole step one CUDA graph, zrs.CapturedStep), zrs_eager (zrs.shard, no
torch.compile), zrs_shard_compile (zrs.shard with each layer compiled, and the root's code
around them), zrs_shard_compile_layers (the layers only: compile_root=False), zrs_offload (the same,
the masters and the AdamW step on the host), zrs_offload_overlap (that step run during the
backward, zrs.OverlappedStep) and zrs_params_overlap (that, with the bf16 shards on the host
too: offload="params"); their builder, their piece of the registry, and the
zrs.compile ones' record fields."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from systems.common import DTYPES, Built, Ctx, adamw, plain_step


def build_zrs(
    ctx: Ctx,
    compiled: bool,
    graphed: bool = False,
    captured: bool = False,
    compiled_layers: bool = False,
    compile_root: bool = True,
    offload: str | None = None,
    overlap: bool = False,
) -> Built:
    """zrs.compile (the --zrs-* options are its), or zrs.shard: the same sharding, trained
    eagerly by module hooks (`compiled_layers`: each layer's forward compiled by inductor, and
    with `compile_root` the root's code around them). `graphed`: the optimizer step replayed as a CUDA graph
    (zrs.GraphedStep, without clipping or the non-finite check, as the other systems step).
    `captured`: also the forward and backward, the whole step one graph (zrs.CapturedStep).
    `offload`: zrs.shard(offload=...), the AdamW step on the host (not fused there);
    `overlap`: run by zrs.OverlappedStep during the backward."""
    import zrs

    if ctx.args.zrs_reduces_in_flight is not None:
        from zrs.runtime import grads

        grads.MAX_IN_FLIGHT_REDUCES = ctx.args.zrs_reduces_in_flight
    spec = ctx.spec
    model = ctx.master_model()
    torch.manual_seed(ctx.args.seed)
    common = {
        "init_fn": spec.init_fn(model),
        "param_dtype": ctx.param_dtype,
        "reduce_dtype": ctx.reduce_dtype,
        "master_dtype": DTYPES[ctx.args.master_dtype],
    }
    if ctx.args.zrs_mesh:
        common["mesh"] = _mesh(ctx.args.zrs_mesh, ctx.device.type)
    if compiled:
        model = zrs.compile(
            model,
            **common,
            backend=ctx.args.zrs_backend,
            scheduler=ctx.args.zrs_scheduler,
            separate_reduce_communicator=not ctx.args.zrs_shared_reduce_communicator,
            regions=not ctx.args.zrs_no_regions,
            dynamic=True if ctx.args.zrs_dynamic else None,
        )
    else:
        model = zrs.shard(
            model, **common, compile=compiled_layers, compile_root=compile_root, offload=offload
        )
    graphed = graphed or captured
    opt = adamw(model.parameters(), ctx, fused=True if graphed else False if offload else None)
    stepper = zrs.GraphedStep(opt, check_finite=False) if graphed else None
    if overlap:
        stepper = zrs.OverlappedStep(opt)
    step = plain_step(model, opt, spec, stepper)
    return Built(
        zrs.CapturedStep(step) if captured else step,
        ctx.world,
        ctx.args.reduce_dtype,
        (model, opt),
        {"zrs": getattr(zrs, "__version__", "?")}
        | ({"zrs_mesh": ctx.args.zrs_mesh} if ctx.args.zrs_mesh else {}),
    )


def _mesh(shape: str, device_type: str) -> object:
    """The 2-D ("dp_replicate", "dp_shard") DeviceMesh of `--zrs-mesh RxS`."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shards = (int(n) for n in shape.split("x"))
    names = ("dp_replicate", "dp_shard")
    return init_device_mesh(device_type, (replicas, shards), mesh_dim_names=names)


def settle() -> str:
    """Wait for the CUDA copy kernels' background build; their status for the record. Until the
    build is done the torch ops serve, and zrs.shard has no compile for nvcc's ~25 s to hide
    behind: a short run from a cold extension cache would time the torch ops."""
    from zrs.runtime import kernels

    kernels.wait()
    return kernels.status()[0]


BUILDERS: dict[str, Callable[[Ctx], Built]] = {
    "zrs": lambda ctx: build_zrs(ctx, compiled=True),
    "zrs_graphed": lambda ctx: build_zrs(ctx, compiled=True, graphed=True),
    "zrs_captured": lambda ctx: build_zrs(ctx, compiled=True, captured=True),
    "zrs_eager": lambda ctx: build_zrs(ctx, compiled=False),
    "zrs_shard_compile": lambda ctx: build_zrs(ctx, compiled=False, compiled_layers=True),
    "zrs_shard_compile_layers": lambda ctx: build_zrs(
        ctx, compiled=False, compiled_layers=True, compile_root=False
    ),
    "zrs_offload": lambda ctx: build_zrs(
        ctx, compiled=False, compiled_layers=True, offload="optimizer"
    ),
    "zrs_offload_overlap": lambda ctx: build_zrs(
        ctx, compiled=False, compiled_layers=True, offload="optimizer", overlap=True
    ),
    "zrs_params_overlap": lambda ctx: build_zrs(
        ctx, compiled=False, compiled_layers=True, offload="params", overlap=True
    ),
}
COMPILED = ("zrs", "zrs_graphed", "zrs_captured")  # the zrs.compile ones: record_fields


def record_fields(args: argparse.Namespace, built: Built) -> dict:
    """A zrs.compile system's own fields of the record: its options and its compile's share."""
    from zrs.runtime import grads

    record: dict = {}
    record["zrs_backend"] = args.zrs_backend
    record["zrs_reduces_in_flight"] = grads.MAX_IN_FLIGHT_REDUCES  # the value in effect
    record["zrs_scheduler"] = args.zrs_scheduler
    record["zrs_regions"] = not args.zrs_no_regions
    record["zrs_dynamic"] = bool(args.zrs_dynamic) or built.world > 1
    record["zrs_reduce_communicator"] = (
        "shared" if args.zrs_shared_reduce_communicator else "separate"
    )
    # zrs's own share of the warm-up (this rank's; dynamo, inductor and the kernel build
    # are the rest).
    state = built.keep[0]._zrs_state
    record["zrs_compile_s"] = {k: round(v, 2) for k, v in sorted(state.compile_s.items())}
    # The collectives' latency and bandwidth the planner fitted (None: not measured), to
    # replay its plans in the simulator later (benches/scale_sim.py) without a device.
    record["zrs_cost_model"] = state.cost_model
    return record
