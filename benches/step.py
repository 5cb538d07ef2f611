"""Training-step benchmark: zrs against the systems users would pick instead.

Runs under torchrun, one process per GPU, on any number of GPUs (or on the CPU with gloo, for
development; a plain ``python benches/step.py`` is one process, world 1). For each system in
``--systems`` it builds the model of ``--preset``, trains ``--warmup`` steps and then ``--steps``
timed steps with AdamW on random tokens, and prints one JSON line (appended to ``--out`` too):

    torchrun --standalone --nproc-per-node 2 benches/step.py --preset 1b --systems zrs \\
        --out benches/results/h200x2.jsonl
    python benches/step.py --table benches/results/h200x2.jsonl   # Markdown table of a file

Presets:
  1b, 7b, tiny     the Llama-style model of benches/llama.py (loss: cross-entropy of fp32 logits)
  hf_llama_1b      transformers LlamaForCausalLM, TinyLlama-1.1B shape (22 layers, hidden 2048,
                   32 heads, 4 KV heads); seq 2048, micro-batch 4
  hf_gpt2_xl       transformers GPT2LMHeadModel, GPT-2 XL shape (48 layers, 1600, 25 heads, tied
                   head); seq 1024, micro-batch 4
  hf_llama_tiny, hf_gpt2_tiny   2 layers, dim 64: CPU smoke tests
The hf_* models (benches/hf_models.py) are built from configs (nothing is downloaded) with
attn_implementation="sdpa", no dropout, and train on their own loss,
``model(input_ids=x, labels=x).loss``; FSDP2 shards (and fsdp2_compile compiles) each
LlamaDecoderLayer / GPT2Block and the root.

--varlen: step i on rank r uses the first L tokens of its batch, L uniform in
[seq_len // 16, seq_len], drawn from (--seed, r, i), so ranks differ within a step and runs repeat.
zrs relies on zrs.compile's dynamic shapes at several ranks; at world 1, and for the other
compiled systems, torch.compile recompiles once and then treats the length as dynamic; the eager
ones (zrs_eager, fsdp2_eager, deepspeed_zero3) compile nothing.

Systems:
  zrs              zrs.compile(model, param_dtype=bf16, reduce_dtype=fp32)
  zrs_graphed      the same, its fused AdamW step replayed as a CUDA graph (zrs.GraphedStep)
  zrs_captured     the same, the whole step (forward, backward, AdamW) one CUDA graph
                   (zrs.CapturedStep; one rank)
  zrs_eager        zrs.shard(model, param_dtype=bf16, reduce_dtype=fp32): the same sharding, no
                   torch.compile (module hooks gather, prefetch and release); --zrs-* don't apply
  fsdp2_eager      fully_shard per block and on the root, MixedPrecisionPolicy(bf16, fp32)
  fsdp2_compile    the same with each block torch.compile'd (fullgraph), as torchtitan does
  single           one GPU (rank 0 only), unsharded bf16 parameters, whole model compiled: the
                   compute-only bound
  single_amp       as single, but fp32 parameters under torch.autocast to --param-dtype: the same
                   mixed-precision recipe as the sharded systems (fp32 master weights, optimizer
                   and gradients), the bound that the sharding alone is measured against
  deepspeed_zero3  DeepSpeed ZeRO-3, eager, bf16 (only when deepspeed imports)
  deepcompile      DeepSpeed ZeRO-3 with DeepCompile: "compile": {"deepcompile": true} and
                   engine.compile() (at least 8 warm-up steps; its passes run at step 5)

Each system gets its own process group, created before it is built and destroyed after it. An
exception is caught and reported as a JSON line with "error"; the next system still runs. Run one
system per torchrun invocation (scripts/bench_device.sh does) to isolate crashes and hangs as well,
and always for the DeepSpeed systems, which keep process-global state.

Metrics (times are the maximum over ranks, step by step):
  step_ms_med / step_ms_min   median / minimum of the timed steps (CUDA events on GPUs);
                              step_ms_each: every timed step; step_ms_mean_wall: the host's
                              wall time over the timed steps, per step
  tok_s_gpu                   micro_batch * seq_len / median step (--varlen too: nominal)
  mfu                         flops_per_token * tokens / (median step * --peak-tflops); flops per
                              token = 6 * (parameters less the input embeddings; a tied head
                              counted) + 12 * layers * dim * seq: approximate (no causal saving,
                              no elementwise ops)
  tok_s_gpu_real, mfu_real    (--varlen) over the tokens really processed: micro_batch * the sum
                              of the timed steps' lengths over all ranks / world / the sum of the
                              step times (mfu_real: attention term at each step's length);
                              tok_s_gpu_real_med: the median of the per-step rates. With
                              "varlen": true, seq_len_mean (timed steps), distinct_lengths (over
                              warm-up and timed steps and all ranks), varlen_range and
                              timed_compiles (graphs dynamo compiled during the timed steps, max
                              over ranks: 0 unless a new length recompiled there)
  peak_GiB                    torch.cuda.max_memory_allocated over the timed steps (max over ranks);
                              peak_GiB_all over the whole system's run (build and warm-up included).
                              zrs_captured: peak_GiB_all (a replay allocates nothing; its graph's
                              memory is allocated at the capture)
  warmup_s                    wall time from the start of the model build to the end of the first
                              trained step (compilation included); build_s to the end of the
                              build (the library's import included); warmup_total_s to the end of
                              all warm-up steps; compile_phases_s: torch's own compile timers
                              (dynamo_timed, summed over graphs) that took at least 0.5 s
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import faulthandler
import gc
import importlib.util
import json
import os
import pickle
import platform
import pstats
import random
import shlex
import signal
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import hf_models
from hf_models import HF_PRESETS
from llama import PRESETS, Llama, LlamaConfig, init_weights
from memory_peak import peak_breakdown
from trace_summary import load, summarize

ALL_SYSTEMS = (
    "zrs",
    "zrs_graphed",
    "zrs_captured",
    "zrs_eager",
    "fsdp2_eager",
    "fsdp2_compile",
    "single",
    "single_amp",
    "deepspeed_zero3",
    "deepcompile",
)
# The compiled one-GPU bounds, run on rank 0 alone: "single" trains the model in param_dtype
# (no fp32 master weights); "single_amp" keeps fp32 parameters and computes under autocast to
# param_dtype, the mixed-precision recipe of the sharded systems (a cast per use, fp32 gradients
# and optimizer) without the sharding.
SINGLE_SYSTEMS = ("single", "single_amp")
DEEPSPEED_SYSTEMS = ("deepspeed_zero3", "deepcompile")
_DEEPSPEED_RAN: list[str] = []  # DeepSpeed systems run in this process
DEEPCOMPILE_MIN_WARMUP = 8  # DeepCompile runs its profile-guided passes at step 5
ENV_KEYS = (
    "NCCL_P2P_DISABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "TORCH_CUDA_ARCH_LIST",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "ZRS_COMM_STREAMS",
    "BENCH_CACHE",
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
ALL_PRESETS = (*PRESETS, *HF_PRESETS)


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def default_systems() -> list[str]:
    return [s for s in ALL_SYSTEMS if s not in DEEPSPEED_SYSTEMS or deepspeed_available()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Run under torchrun; see benches/README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=ALL_PRESETS,
        default="1b",
        help="model (default 1b): benches/llama.py's, or a transformers model (hf_*, "
        "benches/hf_models.py)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help=f"from {','.join(ALL_SYSTEMS)}, comma- or space-separated (default: all available: "
        "the DeepSpeed ones only when deepspeed imports)",
    )
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (default 10; >= 8 for "
                   "deepcompile, raised there if lower)")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--tag", default="", help='label of the run, e.g. "" or "nop2p"')
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="cuda (NCCL, one GPU per rank) or cpu (gloo); default cuda when available",
    )
    p.add_argument("--micro-batch", type=int, help="sequences per rank per step (preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument(
        "--varlen",
        action="store_true",
        help="variable-length batches: each step and rank draws its length uniformly from "
        "[seq_len // 16, seq_len] (seeded by --seed, the step and the rank)",
    )
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--reduce-dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="gradient reduce-scatter dtype of zrs and FSDP2 (DeepSpeed reduces in its "
        "bf16 default)",
    )
    p.add_argument(
        "--master-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="what zrs and FSDP2 keep their sharded parameters and optimizer state in: fp32 "
        "(default; master weights, single_amp's recipe) or bf16 (none, single's recipe: with "
        "--reduce-dtype bf16 they train what single trains)",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="dense bf16 peak per device for MFU (default 989: H100/H200 SXM)",
    )
    p.add_argument(
        "--zrs-backend",
        choices=["inductor", "eager"],
        default="inductor",
        help="zrs.compile backend",
    )
    p.add_argument(
        "--zrs-scheduler",
        choices=["search", "greedy", "none"],
        default="search",
        help="zrs.compile scheduler (default search)",
    )
    p.add_argument(
        "--zrs-no-regions",
        action="store_true",
        help="zrs.compile(regions=False): trace every layer on its own",
    )
    p.add_argument(
        "--zrs-dynamic",
        action="store_true",
        help="zrs.compile(dynamic=True): symbolic sizes from the first compile (the default at "
        "several ranks; at world 1 torch.compile's static-first)",
    )
    p.add_argument(
        "--zrs-shared-reduce-communicator",
        action="store_true",
        help="zrs.compile(separate_reduce_communicator=False): gathers and reduce-scatters on "
        "one NCCL communicator",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of single and fsdp2_compile (default inductor; aot_eager "
        "for quick CPU smoke tests)",
    )
    p.add_argument(
        "--ds-init",
        choices=["zero_init", "full"],
        default="zero_init",
        help="DeepSpeed model construction: under deepspeed.zero.Init (default) or full on the GPU",
    )
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="torch.backends.cuda.enable_cudnn_sdp(False): SDPA takes flash attention. cuDNN's "
        "attention builds a plan per new shape on the host (~0.5 s per new length at 1b)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="after the timed steps, profile 3 more with torch.profiler: Chrome traces per rank "
        "in DIR and the ops with the most device time per step in the record",
    )
    p.add_argument(
        "--host-profile",
        type=Path,
        metavar="DIR",
        help="after the timed steps, run 3 more under cProfile: the raw profile per rank in DIR "
        "(read it with pstats) and the functions with the most host time per step in the record",
    )
    p.add_argument(
        "--first-profile",
        type=Path,
        metavar="DIR",
        help="run the build and the first step under cProfile: the raw profile per rank in DIR "
        "and the functions with the most host time in the record (first_profile)",
    )
    p.add_argument(
        "--memory",
        type=Path,
        metavar="DIR",
        help="(CUDA) after the timed steps, record the allocator's history for one more step: a "
        "snapshot per rank in DIR and what is live at the peak in the record (memory_peak.py)",
    )
    p.add_argument("--pg-timeout", type=float, default=1800, help="process-group timeout, seconds")
    p.add_argument("--command", help=argparse.SUPPRESS)  # the launching command, for the record
    p.add_argument("--table", type=Path, metavar="FILE", help="print a Markdown table of FILE")
    args = p.parse_args(argv)
    if args.table is None:
        systems = (
            [s for arg in args.systems for s in arg.split(",") if s]
            if args.systems
            else default_systems()
        )
        unknown = [s for s in systems if s not in ALL_SYSTEMS]
        if unknown:
            p.error(f"unknown system(s) {','.join(unknown)}; choose from {','.join(ALL_SYSTEMS)}")
        args.systems = systems
        if args.warmup < 1 or args.steps < 1:
            p.error("--warmup and --steps must be at least 1")
        if args.master_dtype != "fp32" and set(systems) & set(DEEPSPEED_SYSTEMS):
            p.error("--master-dtype bf16: the DeepSpeed systems keep fp32 master weights")
    return args


# --------------------------------------------------------------------------------------------
# Setup shared by the systems


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


def varlen_range(seq_len: int) -> tuple[int, int]:
    """--varlen: the lengths drawn from, inclusive: [seq_len // 16 (at least 2), seq_len]."""
    return max(2, seq_len // 16), seq_len


def varlen_length(seed: int, rank: int, step: int, seq_len: int) -> int:
    """--varlen: the sequence length of ``step`` on ``rank``, uniform in ``varlen_range``; the
    same in every run, and computable on any rank."""
    return random.Random(f"varlen/{seed}/{rank}/{step}").randint(*varlen_range(seq_len))


class Data:
    """The batches of one rank: ``n`` fixed random-token batches of (micro_batch, seq_len) per
    rank, each rank its own (seeded by --seed and the rank), cycled through the steps. With
    --varlen, step ``i`` takes the first ``varlen_length(.., i, ..)`` tokens of its batch (copied
    to a contiguous tensor, before the timed steps)."""

    def __init__(self, ctx: Ctx, n: int = 4):
        self.ctx = ctx
        g = torch.Generator().manual_seed(ctx.args.seed * 1000 + ctx.rank)
        spec = ctx.spec
        self.batches = []
        for _ in range(n):
            tok = torch.randint(
                0, spec.vocab_size, (spec.micro_batch, spec.seq_len + 1), generator=g
            )
            self.batches.append(
                (tok[:, :-1].contiguous().to(ctx.device), tok[:, 1:].contiguous().to(ctx.device))
            )
        self.sliced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def length(self, step: int, rank: int | None = None) -> int:
        spec = self.ctx.spec
        if not self.ctx.args.varlen:
            return spec.seq_len
        rank = self.ctx.rank if rank is None else rank
        return varlen_length(self.ctx.args.seed, rank, step, spec.seq_len)

    def prepare(self, steps: range) -> None:
        for i in steps:
            self(i)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batches[step % len(self.batches)]
        if not self.ctx.args.varlen:
            return x, y
        if step not in self.sliced:
            t = self.length(step)
            self.sliced[step] = (x[:, :t].contiguous(), y[:, :t].contiguous())
        return self.sliced[step]


def meta_model(spec: ModelSpec) -> nn.Module:
    with torch.device("meta"):
        return spec.build()


# --------------------------------------------------------------------------------------------
# The systems


def compile_phases(least_s: float = 0.5) -> dict[str, float]:
    """torch's compile timers (dynamo, AOTAutograd, inductor phases) summed over this process."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {
        n: round(float(v), 2) for n, v in zip(names, values, strict=True) if float(v) >= least_s
    }


def build_zrs(ctx: Ctx, compiled: bool, graphed: bool = False, captured: bool = False) -> Built:
    """zrs.compile (the --zrs-* options are its), or zrs.shard: the same sharding, trained
    eagerly by module hooks. `graphed`: the optimizer step replayed as a CUDA graph
    (zrs.GraphedStep, without clipping or the non-finite check, as the other systems step).
    `captured`: also the forward and backward, the whole step one graph (zrs.CapturedStep)."""
    import zrs

    spec = ctx.spec
    model = ctx.master_model()
    torch.manual_seed(ctx.args.seed)
    common = {
        "init_fn": spec.init_fn(model),
        "param_dtype": ctx.param_dtype,
        "reduce_dtype": ctx.reduce_dtype,
        "master_dtype": DTYPES[ctx.args.master_dtype],
    }
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
        model = zrs.shard(model, **common)
    graphed = graphed or captured
    opt = adamw(model.parameters(), ctx, fused=True if graphed else None)
    stepper = zrs.GraphedStep(opt, check_finite=False) if graphed else None
    step = plain_step(model, opt, spec, stepper)
    return Built(
        zrs.CapturedStep(step) if captured else step,
        ctx.world,
        ctx.args.reduce_dtype,
        (model, opt),
        {"zrs": getattr(zrs, "__version__", "?")},
    )


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


def build_deepspeed(ctx: Ctx, deepcompile: bool) -> Built:
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
    opt = adamw(model.parameters(), ctx)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    del model
    if deepcompile:
        # DeepCompile recompiles when its passes run; its own benchmark raises these limits.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 128)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 256
        )
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
    "zrs": lambda ctx: build_zrs(ctx, compiled=True),
    "zrs_graphed": lambda ctx: build_zrs(ctx, compiled=True, graphed=True),
    "zrs_captured": lambda ctx: build_zrs(ctx, compiled=True, captured=True),
    "zrs_eager": lambda ctx: build_zrs(ctx, compiled=False),
    "fsdp2_eager": lambda ctx: build_fsdp2(ctx, compiled=False),
    "fsdp2_compile": lambda ctx: build_fsdp2(ctx, compiled=True),
    "single": build_single,
    "single_amp": build_single_amp,
    "deepspeed_zero3": lambda ctx: build_deepspeed(ctx, deepcompile=False),
    "deepcompile": lambda ctx: build_deepspeed(ctx, deepcompile=True),
}


# --------------------------------------------------------------------------------------------
# Measurement


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dynamo_graphs() -> int:
    """Graphs dynamo compiled in this process so far (torch.compile, zrs, DeepCompile)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def max_memory(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def measure(system: str, ctx: Ctx, distributed: bool) -> dict:
    """Build ``system``, warm it up, time it; the record (complete on rank 0)."""
    args, device, spec = ctx.args, ctx.device, ctx.spec
    warmup = args.warmup
    if system == "deepcompile":
        warmup = max(warmup, DEEPCOMPILE_MIN_WARMUP)
    data = Data(ctx)
    data.prepare(range(warmup + args.steps + TRACE_STEPS + 1))  # --varlen: sliced ahead
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    first_prof = cProfile.Profile() if args.first_profile is not None else None
    t0 = time.perf_counter()
    if first_prof is not None:
        first_prof.enable()
    built = BUILDERS[system](ctx)
    build_s = time.perf_counter() - t0
    loss = None
    first_step_s = 0.0
    for i in range(warmup):
        loss = built.step(*data(i))
        if i == 0:
            sync(device)
            first_step_s = time.perf_counter() - t0
            if first_prof is not None:
                first_prof.disable()
    sync(device)
    warmup_total_s = time.perf_counter() - t0
    peak_all = max_memory(device)
    if distributed:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    step_s: list[float] = []
    graphs0 = dynamo_graphs()
    w0 = time.perf_counter()
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(args.steps)
        ]
        for i, (start, end) in enumerate(events):
            start.record()
            loss = built.step(*data(warmup + i))
            end.record()
        sync(device)
        step_s = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for i in range(args.steps):
            s = time.perf_counter()
            loss = built.step(*data(warmup + i))
            step_s.append(time.perf_counter() - s)
    wall_s = time.perf_counter() - w0
    timed_graphs = dynamo_graphs() - graphs0
    peak = max_memory(device)

    # Slowest rank per step, peak memory, warm-up and graphs compiled while timed: max over
    # ranks; loss: mean over ranks.
    maxes = torch.tensor(
        [*step_s, timed_graphs, wall_s, peak, peak_all, build_s, first_step_s, warmup_total_s],
        dtype=torch.float64,
        device=device,
    )
    loss_t = loss.detach().float().reshape(1).to(torch.float64)
    if distributed:
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss_t)
        loss_t /= built.world
    vals = maxes.tolist()
    step_s, (timed_graphs, wall_s, peak, peak_all, build_s, first_step_s, warmup_total_s) = (
        vals[: args.steps],
        vals[-7:],
    )
    med = statistics.median(step_s)
    tokens = spec.micro_batch * spec.seq_len
    record = {
        "system": system,
        "preset": args.preset,
        "tag": args.tag,
        "world": built.world,
        "step_ms_med": round(med * 1e3, 2),
        "step_ms_min": round(min(step_s) * 1e3, 2),
        "step_ms_mean_wall": round(wall_s / args.steps * 1e3, 2),
        "step_ms_each": [round(s * 1e3, 1) for s in step_s],
        "tok_s_gpu": round(tokens / med, 1),
        "mfu": round(spec.flops_per_token() * tokens / med / (args.peak_tflops * 1e12), 4),
        # A replay allocates nothing: a captured step's memory comes from its graph's pool,
        # allocated at the capture, in the warm-up.
        "peak_GiB": round(max(peak_all, peak) if system == "zrs_captured" else peak, 2),
        "peak_GiB_all": round(max(peak_all, peak), 2),
        "build_s": round(build_s, 2),
        "warmup_s": round(first_step_s, 2),
        "warmup_total_s": round(warmup_total_s, 2),
        "compile_phases_s": compile_phases(),
        "loss": round(loss_t.item(), 4),
        "warmup_steps": warmup,
        "steps": args.steps,
        "params_M": round(spec.n_params / 1e6, 1),
        "micro_batch": spec.micro_batch,
        "seq_len": spec.seq_len,
        "layers": spec.n_layers,
        "param_dtype": args.param_dtype,
        "master_dtype": {"single": args.param_dtype, "single_amp": "fp32"}.get(
            system, args.master_dtype
        ),
        "reduce_dtype": built.reduce_dtype,
        "cudnn_sdpa": not args.no_cudnn_sdpa,
    }
    if spec.hf_model is not None:
        import transformers

        record["hf_model"] = spec.hf_model
        record["transformers"] = transformers.__version__
    if args.varlen:
        record.update(varlen_metrics(data, built.world, warmup, step_s))
        record["timed_compiles"] = int(timed_graphs)
    if system in ("zrs", "zrs_graphed", "zrs_captured"):
        record["zrs_backend"] = args.zrs_backend
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
    elif system in (*SINGLE_SYSTEMS, "fsdp2_compile"):
        record["compile_backend"] = args.compile_backend
    record.update(built.versions or {})
    if args.trace is not None:
        record.update(profile_steps(system, ctx, built, data, warmup + args.steps))
    if first_prof is not None:
        path = artifact_path(args, args.first_profile, system, "prof")
        record["first_profile"] = profile_summary(first_prof, path, 1)
    if args.host_profile is not None:
        record["host_profile"] = host_profile(system, ctx, built, data, warmup + args.steps)
    if args.memory is not None and device.type == "cuda":
        record["memory_at_peak"] = memory_step(system, ctx, built, data, warmup + args.steps)
    if built.close is not None:
        built.close()
    del built, loss
    return record


def varlen_metrics(data: Data, world: int, warmup: int, step_s: list[float]) -> dict:
    """--varlen: throughput over the tokens really processed. Every rank's lengths follow from the
    seed, the step and the rank, so rank 0 computes them all; ``step_s`` are the timed steps'
    times (slowest rank per step)."""
    spec, n = data.ctx.spec, len(step_s)
    timed = [data.length(warmup + i, r) for i in range(n) for r in range(world)]
    seen = {data.length(i, r) for i in range(warmup + n) for r in range(world)}
    tokens = spec.micro_batch * sum(timed)  # all ranks
    flops = spec.micro_batch * sum(t * spec.flops_per_token(t) for t in timed)
    total_s = sum(step_s)
    peak = data.ctx.args.peak_tflops * 1e12
    per_step = [
        spec.micro_batch * sum(timed[i * world : (i + 1) * world]) / world / t
        for i, t in enumerate(step_s)
    ]
    return {
        "varlen": True,
        "tok_s_gpu_real": round(tokens / world / total_s, 1),
        "tok_s_gpu_real_med": round(statistics.median(per_step), 1),
        "mfu_real": round(flops / world / total_s / peak, 4),
        "seq_len_mean": round(sum(timed) / len(timed), 1),
        "varlen_range": list(varlen_range(spec.seq_len)),
        "distinct_lengths": len(seen),
    }


TRACE_STEPS = 3


def artifact_path(args: argparse.Namespace, directory: Path, system: str, suffix: str) -> Path:
    """This rank's file in `directory` (created) for one run: preset, system, tag and rank."""
    directory.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return directory / f"{args.preset}_{system}_{args.tag or 'nvlink'}_rank{rank}.{suffix}"


TRACE_TOP = 20


def profile_steps(system: str, ctx: Ctx, built: Built, data: Data, start: int) -> dict:
    """Run TRACE_STEPS more steps under torch.profiler (after the timed ones, so they are not
    slowed): a Chrome trace per rank in --trace DIR, and the ops with the most device (else CPU)
    self time per step, for the record."""
    from torch.profiler import ProfilerActivity, profile

    args, device = ctx.args, ctx.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for i in range(TRACE_STEPS):
            built.step(*data(start + i))
        sync(device)
    path = artifact_path(args, args.trace, system, "json.gz")
    prof.export_chrome_trace(str(path))  # gzipped: a 1b trace is ~20 MB of JSON
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TRACE_TOP]
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:TRACE_TOP]
    zrs_ops = sorted((e for e in events if e.key.startswith("zrs::")), key=lambda e: e.key)
    return {
        "trace": str(path),
        "timeline": summarize(load(path), TRACE_STEPS),
        "top_ops_ms_per_step": [
            [e.key, round(getattr(e, key) / 1e3 / TRACE_STEPS, 3)] for e in top
        ],
        # The host's side: ops by their own CPU time, and every zrs op (calls, CPU time with
        # what it calls), per step.
        "top_host_ops_ms_per_step": [
            [e.key, round(e.self_cpu_time_total / 1e3 / TRACE_STEPS, 3)] for e in host
        ],
        "zrs_ops_per_step": [
            [e.key, e.count // TRACE_STEPS, round(e.cpu_time_total / 1e3 / TRACE_STEPS, 3)]
            for e in zrs_ops
        ],
    }


HOST_TOP = 30


def host_profile(system: str, ctx: Ctx, built: Built, data: Data, start: int) -> dict:
    """TRACE_STEPS more steps under cProfile (after the timed ones): the host's wall time per step,
    and the functions with the most own time and the most time with their callees, ms per step.
    A device sync ends each step, so a wait for the GPU shows as the sync's own time."""
    sync(ctx.device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(TRACE_STEPS):
        built.step(*data(start + i))
        sync(ctx.device)
    prof.disable()
    wall = time.perf_counter() - t0
    path = artifact_path(ctx.args, ctx.args.host_profile, system, "prof")
    return {
        "step_ms": round(wall * 1e3 / TRACE_STEPS, 2),
        **profile_summary(prof, path, TRACE_STEPS),
    }


def profile_summary(prof: cProfile.Profile, path: Path, steps: int) -> dict:
    """Dump ``prof`` to ``path``; the functions with the most own time and the most time with
    their callees, ms per step over ``steps`` steps."""
    prof.dump_stats(path)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, _)

    def label(key: tuple) -> str:
        file, line, name = key
        return f"{Path(file).name}:{line}:{name}" if line else name

    def top(index: int) -> list:
        rows = sorted(stats.items(), key=lambda kv: kv[1][index], reverse=True)[:HOST_TOP]
        return [[label(k), v[1] // steps, round(v[index] * 1e3 / steps, 3)] for k, v in rows]

    return {
        "profile": str(path),
        "self_ms": top(2),  # [function, calls per step, own ms per step]
        "cumulative_ms": top(3),
    }


def memory_step(system: str, ctx: Ctx, built: Built, data: Data, start: int) -> dict:
    """One more step with the allocator's history on; its snapshot goes to --memory DIR and what
    was live at its peak (rank 0's) into the record."""
    args, device = ctx.args, ctx.device
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    built.step(*data(start))
    sync(device)
    path = artifact_path(args, args.memory, system, "pickle")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return {"snapshot": str(path), **peak_breakdown(snapshot, before)}


def environment(ctx: Ctx) -> dict:
    if ctx.device.type == "cuda":
        name = torch.cuda.get_device_name(ctx.device)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        name, nccl = f"cpu ({platform.processor() or platform.machine()})", None
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    launcher = ["python"] if _STANDALONE else ["torchrun", f"--nproc-per-node={ctx.world}"]
    command = ctx.args.command or shlex.join([*launcher, *sys.argv])
    return {
        "device": name,
        "torch": torch.__version__,
        "nccl": nccl,
        "env": env,
        "command": command,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def emit(record: dict, out: Path | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(line + "\n")


def init_group(ctx: Ctx) -> None:
    timeout = datetime.timedelta(seconds=ctx.args.pg_timeout)
    if ctx.device.type == "cuda":
        dist.init_process_group("nccl", device_id=ctx.device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def cleanup(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_one(system: str, ctx: Ctx) -> dict | None:
    """Run one system in its own process-group lifetime; its record, or an error record."""
    single = system in SINGLE_SYSTEMS
    if single and ctx.rank != 0:
        return None  # the single-GPU bound runs on rank 0 alone
    distributed = not single  # every sharded system gets a process group, world 1 included
    base = {"system": system, "preset": ctx.args.preset, "tag": ctx.args.tag}
    if ctx.args.varlen:
        base["varlen"] = True
    try:
        if system in DEEPSPEED_SYSTEMS:
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
        if distributed:
            init_group(ctx)
        record = measure(system, ctx, distributed)
    except Exception as e:  # report, and go on with the next system
        traceback.print_exc()
        record = {
            **base,
            "world": 1 if single else ctx.world,
            "rank": ctx.rank,
            "error": f"{type(e).__name__}: {e}"[:2000],
        }
    finally:
        cleanup(ctx.device)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    record.update(environment(ctx))
    return record


_STANDALONE: list[bool] = []  # [True] when run without torchrun


def standalone_env() -> None:
    """Run as a plain ``python benches/step.py`` (no torchrun): one process, world 1, its process
    groups on a free local port."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    _STANDALONE.append(True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def worker(args: argparse.Namespace) -> None:
    standalone_env()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            sys.exit(f"step.py: local rank {local_rank} but {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // local_world))
    torch.set_float32_matmul_precision("high")
    ctx = Ctx(args, make_spec(args), rank, world, local_rank, device)
    records = []
    for system in args.systems:
        record = run_one(system, ctx)
        if record is None:
            continue
        if rank == 0 or "error" in record:  # a failing rank reports itself: rank 0 may be killed
            emit(record, args.out)
        records.append(record)
    if rank == 0 and records:
        print(table(records), flush=True)


# --------------------------------------------------------------------------------------------
# Tables


def _fmt(v, spec: str = "") -> str:
    return "" if v is None else format(v, spec)


def table(records: list[dict]) -> str:
    """Markdown table, the latest record per (preset, world, system, tag, varlen). --varlen rows
    (tag "+varlen") show the throughput and MFU over the real tokens."""
    latest: dict[tuple, dict] = {}
    for r in records:
        tag = r.get("tag", "") + ("+varlen" if r.get("varlen") else "")
        key = (r.get("preset"), r.get("world"), r.get("system"), tag)
        latest.pop(key, None)
        latest[key] = r
    rows = [
        "| preset | GPUs | system | tag | step ms (med) | step ms (min) | tok/s/GPU | MFU "
        "| peak GiB | warm-up s | loss | device |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = {s: i for i, s in enumerate(ALL_SYSTEMS)}
    for (preset, world, system, tag), r in sorted(
        latest.items(),
        key=lambda kv: (str(kv[0][0]), kv[0][3], order.get(kv[0][2], 99), kv[0][1] or 0),
    ):
        if "error" in r:
            err = r["error"].splitlines()[0][:80].replace("|", "/")
            cells = [f"error: {err}", "", "", "", "", "", ""]
        else:
            real = "_real" if r.get("varlen") else ""
            mfu = r.get("mfu" + real)
            cells = [
                _fmt(r.get("step_ms_med"), ".1f"),
                _fmt(r.get("step_ms_min"), ".1f"),
                _fmt(r.get("tok_s_gpu" + real), ",.0f"),
                f"{100 * mfu:.1f}%" if mfu is not None else "",
                _fmt(r.get("peak_GiB"), ".2f"),
                _fmt(r.get("warmup_s"), ".1f"),
                _fmt(r.get("loss"), ".3f"),
            ]
        rows.append(
            "| "
            + " | ".join([str(preset), str(world), system, tag or "-", *cells, r.get("device", "")])
            + " |"
        )
    return "\n".join(rows)


def read_records(path: Path) -> list[dict]:
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"{path}:{n}: not JSON, skipped", file=sys.stderr)
    return records


def main(argv: list[str] | None = None) -> None:
    # `kill -USR1 <pid>` prints every thread's stack: where a hung rank waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = parse_args(argv)
    if args.table is not None:
        print(table(read_records(args.table)))
        return
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    worker(args)


if __name__ == "__main__":
    main()
