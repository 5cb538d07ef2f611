"""zrs.step.replay: no garbage collection starts inside a CUDA graph capture
(tests/gpu/test_captured_gpu.py counts them in real captures), and the collector comes back as it
was, through an exception too; a capture starts only after the copy kernels' background build,
whose torch fallback it would otherwise replay for good."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from zrs.runtime import kernels
from zrs.step.replay import collector_paused, settle_before_capture


def test_the_collector_is_off_inside_and_back_after_an_exception() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("the step failed")
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_user_stays_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_capture_waits_for_the_copy_kernels_build(monkeypatch) -> None:
    release = threading.Event()
    order: list[str] = []

    def slow_build(verbose: bool = False) -> str:
        release.wait(10)
        order.append("built")
        return "zrs_kernels.so"

    monkeypatch.setattr(kernels, "LOADER", kernels.Loader())  # a process that never loaded
    monkeypatch.delenv("ZRS_NO_CUDA_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(kernels, "build", slow_build)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: order.append("synchronized"))
    kernels.build_in_background()
    assert not kernels.load()  # the step before the capture ran the torch copies
    threading.Timer(0.2, release.set).start()
    settle_before_capture()
    assert order == ["built", "synchronized"]
    assert kernels.status()[0] == "loaded"
