"""zrs-sharded training matches unsharded training (DESIGN.md, "Testing").

For each world size and backend, one group of gloo workers trains every zoo model in turn with
``zrs.compile`` and SGD with momentum, each rank on its own batches, and gathers the parameters
with ``zrs.full_state_dict``. Running the whole zoo in one group pays for process start-up once
per (world size, backend); the tests below then read that group's results per model, so every
model still passes or fails on its own. The reference trains the unsharded model in this process,
averaging the gradients of the ranks' batches at each step.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from _dist import cached_run, reemit_warnings
from checks import compiled_problems, fp32_problems
from zoo import (
    ZOO,
    Case,
    Reference,
    case_outcome,
    run_cases,
    train_reference,
)

WORLD_SIZES = (1, 2, 3)
# A backend, optionally with a scheduler after "-" (default: zrs.compile's, the search). The
# greedy scheduler runs the zoo too, on the cheaper eager backend. "shard": zrs.shard, the eager
# path (nothing compiled; tests/e2e/test_shard_compile.py compiles its layers).
BACKENDS = ("eager", "inductor", "eager-greedy", "shard")
MODELS = tuple(ZOO)

# fp32 end to end: sharding, gathering and the pre-divided reduce-scatter only change the order
# of a few additions (and inductor may fuse differently), so after three steps the parameters
# agree to a few ulp of their magnitude; these bounds are ~50x that.
RTOL, ATOL = 1e-5, 1e-6
# The recorded losses additionally go through .item() and a sum of a handful of terms.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6

PARAMS = [
    pytest.param(backend, world, model, id=f"{backend}-w{world}-{model}")
    for backend in BACKENDS
    for world in WORLD_SIZES
    for model in MODELS
]


def _case(model: str, variant: str, **kw) -> Case:
    backend, _, scheduler = variant.partition("-")
    return Case(model, backend, scheduler=scheduler or None, **kw)


def _cases(backend: str) -> list[Case]:
    # The first case uses the default process group (process_group=None), the others a fresh
    # group each (see Case.default_group).
    return [_case(model, backend, default_group=i == 0) for i, model in enumerate(MODELS)]


def _group(backend: str, world: int) -> list[dict[str, dict]]:
    return cached_run(("correctness", backend, world), run_cases, world, _cases(backend))


@functools.cache
def _reference(model: str, world: int) -> Reference:
    return train_reference(ZOO[model], world)


def _run(
    backend: str, world: int, model: str, *, brief: bool = True
) -> tuple[list[dict], Reference]:
    per_rank = case_outcome(_group(backend, world), _case(model, backend).key, brief=brief)
    return per_rank, _reference(model, world)


@pytest.mark.parametrize(("backend", "world", "model"), PARAMS)
def test_matches_reference(backend: str, world: int, model: str) -> None:
    per_rank, ref = _run(backend, world, model, brief=False)
    problems = fp32_problems(
        per_rank, ZOO[model], ref, rtol=RTOL, atol=ATOL, loss_rtol=LOSS_RTOL, loss_atol=LOSS_ATOL
    )
    if problems:
        pytest.fail(
            f"{model} (world {world}, backend {backend}) differs from the unsharded reference "
            f"after {len(ref.losses)} SGD-momentum steps (rtol={RTOL}, atol={ATOL}):\n  "
            + "\n  ".join(problems),
            pytrace=False,
        )
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {model}")


@pytest.mark.parametrize(("backend", "world", "model"), PARAMS)
def test_full_state_dict_contract(backend: str, world: int, model: str) -> None:
    """compile returns the same object; full_state_dict is keyed like model.state_dict() and
    gives the same parameters on every rank."""
    per_rank, ref = _run(backend, world, model)
    assert all(r["returned_same_object"] for r in per_rank), "zrs.compile returned a new object"
    keys = list(per_rank[0]["state"])
    assert sorted(keys) == sorted(ref.state_dict_keys), (
        f"missing {sorted(set(ref.state_dict_keys) - set(keys))}, "
        f"unexpected {sorted(set(keys) - set(ref.state_dict_keys))}"
    )
    for rank, r in enumerate(per_rank[1:], start=1):
        differ = [
            name
            for name in ref.final
            if not torch.equal(r["state"][name], per_rank[0]["state"][name])
        ]
        assert not differ, f"rank {rank}'s full_state_dict differs from rank 0's in {differ}"


@pytest.mark.parametrize(("backend", "world", "model"), PARAMS)
def test_parameters_are_sharded(backend: str, world: int, model: str) -> None:
    """model.parameters() yields fp32 DTensors over the original shapes, one per distinct
    parameter (tied ones count once), keeping requires_grad: each rank holds the rows that
    torch.chunk gives it (Shard(0), FSDP2's convention); a 0-d parameter is replicated."""
    per_rank, ref = _run(backend, world, model)

    def local_shape(shape: tuple, rank: int) -> tuple:
        if not shape:
            return ()
        rows = math.ceil(shape[0] / world)
        return (max(0, min(rows, shape[0] - rank * rows)), *shape[1:])

    for rank, r in enumerate(per_rank):
        expected = sorted(
            (
                shape,
                local_shape(shape, rank),
                "(Shard(dim=0),)" if shape else "(Replicate(),)",
                "torch.float32",
                rg,
            )
            for shape, rg in ref.params
        )
        got = sorted(r["local_params"])
        assert got == expected, (
            f"rank {rank}: parameters (shape, local shape, placements, dtype, requires_grad) "
            f"{got}, expected {expected}"
        )


@pytest.mark.parametrize(("backend", "world", "model"), PARAMS)
def test_compiled_by_zrs(backend: str, world: int, model: str) -> None:
    """The zrs backend compiled the whole forward (checks.compiled_problems)."""
    per_rank, _ = _run(backend, world, model)
    problems = compiled_problems(per_rank, ZOO[model], backend)
    assert not problems, "\n---\n".join(problems)


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("model", MODELS)
def test_reference_moves_every_trainable_parameter(model: str, world: int) -> None:
    """Guards the test itself: every trainable parameter changes by more than the tolerance,
    frozen ones not at all, and training is deterministic."""
    spec = ZOO[model]
    ref = _reference(model, world)
    for name, final in ref.final.items():
        init = ref.init[name]
        if name in spec.frozen:
            assert torch.equal(final, init), name
        else:
            assert (final - init).abs().max() > 100 * (ATOL + RTOL * init.abs().max()), name
    again = train_reference(spec, world)
    for name in ref.final:
        assert torch.equal(again.final[name], ref.final[name]), f"{name} is not deterministic"
