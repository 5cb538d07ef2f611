"""zrs.GraphedStep on GPUs: the captured step gives bit-identical parameters to the same step run
without the graph, fp32 and bf16, SGD-momentum and AdamW, clipped, through a non-finite step.

Marked `gpu` (tests/conftest.py): run with `ZRS_GPU_WORLD=1` on one GPU, NCCL process groups.
"""

from __future__ import annotations

import os

import pytest
import torch

from _dist import cached_run
from zoo import ZOO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
]

STEPS, POISONED = 7, 4  # warmup 2, capture at 3, replays after; step 4 overflows
CONFIGS = [
    (model, dtype, kind)
    for model in ("gpt_tied", "bias_stack")
    for dtype in ("fp32", "bf16")
    for kind in ("sgd", "adamw")
] + [("bias_stack", "bf16_reduce", "adamw")]  # reduced in bf16: each .grad a cast, kept in place


def _train(model_name: str, dtype: str, kind: str, graphs: bool, rank: int) -> dict:
    import zrs

    spec = ZOO[model_name]
    device = torch.device("cuda", torch.cuda.current_device())
    model = spec.build().to(device)
    param_dtype = torch.bfloat16 if dtype.startswith("bf16") else None
    reduce_dtype = torch.bfloat16 if dtype == "bf16_reduce" else None
    zrs.compile(model, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    else:
        lr = torch.tensor(0.01, device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)
    sched = (
        torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if kind == "adamw" else None
    )
    step = zrs.GraphedStep(opt, max_norm=0.05, cuda_graphs=graphs)
    norms = []
    for i in range(STEPS):
        opt.zero_grad()
        batch = [t.to(device) if isinstance(t, torch.Tensor) else t for t in spec.batch(rank, i)]
        spec.loss(model, batch).backward()
        if i == POISONED:
            p = next(model.parameters())
            p.grad.to_local().view(-1)[0] = float("nan")
        norms.append(step().clone())
        if sched is not None:
            sched.step()
    state = {k: v.detach().cpu().clone() for k, v in zrs.full_state_dict(model).items()}
    return {
        "state": state,
        "norms": torch.stack(norms).cpu(),
        "skipped": step.skipped_steps,
        "captured": step.graph is not None,
        "recaptures": step.recaptures,
    }


def run_all(rank: int, world: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    # Bit for bit needs the forward and backward to be, too: the embedding's backward otherwise
    # sums with atomics, in an order that changes from run to run (seen: gpt_tied, fp32 AdamW).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    out = {}
    for model, dtype, kind in CONFIGS:
        for graphs in (False, True):
            out[(model, dtype, kind, graphs)] = _train(model, dtype, kind, graphs, rank)
    return out


def _results() -> list[dict]:
    world = int(os.environ.get("ZRS_GPU_WORLD") or torch.cuda.device_count())
    return cached_run(("graphed_gpu",), run_all, world, backend="nccl")


@pytest.mark.parametrize(("model", "dtype", "kind"), CONFIGS)
def test_graphed_step_is_bit_identical(model: str, dtype: str, kind: str) -> None:
    for rank, res in enumerate(_results()):
        eager, graphed = res[(model, dtype, kind, False)], res[(model, dtype, kind, True)]
        assert graphed["captured"] and graphed["recaptures"] == 0, graphed
        assert not eager["captured"]
        assert eager["skipped"] == graphed["skipped"] == 1
        same_norms = torch.allclose(
            eager["norms"], graphed["norms"], rtol=0, atol=0, equal_nan=True
        )
        assert same_norms, (eager["norms"], graphed["norms"])
        for name, value in eager["state"].items():
            assert torch.equal(value, graphed["state"][name]), (rank, name)
