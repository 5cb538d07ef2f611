"""A watchdog for collectives replayed from CUDA graphs (zrs.CapturedStep at several ranks).

The process group's own watchdog times the collectives it launched, not those a graph replays
(PyTorch PR #103503): a peer that stalls or dies during a replay would leave this rank's GPU
waiting in an NCCL kernel forever. So each replay records an event behind it on the stream, and
a thread checks that the event completes within the timeout. When one does not, the thread
calls the replay's `on_timeout` once: the captured step marks its models broken and aborts
their communicators, whose kernels then return, and its next call raises ZrsError.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Event(Protocol):
    def query(self) -> bool: ...


@dataclass(eq=False)
class _Replay:
    done: Event
    deadline: float
    on_timeout: Callable[[], None]


class ReplayWatch:
    """Times replays in launch order on one daemon thread, polling each one's event every
    `poll_s` seconds (a query costs microseconds; a step takes milliseconds)."""

    def __init__(self, poll_s: float = 0.002) -> None:
        self.poll_s = poll_s
        self.expired = False  # a replay timed out: nothing is watched from then on
        self._pending: collections.deque[_Replay] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, done: Event, timeout_s: float, on_timeout: Callable[[], None]) -> None:
        """Call `on_timeout` (on the watch's thread) if `done` has not completed `timeout_s`
        seconds from now."""
        with self._wake:
            if self.expired:
                return
            self._pending.append(_Replay(done, time.monotonic() + timeout_s, on_timeout))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="zrs-replay-watch", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
                replay = self._pending[0]
            while not replay.done.query():
                if time.monotonic() >= replay.deadline:
                    with self._wake:
                        self.expired = True
                        self._pending.clear()
                    replay.on_timeout()
                    return
                time.sleep(self.poll_s)
            with self._wake:
                if self._pending and self._pending[0] is replay:
                    self._pending.popleft()
