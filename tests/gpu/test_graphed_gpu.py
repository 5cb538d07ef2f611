"""zrs.GraphedStep on GPUs: the captured step gives bit-identical parameters and norms to the same
step run without the graph, at every rank of the group: fp32 SGD-momentum (inductor), bf16 AdamW
with a scheduled tensor learning rate, and bf16 reduced in bf16 (each .grad a cast kept in place),
clipped, through a non-finite step. The runs are in the GPU suite's one group of workers
(tests/support/gpu_group.py, `GRAPHED`), under deterministic algorithms.

Marked `gpu`: run as tests/gpu/test_zoo_gpu.py says.
"""

from __future__ import annotations

import pytest
import torch

import gpu_group as group
from _dist import reemit_warnings

pytestmark = [
    pytest.mark.gpu,
    # one pytest-xdist worker for the readers of one spawned group (README: the GPU suite)
    pytest.mark.xdist_group("gpu_group"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
]


@pytest.mark.parametrize("config", group.GRAPHED, ids="-".join)
def test_graphed_step_is_bit_identical(config: tuple[str, ...]) -> None:
    eager = group.outcome(group.graphed_key(config, False))
    graphed = group.outcome(group.graphed_key(config, True))
    captures = group.DEVICE == "cuda"  # a CPU dry run of the group has no graphs
    for rank, (e, g) in enumerate(zip(eager, graphed, strict=True)):
        assert g["captured"] == captures and g["recaptures"] == 0, (rank, g)
        assert not e["captured"]
        assert e["skipped"] == g["skipped"] == 1, (rank, e["skipped"], g["skipped"])
        same_norms = torch.allclose(e["norms"], g["norms"], rtol=0, atol=0, equal_nan=True)
        assert same_norms, (rank, e["norms"], g["norms"])
        for name, value in e["state"].items():
            assert torch.equal(value, g["state"][name]), (rank, name)
        for r in (e, g):
            reemit_warnings(r["warnings"], where=f"rank {rank}, graphed step {config}")
