"""The one-GPU bounds, run on rank 0 alone: single (unsharded param_dtype parameters, the whole
model compiled) and single_amp (fp32 parameters under autocast); their builders and their piece
of the registry."""

from __future__ import annotations

from collections.abc import Callable

import torch

from systems.common import Built, Ctx, adamw, meta_model, plain_step

# The compiled one-GPU bounds, run on rank 0 alone: "single" trains the model in param_dtype
# (no fp32 master weights); "single_amp" keeps fp32 parameters and computes under autocast to
# param_dtype, the mixed-precision recipe of the sharded systems (a cast per use, fp32 gradients
# and optimizer) without the sharding.
SINGLE_SYSTEMS = ("single", "single_amp")


def build_single(ctx: Ctx) -> Built:
    spec = ctx.spec
    model = meta_model(spec)
    torch.manual_seed(ctx.args.seed)
    spec.materialize(model, ctx.device)
    model.to(ctx.param_dtype)
    model.compile(backend=ctx.args.compile_backend)
    opt = adamw(model.parameters(), ctx)
    return Built(plain_step(model, opt, spec), 1, "none", (model, opt))


def build_single_amp(ctx: Ctx) -> Built:
    spec = ctx.spec
    model = meta_model(spec)
    torch.manual_seed(ctx.args.seed)
    spec.materialize(model, ctx.device)
    model.float()
    model.compile(backend=ctx.args.compile_backend)
    opt = adamw(model.parameters(), ctx)
    loss_of = spec.loss

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(ctx.device.type, dtype=ctx.param_dtype):
            loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Built(step, 1, "float32", (model, opt))


BUILDERS: dict[str, Callable[[Ctx], Built]] = {
    "single": build_single,
    "single_amp": build_single_amp,
}
