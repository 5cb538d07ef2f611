"""The training step, captured as CUDA graphs and replayed: `zrs.GraphedStep` (the optimizer step,
`graphed.py`) and `zrs.CapturedStep` (the whole step, `captured.py`), over what they share
(`replay.py`, `replay_watch.py`). They act on a model that `zrs.compile` or `zrs.shard` prepared,
through its runtime state, and import only the runtime below them (docs/architecture.md)."""

from zrs.step.captured import CapturedStep
from zrs.step.graphed import GraphedStep

__all__ = ["CapturedStep", "GraphedStep"]
