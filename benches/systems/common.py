"""What the systems' builders share (benches/systems/): the preset's model as a ModelSpec
(benches/llama.py's Llama or a transformers model of benches/hf_models.py), the run's context
(Ctx), what a builder returns (Built), and the optimizer and training step they all use."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import hf_models
from hf_models import HF_PRESETS
from llama import PRESETS, Llama, LlamaConfig, init_weights

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
ALL_PRESETS = (*PRESETS, *HF_PRESETS)


@dataclass
class ModelSpec:
    """What the systems need of a preset's model, whichever family it is: benches/llama.py's
    Llama or a transformers model (benches/hf_models.py)."""

    preset: str
    micro_batch: int
    seq_len: int
    vocab_size: int
    n_layers: int
    dim: int
    n_params: int  # all parameters, tied ones once
    n_matmul_params: int  # less the input embeddings (token, position); a tied head counted
    build: Callable[[], nn.Module]  # the model, on torch's current default device
    blocks: Callable[[nn.Module], nn.ModuleList]  # the decoder blocks, for FSDP2
    # fn(module) initialising one module's own parameters and buffers, for zrs.compile(init_fn=)
    # and init_all (None: each module's reset_parameters)
    init_fn: Callable[[nn.Module], Callable[[nn.Module], None] | None]
    init_all: Callable[[nn.Module], None]  # initialise a model materialised with to_empty
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, x, y) -> loss
    hf_model: str | None = None  # the transformers class, for hf_* presets

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6 x the parameters that multiply activations, plus
        12 x layers x dim x seq_len for the attention scores and values (non-causal, as PaLM
        and torchtitan count them). For the Llama presets this is LlamaConfig.flops_per_token."""
        t = seq_len or self.seq_len
        return 6 * self.n_matmul_params + 12 * self.n_layers * self.dim * t

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """to_empty (a meta model) and initialise."""
        model.to_empty(device=device)
        if self.hf_model is not None:
            hf_models.retie(model)
        self.init_all(model)


@dataclass
class Ctx:
    args: argparse.Namespace
    spec: ModelSpec
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.args.param_dtype]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.args.reduce_dtype]

    def master_model(self) -> nn.Module:
        """The preset's model on the meta device, in --master-dtype."""
        return meta_model(self.spec).to(DTYPES[self.args.master_dtype])


@dataclass
class Built:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # one training step -> loss
    world: int  # ranks the system trains on
    reduce_dtype: str
    keep: tuple = ()  # model, optimizer, engine: alive until the system is done
    versions: dict | None = None
    close: Callable[[], None] | None = None  # releases what the system holds


def make_config(args: argparse.Namespace) -> LlamaConfig:
    cfg = PRESETS[args.preset]
    changes = {}
    if args.micro_batch:
        changes["micro_batch"] = args.micro_batch
    if args.seq_len:
        changes["seq_len"] = args.seq_len
    if args.layers:
        changes["n_layers"] = args.layers
    if changes:
        cfg = LlamaConfig(**{**cfg.__dict__, **changes})
    return cfg


def llama_spec(args: argparse.Namespace) -> ModelSpec:
    cfg = make_config(args)
    return ModelSpec(
        preset=args.preset,
        micro_batch=cfg.micro_batch,
        seq_len=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        n_layers=cfg.n_layers,
        dim=cfg.dim,
        n_params=cfg.n_params(),
        n_matmul_params=cfg.n_params(embedding=False),
        build=lambda: Llama(cfg),
        blocks=lambda model: model.layers,
        init_fn=lambda model: None,
        init_all=init_weights,
        loss=lambda model, x, y: model(x, y),
    )


def hf_spec(args: argparse.Namespace) -> ModelSpec:
    p = HF_PRESETS[args.preset]
    seq_len = args.seq_len or p.seq_len
    config = hf_models.hf_config(p, n_layers=args.layers, seq_len=seq_len)
    with torch.device("meta"):
        n_params, n_matmul = hf_models.n_params(hf_models.build(p, config))
    return ModelSpec(
        preset=args.preset,
        micro_batch=args.micro_batch or p.micro_batch,
        seq_len=seq_len,
        vocab_size=p.vocab_size,
        n_layers=args.layers or p.n_layers,
        dim=p.dim,
        n_params=n_params,
        n_matmul_params=n_matmul,
        build=lambda: hf_models.build(p, config),
        blocks=hf_models.blocks,
        init_fn=hf_models.init_fn,
        init_all=hf_models.init_all,
        loss=hf_models.loss,
        hf_model=p.model_class,
    )


def make_spec(args: argparse.Namespace) -> ModelSpec:
    return hf_spec(args) if args.preset in HF_PRESETS else llama_spec(args)


def adamw(params, ctx: Ctx, fused: bool | None = None) -> torch.optim.Optimizer:
    """Fused on CUDA (and wherever `fused` asks for it: zrs.GraphedStep needs it)."""
    return torch.optim.AdamW(
        params,
        lr=ctx.args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=ctx.device.type == "cuda" if fused is None else fused,
    )


def plain_step(model, opt, spec: ModelSpec, stepper=None) -> Callable:
    """Forward, backward, `stepper()` (default: opt.step) and zero_grad."""
    loss_of = spec.loss
    optimizer_step = opt.step if stepper is None else stepper

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer_step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def meta_model(spec: ModelSpec) -> nn.Module:
    with torch.device("meta"):
        return spec.build()
