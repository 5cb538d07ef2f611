"""What a compile measured and the ranks agreed on, kept on disk, so that a restart plans alone.

A cold compile at several ranks meets the other ranks inside zrs's pass: the size hints, the
profile's timings and the plan are agreed, the CUDA budget is the least free memory, and the
collectives are timed once. Those meetings are why torch's caches stay off on a cold compile: a
cache hit on one rank would skip the pass and leave the others waiting in it. The record keeps
what was agreed, keyed by the dynamo graph, the options, the world size and the versions; when
every rank holds the same record (one collective decision, `agree`), the graph compiles from it
with no meeting (docs/compile-time.md).

Each cold compile names its record with a fresh run id (rank 0's), and that id is in the cache
keys of the compiled code (`PlanContext.key`, `ZeroPartitioner`). So a cold compile's lookups
always miss while its writes serve the warm runs that read its record, and no cache entry of
another compile, whose plan may differ, is ever taken for it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

import zrs
from zrs import _core
from zrs._core import ZrsError
from zrs.compiler.consistency import signature
from zrs.runtime.exchange import all_gather_bytes
from zrs.runtime.state import ZeroState

FORMAT = 1
ARTIFACTS_FORMAT = 1

# The keys of the records this process compiled with, for `save_artifacts`: process-wide, as
# torch's own list of the cache entries it wrote and read (torch.compiler.save_cache_artifacts).
_USED: set[str] = set()


@functools.cache
def core_build() -> str:
    """A digest of the compiled core (`zrs._core`), which holds the planner: a build with another
    planner plans other code, with zrs's version unchanged (a development build, a patched one)."""
    return hashlib.sha256(Path(_core.__file__).read_bytes()).hexdigest()[:16]


def _example(n: fx.Node) -> str:
    value = n.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{[str(s) for s in value.shape]}{value.requires_grad}"
    return type(value).__name__


def record_key(state: ZeroState, graph: fx.Graph, backend: str) -> str:
    """What the compiled code depends on besides the caches' own keys: the graph with its inputs'
    kinds, the backend (the record's timings are its code's) and zrs's options, the world, the
    device (its model, not its index: every rank looks up one key) and the versions, the core's
    build among them. The replicas and the offload mode change the plan (the all-reduce's and
    the host copies' costs and memory), not the lowered ops."""
    offload = state.offload and ("params" if state.offload.params else "optimizer")
    parts = [
        f"format {FORMAT}",
        f"zrs {zrs.__version__} core {core_build()} torch {torch.__version__}",
        f"world {state.world_size} replicas {state.replicas} offload {offload}",
        f"device {state.device.type} backend {backend}",
        f"scheduler {state.scheduler} budget {state.memory_budget} profile {state.profile}",
        f"keep {state.keep_for_backward} dtypes {state.param_dtype} {state.master_dtype} "
        f"{state.reduce_dtype}",
        *signature(graph),
        *(_example(n) for n in graph.find_nodes(op="placeholder")),
    ]
    if state.device.type == "cuda":
        parts.append(torch.cuda.get_device_name(state.device))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def record_dir() -> Path:
    """Beside inductor's cache (TORCHINDUCTOR_CACHE_DIR), so that clearing one clears both."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "zrs_records"


@dataclass
class Record:
    """One dynamo graph's agreed measurements: per lowered graph (by the digest of its signature)
    its size hints (symbol name -> size) and its compute timings (node name -> microseconds);
    the budget and the collectives' cost model; the id of the cold run that measured them."""

    key: str
    run: str
    graphs: dict[str, dict[str, Any]] = field(default_factory=dict)
    budget: int | None = None
    cost: Any = None

    @classmethod
    def load(cls, key: str) -> Record | None:
        try:
            data = json.loads((record_dir() / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        _USED.add(key)
        return cls(key, data["run"], data["graphs"], data["budget"], data["cost"])

    def _data(self) -> dict[str, Any]:
        data = {"format": FORMAT, "key": self.key, "run": self.run, "graphs": self.graphs}
        return data | {"budget": self.budget, "cost": self.cost}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self._data(), sort_keys=True).encode()).hexdigest()

    def save(self) -> None:
        _write(self.key, json.dumps(self._data()))
        _USED.add(self.key)


def _write(key: str, text: str) -> None:
    """Atomically, so that a rank that dies while writing leaves no half record."""
    folder = record_dir()
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, folder / f"{key}.json")


def agree(key: str, mine: Record | None, group: Any) -> tuple[Record, bool]:
    """The record this graph compiles with, and whether it is warm: the one every rank holds, the
    same to the byte, else a new one for a cold compile, named by rank 0's run id. One collective
    at the dynamo graph, which every rank compiles whatever its caches hold. Ranks whose graphs
    differ have different keys and compile cold, where the rank check names the difference."""
    held = mine.digest() if mine is not None else "none"
    said = json.dumps({"key": key, "held": held, "run": uuid.uuid4().hex})
    if group is None or torch.distributed.get_world_size(group) == 1:
        everyone = [said]
    else:
        everyone = [s.decode() for s in all_gather_bytes(said.encode(), group)]
    told = [json.loads(s) for s in everyone]
    if mine is not None and all(t["key"] == key and t["held"] == held for t in told):
        return mine, True
    return Record(key, told[0]["run"]), False


def save_artifacts() -> bytes:
    """torch.compiler.save_cache_artifacts's bytes with the records of this process's compiles:
    without its record, a compile elsewhere would be cold and take none of torch's entries."""
    from torch.compiler import save_cache_artifacts

    saved = save_cache_artifacts()
    records = {}
    for key in sorted(_USED):
        with contextlib.suppress(OSError):
            records[key] = (record_dir() / f"{key}.json").read_text()
    data = {"format": ARTIFACTS_FORMAT, "zrs": zrs.__version__, "torch": torch.__version__}
    data["records"] = records
    data["caches"] = base64.b64encode(saved[0]).decode() if saved is not None else None
    return json.dumps(data).encode()


def load_artifacts(blob: bytes) -> None:
    """Put `save_artifacts`'s bytes into this machine's caches (inductor's cache folder)."""
    from torch.compiler import load_cache_artifacts

    try:
        data = json.loads(blob)
        usable = data.get("format") == ARTIFACTS_FORMAT
    except (ValueError, AttributeError):
        usable = False
    if not usable:
        raise ZrsError(
            "zrs.load_cache_artifacts: these bytes are not zrs.save_cache_artifacts()'s (for "
            "torch's own, call torch.compiler.load_cache_artifacts)"
        )
    if data["caches"] is not None:
        load_cache_artifacts(base64.b64decode(data["caches"]))
    for key, text in data["records"].items():
        _write(key, text)
