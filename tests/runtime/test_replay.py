"""zrs.step.replay.collector_paused: no garbage collection starts inside a CUDA graph capture
(tests/gpu/test_captured_gpu.py counts them in real captures); the collector comes back as it
was, through an exception too."""

from __future__ import annotations

import gc

import pytest

from zrs.step.replay import collector_paused


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
