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
import hashlib
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


def all_gather_ints(values: list[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's `values` (the same length on every rank), in rank order: one collective."""
    world = dist.get_world_size(group)
    device = _device(group)
    with unset_fake_temporarily(), no_python_dispatcher():
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        everyone = torch.empty(world * len(values), dtype=torch.int64, device=device)
        _all_gather(everyone, mine, group)
        return everyone.view(world, len(values)).tolist()


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """How long `group`'s collectives wait for a peer (init_process_group's or new_group's
    timeout)."""
    try:
        return group._get_backend(_device(group)).options._timeout
    except (AttributeError, RuntimeError):  # a backend without options: its store's timeout
        return dist.distributed_c10d._get_process_group_store(group).timeout


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or "": enough to name it in a log line or in
    another rank's error, without a compiler's dump or a collective's backtrace."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def first_difference(a: list[str], b: list[str]) -> tuple[int, str, str]:
    """The index of the first line where `a` and `b` differ, and both lines there."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return i, a[i] if i < len(a) else "<end>", b[i] if i < len(b) else "<end>"


class Peers:
    """How the ranks of one `zrs.compile` meet outside the collectives: through the process
    group's store, which cannot pair one rank's call with another's.

    A rank whose guards fail (a shape, dtype or branch that only it saw) compiles alone, while
    its peers run the graphs compiled before; its compile's exchanges (the rank check, the
    profile) would then meet a peer's parameter all-gather: gloo aborts the process on the
    mismatch, NCCL hangs. So each rank marks its arrival at its n-th compile and waits, up to
    `timeout`, for every peer's mark (`arrive`). `agree` compares a description (the model's
    parameters and the options) before any collective. A rank that gives up or fails leaves
    the reason in the store (`note`), where a peer whose collective then fails finds it
    (`explain`).
    """

    def __init__(self, group: dist.ProcessGroup, uid: str, timeout: datetime.timedelta):
        self.store = dist.distributed_c10d._get_process_group_store(group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.prefix = f"zrs/{uid}"
        self.timeout = timeout
        self.arrived = 0  # compiles this rank has arrived at
        self.agreements = 0  # `agree` calls so far

    def _wait(self, keys: list[str], ranks: list[int], what: str) -> None:
        """Wait for `keys` (set by `ranks`); ZrsError naming the ranks that did not set theirs."""
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError:  # DistStoreError, or a FileStore's plain "Wait timeout"
            missing = [r for r, k in zip(ranks, keys, strict=True) if not self.store.check([k])]
            message = (
                f"rank(s) {missing} did not reach {what} within "
                f"{self.timeout.total_seconds():g} s while rank {self.rank} did"
            )
            raise ZrsError(message) from None

    def agree(
        self,
        what: str,
        lines: list[str],
        hint: str = "every rank must build the same model and call zrs.compile with the same "
        "options",
    ) -> None:
        """Raise the same ZrsError on every rank unless every rank passes the same `lines`; it
        names the first line that differs. Only digests go through the store, unless they
        differ."""
        key = f"{self.prefix}/agree{self.agreements}"
        self.agreements += 1
        text = "\n".join(lines).encode()
        ranks = list(range(self.world))
        self.store.set(f"{key}/digest/rank{self.rank}", hashlib.sha256(text).hexdigest())
        digest_keys = [f"{key}/digest/rank{r}" for r in ranks]
        self._wait(digest_keys, ranks, what)
        digests = self.store.multi_get(digest_keys)
        other = next((r for r, d in enumerate(digests) if d != digests[0]), None)
        if other is None:
            return
        self.store.set(f"{key}/text/rank{self.rank}", text)
        text_keys = [f"{key}/text/rank0", f"{key}/text/rank{other}"]
        self._wait(text_keys, [0, other], f"{what} (the comparison)")
        a, b = (t.decode().split("\n") for t in self.store.multi_get(text_keys))
        i, line_a, line_b = first_difference(a, b)
        raise ZrsError(
            f"ranks disagree on {what}: line {i} is `{line_a}` on rank 0 but `{line_b}` on rank "
            f"{other}: {hint}"
        )

    def arrive(self, what: str) -> None:
        """Wait until every rank has arrived at this compile; ZrsError naming the ranks that did
        not within the timeout."""
        n = self.arrived
        self.arrived += 1
        self.store.set(f"{self.prefix}/at/rank{self.rank}", str(n + 1))
        self.store.set(self._key(n, self.rank), what)
        keys = [self._key(n, r) for r in range(self.world)]
        try:
            self._wait(keys, list(range(self.world)), f"the compile of {what}")
        except ZrsError as e:
            message = (
                f"{e}: a rank compiled a graph alone (an input shape, dtype or branch that only "
                "it saw), and its peers ran the graphs compiled before. Every rank must capture "
                "the same graphs: keep the input sizes symbolic (zrs.compile(dynamic=True), the "
                "default with several ranks), make control flow independent of the rank, or pad "
                "the batches to equal shapes"
            )
            self.store.set(f"{self.prefix}/diverged", message)
            raise ZrsError(message) from None

    def _key(self, n: int, rank: int) -> str:
        return f"{self.prefix}/compile{n}/rank{rank}"

    def note(self, why: str) -> None:
        """Leave why this rank stopped issuing its collectives where its peers look (`explain`).
        The first reason stays: a later one (its own timeout) is a consequence."""
        key = f"{self.prefix}/failed/rank{self.rank}"
        if not self.store.check([key]):  # only this rank writes its key: no race
            self.store.set(key, why)

    def notes(self) -> str | None:
        """The reasons the other ranks left (`note`), without waiting; None if there are none."""
        failed = [f"{self.prefix}/failed/rank{r}" for r in range(self.world) if r != self.rank]
        notes = [self.store.get(k).decode() for k in failed if self.store.check([k])]
        return "; ".join(notes) or None

    def explain(self) -> str | None:
        """Why a collective of this rank failed, if a peer left a reason: it waits at (or gave
        up on) a compile that this rank never reached, or it noted an error; None otherwise."""
        notes = self.notes()
        if notes is not None:
            return notes
        diverged = f"{self.prefix}/diverged"
        # Only compiles arrive (zrs.shard never does): a key no rank set would block a get.
        at_keys = [f"{self.prefix}/at/rank{r}" for r in range(self.world)]
        at = [self.store.get(k) for k in at_keys if self.store.check([k])]
        ahead = any(int(n) > self.arrived for n in at if n)
        if not ahead and not self.store.check([diverged]):
            return None
        try:
            self.store.wait([diverged], self.timeout)
        except RuntimeError:  # DistStoreError, or a FileStore's plain "Wait timeout"
            return None
        return self.store.get(diverged).decode()
