"""Side CUDA streams for the collectives: all-gathers on a high-priority stream, reduce-scatters on
another, ordered against the compute stream with events only (no CPU sync, no `record_stream`).

Opt-in with `ZRS_COMM_STREAMS=1`: on GPUs it measured slower than the compute stream
(BENCHMARKS.md). Without it (and always on the CPU) the collectives go through torch.distributed
from the compute stream.

Ownership rule that makes `record_stream` unnecessary: a tensor is allocated on the stream that
frees it. Buffers the compute stream reads later (gathered parameters, reduce-scatter outputs,
gradient buckets) are allocated on the compute stream before the side stream starts, and the
compute stream waits for the side stream's done event before it uses them; scratch that only
the side stream touches (the packed send buffer, a fused gather's receive buffer) is allocated on
the side stream and kept referenced until that done event has been waited for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ENV = "ZRS_COMM_STREAMS"


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get(ENV, "0") == "1"


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream | None:
    """A new side stream for `role` ("gather" or "reduce") on `device`, or None when the
    collectives run on the compute stream. Each model owns its own (`ZeroState`)."""
    if not enabled(device):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Lower is higher priority: gathers feed the compute stream's next layer.
    return torch.cuda.Stream(device=index, priority=-1 if role == "gather" else 0)


@contextlib.contextmanager
def running_on(stream: torch.cuda.Stream) -> Iterator[list[torch.cuda.Event]]:
    """Run the block on `stream` after the compute stream's work so far; yields a list that holds,
    after the block, the event that marks the block's end on `stream`."""
    compute = torch.cuda.current_stream(stream.device)
    stream.wait_stream(compute)
    done: list[torch.cuda.Event] = []
    with torch.cuda.stream(stream):
        yield done
        done.append(stream.record_event())


def wait_for(event: torch.cuda.Event | None) -> None:
    """Make the compute stream wait for `event` (a side stream's done event); None: nothing."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)
