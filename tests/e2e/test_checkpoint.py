"""Checkpoints, state dicts, clipping and non-finite gradients on a zrs model, as users call them.

Four groups of gloo workers run in order, each a fresh set of processes:

* world 2 trains, saves (PyTorch's DCP recipe with SGD-momentum on inductor and on `zrs.shard`,
  and with AdamW on `zrs.shard(offload="optimizer")`; `zrs.checkpoint`'s async save with AdamW on
  eager), trains on uninterrupted, and checks the
  ordinary calls on a compiled and on an eager (`zrs.shard`) model: clip, GradScaler, hooks, full
  state dicts in and out, `save_pretrained`; and bad checkpoints;
* world 1 and world 3 load world 2's checkpoints (world 3 saves what it loaded);
* world 2 resumes from its own checkpoints and loads world 3's.

The tests then compare what the groups returned: resume is bit-exact, resharding keeps every
value.
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
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpointing as ckpt
from _dist import cached_run
from zoo import spec_of

pytestmark = pytest.mark.slow

K = 2  # steps before the save, and after it
# (model, zrs backend, optimizer, saved by): what world 2 saves
RUNS = (
    ("hf_gpt2", "inductor", "sgd", "dcp"),
    ("hf_gpt2", "eager", "adamw", "zrs_async"),
    ("scalar_param", "eager", "sgd", "zrs"),
    ("hf_gpt2", "shard", "sgd", "dcp"),
    # the masters and AdamW's moments on the host (offload="optimizer")
    ("hf_gpt2", "shard-offload", "adamw", "dcp"),
    ("gpt_tied", "eager-offload", "sgd", "zrs"),
)
# zrs.compile's backends for the ordinary calls, and "shard": zrs.shard, the eager path
CALLS = ("eager", "shard")


def _name(run: tuple[str, ...]) -> str:
    return "-".join(run)


@functools.cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="zrs-ckpt-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _save(run: tuple[str, ...], model: Any, opt: torch.optim.Optimizer, where: str) -> None:
    import zrs

    if run[3] == "dcp":  # PyTorch's recipe, as FSDP2 users write it
        ckpt.dcp_save(model, opt, where)
    elif run[3] == "zrs_async":
        zrs.checkpoint.save(where, model, opt, extra={"step": K}, async_save=True).result()
    else:
        zrs.checkpoint.save(where, model, opt, extra={"step": K})


def _load(run: tuple[str, ...], model: Any, opt: torch.optim.Optimizer, where: str) -> None:
    import zrs

    if run[3] == "dcp":
        ckpt.dcp_load(model, opt, where)
    else:
        assert zrs.checkpoint.load(where, model, opt) == {"step": K}


# --- world 2: train, save, go on; the ordinary calls -------------------------------------------


def _first_group(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run in RUNS:
        spec, model, opt = ckpt.new(run)
        ckpt.train(spec, model, opt, rank, range(K))
        _save(run, model, opt, os.path.join(root, _name(run)))
        out[("saved", run)] = ckpt.full(model, opt)
        ckpt.train(spec, model, opt, rank, range(K, 2 * K))
        out[("uninterrupted", run)] = ckpt.full(model, opt)["model"]
    for backend in CALLS:
        out[backend] = _ordinary_calls(rank, root, backend)
    out.update(_bad_checkpoints(rank, root))
    return out


def _ordinary_calls(rank: int, root: str, backend: str) -> dict[str, Any]:
    import zrs

    out: dict[str, Any] = {}
    spec, model, opt = ckpt.new(("hf_gpt2", backend, "sgd"))
    calls: list[bool] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad is not None))
    spec.loss(model, spec.batch(rank, 0)).backward()
    out["hook_calls"] = (calls.count(True), calls.count(False), len(list(model.parameters())))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    out["norm"] = norm.full_tensor().item()
    # One rank's inf: every rank's norm says so, and GradScaler skips the step on every rank.
    first = next(p for p in model.parameters() if p.to_local().numel())
    if rank == 0:
        first.grad.to_local().view(-1)[0] = float("inf")
    out["norm_finite"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).isfinite().item()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    before = zrs.full_state_dict(model)
    opt.zero_grad(set_to_none=True)
    scaler.scale(spec.loss(model, spec.batch(rank, 1))).backward()
    if rank == 0:
        first.grad.to_local().view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    after = zrs.full_state_dict(model)
    out["scaler"] = (scaler.get_scale(), all(torch.equal(before[k], after[k]) for k in before))
    out.update(_optimizer_habit(rank, root, spec, model, opt, backend))
    out.update(_full_state_dicts(rank, root, spec, backend))
    return out


def _optimizer_habit(
    rank: int, root: str, spec: Any, model: Any, opt: torch.optim.Optimizer, backend: str
) -> dict[str, Any]:
    """The DDP habit with the optimizer: each rank's own state_dict() loads back; rank 0's,
    loaded on every rank, is refused at rank 1's next step, and the next forward stops every
    rank (rank 0 stepped alone)."""
    import zrs

    own = os.path.join(root, f"opt-rank{rank}-{backend}.pt")
    first = os.path.join(root, f"opt-rank0-{backend}.pt")
    opt.step()  # SGD's momentum, the state to save, starts at the first step
    torch.save(opt.state_dict(), own)
    dist.barrier()
    opt.load_state_dict(torch.load(own, weights_only=False))
    opt.step()  # its own rows: no error
    opt.load_state_dict(torch.load(first, weights_only=False))
    out: dict[str, Any] = {"optimizer_habit": None, "after_habit": None}
    try:
        opt.step()
    except zrs.ZrsError as e:
        out["optimizer_habit"] = str(e)
    try:
        spec.loss(model, spec.batch(rank, 2))
    except zrs.ZrsError as e:
        out["after_habit"] = str(e)
    return out


def _full_state_dicts(rank: int, root: str, spec: Any, backend: str) -> dict[str, Any]:
    import zrs

    out: dict[str, Any] = {}
    plain = spec.build()
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(-0.5)  # weights that differ from the model's own
    full = plain.state_dict()
    model = ckpt.sharded(spec, backend)
    model.load_state_dict(full)  # before the first step
    out["loaded_before"] = _same(zrs.full_state_dict(model), full)
    spec.loss(model, spec.batch(rank, 0)).backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model.load_state_dict(full)  # after it
    out["loaded_after"] = _same(zrs.full_state_dict(model), full)
    spec.loss(model, spec.batch(rank, 1)).backward()
    out["recompiled"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    exported = zrs.full_state_dict(model, rank0_only=True, cpu_offload=True)
    out["rank0_only"] = (len(exported), all(t.device.type == "cpu" for t in exported.values()))
    if rank == 0:
        where = os.path.join(root, f"pretrained-{backend}")
        model.save_pretrained(where, state_dict=dict(exported))
        loaded = type(model).from_pretrained(where)
        out["pretrained"] = _same(loaded.state_dict(), full)
    # save_pretrained without a state dict, on every rank: zrs gathers, rank 0 writes.
    where = os.path.join(root, f"gathered-{backend}")
    model.save_pretrained(where)
    dist.barrier()
    if rank == 0:
        out["gathered"] = _same(type(model).from_pretrained(where).state_dict(), full)
    # The DDP habit: rank 0 saves its state_dict(), every rank loads it.
    where = os.path.join(root, f"rank0-{backend}.pt")
    if rank == 0:
        torch.save(model.state_dict(), where)
    dist.barrier()
    try:
        model.load_state_dict(torch.load(where, weights_only=False))
        out["ddp_habit"] = None
    except zrs.ZrsError as e:
        out["ddp_habit"] = str(e)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _bad_checkpoints(rank: int, root: str) -> dict[str, Any]:
    """Truncated, corrupt and mismatched checkpoints: a ZrsError, and nothing changed."""
    import zrs

    good = os.path.join(root, _name(RUNS[1]))
    cases = {}
    for kind in ("truncated", "corrupt"):
        cases[kind] = os.path.join(root, kind)
        if rank == 0:
            shutil.copytree(good, cases[kind])
            data = sorted(f for f in os.listdir(cases[kind]) if f.endswith(".distcp"))[-1]
            with open(os.path.join(cases[kind], data), "r+b") as fh:
                if kind == "truncated":
                    fh.truncate(os.path.getsize(fh.name) // 2)
                else:
                    fh.write(b"\0" * 64)  # the first item's header
    cases["mismatched"] = os.path.join(root, _name(RUNS[2]))  # scalar_param's
    cases["missing"] = os.path.join(root, "never-saved")
    dist.barrier()
    out = {}
    for kind, where in cases.items():
        spec, model, opt = ckpt.new(RUNS[1])
        ckpt.train(spec, model, opt, rank, range(1))
        before = ckpt.full(model, opt)
        try:
            zrs.checkpoint.load(where, model, opt)
            error = None
        except zrs.ZrsError as e:
            error = str(e)
        after = ckpt.full(model, opt)
        unchanged = _same(before["model"], after["model"]) and all(
            _same(before["optim"][k], after["optim"][k]) for k in before["optim"]
        )
        out[("bad", kind)] = (error, unchanged)
    return out


# --- world 1 and 3: load world 2's checkpoints; world 2: resume -------------------------------


def _load_group(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run in RUNS:
        _, model, opt = ckpt.new(run)
        _load(run, model, opt, os.path.join(root, _name(run)))
        out[("loaded", run)] = ckpt.full(model, opt)
        if world == 3 and run == RUNS[0]:
            _save((*run[:3], "zrs"), model, opt, os.path.join(root, "from-w3"))
    return out


def _resume_group(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run in RUNS:
        spec, model, opt = ckpt.new(run)
        _load(run, model, opt, os.path.join(root, _name(run)))
        ckpt.train(spec, model, opt, rank, range(K, 2 * K))
        out[("resumed", run)] = ckpt.full(model, opt)["model"]
    run = (*RUNS[0][:3], "zrs")
    spec, model, opt = ckpt.new(run)
    _load(run, model, opt, os.path.join(root, "from-w3"))
    out[("loaded_w3", run)] = ckpt.full(model, opt)
    return out


def _group(name: str) -> dict[str, Any]:
    """Rank 0's results of a group; the groups run once, in order."""
    order = {"first": (_first_group, 2), "w1": (_load_group, 1), "w3": (_load_group, 3)}
    order["resume"] = (_resume_group, 2)
    results = {}
    for key, (fn, world) in order.items():
        results[key] = cached_run(("checkpoint", key), fn, world, _root())
        if key == name:
            return results[key][0] | {"all_ranks": results[key]}
    raise KeyError(name)


def _calls(backend: str) -> list[dict[str, Any]]:
    """Every rank's results of the ordinary calls on a model of `backend` (world 2)."""
    return [r[backend] for r in _group("first")["all_ranks"]]


@pytest.mark.parametrize("run", RUNS, ids=_name)
def test_resume_is_bit_exact(run):
    first, resumed = _group("first"), _group("resume")
    ckpt.assert_equal(resumed[("resumed", run)], first[("uninterrupted", run)], "resumed")


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("run", RUNS, ids=_name)
def test_a_checkpoint_of_2_ranks_loads_on(world, run):
    first, loaded = _group("first"), _group(f"w{world}")
    ckpt.assert_equal(loaded[("loaded", run)], first[("saved", run)], f"loaded on {world}")


def test_a_checkpoint_of_3_ranks_loads_on_2():
    first, resumed = _group("first"), _group("resume")
    run = (*RUNS[0][:3], "zrs")
    ckpt.assert_equal(resumed[("loaded_w3", run)], first[("saved", RUNS[0])], "3 -> 2")


def test_dcp_to_torch_save_loads_into_the_plain_model(tmp_path):
    first = _group("first")
    run = RUNS[0]
    dcp_to_torch_save(os.path.join(_root(), _name(run)), tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    plain = spec_of(run[0]).build()
    plain.load_state_dict(saved, strict=True)
    ckpt.assert_equal(plain.state_dict(), first[("saved", run)]["model"], "dcp_to_torch_save")


@pytest.mark.parametrize("backend", CALLS)
def test_the_gradient_norm_is_the_true_one_on_every_rank(backend):
    calls = _calls(backend)
    spec = spec_of("hf_gpt2")
    reference = spec.build()
    for rank in range(2):
        (spec.loss(reference, spec.batch(rank, 0)) / 2).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    norms = [r["norm"] for r in calls]
    assert norms[0] == norms[1]
    assert norms[0] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("backend", CALLS)
def test_one_ranks_inf_is_seen_by_every_rank(backend):
    calls = _calls(backend)
    assert [r["norm_finite"] for r in calls] == [False, False]
    # GradScaler: every rank skipped the step and halved its scale
    assert [r["scaler"] for r in calls] == [(128.0, True), (128.0, True)]


@pytest.mark.parametrize("backend", CALLS)
def test_post_accumulate_grad_hooks_see_the_gradient(backend):
    for r in _calls(backend):
        with_grad, without, params = r["hook_calls"]
        assert (with_grad, without) == (params, 0)


@pytest.mark.parametrize("backend", CALLS)
def test_load_state_dict_of_a_full_state_dict(backend):
    for r in _calls(backend):
        assert r["loaded_before"] and r["loaded_after"]
        assert r["recompiled"] == 0


@pytest.mark.parametrize("backend", CALLS)
def test_full_state_dict_on_rank_0_only_and_save_pretrained(backend):
    calls = _calls(backend)
    n = len(spec_of("hf_gpt2").build().state_dict())
    assert [r["rank0_only"] for r in calls] == [(n, True), (0, True)]
    assert calls[0]["pretrained"]
    assert calls[0]["gathered"], "save_pretrained on every rank wrote other weights"


@pytest.mark.parametrize("backend", CALLS)
def test_one_ranks_state_dict_loaded_on_another_rank_raises(backend):
    habits = [r["ddp_habit"] for r in _calls(backend)]
    assert habits[0] is None  # rank 0 loads its own rows
    assert habits[1] is not None and "rows of rank 0 of 2" in habits[1]


@pytest.mark.parametrize("backend", CALLS)
def test_one_ranks_optimizer_state_loaded_on_another_rank_raises(backend):
    """Rank 0's optimizer.state_dict() loaded on every rank: rank 1's next step raises."""
    habits = [r["optimizer_habit"] for r in _calls(backend)]
    assert habits[0] is None  # rank 0 loads its own rows
    assert habits[1] is not None, "rank 1 stepped with rank 0's optimizer state"
    assert "rank 1 of 2 owns" in habits[1] and "rows from 0" in habits[1], habits[1]
    # Never one rank's state for all: rank 0 stepped, rank 1 did not, and both learn it.
    after = [r["after_habit"] for r in _calls(backend)]
    assert all(e is not None and "optimizer steps" in e for e in after), after


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("truncated", r"data file .*__1_0\.distcp has \d+ bytes of \d+ \(truncated: '"),
        ("corrupt", r"cannot read '.*' from .*__1_0\.distcp"),
        ("mismatched", r"has no 'model\.transformer\.wte\.weight'"),
        ("missing", r"cannot read its metadata .*never-saved/\.metadata"),
    ],
)
def test_a_bad_checkpoint_raises_and_changes_nothing(kind, message):
    import re

    first = _group("first")
    for r in first["all_ranks"]:
        error, unchanged = r[("bad", kind)]
        assert error is not None and re.search(message, error), error
        assert unchanged
