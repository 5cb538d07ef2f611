"""Mixed precision: param_dtype=bfloat16 (fp32 reduce, fp32 master shards) against an unsharded
reference that runs its forward under torch.autocast("cpu", dtype=torch.bfloat16) and averages the
per-rank gradients; and master_dtype=bfloat16 (a bf16 model trained wholly in bf16, no fp32 copy)
against the same model trained unsharded in bf16. Same group-of-workers layout as
test_correctness.py."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from _dist import cached_run, reemit_warnings
from zoo import (
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

# Tolerance. bf16 keeps 8 significant bits (eps = 2**-8 ~ 3.9e-3, about 2-3 decimal digits), so
# every gradient carries ~0.4% relative rounding error that compounds through the layers. The two
# sides are also not the same bf16 computation: zrs runs the whole forward in bf16 (layer norm,
# softmax, the loss inputs), autocast keeps those ops in fp32. Emulating zrs's bf16 semantics in
# one process against this reference gave, after 3 steps, at most 7e-4 absolute difference on any
# GPT parameter and 1.4% of the norm of a parameter's update (the MLP: exact). The bounds below
# leave about 3x margin, and stay far below what a real bug does: a wrong scale (e.g. no
# pre-divide) or a mixed-up shard is off by >= 50% of the update. The master weights are fp32 in
# both, so only the updates (up to ~6e-2) carry bf16 noise; the norm bound is the sharp one for
# parameters with small updates (layer norms), the elementwise one catches a few bad elements.
# bf16 vs fp32 training differs by only ~1% of the update, so these bounds cannot tell whether the
# forward really ran in bf16: the test checks the model's output dtype for that.
ATOL, RTOL = 2e-3, 0.0
UPDATE_RTOL = 0.05  # ||(p_zrs - p0) - (p_ref - p0)|| <= UPDATE_RTOL * ||p_ref - p0||, per tensor
LOSS_RTOL = 1e-2  # a mean of bf16 terms: ~2**-8 relative error, with 2.5x margin

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


def _bf16_output_and_losses(rank: int, r: dict, ref: Reference) -> list[str]:
    """One rank's problems: its model's output not bf16, a loss not close to the reference's."""
    problems = []
    if r["output_dtypes"] != [torch.bfloat16]:
        problems.append(f"rank {rank}: model output dtypes {r['output_dtypes']}, not bf16")
    for step, (got, exp) in enumerate(zip(r["losses"], ref.losses, strict=True)):
        if not math.isclose(got, exp[rank], rel_tol=LOSS_RTOL):
            problems.append(f"loss of rank {rank} at step {step}: {got!r} != {exp[rank]!r}")
    return problems


@pytest.mark.parametrize(("backend", "world", "model"), PARAMS)
def test_bf16_matches_autocast_reference(backend: str, world: int, model: str) -> None:
    per_rank = case_outcome(_group(backend, world), _case(backend, model).key)
    ref = _reference(model, world)
    state = per_rank[0]["state"]
    problems = []

    for rank, r in enumerate(per_rank):
        for reason in unexpected_graph_breaks(ZOO[model], r["graph_breaks"]):
            problems.append(f"rank {rank}: graph break (zrs compiled path not used): {reason}")
        problems += _bf16_output_and_losses(rank, r, ref)

    # fp32 master weights: compare_params also checks that full_state_dict gives fp32 tensors.
    problems += compare_params(state, ref.final, rtol=RTOL, atol=ATOL)
    for name, final in ref.final.items():
        if name not in state or state[name].shape != final.shape:
            continue  # reported above
        want = final - ref.init[name]
        err = (state[name] - final).norm() / want.norm()
        if not err <= UPDATE_RTOL:
            problems.append(f"{name}: update off by {err:.3g} of its norm (> {UPDATE_RTOL})")

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


# master_dtype=bf16 against the bf16 model trained unsharded. Both keep bf16 weights, so an update
# smaller than half a bf16 step of its weight rounds away on both sides, and a gradient that
# differs in its last bit moves a weight by one bf16 step (2**-8 relative) more or less: zrs sums
# the ranks' pre-divided bf16 gradients where the reference rounds their fp32 mean once, and the
# workers' CPU matmuls (one thread) round otherwise than the reference's. zrs.shard in one
# process gives the reference's numbers exactly. Measured in the workers: weights at most one
# bf16 step apart; each matrix's update off by at most 4.3% of its norm, the whole model's by
# 2.4% (inductor, world 2). The bounds leave about 3x margin; a wrong gradient scale (the ranks'
# sum for their mean) is off by the whole update.
MASTER_RTOL, MASTER_ATOL = 2**-6, 1e-3
MASTER_UPDATE_RTOL = 0.15  # each matrix's; the whole model's: half of it


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
    state = per_rank[0]["state"]
    problems = []
    for rank, r in enumerate(per_rank):
        dtypes = {dtype for *_, dtype, _ in r["local_params"]}
        if dtypes != {"torch.bfloat16"}:
            problems.append(f"rank {rank}: shards in {sorted(dtypes)}, not bf16")
        if r["optimizer_state_dtypes"] != ["torch.bfloat16"]:
            problems.append(f"rank {rank}: optimizer state in {r['optimizer_state_dtypes']}")
        problems += _bf16_output_and_losses(rank, r, ref)
    problems += compare_params(state, ref.final, rtol=MASTER_RTOL, atol=MASTER_ATOL)
    # The updates, of the matrices one by one (their updates span many bf16 steps) and of the
    # whole model (a layer norm's update may be one step or none).
    off = want = 0.0
    for name, final in ref.final.items():
        if name not in state or state[name].shape != final.shape:
            continue  # reported above
        update = (final - ref.init[name]).float()
        err = (state[name].float() - final.float()).norm()
        off, want = off + err**2, want + update.norm() ** 2
        if final.dim() >= 2 and not err <= MASTER_UPDATE_RTOL * update.norm():
            problems.append(f"{name}: update off by {err / update.norm():.3g} of its norm")
    if not off <= (MASTER_UPDATE_RTOL / 2) ** 2 * want:
        problems.append(f"the model's update off by {(off / want) ** 0.5:.3g} of its norm")
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
