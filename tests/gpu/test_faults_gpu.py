"""Faults under NCCL end in errors, never a hang: the scenarios of tests/support/faults.py (which
tests/e2e/test_faults.py runs on gloo) on 2 GPUs, NCCL process groups (rank r on cuda:r),
zrs.compile(timeout=10).

Under NCCL the host does not wait in collectives: a peer that stops, dies, raises or compiles
alone leaves this rank's collectives pending on its GPU while its host runs on, to the next
forward's step check (a gloo exchange on zrs's control group) or a store meeting (a compile).
Those are where every survivor's ZrsError comes from: at once when the peer is there to compare
step counters with, at the timeout when it is stopped. torch's NCCL watchdog sees the pending
collective time out as well and takes the process down 60 s after that timeout (its defaults,
pinned by `_dist.NCCL_FAULT_ENV`): zrs's error must come first. docs/faults.md, "Under NCCL".

A scenario that leaves a collective pending on a GPU (every one where a rank stops issuing them)
ends its process group: the stream stays blocked. Each is the last of its spawn: six spawns.

Every test prints each rank's latency, the seconds from the fault to its error, on lines that
start with "nccl fault" (run with -s). Marked `gpu` (tests/conftest.py); needs two GPUs.
"""

from __future__ import annotations

import time

import pytest
import torch

import faults
from _dist import WorkerError, run_faulty

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.xdist_group("faults_gpu"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="faults under NCCL run on two GPUs",
    ),
]

TIMEOUT = 10.0  # zrs.compile(timeout=): every communicator and store meeting of the models
# Seconds an error may come after the timeout: the explanation's store reads, and (one rank
# recompiling alone) that rank's own trace before it starts to wait for its peer.
MARGIN = 10.0
BOUND = 150  # one spawn: NCCL init, the compiles, the faults

T, CUDA = TIMEOUT, "cuda"
_PLANS = {
    "recover, then a forward raises": (
        faults.in_turn,
        (
            [
                ("all_ranks_raise", faults.all_ranks_raise, (T, "eager", CUDA)),
                ("forward", faults.one_rank_raises, (T, "forward", "eager", CUDA)),
            ],
        ),
    ),
    "an optimizer step, then a backward raises": (
        faults.in_turn,
        (
            [
                ("optimizer", faults.one_rank_raises, (T, "optimizer", "eager", CUDA)),
                ("backward", faults.one_rank_raises, (T, "backward", "eager", CUDA)),
            ],
        ),
    ),
    "a rank recompiles alone": (faults.disagreements, (T, ("shape_on_one_rank",), CUDA)),
    "stop": (faults.peer_lost, (T, "stop", True, CUDA)),
    "kill": (faults.peer_lost, (T, "kill", False, CUDA)),
    "stop before a replay": (faults.replay_lost, (T, CUDA)),
}
_RESULTS: dict[str, list | Exception] = {}


def _spawn(plan: str) -> list:
    """The ranks' results of `plan`, run once for the module (a failed run fails every test that
    reads it, without running it again)."""
    if plan not in _RESULTS:
        fn, args = _PLANS[plan]
        t0 = time.monotonic()
        try:
            _RESULTS[plan] = run_faulty(fn, 2, *args, timeout=BOUND, backend="nccl")
        except Exception as e:
            _RESULTS[plan] = e
        print(f"\nnccl fault spawn {plan!r}: {time.monotonic() - t0:.1f} s")
    result = _RESULTS[plan]
    if isinstance(result, Exception):
        pytest.fail(f"the spawn {plan!r} failed as a whole:\n{result}")
    return result


def _rank(results: list, rank: int, key: str | None = None) -> dict:
    """One rank's result (of scenario `key` of an `in_turn` plan); fails on a rank that raised
    outside the scenario's own error handling or died."""
    r = results[rank]
    if isinstance(r, WorkerError):
        pytest.fail(f"rank {rank} raised:\n{r}")
    if r is None:
        pytest.fail(
            f"rank {rank} left no result: it died, maybe taken down by the NCCL watchdog (60 s "
            "after a collective's timeout); see its stderr"
        )
    if key is not None:
        r = r[key]
        if "failed" in r:
            pytest.fail(f"rank {rank} raised in {key}:\n{r['failed']}")
    return r


def _latency(fault: str, rank: int, record: dict) -> str:
    line = (
        f"nccl fault | {fault} | rank {rank} | {record['kind'] or 'no error'} after "
        f"{record['seconds']:.2f} s (timeout {TIMEOUT:g} s) | {record['error'][:300]}"
    )
    print(line)
    return line


def _within_timeout(fault: str, rank: int, record: dict) -> None:
    line = _latency(fault, rank, record)
    assert record["kind"] == "ZrsError", line
    assert record["seconds"] <= TIMEOUT + MARGIN, line


def test_every_rank_raising_in_a_phase_recovers_to_the_clean_skip():
    results = _spawn("recover, then a forward raises")
    for rank in range(2):
        r = _rank(results, rank, "all_ranks_raise")
        faults.assert_recovered(r)
        assert r["timeouts"] == [TIMEOUT] * 3, "every communicator zrs made waits `timeout`"


def _one_rank_raises(phase: str) -> tuple[list[dict], list[dict]]:
    plan = "recover, then a forward raises"
    if phase != "forward":
        plan = "an optimizer step, then a backward raises"
    results = _spawn(plan)
    peer, failed = (_rank(results, rank, phase)["errors"] for rank in range(2))
    assert failed and failed[0]["kind"] == "Fault", failed  # rank 1 sees its own error first
    return peer, failed


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_pass_that_raises_on_one_rank_stops_every_rank_within_the_timeout(phase):
    """The peer's host does not wait for the collectives that rank 1 never issues: both ranks
    meet at the next step check, which finds one backward and one optimizer step fewer on rank
    1 (docs/faults.md)."""
    peer, failed = _one_rank_raises(phase)
    fault = f"rank 1 raises in its {phase}"
    assert peer, "rank 0 got no error"
    _within_timeout(fault, 0, peer[0])
    assert len(failed) > 1, f"rank 1 got no error after its own: {failed}"
    _within_timeout(fault, 1, failed[1])  # its next step finds no peer or other counters
    for errors in (peer, failed):
        assert errors[-1]["kind"] == "ZrsError", errors  # and every later step refuses


def test_an_optimizer_step_that_raises_on_one_rank_is_found_at_the_next_forward():
    peer, failed = _one_rank_raises("optimizer")
    fault = "rank 1 raises in its optimizer step"
    for rank, errors in ((0, peer), (1, failed[1:])):
        assert errors, f"rank {rank} got no ZrsError"
        _within_timeout(fault, rank, errors[0])
        assert "optimizer steps" in errors[0]["error"]


def test_a_rank_that_recompiles_alone_stops_every_rank_within_the_timeout():
    """Rank 1's batch of one row recompiles its first graph alone: it waits in the store for a
    compile that rank 0 never reaches, while rank 0 waits at the next step check."""
    results = _spawn("a rank recompiles alone")
    for rank in range(2):
        record = _rank(results, rank)["shape_on_one_rank"]
        _within_timeout("rank 1 recompiles alone (a batch of one row)", rank, record)
        assert "compile" in record["error"], record


@pytest.mark.parametrize(
    "how", ["stop", "kill"], ids=["stopped, the group's timeout", "killed, zrs's timeout"]
)
def test_a_lost_peer_gives_the_survivor_an_error_within_the_timeout(how):
    """Rank 1 stops (SIGSTOP) or dies (SIGKILL) in its backward. Rank 0's host runs past the
    collectives that will never complete to the next step check: a stopped peer times it out, a
    dead one closes its connection at once."""
    results = _spawn(how)
    assert results[1] is None, results[1]  # stopped or dead: it left no result
    survivor = _rank(results, 0)
    _within_timeout(f"rank 1 {'stopped' if how == 'stop' else 'killed'}", 0, survivor)
    if how == "stop":  # nothing fails before the timeout
        assert survivor["seconds"] >= TIMEOUT - 0.5, survivor
    assert "restart" in survivor.get("next", ""), survivor
    assert survivor["next_seconds"] < 1.0, survivor


def test_a_peer_lost_during_a_captured_replay_gives_an_error_within_the_timeout():
    """zrs.CapturedStep: rank 1 stops right before launching a replay, after the step check.
    Rank 0's replayed collectives wait on its GPU, out of the NCCL watchdog's sight, and its host
    waits for the loss: the replay watch aborts them at the timeout (zrs/step/replay_watch.py)."""
    results = _spawn("stop before a replay")
    assert results[1] is None, results[1]  # stopped: it left no result
    survivor = _rank(results, 0)
    _within_timeout("rank 1 stopped before its replay", 0, survivor)
    assert "replayed step did not finish within the timeout" in survivor["error"], survivor
    assert "restart" in survivor.get("next", ""), survivor
