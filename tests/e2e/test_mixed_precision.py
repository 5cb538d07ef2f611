"""Mixed precision: param_dtype=bfloat16 (fp32 reduce, fp32 master shards) against an unsharded
reference that runs its forward under torch.autocast("cpu", dtype=torch.bfloat16) and averages the
per-rank gradients; and master_dtype=bfloat16 (a bf16 model trained wholly in bf16, no fp32 copy)
against the same model trained unsharded in bf16; and a model with an fp16 layer among fp32 ones,
each parameter gathered in its own dtype. Same group-of-workers layout as test_correctness.py."""

from __future__ import annotations

import functools

import pytest
import torch

from _dist import cached_run, reemit_warnings
from checks import (
    BF16_ATOL,
    BF16_UPDATE_RTOL,
    MASTER_ATOL,
    bf16_problems,
    loss_problems,
    master_problems,
    update_problems,
)
from zoo import (
    MIXED_DTYPES,
    ZOO,
    Case,
    Reference,
    case_outcome,
    compare_params,
    run_cases,
    train_reference,
    unexpected_graph_breaks,
)

WORLD_SIZES = (1, 2)
BACKENDS = ("eager", "inductor")
MODELS = ("mlp", "gpt_tied")

# The bounds, reasoned in tests/support/checks.py (bf16 compute over fp32 masters).
ATOL, UPDATE_RTOL = BF16_ATOL, BF16_UPDATE_RTOL

PARAMS = [
    pytest.param(backend, world, model, id=f"{backend}-w{world}-{model}-bf16")
    for backend in BACKENDS
    for world in WORLD_SIZES
    for model in MODELS
]


def _case(backend: str, model: str) -> Case:
    return Case(model, backend, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# master_dtype=bf16 runs in the same workers: zrs.compile's eager backend and zrs.shard beside the
# eager group's cases, inductor beside the inductor group's.
MASTER_MODEL = "gpt_tied"
MASTER_APIS = {"eager": ("eager", "shard"), "inductor": ("inductor",)}


def _master_case(api: str) -> Case:
    return Case(MASTER_MODEL, api, master_dtype=torch.bfloat16)


def _group(backend: str, world: int) -> list[dict[str, dict]]:
    cases = [_case(backend, m) for m in MODELS] + [_master_case(a) for a in MASTER_APIS[backend]]
    cases += [Case(MIXED_DTYPES.name, a) for a in MASTER_APIS[backend]]
    return cached_run(("mixed_precision", backend, world), run_cases, world, cases)


@functools.cache
def _reference(model: str, world: int) -> Reference:
    return train_reference(ZOO[model], world, autocast_dtype=torch.bfloat16)


@pytest.mark.parametrize(("backend", "world", "model"), PARAMS)
def test_bf16_matches_autocast_reference(backend: str, world: int, model: str) -> None:
    per_rank = case_outcome(_group(backend, world), _case(backend, model).key)
    ref = _reference(model, world)
    problems = []
    for rank, r in enumerate(per_rank):
        for reason in unexpected_graph_breaks(ZOO[model], r["graph_breaks"]):
            problems.append(f"rank {rank}: graph break (zrs compiled path not used): {reason}")
    problems += bf16_problems(per_rank, ref)

    if problems:
        pytest.fail(
            f"{model} (world {world}, backend {backend}, param_dtype=bf16) differs from the "
            f"bf16-autocast reference after {len(ref.losses)} SGD-momentum steps:\n  "
            + "\n  ".join(problems),
            pytrace=False,
        )
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {model} bf16")


@pytest.mark.parametrize("model", MODELS)
def test_tolerance_is_meaningful(model: str) -> None:
    """Guards the test itself: the bf16 reference moves the parameters by much more than the
    elementwise tolerance, and bf16 rounding alone (bf16 vs fp32 reference) stays well inside
    the update tolerance."""
    bf16 = _reference(model, 2)
    fp32 = train_reference(ZOO[model], 2)
    largest = max((f - bf16.init[n]).abs().max() for n, f in bf16.final.items())
    assert largest > 10 * ATOL
    for name, final in bf16.final.items():
        update = (final - bf16.init[name]).norm()
        assert update > 0, name
        assert (final - fp32.final[name]).norm() / update < UPDATE_RTOL / 2, name


# Every API (each backend and zrs.shard) at every world size, for the master and fp16 tests.
API_WORLDS = [
    pytest.param(api, world, id=f"{api}-w{world}")
    for backend in BACKENDS
    for world in WORLD_SIZES
    for api in MASTER_APIS[backend]
]


# master_dtype=bf16 against the bf16 model trained unsharded: the bounds are reasoned in
# tests/support/checks.py.
@functools.cache
def _bf16_reference(world: int) -> Reference:
    return train_reference(ZOO[MASTER_MODEL], world, model_dtype=torch.bfloat16)


@pytest.mark.parametrize(("api", "world"), API_WORLDS)
def test_bf16_masters_match_bf16_reference(api: str, world: int) -> None:
    backend = "eager" if api == "shard" else api
    per_rank = case_outcome(_group(backend, world), _master_case(api).key)
    ref = _bf16_reference(world)
    problems = master_problems(per_rank, ref)
    if problems:
        pytest.fail(
            f"{MASTER_MODEL} ({api}, world {world}, master_dtype=bf16) differs from the bf16 "
            f"reference after {len(ref.losses)} SGD-momentum steps:\n  " + "\n  ".join(problems),
            pytrace=False,
        )


def test_bf16_master_tolerance_is_meaningful() -> None:
    """Guards the bounds above: in the bf16 reference most elements of every matrix move, by far
    more than the elementwise tolerance."""
    ref = _bf16_reference(2)
    for name, final in ref.final.items():
        if final.dim() < 2:
            continue
        update = (final - ref.init[name]).float()
        assert (update != 0).float().mean() > 0.4, name
        assert update.abs().max() > 10 * MASTER_ATOL, name


# An fp16 layer among fp32 ones (param_dtype unset) against the same model trained unsharded: zrs
# gathers each parameter in its own dtype over fp32 masters, while the reference keeps the fp16
# layer's weights and momentum in fp16, so its weights may round one fp16 step apart (2**-12 at
# their magnitude, 2.4e-4), and the fp32 layers see that through its output. Measured in the
# workers (both backends, zrs.shard, worlds 1 and 2): at most one fp16 step elementwise; the fp16
# layer's updates off by at most 1.7% of their norm, the fp32 layers' by 0.05%. The bounds leave
# 3-4x margin; compare_params checks each tensor's dtype, so an fp16 layer returned in fp32 fails.
FP16_ATOL, FP16_UPDATE_RTOL, FP16_LOSS_RTOL = 1e-3, 0.05, 5e-3


@functools.cache
def _mixed_reference(world: int) -> Reference:
    return train_reference(MIXED_DTYPES, world)


@pytest.mark.parametrize(("api", "world"), API_WORLDS)
def test_an_fp16_layer_among_fp32_ones_keeps_its_dtype(api: str, world: int) -> None:
    backend = "eager" if api == "shard" else api
    per_rank = case_outcome(_group(backend, world), Case(MIXED_DTYPES.name, api).key)
    ref = _mixed_reference(world)
    state = per_rank[0]["state"]
    problems = loss_problems(per_rank, ref, rtol=FP16_LOSS_RTOL)
    problems += compare_params(state, ref.final, rtol=0.0, atol=FP16_ATOL)
    problems += update_problems(state, ref, rtol=FP16_UPDATE_RTOL)
    if problems:
        pytest.fail(
            f"{MIXED_DTYPES.name} ({api}, world {world}) differs from the model trained "
            f"unsharded after {len(ref.losses)} SGD-momentum steps:\n  " + "\n  ".join(problems),
            pytrace=False,
        )


def test_fp16_tolerance_is_meaningful() -> None:
    """Guards the bounds above: the fp16 layer's parameters, which the elementwise bound is for,
    move by far more than it; every parameter moves (the update bound is relative)."""
    ref = _mixed_reference(2)
    for name, final in ref.final.items():
        moved = (final.float() - ref.init[name].float()).abs().max()
        assert moved > (10 * FP16_ATOL if final.dtype == torch.float16 else 0), name
