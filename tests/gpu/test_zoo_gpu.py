"""The CPU correctness suite's zoo on GPUs (NCCL): fp32 on every backend, a few models with the
collectives on zrs's side streams, bf16 compute and bf16 masters, each against the unsharded CPU
reference. The runs are the GPU suite's one group of workers (tests/support/gpu_group.py, which
lists every case); these tests read its results.

Marked `gpu`: skipped without two CUDA devices, or one with `ZRS_GPU_WORLD=1` (tests/conftest.py).
Run the suite on the two-GPU device machine, at world 2:
`bash scripts/device_setup.sh python3 -m pytest tests/gpu -q` (the setup script installs the
carried wheel and keeps NVLink multicast off). The world size is the number of visible GPUs;
`ZRS_GPU_WORLD=N` picks fewer.

Side streams (`ZRS_COMM_STREAMS=1`, opt-in) are read when a model is sharded, so a few cases of
the same group set it for their model alone (`gpu_group.SIDE_STREAMS`): no spawn of their own.

Tolerances. fp32: TF32 is off, but cuBLAS/cuDNN sum in other orders than the CPU kernels of the
reference, ~1e-7 relative per op; after three SGD-momentum steps through a few layers that stays
far below rtol 1e-4 / atol 1e-5 (10x the CPU suite's, tests/e2e/test_correctness.py), while a
wrong gradient scale or a mixed-up shard moves parameters by >= 1e-2. bf16 and bf16 masters: the
bounds of the CPU suite (tests/support/checks.py, reasoned there), against the same bf16-autocast
and bf16-model CPU references.
"""

from __future__ import annotations

import pytest

import gpu_group as group
from checks import bf16_problems, compiled_problems, fp32_problems, master_problems
from zoo import ZOO

pytestmark = [
    pytest.mark.gpu,
    # one pytest-xdist worker for the readers of one spawned group (README: the GPU suite)
    pytest.mark.xdist_group("gpu_group"),
    # Inductor's advice to enable TF32 on a GPU that has it: these tests keep fp32 exact on
    # purpose (the tolerances above assume it), so the advice is not for them.
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
]

RTOL, ATOL = 1e-4, 1e-5
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5

FP32 = (
    [
        pytest.param(backend, model, False, id=f"{backend}-{model}")
        for backend in group.FP32_BACKENDS
        for model in ZOO
    ]
    + [
        pytest.param(backend, model, True, id=f"{backend}-{model}-side-streams")
        for backend, model in group.SIDE_STREAMS
    ]
    + [
        pytest.param(group.COMPILED_UNITS, model, False, id=f"{group.COMPILED_UNITS}-{model}")
        for model in group.COMPILED_UNITS_MODELS
        if model in ZOO
    ]
    + [
        pytest.param(
            group.WHOLE_COMPILE,
            group.WHOLE_COMPILE_MODEL,
            False,
            id=f"{group.WHOLE_COMPILE}-{group.WHOLE_COMPILE_MODEL}",
        ),
        pytest.param(
            group.LAYERS_ONLY,
            group.LAYERS_ONLY_MODEL,
            False,
            id=f"{group.LAYERS_ONLY}-{group.LAYERS_ONLY_MODEL}",
        ),
    ]
)


@pytest.mark.parametrize(("backend", "model", "side_streams"), FP32)
def test_fp32_on_gpus_matches_reference(backend: str, model: str, side_streams: bool) -> None:
    key = group.case(model, backend, comm_streams=side_streams).key
    per_rank = group.outcome(key)
    problems = _fp32_problems(per_rank, model)
    problems += compiled_problems(per_rank, ZOO[model], backend)
    group.check(per_rank, problems, key)


@pytest.mark.parametrize(
    ("kind", "backend", "model", "side_streams"),
    group.HYBRID,
    ids=[f"{k}-{b}-{m}" + ("-side-streams" if s else "") for k, b, m, s in group.HYBRID],
)
def test_hybrid_on_gpus_matches_reference(
    kind: str, backend: str, model: str, side_streams: bool
) -> None:
    """mesh= a 2-D DeviceMesh: sharded within each replica, the gradients all-reduced across
    them; the reference averages every rank's gradients, as HSDP does."""
    hybrid = group.hybrid_case(kind, backend, model, side_streams)
    if hybrid is None:
        pytest.skip(f"the {kind} mesh needs an even number of GPUs, 4 or more")
    per_rank = group.outcome(hybrid.key)
    group.check(per_rank, _fp32_problems(per_rank, model), hybrid.key)


def _fp32_problems(per_rank: list[dict], model: str) -> list[str]:
    """How the fp32 case of zoo `model` differs from the unsharded reference."""
    return fp32_problems(
        per_rank,
        ZOO[model],
        group.reference(model),
        rtol=RTOL,
        atol=ATOL,
        loss_rtol=LOSS_RTOL,
        loss_atol=LOSS_ATOL,
    )


@pytest.mark.parametrize("model", group.BF16_MODELS)
def test_bf16_on_gpus_matches_autocast_reference(model: str) -> None:
    key = group.bf16_case(model).key
    per_rank = group.outcome(key)
    group.check(per_rank, bf16_problems(per_rank, group.reference(model, "bf16")), key)


@pytest.mark.parametrize("api", group.MASTER_APIS)
def test_bf16_masters_on_gpus_match_bf16_reference(api: str) -> None:
    key = group.master_case(api).key
    per_rank = group.outcome(key)
    ref = group.reference(group.MASTER_MODEL, "bf16_model")
    group.check(per_rank, master_problems(per_rank, ref), key)


@pytest.mark.parametrize("offloaded", group.offload_cases(), ids=lambda c: c.key)
def test_offloaded_on_gpus_matches_reference(offloaded) -> None:
    """offload="optimizer": the masters, the gradients and the SGD step on the host; "params":
    the compute copies too, and no device copy keeps storage after the run."""
    per_rank = group.outcome(offloaded.key)
    if offloaded.param_dtype is not None:
        problems = bf16_problems(per_rank, group.reference(offloaded.model, "bf16"))
    else:
        ref = group.reference(offloaded.model, max_norm=offloaded.max_norm)
        problems = fp32_problems(
            per_rank, ZOO[offloaded.model], ref, rtol=RTOL, atol=ATOL, loss_rtol=LOSS_RTOL,
            loss_atol=LOSS_ATOL,
        )  # fmt: skip
    for rank, r in enumerate(per_rank):
        if not r["offloaded"] or r["optimizer_state_devices"] not in ([], ["cpu"]):
            problems.append(f"rank {rank}: not offloaded ({r['optimizer_state_devices']})")
    group.check(per_rank, problems, offloaded.key)
