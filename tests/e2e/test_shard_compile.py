"""zrs.shard(compile=...) with inductor, and torch.compile on a zrs.shard model's layers by hand,
train as the unsharded model does at two ranks (gloo). The own zoo and the Hugging Face zoo run
with compiled layers on AOTAutograd's backend at every world size (test_correctness.py,
test_hf_models.py); these cases add inductor's generated code, which reads the layers' gathered
parameters as graph inputs whose storage the eager path frees and refills between the forward
and the backward, and the hooks that a compile by hand traces (run eagerly, after a graph break).
"""

from __future__ import annotations

import functools

import pytest

from _dist import cached_run, reemit_warnings
from checks import compiled_problems, fp32_problems
from zoo import Case, Reference, case_outcome, run_cases, spec_of, train_reference

pytestmark = pytest.mark.slow

WORLD = 2
CASES = (
    ("shard:inductor", "gpt_tied"),  # a tied embedding and head around the stack
    ("shard:inductor", "hf_llama"),
    ("hand:aot_eager", "gpt_tied"),
)
# fp32: test_correctness.py's bounds, and test_hf_models.py's for the deeper HF models
TOLERANCES = {"gpt_tied": (1e-5, 1e-6), "hf_llama": (1e-4, 1e-5)}
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6


def _cases() -> list[Case]:
    return [Case(model, backend) for backend, model in CASES]


@functools.cache
def _reference(model: str) -> Reference:
    return train_reference(spec_of(model), WORLD)


@pytest.mark.parametrize(("backend", "model"), CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_compiled_layers_match_reference(backend: str, model: str) -> None:
    group = cached_run(("shard-compile", WORLD), run_cases, WORLD, _cases())
    per_rank = case_outcome(group, Case(model, backend).key)
    spec = spec_of(model)
    rtol, atol = TOLERANCES[model]
    problems = fp32_problems(
        per_rank,
        spec,
        _reference(model),
        rtol=rtol,
        atol=atol,
        loss_rtol=LOSS_RTOL,
        loss_atol=LOSS_ATOL,
    )
    if backend.startswith("shard:"):  # by hand, the hooks break the graphs (run eagerly)
        problems += compiled_problems(per_rank, spec, backend)
    if not all(r["compiled_units"] and r["graphs"] for r in per_rank):
        problems.append(
            f"compiled layers {[r['compiled_units'] for r in per_rank]}, "
            f"graphs {[r['graphs'] for r in per_rank]}"
        )
    assert not problems, "\n".join(problems)
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {model}")
