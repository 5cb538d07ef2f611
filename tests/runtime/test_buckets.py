"""Gradient buckets: many small buckets, gradients larger than a bucket, buckets the compiler
planned (reduced full) and unplanned ones (reduced partly filled), and the bound on
reduce-scatters in flight, against the unsharded reference on 2 and 3 ranks (the correctness zoo
fits every model's gradients into one bucket)."""

from __future__ import annotations

import pytest
import torch

from _dist import run_workers
from zoo import LR, MOMENTUM, STEPS, ZOO, compare_params, train_reference

RTOL, ATOL = 1e-5, 1e-6
MODEL = "gpt_tied"
BUCKET_NUMEL = 40  # elements per rank: a weight's gradient exceeds it, biases and norms share one


def _train_small_buckets(
    rank: int, world: int, backend: str, planned: bool, separate_comm: bool = True
) -> dict:
    import zrs
    from zrs.compiler import pipeline
    from zrs.runtime import grads

    grads.GRAD_BUCKET_NUMEL = BUCKET_NUMEL
    if not planned:  # every gradient reaches the runtime without its bucket's size
        pipeline.plan_grad_buckets = lambda graph, shard_numels: []
    in_flight: list[int] = []
    fills: list[tuple[int, int]] = []  # (elements used, capacity) of each reduced bucket
    flush = grads._flush

    def spy(state):
        bucket = state.step.bucket
        fills.append((bucket.used, bucket.buf.size(1)))
        flush(state)
        in_flight.append(len(state.step.reducing))

    grads._flush = spy
    spec = ZOO[MODEL]
    model = zrs.compile(spec.build(), backend=backend, separate_reduce_communicator=separate_comm)
    state = model._zrs_state
    assert (state.reduce_group is state.group) != separate_comm
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        spec.loss(model, spec.batch(rank, step)).backward()
        opt.step()
    state = zrs.full_state_dict(model)
    return {
        "state": {k: v.detach().clone() for k, v in state.items()},
        "in_flight": in_flight,
        "fills": fills,
    }


@pytest.mark.parametrize(
    ("world", "backend", "planned", "separate_comm"),
    [
        (2, "eager", True, True),
        (3, "eager", True, True),
        (2, "inductor", True, True),
        (3, "eager", False, True),
        (3, "eager", True, False),  # gathers and reduce-scatters share one communicator
    ],
)
def test_small_buckets_train_like_unsharded(
    world: int, backend: str, planned: bool, separate_comm: bool
) -> None:
    per_rank = run_workers(_train_small_buckets, world, backend, planned, separate_comm)
    ref = train_reference(ZOO[MODEL], world)
    for rank, r in enumerate(per_rank):
        problems = compare_params(r["state"], ref.final, rtol=RTOL, atol=ATOL)
        assert not problems, (rank, problems)
        assert len(r["in_flight"]) > 3 * STEPS, "several buckets per backward"
        assert max(r["in_flight"]) <= 2, "at most two reduce-scatters in flight"
        partial = [f for f in r["fills"] if f[0] < f[1]]
        if planned:  # sized by the compiler: each bucket is reduced full, with no packing copy
            assert not partial, partial
        else:  # filled on the fly: the next gradient often does not fit
            assert partial


def test_gradients_accumulate_over_micro_batches(monkeypatch) -> None:
    """Two backward passes before the step: each shard's .grad is the sum of both passes'
    gradients (the first pass's reduce-scatter output is the .grad; the second adds into it)."""
    import zrs
    from zrs.runtime import grads
    from zrs.runtime import state as runtime

    monkeypatch.setattr(grads, "GRAD_BUCKET_NUMEL", BUCKET_NUMEL)
    spec = ZOO[MODEL]
    torch.manual_seed(0)
    reference = spec.build()
    torch.manual_seed(0)
    model = zrs.compile(spec.build(), backend="eager")
    batches = [spec.batch(0, 0), spec.batch(1, 0)]
    for batch in batches:
        spec.loss(model, batch).backward()
        spec.loss(reference, batch).backward()
    runtime.reset()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)


def _reduce_groups(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from zrs.runtime import collectives
    from zrs.runtime.exchange import group_timeout

    sub = dist.new_group([0, 1])  # every rank creates the subgroup
    out: dict = {}
    if rank in (0, 1):  # only its members make its reduce communicator (rank 2 does not call)
        reduce = collectives.new_group_like(sub, group_timeout(sub))
        x = torch.full((2,), float(rank + 1))
        y = torch.empty(1)
        dist.reduce_scatter_tensor(y, x, group=reduce)
        out = {
            "separate": reduce is not sub,
            "timeout": group_timeout(reduce) == group_timeout(sub),
            "ranks": dist.get_process_group_ranks(reduce),
            "sum": y.item(),
        }
    dist.barrier()
    return out


def test_reduce_scatters_get_a_communicator_of_their_own_over_the_same_ranks():
    """A second communicator, so that NCCL does not queue reduce-scatters behind all-gathers;
    made by the group's members alone, so a subgroup works without the other ranks."""
    results = run_workers(_reduce_groups, 3)
    for r in results[:2]:
        assert r == {"separate": True, "timeout": True, "ranks": [0, 1], "sum": 3.0}
    assert results[2] == {}
