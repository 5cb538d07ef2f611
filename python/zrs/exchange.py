"""Small exchanges between ranks (hashes, flags, error text) that cannot deadlock under gloo.

`dist.all_gather_object` hung both ranks of the CPU test suite now and then (about 1 run in 4 of
the 2-rank inductor zoo on 2 cores, torch 2.11, in CI too): both main threads sat in the call that
issues its second collective, with no Python frame on any other thread. gdb (on 3 ranks) showed
the main thread, holding the GIL, waiting for the queue lock in `ProcessGroupGloo::enqueue`, while
a gloo worker thread held that lock and waited for the GIL to destroy the previous collective's
`Work`: dropping a tensor whose Python object the main thread had already let go needs the GIL.

So here every collective's `Work` and tensors stay referenced from Python (`keep_alive`) for the
next `KEEP_ALIVE_DEPTH` collectives: a worker thread never drops the last reference, and the
objects die later on the main thread, which holds the GIL anyway. The runtime's CPU collectives use
the same ring. Calls go through `all_gather_into_tensor` with `async_op=True` (the only way to get
the `Work` back), under `no_python_dispatcher` so that the pybind binding can drop the GIL.
"""

from __future__ import annotations

import collections
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

from zrs._core import ZrsError

# How many finished collectives stay referenced. A gloo worker releases its reference right
# after it completes a collective; this many later collectives is far beyond that. On CPU this
# holds up to this many gathered buffers a little longer (CPU runs are small).
KEEP_ALIVE_DEPTH = 16
_KEPT: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=KEEP_ALIVE_DEPTH)


def keep_alive(work: Any, *tensors: torch.Tensor) -> None:
    """Hold `work` and the host tensors it used until `KEEP_ALIVE_DEPTH` later collectives.

    Device (NCCL) tensors are not held: NCCL has no such worker thread, and holding them would
    hold device memory."""
    host = tuple(t for t in tensors if t.device.type == "cpu")
    if host:
        _KEPT.append((work, *host))


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    # The runtime's `all_gather` does the same, but the runtime imports this module.
    work = dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
    work.wait()
    keep_alive(work, out, inp)


def all_gather_bytes(payload: bytes, group: dist.ProcessGroup) -> list[bytes]:
    """Every rank's `payload`, in rank order (two collectives: the lengths, then the bytes)."""
    world = dist.get_world_size(group)
    device = _device(group)
    with unset_fake_temporarily(), no_python_dispatcher():
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        sizes = torch.empty(world, dtype=torch.int64, device=device)
        _all_gather(sizes, size, group)
        lengths = sizes.tolist()
        width = max(max(lengths), 1)
        send = torch.zeros(width, dtype=torch.uint8)
        if payload:
            send[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        send = send.to(device)
        recv = torch.empty(world * width, dtype=torch.uint8, device=device)
        _all_gather(recv, send, group)
        rows = recv.view(world, width).cpu()
        return [bytes(rows[r, :n].tolist()) for r, n in enumerate(lengths)]


def all_gather_flags(flag: bool, group: dist.ProcessGroup | None = None) -> list[bool]:
    """Every rank's `flag`, in rank order (`group` None: the default group)."""
    group = group or dist.group.WORLD
    return [b == b"\x01" for b in all_gather_bytes(b"\x01" if flag else b"\x00", group)]


class CompileRendezvous:
    """Where the ranks meet before each graph compile, through the process group's store.

    A rank whose guards fail (a shape, dtype or branch that only it saw) compiles alone, while
    its peers run the graphs compiled before. The compile's exchanges (the rank check, the
    profile) would then meet a peer's parameter all-gather: gloo aborts the process on the
    mismatch, NCCL hangs. The store cannot be mismatched: each rank marks its arrival at its
    n-th compile and waits, up to `timeout`, for every peer's mark. A rank that waits in vain
    records why (`diverged`) and raises; a peer whose collective then fails finds the record
    (`explain`) and raises the same error.
    """

    def __init__(self, group: dist.ProcessGroup, uid: str, timeout: datetime.timedelta | None):
        self.store = dist.distributed_c10d._get_process_group_store(group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.prefix = f"zrs/{uid}"
        self.timeout = timeout or self.store.timeout
        self.arrived = 0  # compiles this rank has arrived at

    def _key(self, n: int, rank: int) -> str:
        return f"{self.prefix}/compile{n}/rank{rank}"

    def arrive(self, what: str) -> None:
        """Wait until every rank has arrived at this compile; ZrsError naming the ranks that did
        not within the timeout."""
        n = self.arrived
        self.arrived += 1
        self.store.set(f"{self.prefix}/at/rank{self.rank}", str(n + 1))
        self.store.set(self._key(n, self.rank), what)
        keys = [self._key(n, r) for r in range(self.world)]
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError:  # DistStoreError, or a FileStore's plain "Wait timeout"
            missing = [r for r in range(self.world) if not self.store.check([keys[r]])]
            message = (
                f"rank(s) {missing} did not compile {what} within "
                f"{self.timeout.total_seconds():.0f} s while rank {self.rank} did: a rank "
                "compiled a graph alone (an input shape, dtype or branch that only it saw), "
                "and its peers ran the graphs compiled before. Every rank must capture the "
                "same graphs: keep the input sizes symbolic (zrs.compile(dynamic=True), the "
                "default with several ranks), make control flow independent of the rank, or "
                "pad the batches to equal shapes"
            )
            self.store.set(f"{self.prefix}/diverged", message)
            raise ZrsError(message) from None

    def explain(self) -> str | None:
        """Why a collective of this rank failed, if a peer waits at (or gave up on) a compile
        that this rank never reached; None for any other failure."""
        diverged = f"{self.prefix}/diverged"
        at = self.store.multi_get([f"{self.prefix}/at/rank{r}" for r in range(self.world)])
        ahead = any(int(n) > self.arrived for n in at if n)
        if not ahead and not self.store.check([diverged]):
            return None
        try:
            self.store.wait([diverged], self.timeout)
        except RuntimeError:  # DistStoreError, or a FileStore's plain "Wait timeout"
            return None
        return self.store.get(diverged).decode()
