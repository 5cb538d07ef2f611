"""Collectives replayed from CUDA graphs (zrs.CapturedStep at several ranks): a watchdog for
the replays, and the graphs freed before their communicators.

The process group's own watchdog times the collectives it launched, not those a graph replays
(PyTorch PR #103503): a peer that stalls or dies during a replay would leave this rank's GPU
waiting in an NCCL kernel forever. So each replay records an event behind it on the stream, and
a thread checks that the event completes within the timeout. When one does not, the thread
calls the replay's `on_timeout` once: the captured step marks its models broken and aborts
their communicators, whose kernels then return, and its next call raises ZrsError.

NCCL counts each graph that holds its work as a reference to the communicator, and destroying
the communicator waits for those references to go: forever while a step object lives. So
`torch.distributed.destroy_process_group` is made to free the captured graphs first.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zrs.runtime.state import ZeroState


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


def nccl_backends(states: Iterable[ZeroState]) -> list[Any]:
    """The NCCL backends whose collectives a captured step of these models replays: those of the
    models at several ranks (the parameters' group, the gathers' and the reductions')."""
    found: dict[int, Any] = {}
    for state in states:
        if state.world_size == 1:
            continue
        for group in (state.group, state.gather_group, state.reduce_group):
            if group is None:
                continue
            try:
                backend = group._get_backend(torch.device("cuda"))
            except RuntimeError:
                continue  # no CUDA backend: nothing replayed on it
            found.setdefault(id(backend), backend)
    return list(found.values())


def close_before_destroy(close_all: Callable[[], None]) -> None:
    """Make torch.distributed.destroy_process_group call `close_all` (free every captured graph)
    first. Once: a later call keeps the first `close_all`."""
    original = dist.destroy_process_group
    if getattr(original, "zrs_closes_captured_steps", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        close_all()
        original(group)

    destroy_process_group.zrs_closes_captured_steps = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
