"""Mixed precision: param_dtype=bfloat16 (fp32 reduce, fp32 master shards) against an unsharded
reference that runs its forward under torch.autocast("cpu", dtype=torch.bfloat16) and averages the
per-rank gradients; and master_dtype=bfloat16 (a bf16 model trained wholly in bf16, no fp32 copy)
against the same model trained unsharded in bf16. Same group-of-workers layout as
test_correctness.py."""

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
    master_problems,
)
from zoo import (
    ZOO,
    Case,
    Reference,
    case_outcome,
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


# master_dtype=bf16 against the bf16 model trained unsharded: the bounds are reasoned in
# tests/support/checks.py.
@functools.cache
def _bf16_reference(world: int) -> Reference:
    return train_reference(ZOO[MASTER_MODEL], world, model_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("api", "world"),
    [
        pytest.param(api, world, id=f"{api}-w{world}")
        for backend in BACKENDS
        for world in WORLD_SIZES
        for api in MASTER_APIS[backend]
    ],
)
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
