"""The step benchmark's optional looks inside a step, each after the timed steps (so that they
are not slowed) and each writing a file per rank and a summary into the record: torch.profiler
traces (--trace), cProfile host profiles (--host-profile), the first step's sampled stacks
(--first-profile) and the CUDA allocator's history (--memory)."""

from __future__ import annotations

import argparse
import collections
import cProfile
import pickle
import pstats
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harness.data import Data
from harness.device import sync
from memory_peak import peak_breakdown
from systems.common import Built, Ctx
from trace_summary import load, summarize

TRACE_STEPS = 3


def artifact_path(args: argparse.Namespace, directory: Path, system: str, suffix: str) -> Path:
    """This rank's file in `directory` (created) for one run: preset, system, tag and rank."""
    directory.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return directory / f"{args.preset}_{system}_{args.tag or 'nvlink'}_rank{rank}.{suffix}"


TRACE_TOP = 20


def profile_steps(system: str, ctx: Ctx, built: Built, data: Data, start: int) -> dict:
    """Run TRACE_STEPS more steps under torch.profiler (after the timed ones, so they are not
    slowed): a Chrome trace per rank in --trace DIR, and the ops with the most device (else CPU)
    self time per step, for the record."""
    from torch.profiler import ProfilerActivity, profile

    args, device = ctx.args, ctx.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for i in range(TRACE_STEPS):
            built.step(*data(start + i))
        sync(device)
    path = artifact_path(args, args.trace, system, "json.gz")
    prof.export_chrome_trace(str(path))  # gzipped: a 1b trace is ~20 MB of JSON
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TRACE_TOP]
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:TRACE_TOP]
    zrs_ops = sorted((e for e in events if e.key.startswith("zrs::")), key=lambda e: e.key)
    return {
        "trace": str(path),
        "timeline": summarize(load(path), TRACE_STEPS),
        "top_ops_ms_per_step": [
            [e.key, round(getattr(e, key) / 1e3 / TRACE_STEPS, 3)] for e in top
        ],
        # The host's side: ops by their own CPU time, and every zrs op (calls, CPU time with
        # what it calls), per step.
        "top_host_ops_ms_per_step": [
            [e.key, round(e.self_cpu_time_total / 1e3 / TRACE_STEPS, 3)] for e in host
        ],
        "zrs_ops_per_step": [
            [e.key, e.count // TRACE_STEPS, round(e.cpu_time_total / 1e3 / TRACE_STEPS, 3)]
            for e in zrs_ops
        ],
    }


HOST_TOP = 30


def host_profile(system: str, ctx: Ctx, built: Built, data: Data, start: int) -> dict:
    """TRACE_STEPS more steps under cProfile (after the timed ones): the host's wall time per step,
    and the functions with the most own time and the most time with their callees, ms per step.
    A device sync ends each step, so a wait for the GPU shows as the sync's own time."""
    sync(ctx.device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(TRACE_STEPS):
        built.step(*data(start + i))
        sync(ctx.device)
    prof.disable()
    wall = time.perf_counter() - t0
    path = artifact_path(ctx.args, ctx.args.host_profile, system, "prof")
    return {
        "step_ms": round(wall * 1e3 / TRACE_STEPS, 2),
        **profile_summary(prof, path, TRACE_STEPS),
    }


def profile_summary(prof: cProfile.Profile, path: Path, steps: int) -> dict:
    """Dump ``prof`` to ``path``; the functions with the most own time and the most time with
    their callees, ms per step over ``steps`` steps."""
    prof.dump_stats(path)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, _)

    def label(key: tuple) -> str:
        file, line, name = key
        return f"{Path(file).name}:{line}:{name}" if line else name

    def top(index: int) -> list:
        rows = sorted(stats.items(), key=lambda kv: kv[1][index], reverse=True)[:HOST_TOP]
        return [[label(k), v[1] // steps, round(v[index] * 1e3 / steps, 3)] for k, v in rows]

    return {
        "profile": str(path),
        "self_ms": top(2),  # [function, calls per step, own ms per step]
        "cumulative_ms": top(3),
    }


class StackSampler:
    """The calling thread's Python stack, read every ``interval`` seconds from a side thread
    between `start()` and `stop()`. For the first step (a compile): cProfile's cumulative times
    are wrong for the recursive and re-entered frames dynamo and inductor run, and its overhead
    grows the step by ~40%. A function's share of the samples whose stack holds it is its share
    of the wall time (the samples come late when the step holds the GIL, so they are counted as
    shares of the measured time, not as intervals)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
        self._target = threading.get_ident()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._wall = 0.0

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            frame = sys._current_frames().get(self._target)
            names = []
            while frame is not None:
                code = frame.f_code
                names.append(f"{Path(code.co_filename).name}:{code.co_firstlineno}:{code.co_name}")
                frame = frame.f_back
            self.stacks[tuple(reversed(names))] += 1

    def start(self) -> None:
        self._wall = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        self._wall = time.perf_counter() - self._wall
        self._done.set()
        self._thread.join()

    def summary(self, path: Path) -> dict:
        """The collapsed stacks to ``path`` (flame-graph input: frames joined by ";", then the
        count); the functions with the most seconds with their callees and on their own."""
        held: collections.Counter[str] = collections.Counter()
        own: collections.Counter[str] = collections.Counter()
        with open(path, "w") as f:
            for stack, n in self.stacks.items():
                f.write(f"{';'.join(stack)} {n}\n")
                held.update(dict.fromkeys(set(stack), n))
                own[stack[-1] if stack else "?"] += n

        per_sample = self._wall / max(1, sum(self.stacks.values()))

        def top(counts: collections.Counter[str], rows: int) -> list:
            return [[name, round(n * per_sample, 2)] for name, n in counts.most_common(rows)]

        return {
            "stacks": str(path),
            "seconds": round(self._wall, 2),
            "samples": sum(self.stacks.values()),
            "held_s": top(held, 2 * HOST_TOP),
            "own_s": top(own, HOST_TOP),
        }


def memory_step(system: str, ctx: Ctx, built: Built, data: Data, start: int) -> dict:
    """One more step with the allocator's history on; its snapshot goes to --memory DIR and what
    was live at its peak (rank 0's) into the record."""
    args, device = ctx.args, ctx.device
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    built.step(*data(start))
    sync(device)
    path = artifact_path(args, args.memory, system, "pickle")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return {"snapshot": str(path), **peak_breakdown(snapshot, before)}
