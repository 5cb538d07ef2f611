"""Shared pytest configuration: GPU tests run where there are at least two CUDA devices, or on
fewer when `ZRS_GPU_WORLD` asks for that many (one GPU: the single-process paths on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

GPU_DEVICES_NEEDED = 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = min(GPU_DEVICES_NEEDED, max(1, int(os.environ.get("ZRS_GPU_WORLD") or 2)))
    if n >= needed:
        return
    skip = pytest.mark.skip(reason=f"needs {needed} CUDA devices, found {n}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
