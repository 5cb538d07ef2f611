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
from typing import Any

import torch
import torch.distributed as dist
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

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
