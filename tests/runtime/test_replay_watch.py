"""zrs.step.replay_watch: a replay whose event does not complete within the timeout calls its
`on_timeout` once, on the watch's thread, and nothing is watched after that; completed replays
call nothing. Fake events stand in for CUDA events (the watch only queries them)."""

from __future__ import annotations

import threading
import time

from zrs.step.replay_watch import ReplayWatch


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_completed_replays_call_nothing() -> None:
    watch = ReplayWatch(poll_s=0.001)
    called = threading.Event()
    events = [FakeEvent() for _ in range(3)]
    for e in events:
        watch.watch(e, 0.5, called.set)
    for e in events:
        e.done = True
    assert not called.wait(1.0)
    assert not watch.expired


def test_a_replay_that_never_completes_times_out_once() -> None:
    watch = ReplayWatch(poll_s=0.001)
    calls: list[tuple[str, float]] = []
    fired = threading.Event()
    start = time.monotonic()

    def on_timeout(name: str) -> None:
        calls.append((threading.current_thread().name, time.monotonic() - start))
        fired.set()

    watch.watch(FakeEvent(done=True), 0.2, lambda: on_timeout("first"))
    watch.watch(FakeEvent(), 0.2, lambda: on_timeout("hung"))
    watch.watch(FakeEvent(), 0.2, lambda: on_timeout("behind it"))
    assert fired.wait(5.0)
    time.sleep(0.3)  # time for a second call, which must not come
    assert len(calls) == 1, calls
    thread, after = calls[0]
    assert thread == "zrs-replay-watch"
    assert 0.2 <= after < 2.0, after
    assert watch.expired
    watch.watch(FakeEvent(), 0.01, lambda: on_timeout("later"))  # ignored: already expired
    time.sleep(0.1)
    assert len(calls) == 1, calls
