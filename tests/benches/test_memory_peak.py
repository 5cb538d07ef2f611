"""benches/memory_peak.py: the peak of a replayed allocator trace and what is live there."""

from __future__ import annotations

from memory_peak import peak_breakdown


def _ev(action: str, addr: int, size: int, file: str = "x.py", line: int = 1) -> dict:
    frames = [{"filename": "/site/torch/foo.py", "line": 9, "name": "inner"}]
    frames.append({"filename": file, "line": line, "name": "f"})
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_peak_is_the_most_live_bytes_grouped_by_origin():
    gib = 2**30
    trace = [
        _ev("alloc", 1, gib, "/pkg/zrs/runtime/state.py", 10),
        _ev("alloc", 2, 2 * gib, "/tmp/torchinductor_x/ab/c.py", 5),
        _ev("free_requested", 1, gib),  # not yet returned to the allocator: still live
        _ev("alloc", 3, gib, "/pkg/zrs/runtime/state.py", 10),
        _ev("free_completed", 1, gib),
        _ev("free_completed", 2, 2 * gib),
        _ev("alloc", 4, gib, "other.py", 3),  # after the peak: not in the breakdown
    ]
    out = peak_breakdown({"device_traces": [trace]}, before_bytes=gib // 2)
    assert out["peak_GiB"] == 4.5 and out["before_step_GiB"] == 0.5
    assert out["live_at_peak_GiB"] == [["state.py:10 f", 2.0], ["c.py:5 f", 2.0]]
