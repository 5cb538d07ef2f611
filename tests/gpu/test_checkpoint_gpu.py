"""A torch.distributed.checkpoint (DCP) checkpoint saved by the GPU suite's group (NCCL, every
rank; tests/support/gpu_group.py: GPT-2 on zrs.compile's eager backend, SGD with momentum, 2
steps, PyTorch's get_state_dict / dcp.save recipe) loads in one process: this test's own, on the
CPU, without a process group (zrs then keeps each parameter whole). Every parameter and momentum
buffer must equal the full state the group gathered when it saved.

Marked `gpu`: run as tests/gpu/test_zoo_gpu.py says.
"""

from __future__ import annotations

import pytest
import torch

import checkpointing as ckpt
import gpu_group as group
from _dist import reemit_warnings

pytestmark = [
    pytest.mark.gpu,
    # one pytest-xdist worker for the readers of one spawned group (README: the GPU suite)
    pytest.mark.xdist_group("gpu_group"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
]


# DCP's note that it loads in a single process (no process group here): what this test asks.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_checkpoint_saved_by_the_group_loads_in_one_process() -> None:
    per_rank = group.outcome(group.CHECKPOINT_KEY)
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, saving the checkpoint")
    saved = per_rank[0]["saved"]
    for rank, r in enumerate(per_rank[1:], start=1):
        ckpt.assert_equal(r["saved"], saved, f"rank {rank}'s gathered state against rank 0's")
    assert saved["optim"], "the saved optimizer has no state"
    _, model, opt = ckpt.new(group.CHECKPOINT_RUN)  # on the CPU, no process group
    assert not torch.distributed.is_initialized()
    ckpt.dcp_load(model, opt, group.checkpoint_dir(group.root()))
    ckpt.assert_equal(ckpt.full(model, opt), saved, "loaded in one process")


def test_an_offloaded_run_resumed_from_dcp_matches_the_uninterrupted_one() -> None:
    """Offload under NCCL: masters and AdamW state on the host, saved and loaded by DCP; the
    device copies the resumed run trains from must be made from the loaded masters."""
    for rank, r in enumerate(group.outcome(group.OFFLOAD_RESUME_KEY)):
        reemit_warnings(r["warnings"], where=f"rank {rank}, the offloaded resume")
        assert r["uninterrupted"]["optim"], "the offloaded optimizer has no state"
        ckpt.assert_equal(r["resumed"], r["uninterrupted"], f"rank {rank}'s resumed run")
