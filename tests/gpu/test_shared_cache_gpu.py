"""One compile cache for every rank on GPUs (issue 34). Torch 2.11 puts the CUDA device index into
inductor's cache key and into its generated code, so ranks on cuda:0 and cuda:1 cache apart
(docs/compile-time.md). Started as `torchrun --virtual-local-rank` starts them, each rank sees
its own GPU alone, as cuda:0. Then two ranks compiling cold into caches of their own write the
same AOTAutograd and inductor keys and the same code, and a rank given the other's torch caches
hits them, meets no other rank, and trains alike. tests/e2e/test_warm_restart.py checks the same
on CPU ranks.

Two ranks or more (`ZRS_GPU_WORLD=1` skips it): one rank has no other to share with. Marked `gpu`
(tests/conftest.py); its own spawned group, two runs of a tiny Llama.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _dist import run_workers
from compile_caches import MEETINGS, take_torch_caches, torch_entries, train_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.xdist_group("shared_cache_gpu"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
]


def _run(cache: Path) -> list[dict]:
    world = int(os.environ.get("ZRS_GPU_WORLD") or torch.cuda.device_count())
    if world < 2:
        pytest.skip("one cache for every rank needs two ranks (ZRS_GPU_WORLD=1)")
    args = (str(cache), True, 2, {})  # per-rank caches, 2 layers, zrs's default options
    return run_workers(
        train_tiny_llama, world, *args, backend="nccl", virtual_local_rank=True, timeout=600
    )


def test_one_cache_serves_every_rank_when_each_sees_its_gpu_alone(tmp_path: Path) -> None:
    first = _run(tmp_path)
    assert {r["device"] for r in first} == {"cuda:0"}
    assert all(r["meetings"] == list(MEETINGS) and r["aot_hits"] == 0 for r in first)
    caches = sorted(tmp_path.glob("rank*"))
    for other in caches[1:]:
        assert torch_entries(caches[0]) == torch_entries(other), "nothing rank-specific in a key"
        take_torch_caches(caches[0], other)  # each keeps its own record
    served = _run(tmp_path)
    assert all(r["meetings"] == [] and r["aot_hits"] >= 1 for r in served), "one cache serves all"
    for r in [*first[1:], *served]:
        for name, value in first[0]["state"].items():
            torch.testing.assert_close(r["state"][name], value, msg=name)
