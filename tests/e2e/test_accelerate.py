"""Accelerate with a zrs model (`zrs.trainers.accelerate.Accelerator`), on CPU ranks: prepare,
gradient accumulation and clipping against the unsharded reference; save_state, then load_state
at the same world size (the run continues bit for bit) and at another (every rank holds the saved
rows of the weights and of the optimizer's momentum); for both of zrs's state dict types, full
tensors in Accelerate's files and torch.distributed.checkpoint folders, and with offload (the
step on the host, the clip of host gradients). At 3 ranks, `zrs.compile` through
`prepare(model, optimizer, dataloader)` trains on the loader's shards as the reference does."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
import torch.distributed as dist

import zrs
from _dist import as_torchrun, run_workers
from zoo import LR, MOMENTUM, ZooModel, compare_params, spec_of, train_reference

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

MODEL = "gpt_tied"  # a tied head: two keys of one tensor in the saved weights
ACCUMULATE, STEPS, SAVE_AFTER, MAX_NORM = 2, 3, 1, 0.5
RTOL, ATOL = 1e-5, 1e-6
# zrs's state dict types; "-offload": the model with offload="optimizer"
TYPES = ("full", "sharded", "full-offload")


def _micro_batches(spec: ZooModel, world: int) -> ZooModel:
    """The reference's view of accumulation: step s averages world x ACCUMULATE micro-batches,
    micro-batch m of rank r being the run's batch (r, s * ACCUMULATE + m)."""

    def batch(virtual: int, step: int):
        return spec.batch(virtual % world, step * ACCUMULATE + virtual // world)

    return dataclasses.replace(spec, batch=batch)


def _prepared(spec: ZooModel, kind: str):
    from zrs.trainers.accelerate import Accelerator

    state_dict_type = kind.removesuffix("-offload")
    offload = "optimizer" if state_dict_type != kind else None
    model = zrs.shard(spec.build(), offload=offload)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=ACCUMULATE, state_dict_type=state_dict_type
    )
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _train(accelerator, model, opt, spec: ZooModel, rank: int, steps: range, save: str = ""):
    for step in steps:
        for micro in range(ACCUMULATE):
            with accelerator.accumulate(model):
                accelerator.backward(spec.loss(model, spec.batch(rank, step * ACCUMULATE + micro)))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                opt.step()
                opt.zero_grad()
        if save and step + 1 == SAVE_AFTER:
            accelerator.save_state(save)


def _momenta(opt) -> list[torch.Tensor]:
    from zrs.checkpointing import optimizer_state

    inner = opt.optimizer
    state = optimizer_state.gather(inner, inner.state_dict())["state"]
    return [state[i]["momentum_buffer"] for i in sorted(state)]


def _save_and_resume(rank: int, world: int, root: str) -> dict:
    as_torchrun(rank, world)
    spec = spec_of(MODEL)
    runs = {}
    for kind in TYPES:
        accelerator, model, opt = _prepared(spec, kind)
        folder = os.path.join(root, kind)
        _train(accelerator, model, opt, spec, rank, range(STEPS), save=folder)
        out = {
            "final": zrs.full_state_dict(model),
            "wrapped": type(model).__name__,
            "processes": (accelerator.num_processes, accelerator.is_main_process),
            "files": sorted(os.listdir(folder)),
        }
        # A fresh model, optimizer and Accelerator from the saved state: the same last steps.
        accelerator, model, opt = _prepared(spec, kind)
        accelerator.load_state(folder)
        out["loaded"] = zrs.full_state_dict(model)
        out["momenta"] = _momenta(opt)
        _train(accelerator, model, opt, spec, rank, range(SAVE_AFTER, STEPS))
        out["resumed"] = zrs.full_state_dict(model)
        runs[kind] = out
    return runs


class _Batches(torch.utils.data.Dataset):
    """Item g is the micro-batch the zoo gives rank g % world at its micro-step g // world:
    Accelerate's sharded loader hands rank r items r, r + world, ... as `_train` reads them."""

    def __init__(self, spec: ZooModel, world: int) -> None:
        self.spec, self.world = spec, world

    def __len__(self) -> int:
        return self.world * STEPS * ACCUMULATE

    def __getitem__(self, g: int):
        return self.spec.batch(g % self.world, g // self.world)


def _compiled_with_a_loader(rank: int, world: int) -> dict:
    """zrs.compile through prepare(model, optimizer, dataloader): the loader's batches,
    accumulated and clipped."""
    from zrs.trainers.accelerate import Accelerator

    spec = spec_of(MODEL)
    model = zrs.compile(spec.build(), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = torch.utils.data.DataLoader(
        _Batches(spec, world), batch_size=1, collate_fn=lambda items: items[0]
    )
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    batches = iter(loader)
    for _ in range(STEPS * ACCUMULATE):
        with accelerator.accumulate(model):
            accelerator.backward(spec.loss(model, next(batches)))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
    return {"final": zrs.full_state_dict(model), "batches": len(loader)}


def _load_elsewhere(rank: int, world: int, root: str) -> dict:
    as_torchrun(rank, world)
    loaded: dict = {"compiled": _compiled_with_a_loader(rank, world)}
    for kind in TYPES:
        accelerator, model, opt = _prepared(spec_of(MODEL), kind)
        accelerator.load_state(os.path.join(root, kind))
        dist.barrier()
        loaded[kind] = {"loaded": zrs.full_state_dict(model), "momenta": _momenta(opt)}
    return loaded


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], str]:
    root = str(tmp_path_factory.mktemp("accelerate"))
    return run_workers(_save_and_resume, 2, root, timeout=600), root


@pytest.fixture(params=TYPES)
def saved(runs, request) -> tuple[list[dict], str]:
    per_rank, root = runs
    return [r[request.param] for r in per_rank], os.path.join(root, request.param)


def test_trains_as_the_unsharded_reference_with_accumulation_and_clipping(saved):
    per_rank, _ = saved
    spec = spec_of(MODEL)
    ref = train_reference(_micro_batches(spec, 2), 2 * ACCUMULATE, steps=STEPS, max_norm=MAX_NORM)
    assert [r["processes"] for r in per_rank] == [(2, True), (2, False)]
    assert per_rank[0]["wrapped"] != "DistributedDataParallel"
    final = {k: v for k, v in per_rank[0]["final"].items() if k in ref.final}
    problems = compare_params(final, ref.final, rtol=RTOL, atol=ATOL)
    assert not problems, problems
    assert all(torch.equal(r["final"][k], per_rank[0]["final"][k]) for r in per_rank for k in final)


def test_load_state_at_the_same_world_size_continues_the_run_exactly(saved):
    per_rank, _ = saved
    for rank, r in enumerate(per_rank):
        for key, value in r["final"].items():
            assert torch.equal(r["resumed"][key], value), f"rank {rank}: {key}"


def test_a_sharded_state_is_folders_beside_accelerates_files(runs):
    per_rank, _ = runs
    full, sharded = per_rank[0]["full"]["files"], per_rank[0]["sharded"]["files"]
    assert "model.safetensors" in full and "optimizer.bin" in full
    assert "zrs_model_0" in sharded and "zrs_optimizer_0" in sharded
    assert "model.safetensors" not in sharded and "optimizer.bin" not in sharded
    assert "random_states_0.pkl" in sharded  # the rest as Accelerate saves it


@functools.cache
def _loaded_elsewhere(root: str) -> list[dict]:
    return run_workers(_load_elsewhere, 3, root, timeout=600)


def test_load_state_at_another_world_size_gives_every_rank_its_rows(saved):
    per_rank, folder = saved
    kind = os.path.basename(folder)
    for at_3 in _loaded_elsewhere(os.path.dirname(folder)):
        r = at_3[kind]
        for key, value in per_rank[0]["loaded"].items():
            assert torch.equal(r["loaded"][key], value), key
        assert len(r["momenta"]) == len(per_rank[0]["momenta"])
        for got, want in zip(r["momenta"], per_rank[0]["momenta"], strict=True):
            assert torch.equal(got, want)
    assert not any(torch.equal(m, torch.zeros_like(m)) for m in per_rank[0]["momenta"])


def test_at_3_ranks_zrs_compile_trains_on_the_prepared_loader_as_the_reference(runs):
    _, root = runs
    spec = spec_of(MODEL)
    ref = train_reference(_micro_batches(spec, 3), 3 * ACCUMULATE, steps=STEPS, max_norm=MAX_NORM)
    for rank, r in enumerate(_loaded_elsewhere(root)):
        got = r["compiled"]
        assert got["batches"] == STEPS * ACCUMULATE, got["batches"]  # a third of the set each
        final = {k: v for k, v in got["final"].items() if k in ref.final}
        problems = compare_params(final, ref.final, rtol=RTOL, atol=ATOL)
        assert not problems, (rank, problems)


def test_a_state_dict_type_or_an_optimizer_a_sharded_state_cannot_save_raises():
    from zrs.trainers.accelerate import check_state_dict_type, owner

    with pytest.raises(zrs.ZrsError, match=r"'full'.*'sharded'"):
        check_state_dict_type("dcp")
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    both = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=LR)
    with pytest.raises(zrs.ZrsError, match="an optimizer of its own"):
        owner(both, [first, second])
    assert owner(torch.optim.SGD(second.parameters(), lr=LR), [first, second]) is second
