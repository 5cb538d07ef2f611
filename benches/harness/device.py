"""What the harness reads off torch and the device: a device sync (before a clock is read), the
peak memory, and dynamo's graph count and compile timers."""

from __future__ import annotations

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dynamo_graphs() -> int:
    """Graphs dynamo compiled in this process so far (torch.compile, zrs, DeepCompile)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def max_memory(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def compile_phases(least_s: float = 0.5) -> dict[str, float]:
    """torch's compile timers (dynamo, AOTAutograd, inductor phases) summed over this process."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {
        n: round(float(v), 2) for n, v in zip(names, values, strict=True) if float(v) >= least_s
    }
