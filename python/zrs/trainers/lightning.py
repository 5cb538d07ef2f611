"""PyTorch Lightning with zrs models: `Strategy`, Lightning's `ModelParallelStrategy` (the
strategy for a model that shards itself in `configure_model`) with a data-parallel mesh that fits
zrs (docs/integrations.md).

`ModelParallelStrategy` defaults to a data-parallel size of the number of nodes and a tensor-
parallel size of the processes of a node, so on one machine its data-parallel size is 1. Its
sampler then gives every rank the same batches, and zrs, which averages every rank's gradients
as data-parallel ranks', trains on one rank's data at the cost of all, with no error. zrs shards
over every rank of its group and shards no tensor-parallel dimension of its own:

- `Strategy()` makes every process data parallel (`data_parallel_size` is the world size,
  `tensor_parallel_size` 1);
- its setup raises `ZrsError` when a zrs model's group is not the data-parallel mesh's size
  (a `data_parallel_size` given that leaves ranks on the same batches).

Everything else is Lightning's: `configure_model` shards (`self.model = zrs.shard(self.model)`
or `zrs.compile`), `configure_optimizers` steps the shards, and the checkpoints are
torch.distributed.checkpoint folders (the default, `save_distributed_checkpoint=True`), which
hold DTensor parameters and the optimizer's DTensor states and their `zrs_rows` marks, and so
load at another world size.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from zrs._core import ZrsError


class Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` whose data-parallel mesh is every process (see the module)."""

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        # configure_model has run: the model is sharded, its optimizer not yet made.
        assert self.model is not None
        _check_mesh(self.model, self.device_mesh["data_parallel"].size())
        super().setup(trainer)


def _check_mesh(model: nn.Module, data_parallel: int) -> None:
    for name, module in model.named_modules():
        state = getattr(module, "_zrs_state", None)
        if state is not None and state.world_size != data_parallel:
            raise ZrsError(
                f"Lightning's data-parallel size is {data_parallel}, but zrs shards "
                f"{name or 'the model'} over {state.world_size} ranks: ranks of one data-parallel "
                "group draw the same batches, and zrs would average their gradients as if they "
                f"were different. Pass data_parallel_size={state.world_size} (zrs's Strategy() "
                "makes every process data parallel) and tensor_parallel_size=1"
            )
