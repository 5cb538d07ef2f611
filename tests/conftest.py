"""Shared pytest configuration: GPU tests run only where there are at least two CUDA devices."""

from __future__ import annotations

import pytest
import torch

GPU_DEVICES_NEEDED = 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= GPU_DEVICES_NEEDED:
        return
    skip = pytest.mark.skip(reason=f"needs {GPU_DEVICES_NEEDED} CUDA devices, found {n}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
