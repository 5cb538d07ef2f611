"""A sharded model's state on disk: its state dicts (`state_dict.py`: the full export and import,
the guard on one rank's shards) and its checkpoints through torch.distributed.checkpoint
(`checkpoint.py`, public as `zrs.checkpoint`). They import only the runtime below them
(docs/architecture.md).

`checkpoint.py` is not imported here: it imports torch.distributed.checkpoint (0.5 s), which
`import zrs` leaves to the first use of `zrs.checkpoint` (`zrs.__getattr__`)."""

from zrs.checkpointing.state_dict import full_state_dict, install_hooks

__all__ = ["full_state_dict", "install_hooks"]
