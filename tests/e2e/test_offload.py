"""Offload against the unsharded reference: the masters and the SGD momentum step on the host
(zrs-core's update, runtime/offload.py), the zoo at world 1, 2 and 3 in fp32 (the same bounds as
test_correctness.py) on zrs.shard and on zrs.compile (its graphs gather from the device copies),
and two models in bf16 compute at world 2 (the bounds of test_mixed_precision.py);
zrs.OverlappedStep's updates during the backward; `offload="params"` (the compute-dtype copies on
the host, staged in for each gather) on both APIs at every world."""

from __future__ import annotations

import functools

import pytest
import torch

from _dist import cached_run, reemit_warnings
from checks import bf16_problems, compiled_problems, fp32_problems, varlen_graph_problems
from zoo import ZOO, Case, Reference, case_outcome, run_cases, spec_of, train_reference

WORLD_SIZES = (1, 2, 3)
MODELS = tuple(ZOO)
# zrs.shard at every world; zrs.compile on inductor at world 2 (the GPUs' backend), on the
# cheaper eager backend at 1 and 3
BACKENDS = {1: ("shard", "eager"), 2: ("shard", "inductor"), 3: ("shard", "eager")}
BF16_MODELS = ("mlp", "gpt_tied")
RTOL, ATOL = 1e-5, 1e-6
HF_RTOL, HF_ATOL = 1e-4, 1e-5  # test_hf_models.py's: deeper models, more reordered additions
# zrs.OverlappedStep (the updates during the backward): (world, backend, model, max_norm,
# accumulation_steps); GPT-2 on variable lengths: a Hugging Face model with biases, its ranks'
# batches of different lengths
OVERLAPPED = [
    (2, "shard", "gpt_tied", None, 1),
    (2, "shard", "hf_gpt2_varlen", 0.05, 1),
    (2, "inductor", "hf_gpt2_varlen", 0.05, 1),
    (2, "shard", "gpt_tied", 0.05, 1),
    (2, "inductor", "gpt_tied", None, 3),
    (3, "shard", "bias_stack", None, 1),
    (3, "eager", "graph_break", None, 1),
    (3, "shard", "frozen", 0.05, 1),
    (3, "eager", "used_twice", 0.05, 1),
    (3, "shard", "chunked", 0.05, 2),
]

# offload="params": (world, backend, model, bf16); each gather stages its shards in and frees
# them once read, forward and backward, fused groups and single parameters
PARAMS = [
    (1, "shard", "gpt_tied", False),
    (1, "eager", "conv_bn", False),
    (2, "shard", "bias_stack", False),
    (2, "inductor", "gpt_tied", False),
    (2, "inductor", "mlp", True),
    (2, "shard", "gpt_tied", True),
    (2, "inductor", "hf_gpt2_varlen", False),  # Hugging Face, biases, ranks' lengths differ
    (3, "eager", "used_twice", False),
    (3, "shard", "frozen", False),
]

pytestmark = pytest.mark.slow


def _case(
    model: str, backend: str, bf16: bool = False, offload: str = "optimizer", **kw: object
) -> Case:
    dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}
    return Case(model, backend, offload=offload, default_group=False, **dtypes, **kw)


def _overlapped(model: str, backend: str, max_norm: float | None, accumulate: int) -> Case:
    return _case(model, backend, overlapped=True, max_norm=max_norm, accumulate=accumulate)


def _group(world: int) -> list[dict[str, dict]]:
    cases = [_case(m, b) for b in BACKENDS[world] for m in MODELS]
    if world == 2:
        cases += [_case(m, b, bf16=True) for b in BACKENDS[world] for m in BF16_MODELS]
    cases += [_overlapped(m, b, norm, acc) for w, b, m, norm, acc in OVERLAPPED if w == world]
    cases += [_case(m, b, bf16, offload="params") for w, b, m, bf16 in PARAMS if w == world]
    return cached_run(("offload", world), run_cases, world, cases)


@functools.cache
def _reference(
    model: str, world: int, bf16: bool = False, max_norm: float | None = None
) -> Reference:
    return train_reference(
        spec_of(model), world, autocast_dtype=torch.bfloat16 if bf16 else None, max_norm=max_norm
    )


def _fail(what: str, problems: list[str]) -> None:
    if problems:
        pytest.fail(f"{what}:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.mark.parametrize(
    ("world", "backend", "model"),
    [(w, b, m) for w in WORLD_SIZES for b in BACKENDS[w] for m in MODELS],
    ids=lambda v: str(v),
)
def test_offloaded_training_matches_reference(world: int, backend: str, model: str) -> None:
    per_rank = case_outcome(_group(world), _case(model, backend).key, brief=False)
    ref = _reference(model, world)
    problems = fp32_problems(
        per_rank, ZOO[model], ref, rtol=RTOL, atol=ATOL, loss_rtol=RTOL, loss_atol=ATOL
    )
    problems += compiled_problems(per_rank, ZOO[model], backend)
    for rank, r in enumerate(per_rank):
        if not r["offloaded"]:
            problems.append(f"rank {rank}: some parameter has no device copy (not offloaded)")
        if r["optimizer_state_devices"] not in ([], ["cpu"]):
            problems.append(f"rank {rank}: optimizer state on {r['optimizer_state_devices']}")
    _fail(
        f"{model} offloaded on {backend} (world {world}) differs from the unsharded reference",
        problems,
    )
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {model} offloaded on {backend}")


@pytest.mark.parametrize("backend", BACKENDS[2])
@pytest.mark.parametrize("model", BF16_MODELS)
def test_offloaded_bf16_matches_autocast_reference(model: str, backend: str) -> None:
    per_rank = case_outcome(_group(2), _case(model, backend, bf16=True).key)
    _fail(
        f"{model} offloaded on {backend} with bf16 compute (world 2) differs from the autocast "
        "reference",
        bf16_problems(per_rank, _reference(model, 2, bf16=True)),
    )


@pytest.mark.parametrize(
    ("world", "backend", "model", "max_norm", "accumulate"), OVERLAPPED, ids=str
)
def test_updates_during_the_backward_match_reference(
    world: int, backend: str, model: str, max_norm: float | None, accumulate: int
) -> None:
    """zrs.OverlappedStep: each parameter's update runs as its gradient reaches the host (with
    max_norm, after the backward's global norm and clip; accumulating micro-batches, in the
    last one's backward)."""
    case = _overlapped(model, backend, max_norm, accumulate)
    per_rank = case_outcome(_group(world), case.key, brief=False)
    ref = _reference(model, world, max_norm=max_norm)
    rtol, atol = (HF_RTOL, HF_ATOL) if model.startswith("hf_") else (RTOL, ATOL)
    _fail(
        f"{case.key} (world {world}) differs from the unsharded reference",
        fp32_problems(
            per_rank, spec_of(model), ref, rtol=rtol, atol=atol, loss_rtol=RTOL, loss_atol=ATOL
        ),
    )


@pytest.mark.parametrize(("world", "backend", "model", "bf16"), PARAMS, ids=str)
def test_params_offloaded_match_reference(world: int, backend: str, model: str, bf16: bool) -> None:
    """offload="params": the gathers read device copies staged in from the host's."""
    case = _case(model, backend, bf16, offload="params")
    per_rank = case_outcome(_group(world), case.key, brief=False)
    ref = _reference(model, world, bf16=bf16)
    if bf16:
        problems = bf16_problems(per_rank, ref)
    else:
        rtol, atol = (HF_RTOL, HF_ATOL) if model.startswith("hf_") else (RTOL, ATOL)
        spec = spec_of(model)
        problems = fp32_problems(
            per_rank, spec, ref, rtol=rtol, atol=atol, loss_rtol=RTOL, loss_atol=ATOL
        )
        if model.endswith("_varlen"):  # a few graphs over the lengths, not one
            problems += varlen_graph_problems(per_rank, backend)
        else:
            problems += compiled_problems(per_rank, spec, backend)
    for rank, r in enumerate(per_rank):
        if not r["offloaded"]:
            problems.append(
                f"rank {rank}: a compute copy is not on the host, or a device copy kept storage"
            )
    _fail(f"{case.key} (world {world}) differs from the unsharded reference", problems)
