"""The FSDP2 systems: fsdp2_eager (fully_shard per block and on the root) and fsdp2_compile (each
block torch.compile'd, as torchtitan does); their builder and their piece of the registry."""

from __future__ import annotations

from collections.abc import Callable

import torch

from systems.common import Built, Ctx, adamw, plain_step


def build_fsdp2(ctx: Ctx, compiled: bool) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy(param_dtype=ctx.param_dtype, reduce_dtype=ctx.reduce_dtype)
    spec = ctx.spec
    model = ctx.master_model()
    layers = spec.blocks(model)  # Llama's Blocks, LlamaDecoderLayer's or GPT2Block's
    n = len(layers)
    for i in range(n):
        block = layers[i]
        if compiled:
            # As torchtitan does: compile each block, then shard the compiled wrapper, so that
            # FSDP2's hooks run outside the compiled region.
            block = torch.compile(block, backend=ctx.args.compile_backend, fullgraph=True)
            layers[i] = block
        # The last block is needed again right at the start of backward: keep it unsharded.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # embedding, final norm, head
    model.to_empty(device=ctx.device)
    torch.manual_seed(ctx.args.seed)
    spec.init_all(model)
    opt = adamw(model.parameters(), ctx)
    return Built(plain_step(model, opt, spec), ctx.world, ctx.args.reduce_dtype, (model, opt))


BUILDERS: dict[str, Callable[[Ctx], Built]] = {
    "fsdp2_eager": lambda ctx: build_fsdp2(ctx, compiled=False),
    "fsdp2_compile": lambda ctx: build_fsdp2(ctx, compiled=True),
}
