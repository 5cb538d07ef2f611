"""The DeepSpeed systems: deepspeed_zero3 (ZeRO-3, eager) and deepcompile (ZeRO-3 with
DeepCompile); their builder, their piece of the registry, and the checks before one runs.
DeepSpeed is optional: it is imported only when one of them is built (deepspeed_available says
whether it would import)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from systems.common import Built, Ctx, adamw

DEEPSPEED_SYSTEMS = ("deepspeed_zero3", "deepcompile", "deepspeed_offload")
_DEEPSPEED_RAN: list[str] = []  # DeepSpeed systems run in this process
DEEPCOMPILE_MIN_WARMUP = 8  # DeepCompile runs its profile-guided passes at step 5


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def claim(system: str) -> None:
    """Before a DeepSpeed system runs: deepspeed must be installed, and no other DeepSpeed system
    may have run in this process (the system is recorded as run)."""
    if not deepspeed_available():
        raise ModuleNotFoundError("deepspeed is not installed")
    if _DEEPSPEED_RAN:
        # DeepSpeed caches its process groups in module globals: a second engine in the
        # same process, on a new group, hangs.
        raise RuntimeError(
            f"{_DEEPSPEED_RAN[0]} already ran in this process: run each DeepSpeed system "
            "in its own torchrun invocation (scripts/bench_device.sh does)"
        )
    _DEEPSPEED_RAN.append(system)


def build_deepspeed(ctx: Ctx, deepcompile: bool, offload: bool = False) -> Built:
    """ZeRO-3 (`deepcompile`: with DeepCompile; `offload`: the optimizer on the host, where
    DeepSpeed steps its CPUAdam, built from the config as its offload expects)."""
    import deepspeed

    if ctx.param_dtype != torch.bfloat16:
        raise ValueError("the DeepSpeed systems are configured for --param-dtype bf16 only")
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts our process group
    config = {
        "train_micro_batch_size_per_gpu": ctx.spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # torch's (fused) AdamW, as for the others
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "compile": {"deepcompile": deepcompile},
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        adam = {"lr": ctx.args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}
        config["optimizer"] = {"type": "AdamW", "params": adam}
    torch.manual_seed(ctx.args.seed)
    if ctx.args.ds_init == "zero_init":
        # DeepSpeed's way for ZeRO-3: each module is partitioned as soon as it is constructed.
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = ctx.spec.build()
    else:
        # The full fp32 model on this GPU; deepspeed.initialize partitions it and frees the rest
        # (7b: 27 GB for a moment).
        with torch.device(ctx.device):
            model = ctx.spec.build()
    if offload:
        engine, opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    else:
        opt = adamw(model.parameters(), ctx)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    del model
    if deepcompile:
        # DeepCompile recompiles when its passes run; its own benchmark raises these limits.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 128)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 256
        )
        # Its scheduler walks the forward graph's dependencies recursively (DeepSpeed 0.19.8,
        # compile/list_schedule.py): GPT-2 XL's 48 layers passed Python's default depth
        # (1000) and the compile raised RecursionError (session 48).
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 20_000))
        engine.compile(backend="inductor")

    loss_of = ctx.spec.loss

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return Built(
        step,
        ctx.world,
        "bf16",
        (engine, opt),
        {"deepspeed": deepspeed.__version__, "ds_init": ctx.args.ds_init},
        close=engine.destroy,
    )


BUILDERS: dict[str, Callable[[Ctx], Built]] = {
    "deepspeed_zero3": lambda ctx: build_deepspeed(ctx, deepcompile=False),
    "deepcompile": lambda ctx: build_deepspeed(ctx, deepcompile=True),
    "deepspeed_offload": lambda ctx: build_deepspeed(ctx, deepcompile=False, offload=True),
}
