"""Shared pytest configuration: GPU tests run where there are at least two CUDA devices, or on
fewer when `ZRS_GPU_WORLD` asks for that many (one GPU: the single-process paths on CUDA). The
compile caches of a test run are its own."""

from __future__ import annotations

import os
import shutil
import tempfile

# Inductor's CPU kernels without vector instructions (plain C++ loops). Their C++ compiles in
# about half the time (a plain torch.compile of the tiny HF GPT-2's step on 2 cores: 27-29 s
# against 54-57 s, session 52), and a CPU compile is mostly that C++ compile; zrs's ops are
# extern calls either way, and the GPUs run Triton. It also skips the check of each vector ISA
# that inductor otherwise builds and loads in a new process in every process (~15 s of each
# spawned rank's first compile). Set before torch reads it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest
import torch

GPU_DEVICES_NEEDED = 2


def pytest_configure(config: pytest.Config) -> None:
    # One folder for the whole run (pytest-xdist's workers and spawned ranks inherit it), so that
    # tests share compiled code, and a new one for each run: zrs's compile records
    # (compiler/record.py) of an earlier run would make a compile warm that a test expects cold.
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="zrs-tests-inductor-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = min(GPU_DEVICES_NEEDED, max(1, int(os.environ.get("ZRS_GPU_WORLD") or 2)))
    if n >= needed:
        return
    skip = pytest.mark.skip(reason=f"needs {needed} CUDA devices, found {n}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
