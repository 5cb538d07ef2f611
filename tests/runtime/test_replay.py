"""zrs.step.replay: no garbage collection starts inside a CUDA graph capture
(tests/gpu/test_captured_gpu.py counts them in real captures), and the collector comes back as it
was, through an exception too; a capture starts only after the copy kernels' background build,
whose torch fallback it would otherwise replay for good, and both captures (zrs.CapturedStep's
and zrs.GraphedStep's) join that build before they record anything."""

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


class _Settled(Exception):
    """Raised by the stand-in for settle_before_capture: the capture reached it."""


def _stop_at_settle(monkeypatch, module, order: list[str]) -> None:
    def settle() -> None:
        order.append("settled")
        raise _Settled

    monkeypatch.setattr(module, "settle_before_capture", settle)


def test_the_captured_step_settles_before_it_records(monkeypatch) -> None:
    from types import SimpleNamespace

    from zrs.step import captured

    order: list[str] = []
    _stop_at_settle(monkeypatch, captured, order)
    monkeypatch.setattr(captured.LIVE, "models", lambda: [])
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: order.append("graph") or object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(
        captured, "register_optimizer_step_post_hook", lambda hook: order.append("hooked")
    )
    step = SimpleNamespace(pool=None)
    sig = SimpleNamespace(captures=0)
    with pytest.raises(_Settled):
        captured.CapturedStep._capture(step, sig, [], captured.tree_flatten(((), {}))[1])
    assert order == ["graph", "settled"]  # nothing hooked or recorded before the build joined


def test_the_graphed_step_settles_before_it_records(monkeypatch) -> None:
    from types import SimpleNamespace

    from zrs.step import graphed

    order: list[str] = []
    _stop_at_settle(monkeypatch, graphed, order)
    step = SimpleNamespace(graph=None, _parts=lambda: order.append("parts") or [])
    with pytest.raises(_Settled):
        graphed.GraphedStep._capture(step)
    assert order == ["settled"]
