"""Spawn helper for the multi-process CPU tests (gloo).

``run_workers(fn, world_size, *args)`` starts ``world_size`` fresh processes, initialises a gloo
process group in each, calls ``fn(rank, world_size, *args)`` and returns the list of the ranks'
return values (which must be picklable). An exception in any rank fails the caller with the
traceback of every rank that raised; a rank that hangs fails it with a timeout after its stack has
been dumped to stderr, instead of hanging the test session.

Warnings raised in the workers are sent back and re-emitted in the parent, so that the project's
``filterwarnings = error`` applies to code that runs in the workers too.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessContext, ProcessException

# Seconds a whole run may take; generous, because inductor compiles C++ on a 2-core machine.
DEFAULT_TIMEOUT = float(os.environ.get("ZRS_TEST_TIMEOUT", "900"))
# Seconds a single gloo collective may wait for its peers before raising in that rank.
COLLECTIVE_TIMEOUT = float(os.environ.get("ZRS_TEST_COLLECTIVE_TIMEOUT", "240"))

# Environment for the workers. One thread per rank: the ranks already share few cores.
_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}


def _worker_env(backend: str, world_size: int) -> dict[str, str]:
    """`_WORKER_ENV`, but on GPUs (NCCL) each rank compiles Triton kernels in parallel on its
    share of the host's cores: with one compile thread each tiny zoo model took ~17 s to train
    under inductor on 2 H100s."""
    if backend != "nccl":
        return _WORKER_ENV
    cores = max(1, (os.cpu_count() or 1) // world_size)
    return {**_WORKER_ENV, "TORCHINDUCTOR_COMPILE_THREADS": str(cores)}


class WorkerError(RuntimeError):
    """One or more ranks raised or died; the message holds every failed rank's traceback."""


class WorkerTimeout(RuntimeError):
    """Some ranks did not finish within the timeout (a hang or a desync)."""


WarningRecord = tuple[type, str, str, int]


def _warning_record(w: warnings.WarningMessage) -> WarningRecord:
    category = w.category
    try:
        pickle.dumps(category)
    except Exception:
        category = UserWarning
    return (category, str(w.message), w.filename, w.lineno)


@contextlib.contextmanager
def record_warnings() -> Iterator[list[WarningRecord]]:
    """Collect the warnings raised inside the block as picklable, de-duplicated records."""
    out: list[WarningRecord] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield out
        finally:
            seen = set()
            for w in caught:
                rec = _warning_record(w)
                if rec[1:] not in seen:
                    seen.add(rec[1:])
                    out.append(rec)


def reemit_warnings(records: list[WarningRecord], where: str = "") -> None:
    """Re-raise warnings recorded in a worker in this process, where pytest's filters apply."""
    for category, message, filename, lineno in records:
        text = f"{message} (in worker{': ' + where if where else ''})"
        warnings.warn_explicit(text, category, filename, lineno)


def _worker_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    init_method: str,
    out_dir: str,
    backend: str,
    virtual_local_rank: bool = False,
) -> None:
    torch.set_num_threads(1)
    device = rank
    if backend == "nccl" and virtual_local_rank:
        # As `torchrun --virtual-local-rank` starts a rank: it sees its own GPU alone, as cuda:0
        # (set before anything initialises CUDA in this fresh process).
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[rank] if visible else str(rank)
        device = 0
    if backend == "nccl":
        torch.cuda.set_device(device)
    # On SIGUSR1 (sent by the parent at its deadline) dump every thread's stack to stderr, so
    # that a hang shows where each rank is stuck. Likewise on SIGTERM, which torch's spawn sends
    # to the other ranks when one raises: often the raising rank only timed out waiting for a
    # rank that is stuck, and the stuck rank's stack is the one that explains the failure.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    with record_warnings() as caught:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT),
            # NCCL: bind the rank's GPU now (else barrier() warns that it guesses the device)
            device_id=torch.device("cuda", device) if backend == "nccl" else None,
        )
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"result{rank}.pkl"), "wb") as fh:
        pickle.dump({"result": result, "warnings": caught}, fh)


@contextlib.contextmanager
def _patched_env(env: dict[str, str]) -> Iterator[None]:
    # spawn copies os.environ at start; only set what the user has not set already.
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _read_errors(ctx: ProcessContext) -> str:
    parts = []
    for rank, (proc, path) in enumerate(zip(ctx.processes, ctx.error_files, strict=True)):
        if os.access(path, os.R_OK) and os.path.getsize(path) > 0:
            with open(path, "rb") as fh:
                tb = pickle.load(fh)
            parts.append(f"-- rank {rank} raised:\n{tb}")
        elif proc.exitcode not in (0, None):
            code = proc.exitcode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            parts.append(f"-- rank {rank} died with {how} (without a Python traceback)")
    return "\n".join(parts)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    backend: str = "gloo",
    virtual_local_rank: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a ``backend`` process
    group (gloo; or nccl, rank r on GPU r, which it sees as cuda:0 alone with
    ``virtual_local_rank``, as torchrun's flag of that name does); return their results.

    ``fn`` must be a module-level (picklable) function. Raises ``WorkerError`` if any rank
    raised or died (with every failing rank's traceback) and ``WorkerTimeout`` if the ranks do
    not all finish within ``timeout`` seconds (their stacks are dumped to stderr first).
    """
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    with tempfile.TemporaryDirectory(prefix="zrs-test-") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        with _patched_env(_worker_env(backend, world_size)):
            ctx = mp.start_processes(
                _worker_entry,
                args=(fn, world_size, args, init_method, tmp, backend, virtual_local_rank),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(
                timeout=max(0.0, min(5.0, deadline - time.monotonic())), grace_period=5.0
            ):
                if time.monotonic() >= deadline:
                    _kill_hung(ctx)
                    raise WorkerTimeout(
                        f"{world_size} worker(s) running {_name(fn)} did not finish within "
                        f"{timeout:.0f}s; their stacks were dumped to stderr above"
                    )
        except ProcessException as exc:
            details = _read_errors(ctx) or str(exc)
            raise WorkerError(f"{_name(fn)} failed on {world_size} rank(s):\n{details}") from None
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join()

        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result{rank}.pkl"), "rb") as fh:
                payload = pickle.load(fh)
            reemit_warnings(payload["warnings"], where=f"rank {rank}")
            results.append(payload["result"])
        return results


def _kill_hung(ctx: ProcessContext) -> None:
    # One rank at a time, so that the stack dumps do not interleave on the shared stderr.
    for rank, proc in enumerate(ctx.processes):
        if proc.is_alive():
            print(
                f"\n--- stack of hung rank {rank} (pid {proc.pid}) ---", file=sys.stderr, flush=True
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def format_exc() -> str:
    """The current exception's traceback, for results that report a failure without raising."""
    return traceback.format_exc()


# The environment of the NCCL ranks of `run_faulty`, set before init_process_group: what torch's
# NCCL watchdog does when a collective that a lost peer never joins times out is pinned, so that
# the tests' expectations hold whatever the caller's environment (docs/faults.md, "Under NCCL").
NCCL_FAULT_ENV = {
    # Work.wait() orders the streams and never blocks the host (torch's default): zrs's host-side
    # checks (the step check, the store meetings) are what must raise.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # torch's default: at a collective's timeout the watchdog takes the process down...
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # ...4 times this many ms later (it waits for the flight recorder's dump first): 60 s, which
    # puts zrs's ZrsError, at the timeout, well ahead of it (torch's default, pinned).
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000",
    # No flight-recorder dump files from the ranks' timeouts.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # No nvcc build of zrs's copy kernels, which a rank killed mid-build would leave locked for
    # every later process (the torch ops serve).
    "ZRS_NO_CUDA_KERNELS": "1",
}


def _fault_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    init_method: str,
    out: str,
    backend: str,
) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        os.environ.update(NCCL_FAULT_ENV)
        torch.cuda.set_device(rank)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT),
        device_id=torch.device("cuda", rank) if backend == "nccl" else None,
    )
    try:
        result: Any = fn(rank, world_size, *args)
    except Exception:
        result = WorkerError(traceback.format_exc())
    with open(os.path.join(out, f"result{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    # A peer may be stopped or dead: no barrier, no destroy_process_group (both would wait). Under
    # NCCL a collective that the peer never joined may still be pending on this rank's GPU:
    # _exit leaves it to the driver instead of waiting for it in CUDA's or NCCL's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_faulty(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """``run_workers`` for ranks that may stop or kill themselves on purpose: each rank's result,
    None for a rank that left none (it died or was still stopped at the end). A rank that raises
    gives its traceback as a ``WorkerError`` result; the run fails with ``WorkerTimeout`` only if
    a rank that has not stopped itself is still running at ``timeout``.

    ``backend``: "gloo" (CPU), or "nccl": rank r on GPU r, with ``NCCL_FAULT_ENV``."""
    with tempfile.TemporaryDirectory(prefix="zrs-fault-") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        with _patched_env(_worker_env(backend, world_size)):
            ctx = mp.start_processes(
                _fault_entry,
                args=(fn, world_size, args, init_method, tmp, backend),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
        deadline = time.monotonic() + timeout
        paths = [os.path.join(tmp, f"result{r}.pkl") for r in range(world_size)]
        try:
            while True:
                running = [
                    r
                    for r, p in enumerate(ctx.processes)
                    if p.is_alive() and not _stopped(p.pid) and not os.path.exists(paths[r])
                ]
                if not running:
                    break
                if time.monotonic() >= deadline:
                    _kill_hung(ctx)
                    raise WorkerTimeout(
                        f"rank(s) {running} running {_name(fn)} did not finish within "
                        f"{timeout:.0f}s; their stacks were dumped to stderr above"
                    )
                time.sleep(0.2)
            time.sleep(0.5)  # a rank that just wrote its result is exiting
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        results = []
        for path in paths:
            try:
                with open(path, "rb") as fh:
                    results.append(pickle.load(fh))
            except (OSError, EOFError):
                results.append(None)
        return results


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


_RUN_CACHE: dict[object, object] = {}


def cached_run(key: object, fn: Callable[..., Any], world_size: int, *args: Any, **kw: Any) -> Any:
    """``run_workers`` once per ``key`` for the whole session; later calls (and a failed run)
    give the same result (or raise the same error) without starting workers again. Lets many
    small tests read the results of one expensive spawned group."""
    if key not in _RUN_CACHE:
        try:
            _RUN_CACHE[key] = run_workers(fn, world_size, *args, **kw)
        except Exception as exc:
            _RUN_CACHE[key] = exc
    result = _RUN_CACHE[key]
    if isinstance(result, Exception):
        raise RuntimeError(f"the worker group {key!r} failed as a whole:\n{result}") from None
    return result


def as_torchrun(rank: int, world_size: int) -> None:
    """The environment torchrun gives a rank, for libraries that read it rather than the
    process group (Accelerate decides whether it trains distributed from WORLD_SIZE)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
