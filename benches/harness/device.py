"""What the harness reads off torch and the device: a device sync (before a clock is read), the
peak memory, dynamo's graph count and compile timers, and the garbage collector's time."""

from __future__ import annotations

import gc
import time

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


def compile_graphs() -> list[dict]:
    """Each graph torch compiled in this process so far, from its own metrics: its compile id
    ("frame/recompile"), the function, its FX nodes, and seconds of the forward's whole compile
    (dynamo to inductor), of the backward's (inductor, lazily at the first backward), and of
    each's inductor code generation and Triton builds. One model's graphs apart: the layer's
    and the root's of compiled layers, the block's of FSDP2 + compile."""
    from torch._dynamo.utils import get_compilation_metrics

    graphs: dict[str, dict] = {}
    for m in get_compilation_metrics():
        g = graphs.setdefault(str(m.compile_id), {"id": str(m.compile_id)})
        side = "fw" if m.is_forward else "bw"
        if m.co_name:
            g["fn"] = m.co_name
        if m.graph_node_count:
            g["nodes"] = m.graph_node_count
        total = (m.duration_us or 0) / 1e6
        g[f"{side}_s"] = round(g.get(f"{side}_s", 0.0) + total, 2)
        g[f"{side}_codegen_s"] = round((m.code_gen_time_s or 0.0), 2)
        g[f"{side}_triton_s"] = round((m.triton_compile_time_us or 0) / 1e6, 2)
    return list(graphs.values())


class CollectorTime:
    """Time Python's garbage collector spends between `start()` and `stop()`, by generation: a
    compile creates millions of objects, and each full collection walks all of them."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._began = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        gen = min(int(info["generation"]), 2)
        self.seconds[gen] += time.perf_counter() - self._began
        self.counts[gen] += 1

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> dict[str, float | int]:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        return {
            "young_s": round(self.seconds[0] + self.seconds[1], 2),
            "full_s": round(self.seconds[2], 2),
            "full_collections": self.counts[2],
        }
