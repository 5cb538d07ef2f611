"""Checks of a zrs training run (`zoo.run_cases`'s per-rank results) against its unsharded
reference (`zoo.train_reference`), shared by the CPU suite (tests/e2e) and the GPU suite
(tests/gpu). Each returns a list of problems, one line each, empty when the run passes; the
tests fail with all of them at once.

The bf16 bounds are here because both suites hold bf16 runs to them; the fp32 bounds are each
suite's own (the GPU's are 10x the CPU's: cuBLAS and cuDNN sum in other orders than the CPU
kernels of the reference).
"""

from __future__ import annotations

import math

import torch

from zoo import Reference, ZooModel, compare_params, unexpected_graph_breaks

# param_dtype=bf16 against the bf16-autocast reference. bf16 keeps 8 significant bits (eps =
# 2**-8 ~ 3.9e-3, about 2-3 decimal digits), so every gradient carries ~0.4% relative rounding
# error that compounds through the layers. The two sides are also not the same bf16 computation:
# zrs runs the whole forward in bf16 (layer norm, softmax, the loss inputs), autocast keeps those
# ops in fp32. Emulating zrs's bf16 semantics in one process against this reference gave, after 3
# steps, at most 7e-4 absolute difference on any GPT parameter and 1.4% of the norm of a
# parameter's update (the MLP: exact). The bounds below leave about 3x margin, and stay far below
# what a real bug does: a wrong scale (e.g. no pre-divide) or a mixed-up shard is off by >= 50%
# of the update. The master weights are fp32 in both, so only the updates (up to ~6e-2) carry
# bf16 noise; the norm bound is the sharp one for parameters with small updates (layer norms), the
# elementwise one catches a few bad elements. bf16 vs fp32 training differs by only ~1% of the
# update, so these bounds cannot tell whether the forward really ran in bf16: `bf16_problems`
# checks the model's output dtype for that.
BF16_ATOL = 2e-3
# ||(p_zrs - p0) - (p_ref - p0)|| <= BF16_UPDATE_RTOL * ||p_ref - p0||, per tensor
BF16_UPDATE_RTOL = 0.05
BF16_LOSS_RTOL = 1e-2  # a mean of bf16 terms: ~2**-8 relative error, with 2.5x margin

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

# Graphs a variable-length run may compile (forward and backward count once; generate() and
# transformers' own graph breaks add a few): a recompile per length would be ~3 steps' worth more.
MAX_VARLEN_GRAPHS = 4


def loss_problems(
    per_rank: list[dict], ref: Reference, *, rtol: float, atol: float = 0.0
) -> list[str]:
    """Each rank's loss at each step against the reference's loss of that rank's batch."""
    problems = []
    for rank, r in enumerate(per_rank):
        for step, (got, exp) in enumerate(zip(r["losses"], ref.losses, strict=True)):
            if not math.isclose(got, exp[rank], rel_tol=rtol, abs_tol=atol):
                problems.append(f"loss of rank {rank} at step {step}: {got!r} != {exp[rank]!r}")
    return problems


def generated_problems(per_rank: list[dict], expected: torch.Tensor | None = None) -> list[str]:
    """The ranks generated the same tokens (`ZooModel.generate`), and `expected` if given."""
    generated = [r["generated"] for r in per_rank]
    if any(g is not None and not torch.equal(g, generated[0]) for g in generated):
        return [f"ranks generated different tokens: {generated}"]
    if expected is not None and not torch.equal(generated[0], expected):
        return [f"generate(): {generated[0]} != {expected}"]
    return []


def tied_and_frozen_problems(
    state: dict[str, torch.Tensor], spec: ZooModel, ref: Reference
) -> list[str]:
    """Frozen parameters kept their initial values; tied ones are equal to each other."""
    problems = []
    for name in spec.frozen:
        if name in state and not torch.equal(state[name], ref.init[name]):
            problems.append(f"{name}: frozen but changed")
    for names in spec.tied:
        present = [n for n in names if n in state]
        if any(not torch.equal(state[present[0]], state[n]) for n in present[1:]):
            problems.append(f"tied parameters {present} differ from each other")
    return problems


def fp32_problems(
    per_rank: list[dict],
    spec: ZooModel,
    ref: Reference,
    *,
    rtol: float,
    atol: float,
    loss_rtol: float,
    loss_atol: float,
    generated: bool = True,
) -> list[str]:
    """An fp32 run against the fp32 reference: losses, parameters (rank 0's full state dict),
    frozen and tied parameters, and (`generated`: the case generated) the generated tokens."""
    state = per_rank[0]["state"]
    problems = loss_problems(per_rank, ref, rtol=loss_rtol, atol=loss_atol)
    problems += compare_params(state, ref.final, rtol=rtol, atol=atol)
    problems += tied_and_frozen_problems(state, spec, ref)
    if generated:
        problems += generated_problems(per_rank, ref.generated)
    elif any(r["generated"] is not None for r in per_rank):
        problems.append("the case was not to generate, but a rank generated tokens")
    return problems


def compiled_problems(per_rank: list[dict], spec: ZooModel, backend: str) -> list[str]:
    """The zrs backend compiled the whole forward: one graph per frame and no graph break
    except the model's explicit one (zrs.shard: no graph at all; torch.compile of a zrs.shard
    model, "whole:B": a graph or more); dynamo traced none of zrs's runtime. When a backend
    fails on a graph, dynamo falls back with a graph break and runs the code eagerly: the
    numbers would still match the reference."""
    expected = 2 if spec.explicit_graph_break else 1
    if backend == "shard":
        expected = 0  # zrs.shard compiles nothing
    problems = []
    for rank, r in enumerate(per_rank):
        if r["traced_runtime"]:
            problems.append(f"rank {rank}: dynamo traced zrs's runtime: {r['traced_runtime']}")
        if backend.startswith("whole:"):  # torch.compile(model): it breaks at zrs's hooks
            if not r["graphs"]:
                problems.append(f"rank {rank}: torch.compile(model) compiled no graph")
            continue
        for reason in unexpected_graph_breaks(spec, r["graph_breaks"]):
            problems.append(f"rank {rank}: unexpected graph break:\n{reason}")
        if ":" in backend:  # zrs.shard's compiled layers: a graph or more, if any layer
            if bool(r["graphs"]) != bool(r["compiled_units"]):
                problems.append(
                    f"rank {rank}: zrs.shard(compile=...) compiled {r['graphs']} graph(s) for "
                    f"{r['compiled_units']} units"
                )
        elif r["graphs"] != expected:
            problems.append(f"rank {rank}: dynamo compiled {r['graphs']} graph(s), not {expected}")
    return problems


def varlen_graph_problems(per_rank: list[dict], backend: str) -> list[str]:
    """A variable-length run compiled a few graphs, not one per length (zrs.shard's compiled
    units: each a static graph, then at most a symbolic one)."""
    graphs = [r["graphs"] for r in per_rank]
    units = max(r["compiled_units"] for r in per_rank)
    bound = 2 * units if ":" in backend else MAX_VARLEN_GRAPHS
    if max(graphs) > bound:
        return [f"compiled {graphs} graphs per rank for variable lengths (at most {bound})"]
    return []


def update_problems(
    state: dict[str, torch.Tensor],
    ref: Reference,
    *,
    rtol: float,
    skip: frozenset[str] = frozenset(),
) -> list[str]:
    """Each parameter's update (from the reference's initial value) within `rtol` of the norm of
    the reference's update, but those in `skip`."""
    problems = []
    for name, final in ref.final.items():
        if name not in state or state[name].shape != final.shape or name in skip:
            continue  # a missing or misshapen one: compare_params says so
        err = (state[name] - final).norm() / (final - ref.init[name]).norm()
        if not err <= rtol:
            problems.append(f"{name}: update off by {err:.3g} of its norm (> {rtol})")
    return problems


def bf16_output_problems(per_rank: list[dict]) -> list[str]:
    """The model's output was bf16 on every rank: the forward ran in bf16."""
    return [
        f"rank {rank}: model output dtypes {r['output_dtypes']}, not bf16"
        for rank, r in enumerate(per_rank)
        if r["output_dtypes"] != [torch.bfloat16]
    ]


def bf16_problems(
    per_rank: list[dict],
    ref: Reference,
    *,
    atol: float = BF16_ATOL,
    update_rtol: float = BF16_UPDATE_RTOL,
    loss_rtol: float = BF16_LOSS_RTOL,
) -> list[str]:
    """A param_dtype=bf16 run (fp32 masters) against the bf16-autocast reference: bf16 output,
    losses, parameters elementwise (fp32: compare_params checks the dtype too) and by update."""
    state = per_rank[0]["state"]
    problems = bf16_output_problems(per_rank)
    problems += loss_problems(per_rank, ref, rtol=loss_rtol)
    problems += compare_params(state, ref.final, rtol=0.0, atol=atol)
    problems += update_problems(state, ref, rtol=update_rtol)
    return problems


def master_problems(
    per_rank: list[dict],
    ref: Reference,
    *,
    rtol: float = MASTER_RTOL,
    atol: float = MASTER_ATOL,
    update_rtol: float = MASTER_UPDATE_RTOL,
    loss_rtol: float = BF16_LOSS_RTOL,
) -> list[str]:
    """A master_dtype=bf16 run against the bf16 model trained unsharded (`train_reference(...,
    model_dtype=torch.bfloat16)`): bf16 shards and optimizer state, bf16 output, losses,
    parameters elementwise, and the updates of the matrices one by one (their updates span many
    bf16 steps) and of the whole model (a layer norm's update may be one step or none)."""
    problems = []
    for rank, r in enumerate(per_rank):
        dtypes = {dtype for *_, dtype, _ in r["local_params"]}
        if dtypes != {"torch.bfloat16"}:
            problems.append(f"rank {rank}: shards in {sorted(dtypes)}, not bf16")
        if r["optimizer_state_dtypes"] != ["torch.bfloat16"]:
            problems.append(f"rank {rank}: optimizer state in {r['optimizer_state_dtypes']}")
    problems += bf16_output_problems(per_rank)
    problems += loss_problems(per_rank, ref, rtol=loss_rtol)
    state = per_rank[0]["state"]
    problems += compare_params(state, ref.final, rtol=rtol, atol=atol)
    off = want = 0.0
    for name, final in ref.final.items():
        if name not in state or state[name].shape != final.shape:
            continue  # reported above
        update = (final - ref.init[name]).float()
        err = (state[name].float() - final.float()).norm()
        off, want = off + err**2, want + update.norm() ** 2
        if final.dim() >= 2 and not err <= update_rtol * update.norm():
            problems.append(f"{name}: update off by {err / update.norm():.3g} of its norm")
    if not off <= (update_rtol / 2) ** 2 * want:
        problems.append(f"the model's update off by {(off / want) ** 0.5:.3g} of its norm")
    return problems
