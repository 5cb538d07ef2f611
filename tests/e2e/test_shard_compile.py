"""zrs.shard(compile=...) trains as the unsharded model does (gloo ranks, SGD with momentum): the
tied GPT of the own zoo, the only one with a stack of layers, at world sizes 1, 2 and 3 on
AOTAutograd's backend, and at two ranks with inductor, with its layers compiled by hand
(`layer.compile()`, whose hooks break the graph and run eagerly), and with the whole model
under `torch.compile`; dynamo never traces zrs's runtime (its hooks and the model's forward
guard are `torch.compiler.disable`d). Inductor's generated code
reads the layers' gathered parameters as graph inputs whose storage the eager path frees and
refills between the forward and the backward. test_hf_models.py runs three Hugging Face models
with compiled layers at two ranks; the GPU suite runs four cases with inductor on NCCL, a
Hugging Face Llama among them.
"""

from __future__ import annotations

import functools

import pytest

from _dist import cached_run, reemit_warnings
from checks import compiled_problems, fp32_problems
from zoo import Case, Reference, case_outcome, run_cases, spec_of, train_reference

pytestmark = pytest.mark.slow

# world -> (backend, model) cases, one group of ranks per world
CASES = {
    1: (("shard:aot_eager", "gpt_tied"),),
    2: (
        ("shard:inductor", "gpt_tied"),  # a tied embedding and head around the stack
        ("hand:aot_eager", "gpt_tied"),
        ("whole:aot_eager", "gpt_tied"),  # torch.compile(zrs.shard(model))
    ),
    3: (("shard:aot_eager", "gpt_tied"),),
}
PARAMS = [
    pytest.param(world, backend, model, id=f"w{world}-{backend}-{model}")
    for world, cases in CASES.items()
    for backend, model in cases
]
RTOL, ATOL = 1e-5, 1e-6  # test_correctness.py's
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6


@functools.cache
def _reference(model: str, world: int) -> Reference:
    return train_reference(spec_of(model), world)


@pytest.mark.parametrize(("world", "backend", "model"), PARAMS)
def test_compiled_layers_match_reference(world: int, backend: str, model: str) -> None:
    cases = [Case(m, b) for b, m in CASES[world]]
    group = cached_run(("shard-compile", world), run_cases, world, cases)
    per_rank = case_outcome(group, Case(model, backend).key)
    spec = spec_of(model)
    problems = fp32_problems(
        per_rank,
        spec,
        _reference(model, world),
        rtol=RTOL,
        atol=ATOL,
        loss_rtol=LOSS_RTOL,
        loss_atol=LOSS_ATOL,
    )
    if backend.startswith("hand:"):  # by hand, the hooks break the graphs (run eagerly)
        problems += [
            f"dynamo traced zrs's runtime: {r['traced_runtime']}"
            for r in per_rank
            if r["traced_runtime"]
        ]
    else:
        problems += compiled_problems(per_rank, spec, backend)
    whole = backend.startswith("whole:")  # dynamo compiles what it can reach: no layer of its own
    if not all((r["compiled_units"] or whole) and r["graphs"] for r in per_rank):
        problems.append(
            f"compiled layers {[r['compiled_units'] for r in per_rank]}, "
            f"graphs {[r['graphs'] for r in per_rank]}"
        )
    assert not problems, "\n".join(problems)
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {model}")
