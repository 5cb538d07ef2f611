"""What a compile measured and the ranks agreed on, kept on disk, so that a restart plans alone.

A cold compile at several ranks meets the other ranks inside zrs's pass: the size hints, the
profile's timings and the plan are agreed, the CUDA budget is the least free memory, and the
collectives are timed once. Those meetings are why torch's caches stay off on a cold compile: a
cache hit on one rank would skip the pass and leave the others waiting in it. The record keeps
what was agreed, keyed by the dynamo graph, the options, the world size and the versions; when
every rank holds it (one collective decision, `agree_warm`), the graph compiles from the record
with no meeting, and AOTAutograd's and inductor's caches are on (docs/compile-time.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

import zrs
from zrs.compiler.consistency import signature
from zrs.runtime.exchange import all_gather_bytes
from zrs.runtime.state import ZeroState

FORMAT = 1


def _example(n: fx.Node) -> str:
    value = n.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{[str(s) for s in value.shape]}{value.requires_grad}"
    return type(value).__name__


def record_key(state: ZeroState, graph: fx.Graph) -> str:
    """What the compiled code depends on besides the caches' own keys: the graph with its inputs'
    kinds, zrs's options, the world, the device and the versions."""
    parts = [
        f"format {FORMAT}",
        f"zrs {zrs.__version__} torch {torch.__version__}",
        f"world {state.world_size} device {state.device.type}",
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
    the budget and the collectives' cost model."""

    key: str
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
        return cls(key, data["graphs"], data["budget"], data["cost"])

    def save(self) -> None:
        """Atomically, so that a rank that dies while writing leaves no half record."""
        folder = record_dir()
        folder.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT, "key": self.key, "graphs": self.graphs}
        data |= {"budget": self.budget, "cost": self.cost}
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, folder / f"{self.key}.json")


def agree_warm(key: str, mine: Record | None, group: Any) -> bool:
    """True when every rank has the same key and holds its record: one collective at the dynamo
    graph, where every rank is whatever its caches hold. Ranks whose graphs differ have different
    keys, and compile cold, where the rank check names the difference."""
    said = (key + ("1" if mine is not None else "0")).encode()
    if group is None or torch.distributed.get_world_size(group) == 1:
        return mine is not None
    everyone = all_gather_bytes(said, group)
    return all(s == everyone[0] for s in everyone) and said.endswith(b"1")
