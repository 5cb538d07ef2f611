"""Tiny deterministic models for the correctness tests.

Each entry has ``build()`` (same weights on every call, whatever the global RNG state),
``batch(rank, step)`` (a deterministic per-rank, per-step batch) and ``loss(model, batch)`` (a
scalar mean over the batch, so averaging the per-rank gradients equals data-parallel training).
Sizes are tiny so that inductor compiles quickly on CPU, and most numels are odd so that padding
to a multiple of the world size is exercised at world sizes 2 and 3.

Every model has its own class with its own ``forward``: dynamo does not trace the ``forward`` of
``torch.nn`` containers such as ``nn.Sequential``, and distinct code objects keep the models from
sharing dynamo's per-function recompile budget when several run in one process.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map

Batch = tuple[Tensor, ...]


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    factory: Callable[[], nn.Module]
    batch: Callable[[int, int], Batch]
    loss: Callable[[nn.Module, Batch], Tensor]
    # Names (as in named_parameters(remove_duplicate=False)) of parameters that must not change.
    frozen: tuple[str, ...] = ()
    # Groups of names that refer to one shared parameter.
    tied: tuple[tuple[str, ...], ...] = ()
    # The forward has one explicit torch._dynamo.graph_break(); any other graph break (such as
    # dynamo falling back when the zrs backend fails on a graph) means the zrs compiled path
    # did not run the code.
    explicit_graph_break: bool = False
    seed: int = 0
    # After training, `generate(model)` returns tokens that must equal the reference's.
    generate: Callable[[nn.Module], Tensor] | None = None

    def build(self) -> nn.Module:
        """The model with its seeded initial weights; leaves the global RNG state untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return self.factory()


def _gen(rank: int, step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(10_007 * salt + 101 * rank + step)


def _regression_batch(n: int, d_in: int, d_out: int, salt: int) -> Callable[[int, int], Batch]:
    def batch(rank: int, step: int) -> Batch:
        g = _gen(rank, step, salt)
        return (torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g))

    return batch


def _mse(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    # .float(): with param_dtype=bf16 the output is bf16; the loss is taken in fp32.
    return F.mse_loss(model(x).float(), y)


# --- an MLP ----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 11)
        self.fc3 = nn.Linear(11, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.fc1(x))
        x = F.gelu(self.fc2(x))
        return self.fc3(x)


class MixedFP16(nn.Module):
    """An fp16 layer between fp32 ones, which casts its input as the fp16 layer needs: zrs
    gathers each parameter in its own dtype (issue 36)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.half_fc = nn.Linear(13, 11).half()
        self.fc3 = nn.Linear(11, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.fc1(x))
        x = F.gelu(self.half_fc(x.half())).float()
        return self.fc3(x)


# --- a small GPT with tied token embedding and LM head ----------------------------------------

GPT_VOCAB, GPT_DIM, GPT_SEQ, GPT_LAYERS, GPT_HEADS = 64, 32, 16, 2, 2


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(GPT_VOCAB, GPT_DIM)
        self.pos = nn.Parameter(torch.randn(GPT_SEQ, GPT_DIM) * 0.1)
        self.blocks = nn.ModuleList(Block(GPT_DIM, GPT_HEADS) for _ in range(GPT_LAYERS))
        self.ln_f = nn.LayerNorm(GPT_DIM)
        self.head = nn.Linear(GPT_DIM, GPT_VOCAB, bias=False)
        nn.init.normal_(self.tok.weight, std=0.1)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _gpt_batch(rank: int, step: int) -> Batch:
    tokens = torch.randint(0, GPT_VOCAB, (2, GPT_SEQ + 1), generator=_gen(rank, step, 2))
    return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _gpt_loss(model: nn.Module, batch: Batch) -> Tensor:
    idx, target = batch
    logits = model(idx).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


# --- a graph break between two parts ----------------------------------------------------------


class GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(9, 11)
        self.second = nn.Linear(11, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h)


# --- a parameter used twice -------------------------------------------------------------------


class UsedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(9, 9)  # the module is called twice
        self.gate = nn.Parameter(torch.randn(9) * 0.5)  # a raw parameter read twice
        self.out = nn.Linear(9, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.lin(x)) * self.gate
        h = torch.tanh(self.lin(h)) + self.gate
        return self.out(h)


# --- 0-d parameters -----------------------------------------------------------------------------


class ScalarParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 5)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.shift = nn.Parameter(torch.tensor(-0.2))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.scale + self.shift


# --- a frozen layer -----------------------------------------------------------------------------


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 9)
        self.mid = nn.Linear(9, 9)  # frozen; gradients still flow through it to `inp`
        self.out = nn.Linear(9, 5)
        self.mid.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.mid(x))
        return self.out(x)


# --- a weight chunked into a tuple --------------------------------------------------------------


class Chunked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(15, 7) * 0.3)  # .chunk(3) into three 5x7 views
        self.proj = nn.Parameter(torch.randn(7, 5) * 0.3)  # torch.split into 3 + 4 rows
        self.bias = nn.Parameter(torch.randn(7) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv.chunk(3)
        h = (x @ q.T) * torch.sigmoid(x @ k.T) + x @ v.T
        p1, p2 = torch.split(self.proj, [3, 4])
        return torch.cat([h @ p1.T, torch.tanh(h @ p2.T)], dim=-1) + self.bias


# --- a stack of layers with biases -------------------------------------------------------------


class BiasStack(nn.Module):
    """Each op reads a weight and a bias (addmm): the planner once held every weight gathered to
    the end of the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(9, 9) for _ in range(6))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


# --- conv layers with buffers (batch norm) ------------------------------------------------------


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, 3, padding=1, bias=False)  # BN follows
        self.bn = nn.BatchNorm2d(5)
        self.conv2 = nn.Conv2d(5, 3, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = self.conv2(x).mean(dim=(2, 3))
        return self.head(x)


def _conv_batch(rank: int, step: int) -> Batch:
    g = _gen(rank, step, 8)
    return (torch.randn(4, 3, 7, 7, generator=g), torch.randn(4, 3, generator=g))


# Models of one test module's own, outside the zoo every correctness test trains.
MIXED_DTYPES = ZooModel("mixed_fp16", MixedFP16, _regression_batch(6, 7, 5, salt=10), _mse, seed=10)


def spec_of(name: str) -> ZooModel:
    """A model of this zoo or of the Hugging Face zoo (`hf_zoo`, which needs transformers)."""
    if name in ZOO:
        return ZOO[name]
    if name == MIXED_DTYPES.name:
        return MIXED_DTYPES
    from hf_zoo import HF_ZOO

    return HF_ZOO[name]


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel("mlp", MLP, _regression_batch(6, 7, 5, salt=1), _mse, seed=1),
        ZooModel(
            "gpt_tied",
            TinyGPT,
            _gpt_batch,
            _gpt_loss,
            tied=(("tok.weight", "head.weight"),),
            seed=2,
        ),
        ZooModel(
            "graph_break",
            GraphBreak,
            _regression_batch(6, 9, 3, salt=3),
            _mse,
            explicit_graph_break=True,
            seed=3,
        ),
        ZooModel("used_twice", UsedTwice, _regression_batch(6, 9, 3, salt=4), _mse, seed=4),
        ZooModel("scalar_param", ScalarParam, _regression_batch(6, 7, 5, salt=5), _mse, seed=5),
        ZooModel(
            "frozen",
            Frozen,
            _regression_batch(6, 7, 5, salt=6),
            _mse,
            frozen=("mid.weight", "mid.bias"),
            seed=6,
        ),
        ZooModel("chunked", Chunked, _regression_batch(6, 7, 7, salt=7), _mse, seed=7),
        ZooModel("bias_stack", BiasStack, _regression_batch(6, 9, 9, salt=9), _mse, seed=9),
        ZooModel("conv_bn", ConvBN, _conv_batch, _mse, seed=8),
    ]
}


# --- training loops: the unsharded reference and the zrs run inside a worker -------------------

STEPS, LR, MOMENTUM = 3, 0.1, 0.9


def param_dict(model: nn.Module) -> dict[str, Tensor]:
    """Detached copies of every parameter under every name (tied parameters appear twice)."""
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


@dataclasses.dataclass
class Reference:
    init: dict[str, Tensor]  # parameters before training
    final: dict[str, Tensor]  # parameters after training
    losses: list[list[float]]  # losses[step][rank]
    state_dict_keys: list[str]
    # (full numel, requires_grad) of each distinct parameter: what a rank's shards must match.
    params: list[tuple[tuple[int, ...], bool]]  # (shape, requires_grad)
    generated: Tensor | None = None  # spec.generate of the trained model


def train_reference(
    spec: ZooModel,
    world_size: int,
    *,
    steps: int = STEPS,
    autocast_dtype: torch.dtype | None = None,
    max_norm: float | None = None,
    model_dtype: torch.dtype | None = None,
) -> Reference:
    """Unsharded, single-process training equivalent to data-parallel training on
    ``world_size`` ranks: each step averages the gradients of the ranks' batches (and clips
    their global norm to ``max_norm``). ``model_dtype``: the model cast to it, trained wholly in
    it (the gradients' mean computed in fp32, rounded once)."""
    model = spec.build()
    if model_dtype is not None:
        model.to(model_dtype)
    init = param_dict(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses: list[list[float]] = []
    for step in range(steps):
        total = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                 for p in trainable]  # fmt: skip
        step_losses = []
        for rank in range(world_size):
            with torch.autocast(
                "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
            ):
                loss = spec.loss(model, spec.batch(rank, step))
            step_losses.append(loss.item())
            grads = torch.autograd.grad(loss, trainable)
            for acc, g in zip(total, grads, strict=True):
                acc += g
        for p, g in zip(trainable, total, strict=True):
            p.grad = (g / world_size).to(p.dtype)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_losses)
    generated = None
    if spec.generate is not None:
        with torch.autocast(
            "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
        ):
            generated = spec.generate(model)
    return Reference(
        init=init,
        final=param_dict(model),
        losses=losses,
        state_dict_keys=list(model.state_dict().keys()),
        params=[(tuple(p.shape), p.requires_grad) for p in model.parameters()],
        generated=generated,
    )


@dataclasses.dataclass(frozen=True)
class Case:
    """One zrs training run inside a group of workers."""

    model: str
    # zrs.compile's backend; "shard": zrs.shard; "shard:B": zrs.shard(compile=B), each layer of
    # a stack compiled by torch.compile's backend B; "hand:B": zrs.shard, then each layer's
    # .compile(backend=B) by hand; "whole:B": zrs.shard, then torch.compile(model, backend=B);
    # "layers:B": zrs.shard(compile=B, compile_root=False), the layers only
    backend: str
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    steps: int = STEPS
    scheduler: str | None = None  # None: zrs.compile's default
    device: str = "cpu"  # "cuda": the model and batches on this rank's GPU (NCCL groups)
    # True: pass process_group=None (the default group). False: a fresh group for this case
    # alone, so that a failure in one case cannot leave stale messages for the next one.
    default_group: bool = False
    # Step through zrs.GraphedStep (a fused SGD, clipped to max_norm when given) instead of
    # opt.step(); without it, max_norm clips with torch.nn.utils.clip_grad_norm_ first.
    graphed_step: bool = False
    max_norm: float | None = None
    # The model cast to it and zrs's master_dtype= (None: neither, the default fp32 masters).
    master_dtype: torch.dtype | None = None
    # The collectives on zrs's side streams (ZRS_COMM_STREAMS=1 while the model is sharded: each
    # model reads it once, when zrs.compile / zrs.shard builds its state; CUDA only).
    comm_streams: bool = False
    # False: no generate() after training (the model's `generate`, if any, is checked by
    # another case); the result's "generated" is then None.
    generate: bool = True
    # offload= (the masters and the optimizer step on the host).
    offload: str | None = None
    # Backwards a step: each of the same batch with the loss divided by it, so that the summed
    # gradient is the reference's (accumulation across micro-batches).
    accumulate: int = 1
    # Step through zrs.OverlappedStep (offload's updates during the backward, clipped to
    # max_norm when given) instead of opt.step().
    overlapped: bool = False
    # Hybrid sharding: mesh= a 2-D DeviceMesh "RxS" (R replicas of S shards, each shard group
    # contiguous ranks), "RxS-strided" (shard groups of every Rth rank: [0, 2] and [1, 3] at
    # 2x2); None: a process group.
    mesh: str | None = None

    @property
    def key(self) -> str:
        dtype = "" if self.param_dtype is None else f"-{str(self.param_dtype).split('.')[-1]}"
        sched = "" if self.scheduler is None else f"-{self.scheduler}"
        where = "" if self.device == "cpu" else f"-{self.device}"
        graphed = f"-graphed{self.max_norm or ''}" if self.graphed_step else ""
        if self.max_norm is not None and not self.graphed_step:
            graphed = f"-clip{self.max_norm}"
        master = "" if self.master_dtype is None else f"-m{str(self.master_dtype).split('.')[-1]}"
        streams = "-side-streams" if self.comm_streams else ""
        offload = f"-offload-{self.offload}" if self.offload else ""
        acc = f"-acc{self.accumulate}" if self.accumulate > 1 else ""
        acc += "-overlapped" if self.overlapped else ""
        mesh = f"-mesh{self.mesh}" if self.mesh else ""
        return (
            f"{self.backend}{sched}-{self.model}{dtype}{master}{where}{graphed}{streams}{offload}"
            f"{acc}{mesh}"
        )


def traced_runtime() -> list[str]:
    """zrs's runtime functions that dynamo compiled code for in this process (its cache entries
    on their code objects): none, when a user's torch.compile meets zrs's hooks and forward.
    The model's forward (zrs's guard around the module's own) is the compile's entry, traced
    as the model's code is; what it calls of the runtime is not."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from zrs.prepare import forward, units
    from zrs.runtime import fetch, state

    def codes(code: types.CodeType) -> Iterator[types.CodeType]:  # with the nested ones (hooks)
        yield code
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from codes(const)

    found = []
    for module in (fetch, state, forward, units):
        for owner in (module, *(v for v in vars(module).values() if isinstance(v, type))):
            for fn in vars(owner).values():
                code = getattr(fn, "__code__", None)
                if code is None or code.co_filename != module.__file__:
                    continue
                found += [
                    f"{module.__name__}.{c.co_qualname}"
                    for c in codes(code)
                    if _debug_get_cache_entry_list(c)
                    and c.co_qualname != "guarded.<locals>.forward"
                ]
    return found


def _train_zrs(rank: int, case: Case, group: object) -> dict:
    from torch._dynamo.utils import counters

    import zrs

    counters.clear()  # per case: the graph breaks below are this case's alone
    spec = spec_of(case.model)
    device = torch.device("cpu")
    if case.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        # fp32 means fp32: the reference runs on the CPU.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = spec.build().to(device=device, dtype=case.master_dtype)
    kwargs: dict = {"process_group": group, "backend": case.backend}
    if case.mesh is not None:
        kwargs = {"mesh": make_mesh(case.mesh, device.type), "backend": case.backend}
    if case.master_dtype is not None:
        kwargs["master_dtype"] = case.master_dtype
    if case.param_dtype is not None:
        kwargs["param_dtype"] = case.param_dtype
    if case.reduce_dtype is not None:
        kwargs["reduce_dtype"] = case.reduce_dtype
    if case.scheduler is not None:
        kwargs["scheduler"] = case.scheduler
    if case.offload is not None:
        kwargs["offload"] = case.offload
    with mock.patch.dict(os.environ, {"ZRS_COMM_STREAMS": "1"} if case.comm_streams else {}):
        api, _, unit_backend = case.backend.partition(":")
        if api in ("shard", "hand", "whole", "layers"):  # the eager path: zrs.shard
            del kwargs["backend"]
            if unit_backend:
                # Layers' forwards share code objects across the zoo's models: a fresh dynamo
                # cache per case keeps each case's compiles its own.
                torch._dynamo.reset()
                counters.clear()
            if api in ("shard", "layers") and unit_backend:
                kwargs["compile"] = unit_backend
            if api == "layers":
                kwargs["compile_root"] = False
            compiled = zrs.shard(model, **kwargs)
            if api == "hand":
                from zrs.prepare.sharding import repeated_blocks

                for layer in (m for m in model.modules() if id(m) in repeated_blocks(model)):
                    layer.compile(backend=unit_backend)
        else:
            compiled = zrs.compile(model, **kwargs)
    runner = torch.compile(model, backend=unit_backend) if api == "whole" else model
    local = [
        (
            tuple(p.shape),
            tuple(p.to_local().shape),
            str(p.placements),
            str(p.dtype),
            p.requires_grad,
        )
        for p in model.parameters()
    ]
    output_dtypes: list[torch.dtype] = []
    if case.param_dtype is not None or case.master_dtype is not None:
        # Evidence that the forward really ran in param_dtype (the output keeps its dtype).
        model.register_forward_hook(
            lambda m, args, out: output_dtypes.append(getattr(out, "logits", out).dtype)
        )
    opt = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=MOMENTUM, fused=True if case.graphed_step else None
    )
    optimizer_step = opt.step
    if case.graphed_step:
        optimizer_step = zrs.GraphedStep(opt, max_norm=case.max_norm)
    elif case.overlapped:
        optimizer_step = zrs.OverlappedStep(
            opt, max_norm=case.max_norm, accumulation_steps=case.accumulate
        )
    losses = []
    for step in range(case.steps):
        opt.zero_grad(set_to_none=True)
        batch = tree_map(
            lambda t: t.to(device) if isinstance(t, Tensor) else t, spec.batch(rank, step)
        )
        loss = spec.loss(runner, batch)
        (loss / case.accumulate).backward()
        for _ in range(case.accumulate - 1):
            (spec.loss(runner, batch) / case.accumulate).backward()
        if case.max_norm is not None and not (case.graphed_step or case.overlapped):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_norm)
        optimizer_step()
        losses.append(loss.item())
    graphs = counters["stats"]["unique_graphs"]
    state_dtypes = {
        str(v.dtype)
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, Tensor) and v.dim()  # not a step count
    }
    generated = spec.generate(model) if case.generate and spec.generate is not None else None
    state = zrs.full_state_dict(model)
    return {
        "traced_runtime": traced_runtime(),
        "generated": generated,
        "returned_same_object": compiled is model,
        "local_params": local,
        "losses": losses,
        "output_dtypes": sorted(set(output_dtypes), key=str),
        "graph_breaks": sorted(counters["graph_break"]),
        "graphs": graphs,
        # the layers compiled: by zrs.shard(compile=...) (an instance attribute) or by hand
        "compiled_units": sum(
            "forward" in vars(m) or m._compiled_call_impl is not None
            for m in list(model.modules())[1:]  # the root's is zrs's guarded forward
        ),
        "optimizer_state_dtypes": sorted(state_dtypes),
        # Where the optimizer's state and the gradients lived: the host, with offload.
        "offloaded": _offloaded_as_asked(model, case.offload),
        "optimizer_state_devices": sorted(
            {str(v.device) for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)}
        ),
        "state": {k: v.detach().cpu().clone() for k, v in state.items()},
    }


def _offloaded_as_asked(model: nn.Module, offload: str | None) -> bool:
    """Every parameter has its device copy; with offload="params" its compute-dtype copy is on
    the host and the device copy holds no storage between steps (a gather that left its
    staging behind would keep it)."""
    state = model._zrs_state
    if state.offload is None or any(h.compute is None for h in state.handles):
        return False
    if offload != "params":
        return True
    return all(
        h.host_compute is not None
        and h.host_compute.device.type == "cpu"
        and h.compute.untyped_storage().nbytes() == 0
        for h in state.handles
    )


def run_isolated(call: Callable[[], dict], label: str) -> dict:
    """One item of a worker's run, isolated from the next: ``call()``'s result with ``ok``,
    ``error`` (traceback or None), the ``warnings`` it raised, its wall-clock ``seconds`` and
    ``all_ranks_ok``. The ranks agree on the outcome before they go on, so that every rank starts
    the next item together. Rank 0 prints one line per item to stderr (seen with ``-s``): where
    a long group spends its time, or where it hangs."""
    import torch.distributed as dist

    from _dist import format_exc, record_warnings
    from zrs.runtime.exchange import all_gather_ints

    start = time.monotonic()
    with record_warnings() as caught:
        try:
            res = {"ok": True, "error": None, **call()}
        except Exception:
            res = {"ok": False, "error": format_exc()}
    res["warnings"] = caught
    res["seconds"] = time.monotonic() - start
    # Not with all_gather_object, which can deadlock under gloo: see zrs.runtime.exchange.
    res["all_ranks_ok"] = all(row[0] for row in all_gather_ints([int(res["ok"])], dist.group.WORLD))
    if dist.get_rank() == 0:
        outcome = "ok" if res["all_ranks_ok"] else "FAILED"
        print(
            f"zrs test item {label}: {outcome} in {res['seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return res


def make_mesh(spec: str, device_type: str) -> object:
    """The 2-D DeviceMesh ("dp_replicate", "dp_shard") of a Case's `mesh` spec, over every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    shape, _, layout = spec.partition("-")
    replicas, shards = (int(n) for n in shape.split("x"))
    ranks = torch.arange(replicas * shards)
    grid = ranks.view(shards, replicas).T if layout == "strided" else ranks.view(replicas, shards)
    return DeviceMesh(device_type, grid, mesh_dim_names=("dp_replicate", "dp_shard"))


def run_cases(rank: int, world_size: int, cases: list[Case]) -> dict[str, dict]:
    """Worker entry point: run every case in order; one case's failure does not stop the others.

    Returns ``{case.key: result}``; a result is ``run_isolated``'s, with, when ok, what
    ``_train_zrs`` returns.
    """
    import torch.distributed as dist

    from _dist import COLLECTIVE_TIMEOUT

    out: dict[str, dict] = {}
    for case in cases:
        group = None
        if not case.default_group and case.mesh is None:
            group = dist.new_group(
                list(range(world_size)),
                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT),
                backend=dist.get_backend(),
            )
        out[case.key] = run_isolated(functools.partial(_train_zrs, rank, case, group), case.key)
    return out


# --- checking results ---------------------------------------------------------------------------


def case_outcome(results: list[dict[str, dict]], key: str, *, brief: bool = False) -> list[dict]:
    """The per-rank results of one case. When the case raised on any rank, fails the test with
    every failing rank's traceback (identical ones shown once), or with ``brief``, only the
    error's last line (for tests that only read a side of the results)."""
    per_rank = [r[key] for r in results]
    if all(r["ok"] for r in per_rank):
        return per_rank
    by_error: dict[str, list[int]] = {}
    for rank, r in enumerate(per_rank):
        if not r["ok"]:
            by_error.setdefault(r["error"], []).append(rank)
    if brief:
        last = next(iter(by_error)).strip().splitlines()[-1]
        pytest.fail(
            f"{key} raised in the workers (traceback under test_matches_reference / "
            f"test_bf16_matches_autocast_reference): {last}",
            pytrace=False,
        )
    msg = [f"{key} raised in the workers:"]
    for error, ranks in by_error.items():
        msg.append(f"-- rank(s) {ranks}:\n{error}")
    pytest.fail("\n".join(msg), pytrace=False)


def describe_diff(actual: Tensor, expected: Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    rel = diff / expected.double().abs().clamp_min(1e-12)
    return (
        f"max|diff|={diff.max().item():.3g} (at flat index {int(diff.argmax())}), "
        f"max rel={rel.max().item():.3g}, |expected|max={expected.abs().max().item():.3g}"
    )


def compare_params(
    actual: dict[str, Tensor],
    expected: dict[str, Tensor],
    *,
    rtol: float,
    atol: float,
) -> list[str]:
    """One line per parameter of ``expected`` that is missing or not close in ``actual``."""
    problems = []
    for name, exp in expected.items():
        if name not in actual:
            problems.append(f"{name}: missing from full_state_dict")
            continue
        act = actual[name]
        if act.shape != exp.shape or act.dtype != exp.dtype:
            problems.append(
                f"{name}: got {tuple(act.shape)} {act.dtype}, expected {tuple(exp.shape)} {exp.dtype}"
            )
            continue
        if not torch.allclose(act, exp, rtol=rtol, atol=atol):
            problems.append(f"{name}: {describe_diff(act, exp)}")
    return problems


EXPLICIT_GRAPH_BREAK = "Call to `torch._dynamo.graph_break()`"


def unexpected_graph_breaks(spec: ZooModel, reasons: list[str]) -> list[str]:
    """The graph-break reasons recorded by dynamo that the model does not ask for."""
    return [
        r for r in reasons if not (spec.explicit_graph_break and r.startswith(EXPLICIT_GRAPH_BREAK))
    ]
