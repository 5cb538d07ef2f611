"""Hugging Face transformers train under zrs as they do unsharded (tests/support/hf_zoo.py).

As in test_correctness.py, one group of gloo workers per (world size, backend, dtype) trains
every model in turn, and each test reads its model's result. fp32 runs at world sizes 1, 2 and 3
and must match the unsharded SGD-momentum reference closely, generate() included; bf16
(param_dtype) runs at world size 2 on the eager backend against a bf16-autocast reference. The `_varlen` models draw a new length per rank and step: they must
train without a recompile per shape.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from test_mixed_precision import LOSS_RTOL as BF16_LOSS_RTOL

from _dist import cached_run, reemit_warnings
from hf_zoo import HF_ZOO
from zoo import Case, Reference, case_outcome, compare_params, run_cases, train_reference

pytestmark = pytest.mark.slow

MODELS = tuple(HF_ZOO)
BF16_MODELS = tuple(m for m in MODELS if not m.endswith("_varlen"))
# fp32 sharded training reorders a few additions; the models are deeper than the own zoo's.
RTOL, ATOL = 1e-4, 1e-5
LOSS_RTOL = 1e-5
# Graphs a variable-length run may compile (forward and backward count once; generate() and
# transformers' own graph breaks add a few): a recompile per length would be ~3 steps' worth more.
MAX_GRAPHS = 4
# bf16 against the bf16-autocast reference: zrs runs every op in bf16, autocast keeps norms,
# softmax and the loss in fp32, so the two differ by bf16 noise that grows with depth (T5's
# encoder and decoder without scaling: 10% of an update, 4e-3 absolute, after 3 steps). The
# bounds stay well below a real bug (a wrong gradient scale is >= 50% of every update). An
# attention key bias has no true gradient (softmax ignores a shift along the keys): its fp32
# update is ~1e-8 and its bf16 one pure noise, so parameters that fp32 training leaves in place
# are held to the absolute bound only.
BF16_ATOL, UPDATE_RTOL, STILL = 6e-3, 0.15, 1e-5

FP32 = [
    pytest.param(backend, world, model, id=f"{backend}-w{world}-{model}")
    for backend in ("eager", "inductor", "shard")
    for world in (1, 2, 3)
    for model in MODELS
]
# bf16 on the eager backend only: inductor's bf16 path is the own zoo's (test_mixed_precision),
# and an inductor group of these models costs ~7 minutes of CI.
BF16 = [
    pytest.param(backend, 2, model, id=f"{backend}-w2-{model}-bf16")
    for backend in ("eager", "shard")
    for model in BF16_MODELS
]


def _case(model: str, backend: str, bf16: bool) -> Case:
    dtype = torch.bfloat16 if bf16 else None
    return Case(model, backend, param_dtype=dtype, default_group=False)


def _group(backend: str, world: int, bf16: bool) -> list[dict[str, dict]]:
    models = BF16_MODELS if bf16 else MODELS
    cases = [_case(m, backend, bf16) for m in models]
    return cached_run(("hf", backend, world, bf16), run_cases, world, cases)


@functools.cache
def _reference(model: str, world: int, bf16: bool) -> Reference:
    return train_reference(HF_ZOO[model], world, autocast_dtype=torch.bfloat16 if bf16 else None)


def _fail(model: str, world: int, backend: str, what: str, problems: list[str]) -> None:
    if problems:
        pytest.fail(
            f"{model} (world {world}, backend {backend}{what}) differs from the unsharded "
            "reference:\n  " + "\n  ".join(problems),
            pytrace=False,
        )


def _common_checks(
    per_rank: list[dict], model: str, ref: Reference, loss_rtol: float, loss_atol: float
) -> list[str]:
    """The losses against the reference's, and what must hold whatever the dtype."""
    problems = []
    for rank, r in enumerate(per_rank):
        for step, (got, exp) in enumerate(zip(r["losses"], ref.losses, strict=True)):
            if not math.isclose(got, exp[rank], rel_tol=loss_rtol, abs_tol=loss_atol):
                problems.append(f"loss of rank {rank} at step {step}: {got!r} != {exp[rank]!r}")
    generated = [r["generated"] for r in per_rank]
    if any(g is not None and not torch.equal(g, generated[0]) for g in generated):
        problems.append(f"ranks generated different tokens: {generated}")
    if model.endswith("_varlen"):
        graphs = [r["graphs"] for r in per_rank]
        if max(graphs) > MAX_GRAPHS:
            problems.append(f"compiled {graphs} graphs per rank for variable lengths")
    return problems


@pytest.mark.parametrize(("backend", "world", "model"), FP32)
def test_hf_model_matches_reference(backend: str, world: int, model: str) -> None:
    per_rank = case_outcome(_group(backend, world, False), _case(model, backend, False).key)
    ref = _reference(model, world, False)
    problems = _common_checks(per_rank, model, ref, LOSS_RTOL, 1e-6)
    problems += compare_params(per_rank[0]["state"], ref.final, rtol=RTOL, atol=ATOL)
    if ref.generated is not None and not torch.equal(per_rank[0]["generated"], ref.generated):
        problems.append(f"generate(): {per_rank[0]['generated']} != {ref.generated}")
    for names in HF_ZOO[model].tied:
        state = per_rank[0]["state"]
        present = [n for n in names if n in state]
        if any(not torch.equal(state[present[0]], state[n]) for n in present[1:]):
            problems.append(f"tied parameters {present} differ from each other")
    _fail(model, world, backend, "", problems)
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {model}")


@pytest.mark.parametrize(("backend", "world", "model"), BF16)
def test_hf_model_bf16_matches_autocast_reference(backend: str, world: int, model: str) -> None:
    per_rank = case_outcome(_group(backend, world, True), _case(model, backend, True).key)
    ref = _reference(model, world, True)
    problems = _common_checks(per_rank, model, ref, BF16_LOSS_RTOL, 0.0)
    state = per_rank[0]["state"]
    fp32 = _reference(model, world, False)
    problems += compare_params(state, ref.final, rtol=0.0, atol=BF16_ATOL)
    for name, final in ref.final.items():
        still = (fp32.final[name] - fp32.init[name]).abs().max() < STILL
        if name in state and state[name].shape == final.shape and not still:
            want = final - ref.init[name]
            err = (state[name] - final).norm() / want.norm()
            if not err <= UPDATE_RTOL:
                problems.append(f"{name}: update off by {err:.3g} of its norm (> {UPDATE_RTOL})")
    _fail(model, world, backend, ", param_dtype=bf16", problems)
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {model} bf16")
