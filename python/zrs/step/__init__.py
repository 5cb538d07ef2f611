"""The training step, captured as CUDA graphs and replayed: `zrs.GraphedStep` (the optimizer step,
`graphed.py`) and `zrs.CapturedStep` (the whole step, `captured.py`), over what they share
(`replay.py`, `replay_watch.py`); and `zrs.OverlappedStep` (offload's host update run during
the backward, `overlapped.py`). They act on a model that `zrs.compile` or `zrs.shard` prepared,
through its runtime state, and import only the runtime below them (docs/architecture.md)."""

from zrs.step.captured import CapturedStep
from zrs.step.graphed import GraphedStep
from zrs.step.overlapped import OverlappedStep

__all__ = ["CapturedStep", "GraphedStep", "OverlappedStep"]
