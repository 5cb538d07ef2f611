"""A CPU dry run of the GPU suite's shared group (tests/support/gpu_group.py): every case on the
CPU over gloo at world 2, read by the same tests, then each item's seconds. Catches a broken case
or check before it costs device time. It runs the group's readers only (the captured-step and
fault tests need CUDA):

    python scripts/gpu_group_dry_run.py tests/gpu/test_zoo_gpu.py tests/gpu/test_hf_gpu.py \
        tests/gpu/test_checkpoint_gpu.py tests/gpu/test_graphed_gpu.py

About 2 minutes on 2 cores.
"""

from __future__ import annotations

import sys
import time

import pytest


class DryRun:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        import gpu_group

        gpu_group.DEVICE, gpu_group.DIST_BACKEND = "cpu", "gloo"
        gpu_group.GROUP_TIMEOUT = 3000.0
        for item in items:  # drop conftest's "needs 2 CUDA devices" skip
            item.own_markers = [m for m in item.own_markers if m.name != "skip"]


def report() -> None:
    import _dist

    for key, res in _dist._RUN_CACHE.items():
        if isinstance(res, Exception):
            print(key, "FAILED", res)
            continue
        rank0 = res[0]
        total = sum(r["seconds"] for r in rank0.values())
        print(f"{key}: {len(rank0)} items, {total:.0f} s in items")
        for k, r in rank0.items():
            print(f"  {r['seconds']:7.1f} s  {k}")


if __name__ == "__main__":
    t = time.monotonic()
    rc = pytest.main(
        ["-q", "-p", "no:cacheprovider", "--durations=5", *sys.argv[1:]], plugins=[DryRun()]
    )
    print(f"dry run: {time.monotonic() - t:.0f} s, rc {rc}")
    report()
    sys.exit(rc)
