"""Hybrid sharding (`mesh=` a 2-D DeviceMesh, docs/hybrid.md) on gloo ranks, against the unsharded
reference, which averages every rank's gradients as HSDP does.

One group of 4 ranks trains zoo models as 2 replicas of 2 shards, with shard groups of
neighbouring ranks ([0, 1] and [2, 3]) and of every other rank ([0, 2] and [1, 3]), and as 1x4
and 4x1; measures the links of 2x2; saves 2x2 checkpoints and loads them on 1x4, 4x1 and on 2
ranks of a process group. One group of 6 ranks trains as 2x3. The faults suite's disagreement
cases on a mesh: tests/e2e/test_faults.py.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch

import checkpointing as ckpt
from _dist import cached_run, reemit_warnings
from checks import fp32_problems
from zoo import Case, Reference, case_outcome, make_mesh, run_cases, spec_of, train_reference

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-6  # test_correctness.py's: fp32, a few reordered additions
HF_RTOL, HF_ATOL = 1e-4, 1e-5  # test_hf_models.py's: deeper models, more reordered additions
# (world, mesh, backend, model): "shard" is zrs.shard, else zrs.compile's backend
TRAINED = [
    (4, "2x2", "shard", "mlp"),
    (4, "2x2", "eager", "gpt_tied"),
    (4, "2x2", "shard", "scalar_param"),
    (4, "2x2", "inductor", "bias_stack"),
    # Hugging Face GPT-2 (biases, a tied head), the ranks' batches of different lengths
    (4, "2x2", "shard", "hf_gpt2_varlen"),
    (4, "2x2-strided", "shard", "used_twice"),
    (4, "2x2-strided", "eager", "frozen"),
    (4, "1x4", "eager", "chunked"),
    (4, "4x1", "shard", "conv_bn"),
    (4, "4x1", "eager", "mlp"),
    (6, "2x3", "shard", "gpt_tied"),
    (6, "2x3", "eager", "bias_stack"),
    (6, "2x3-strided", "shard", "graph_break"),
]
# (model, backend, optimizer, saved by): saved on 2x2, loaded on 1x4, 4x1 and 2 ranks
SAVED = [
    ("gpt_tied", "shard", "adamw", "dcp"),
    ("bias_stack", "eager", "sgd", "zrs"),
]
LOADED_ON = ("1x4", "4x1", "2 ranks")
K = 2  # steps before a save


def _case(mesh: str, backend: str, model: str) -> Case:
    return Case(model, backend, mesh=mesh)


@functools.cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="zrs-hybrid-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _new(run: tuple[str, ...], **where: Any) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    import zrs

    spec = spec_of(run[0])
    model = spec.build()
    if run[1] == "shard":
        model = zrs.shard(model, **where)
    else:
        model = zrs.compile(model, backend=run[1], **where)
    return spec, model, ckpt.optimizer(run[2], model.parameters())


def _save(run: tuple[str, ...], model: Any, opt: torch.optim.Optimizer, path: str) -> None:
    import zrs

    if run[3] == "dcp":
        ckpt.dcp_save(model, opt, path)
    else:
        zrs.checkpoint.save(path, model, opt)


def _checkpoints(rank: int, root: str) -> dict[str, Any]:
    """Save each run on 2x2; load it on every layout of LOADED_ON; the full states of each. The
    2-rank loads come last: zrs numbers its calls per rank, and ranks 2 and 3 sit them out."""
    import torch.distributed as dist

    import zrs

    out: dict[str, Any] = {}
    pair = dist.new_group([0, 1])  # every rank makes it
    for run in SAVED:
        spec, model, opt = _new(run, mesh=make_mesh("2x2", "cpu"))
        ckpt.train(spec, model, opt, rank, range(K))
        _save(run, model, opt, _path(root, run))
        out[f"saved {run}"] = ckpt.full(model, opt)
        for layout in LOADED_ON[:-1]:
            _, model, opt = _new(run, mesh=make_mesh(layout, "cpu"))
            zrs.checkpoint.load(_path(root, run), model, opt)
            out[f"{layout} {run}"] = ckpt.full(model, opt)
    for run in SAVED if rank < 2 else ():
        _, model, opt = _new(run, process_group=pair)
        zrs.checkpoint.load(_path(root, run), model, opt)
        out[f"{LOADED_ON[-1]} {run}"] = ckpt.full(model, opt)
    return out


def _path(root: str, run: tuple[str, ...]) -> str:
    return os.path.join(root, "-".join(run))


def _links_measured(rank: int) -> dict[str, Any]:
    """The cost model a 2x2 compile measured (its profile sweeps each group's collectives)."""
    import zrs

    spec = spec_of("mlp")
    model = zrs.compile(spec.build(), backend="eager", mesh=make_mesh("2x2", "cpu"), timeout=60)
    spec.loss(model, spec.batch(rank, 0)).backward()
    return model._zrs_state.cost_model or {}


def _refusals() -> dict[str, str | None]:
    """Each mesh= zrs does not take, and its ZrsError (None: it did not raise)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import zrs

    grid = torch.arange(4)
    meshes = {
        "with process_group": (make_mesh("2x2", "cpu"), {"process_group": dist.group.WORLD}),
        "3-D": (DeviceMesh("cpu", grid.view(1, 2, 2)), {}),
        "other names": (DeviceMesh("cpu", grid.view(2, 2), mesh_dim_names=("dp", "tp")), {}),
        "shard first": (
            DeviceMesh("cpu", grid.view(2, 2), mesh_dim_names=("dp_shard", "dp_replicate")),
            {},
        ),
        "offload": (make_mesh("2x2", "cpu"), {"offload": "optimizer"}),
    }
    out: dict[str, str | None] = {}
    for what, (mesh, kw) in meshes.items():
        try:
            zrs.shard(spec_of("mlp").build(), mesh=mesh, **kw)
            out[what] = None
        except zrs.ZrsError as exc:
            out[what] = str(exc)
    return out


def _group(rank: int, world: int, root: str) -> dict[str, Any]:
    cases = [_case(m, b, model) for w, m, b, model in TRAINED if w == world]
    out: dict[str, Any] = {"trained": run_cases(rank, world, cases)}
    if world == 4:
        out["links"] = _links_measured(rank)
        out["refusals"] = _refusals()
        out["checkpoints"] = _checkpoints(rank, root)
    return out


def _results(world: int) -> list[dict[str, Any]]:
    return cached_run(("hybrid", world), _group, world, _root())


@functools.cache
def _reference(model: str, world: int) -> Reference:
    return train_reference(spec_of(model), world)


@pytest.mark.parametrize(
    ("world", "mesh", "backend", "model"), TRAINED, ids=["-".join(map(str, t)) for t in TRAINED]
)
def test_matches_reference(world: int, mesh: str, backend: str, model: str) -> None:
    key = _case(mesh, backend, model).key
    per_rank = case_outcome([r["trained"] for r in _results(world)], key)
    ref = _reference(model, world)
    rtol, atol = (HF_RTOL, HF_ATOL) if model.startswith("hf_") else (RTOL, ATOL)
    problems = fp32_problems(
        per_rank, spec_of(model), ref, rtol=rtol, atol=atol, loss_rtol=rtol, loss_atol=atol
    )
    assert not problems, f"{key} differs from the unsharded reference:\n  " + "\n  ".join(problems)
    replicas, shards = (int(n) for n in mesh.partition("-")[0].split("x"))
    placements = {p for r in per_rank for _, _, p, _, _ in r["local_params"]}
    assert placements <= {"(Replicate(), Shard(dim=0))", "(Replicate(), Replicate())"}, placements
    for rank, r in enumerate(per_rank):
        for shape, local, *_ in r["local_params"]:
            # rows cut over the shard group alone: ceil(rows / shards) at most
            assert not shape or local[0] <= -(-shape[0] // shards), (rank, shape, local)
        reemit_warnings(r["warnings"], where=f"rank {rank}, {key}")
    assert replicas * shards == world


@pytest.mark.parametrize("layout", LOADED_ON)
@pytest.mark.parametrize("run", SAVED, ids=["-".join(r) for r in SAVED])
def test_a_checkpoint_of_2x2_loads_on(layout: str, run: tuple[str, ...]) -> None:
    results = [r["checkpoints"] for r in _results(4)]
    for rank, r in enumerate(results):
        if f"{layout} {run}" in r:
            ckpt.assert_equal(r[f"{layout} {run}"], r[f"saved {run}"], f"rank {rank} on {layout}")
    # Every replica saved the same values; the 2-rank load ran on ranks 0 and 1.
    ckpt.assert_equal(results[2][f"saved {run}"], results[0][f"saved {run}"], "replica 1")
    assert sum(f"{layout} {run}" in r for r in results) == (2 if layout == "2 ranks" else 4)


def test_the_profile_measures_the_link_between_replicas() -> None:
    models = [r["links"] for r in _results(4)]
    assert all(m == models[0] for m in models), "ranks planned with different cost models"
    assert models[0].get("world") == 2, models[0]  # the shard group's sweep
    inter = models[0].get("inter")
    assert inter is not None and inter["bus_gbps"] > 0 and inter["latency_us"] >= 0, models[0]


@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("with process_group", "not both"),
        ("3-D", "has 3 dimensions"),
        ("other names", "('dp', 'tp')"),
        ("shard first", "replicate dimension first"),
        ("offload", "not supported yet"),
    ],
)
def test_a_mesh_zrs_does_not_take_raises_on_every_rank(what: str, says: str) -> None:
    for rank, r in enumerate(_results(4)):
        message = r["refusals"][what]
        assert message is not None and says in message, (rank, what, message)
