"""Warm restarts (compiler/record.py): a second run meets no other rank and hits the caches the
first one wrote, and trains alike, here or on another machine from the saved artifacts; a
changed option, model or zrs version compiles cold, and so does every rank when one turns inductor's
cache off; a rank
whose torch caches are gone compiles alone from the record, to the same code; ranks that
disagree about the record compile cold, never hang."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from _dist import run_workers
from compile_caches import (
    MEETINGS,
    drop_torch_caches,
    take_torch_caches,
    torch_entries,
    train_tiny_llama,
)

pytestmark = pytest.mark.slow


def _run(cache: Path, layers: int = 2, per_rank: bool = False, **options) -> list[dict]:
    return run_workers(train_tiny_llama, 2, str(cache), per_rank, layers, options, timeout=600)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """One cold run and its caches, for the tests that start from one (a cold compile is most
    of each run's time)."""
    here = tmp_path_factory.mktemp("warm_restart")
    return here, _run(here)


def test_cold_then_warm_train_alike(cold_run: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """Warm on the same machine, and on another one from the cold run's saved artifacts."""
    here, cold = cold_run
    warm = _run(here)
    moved = _run(tmp_path / "elsewhere", artifacts=str(here), load=True)
    assert all(r["meetings"] == list(MEETINGS) for r in cold)
    assert all(r["aot_hits"] == 0 for r in cold)
    for r in warm + moved:
        assert r["meetings"] == [], "a warm compile meets no other rank"
        assert r["aot_hits"] >= 1, "the cold run's caches serve the warm one"
    for r in [*cold[1:], *warm, *moved]:
        _same(cold[0]["state"], r["state"])


def test_artifacts_of_something_else_are_refused() -> None:
    import zrs

    with pytest.raises(zrs.ZrsError, match=r"not zrs\.save_cache_artifacts"):
        zrs.load_cache_artifacts(b"\x00torch's own bytes")


def test_a_changed_option_model_or_version_compiles_cold(
    cold_run: tuple[Path, list[dict]],
) -> None:
    cache, _ = cold_run
    # zrs's other options are parts of the key like the backend (tests/compiler/test_record.py
    # changes each alone): one option here, the one whose change a record's timings would hide
    for changed in (
        {"backend": "eager"},  # the record's timings are inductor's code's
        {"layers": 3},
        {"version": True},
        {"caches_off": True},  # inductor's cache off on one rank: every rank compiles cold
    ):
        layers = changed.pop("layers", 2)
        again = _run(cache, layers, **changed)
        assert all(r["meetings"] == list(MEETINGS) for r in again), changed


def test_ranks_with_different_caches_train_alike(tmp_path: Path) -> None:
    first = _run(tmp_path, per_rank=True)
    ranks = [tmp_path / "rank0", tmp_path / "rank1"]
    assert torch_entries(ranks[0]) == torch_entries(ranks[1]), "nothing rank-specific in a key"
    take_torch_caches(ranks[0], ranks[1])  # rank 1 keeps its record
    served = _run(tmp_path, per_rank=True)
    assert all(r["meetings"] == [] and r["aot_hits"] >= 1 for r in served), "one cache serves all"
    drop_torch_caches(ranks[1])  # rank 1 keeps its record, not torch's caches
    mixed = _run(tmp_path, per_rank=True)
    assert all(r["meetings"] == [] for r in mixed), "the record alone makes a compile warm"
    assert mixed[0]["aot_hits"] >= 1 and mixed[1]["aot_hits"] == 0
    shutil.rmtree(tmp_path / "rank1" / "zrs_records")
    cold = _run(tmp_path, per_rank=True)
    assert all(r["meetings"] == list(MEETINGS) for r in cold), "a rank without it: all cold"
    for r in [*first[1:], *served, *mixed, *cold]:
        _same(first[0]["state"], r["state"])
