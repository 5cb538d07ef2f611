"""The warm-restart record's key (compiler/record.py) changes with everything a compile's plan
depends on besides torch's own cache keys (the graph and its inputs, the backend, zrs's options,
the world size and the replicas, the offload mode, the GPU model and the versions) and with
nothing rank-specific: ranks on cuda:0 and cuda:1 look up one key. And a record survives its
disk round trip and the ranks' agreement at one rank. No compile: end to end,
tests/e2e/test_warm_restart.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import fx

import zrs
from zrs.compiler import record

CPU = torch.device("cpu")


@dataclasses.dataclass
class Offload:
    """What record_key reads of zrs.runtime.offload.Offload."""

    params: bool = False


@dataclasses.dataclass
class State:
    """What record_key reads of a ZeroState."""

    world_size: int = 2
    replicas: int = 1
    offload: Offload | None = None
    device: torch.device = CPU
    scheduler: str = "search"
    memory_budget: int | None = None
    profile: bool = True
    keep_for_backward: bool = True
    param_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32


def _graph(scale: float = 2.0, shape: tuple[int, ...] = (4, 3), **tensor) -> fx.Graph:
    gm = fx.symbolic_trace(lambda x: torch.relu(x * scale))
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    example = torch.empty(shape, **tensor)
    x.meta["example_value"] = x.meta["val"] = example
    return gm.graph


def _key(graph: fx.Graph | None = None, backend: str = "inductor", **state) -> str:
    return record.record_key(State(**state), graph or _graph(), backend)


@pytest.fixture
def two_h100s(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H100 80GB HBM3", 2: "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: names[torch.device(d).index])


def test_one_key_for_the_same_compile_on_every_rank(two_h100s: None) -> None:
    assert _key() == _key()
    assert _key(device=torch.device("cuda", 0)) == _key(device=torch.device("cuda", 1))


CHANGES = {
    "backend": {"backend": "eager"},
    "world size": {"world_size": 3},
    "replicas": {"replicas": 2},  # hybrid sharding: the same shard groups, twice as many ranks
    "offload": {"offload": Offload()},
    "offload params": {"offload": Offload(params=True)},
    "device type": {"device": torch.device("cuda", 0)},
    "GPU model": {"device": torch.device("cuda", 2)},
    "scheduler": {"scheduler": "greedy"},
    "memory budget": {"memory_budget": 1 << 30},
    "profile": {"profile": False},
    "keep for backward": {"keep_for_backward": False},
    "param dtype": {"param_dtype": torch.bfloat16},
    "master dtype": {"master_dtype": torch.bfloat16},
    "reduce dtype": {"reduce_dtype": torch.bfloat16},
    "graph": {"graph": _graph(scale=3.0)},
    "input shape": {"graph": _graph(shape=(4, 5))},
    "input dtype": {"graph": _graph(dtype=torch.float64)},
    "input requires grad": {"graph": _graph(requires_grad=True)},
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_each_change_misses(change: dict, two_h100s: None) -> None:
    # against the defaults: the CPU; the GPU model's change is from an H100 (cuda:1) to an H200
    base = {"device": torch.device("cuda", 1)} if change is CHANGES["GPU model"] else {}
    assert _key(**change) != _key(**base)


@pytest.mark.parametrize("version", ["zrs", "torch", "core"])
def test_another_version_misses(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _key()
    if version == "core":  # another build of the planner under the same zrs version
        monkeypatch.setattr(record, "core_build", lambda: "another build")
    else:
        monkeypatch.setattr(zrs if version == "zrs" else torch, "__version__", "0.0.0+other")
    assert _key() != before


def test_a_record_round_trips_and_one_rank_agrees_with_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    key = _key()
    assert record.Record.load(key) is None
    fresh, warm = record.agree(key, None, None)
    assert not warm and fresh.key == key and fresh.run
    fresh.graphs["g"] = {"hints": {"s0": 4}, "timings": {"mm": 12.5}}
    fresh.budget = 1 << 20
    fresh.save()
    loaded = record.Record.load(key)
    assert loaded == fresh and loaded.digest() == fresh.digest()
    assert record.agree(key, loaded, None) == (loaded, True)
    (tmp_path / "zrs_records" / f"{key}.json").write_text("{not json")
    assert record.Record.load(key) is None, "a damaged record is none, never an error"
