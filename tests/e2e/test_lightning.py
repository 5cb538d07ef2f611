"""PyTorch Lightning with a zrs model (`zrs.trainers.lightning.Strategy`, the model sharded in
`configure_model`), on CPU ranks: it trains as Lightning's DDP trains the unsharded model, its
torch.distributed.checkpoint folder resumes the run as DDP's own checkpoint does and loads at
another world size with every rank's weights and optimizer rows, it trains as DDP at 3 ranks too,
and a data-parallel size that would leave ranks on the same batches raises ZrsError on every rank
(tests/support/library_runs.py runs it; tests/gpu/test_libraries_gpu.py on NCCL)."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from _dist import cached_run
from library_runs import (
    check_lightning_training,
    check_mesh,
    close,
    lightning_loaded,
    lightning_module,
    lightning_runs,
)

pytest.importorskip("lightning")
pytestmark = [
    pytest.mark.slow,
    # lightning 2.6 under torch 2.11: its pytree helper asks the deprecated LeafSpec
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
    # Lightning's hint to add DataLoader workers (on hosts with many cores)
    pytest.mark.filterwarnings("ignore:The 'train_dataloader' does not have many workers"),
]

RTOL, ATOL = 1e-5, 1e-6


@functools.cache
def _root() -> str:
    return tempfile.mkdtemp(prefix="zrs-lightning-")


def _runs(world: int) -> list[dict]:
    if world == 2:
        return cached_run(("lightning", 2), lightning_runs, 2, _root(), "cpu", timeout=300)
    _runs(2)  # the checkpoint
    return cached_run(("lightning", world), lightning_loaded, world, _root(), "cpu", timeout=300)


def test_trains_and_resumes_as_lightning_ddp():
    check_lightning_training(_runs(2)[0], RTOL, ATOL)


def test_the_checkpoint_loads_at_another_world_size():
    saved = _runs(2)[0]["at_save"]
    for rank, got in enumerate(_runs(3)):
        close(got["weights"], saved["weights"])
        assert len(got["momenta"]) == len(saved["momenta"]), rank
        for a, b in zip(got["momenta"], saved["momenta"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_at_3_ranks_it_trains_as_lightning_ddp():
    initial = lightning_module(shard=False)
    initial.configure_model()
    for got in _runs(3):
        close(got["zrs"], got["ddp"], RTOL, ATOL)
        trained = got["zrs"].items()
        assert any(not torch.equal(v, initial.net.state_dict()[k]) for k, v in trained), (
            "nothing trained"
        )


def test_a_data_parallel_size_that_repeats_batches_raises_on_every_rank():
    check_mesh(_runs(2), 2)
