"""torch.library.opcheck for every zrs op (one process, no process group: collectives are copies),
on the CPU and, where there is one, on a CUDA device (the CUDA kernels of the copy ops included).

The lowered ops change runtime state (holders, buckets), so each gets the opcheck utilities that
make sense for it: `test_schema` checks the alias annotations against what the kernel really does,
`test_faketensor` checks the fake against the real kernel. The functional `gather` also gets the
autograd and AOT-dispatch checks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zrs
from zrs.runtime import state as runtime

STATEFUL_UTILS = ("test_schema", "test_faketensor")


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


@pytest.fixture(params=DEVICES)
def handles(request):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)).to(request.param)
    zrs.compile(model, backend="eager")
    yield model._zrs_state.handles
    runtime.reset()


def test_gather(handles):
    h = handles[0]
    torch.library.opcheck(torch.ops.zrs.gather.default, (h.shard, h.ds_id, list(h.shape)))
    torch.library.opcheck(
        torch.ops.zrs.gather.default,
        (h.shard, h.ds_id, list(h.shape)),
        {"dtype": torch.bfloat16},
    )


def test_gather_grad(handles):
    h = handles[0]
    grad = torch.randn(h.shape, device=h.shard.device)
    torch.library.opcheck(torch.ops.zrs.gather_grad.default, (grad, h.ds_id))
    torch.testing.assert_close(torch.ops.zrs.gather_grad(grad, h.ds_id), grad.reshape(-1))


def test_allgather_wait_release(handles):
    h = handles[0]
    for _ in range(8):  # opcheck runs each op several times: hold enough gathers to release
        torch.ops.zrs.allgather_param(h.shard, 0, h.ds_id)
    torch.library.opcheck(
        torch.ops.zrs.allgather_param.default, (h.shard, 0, h.ds_id), test_utils=STATEFUL_UTILS
    )
    full = torch.ops.zrs.allgather_param(h.shard, 0, h.ds_id)
    torch.library.opcheck(
        torch.ops.zrs.wait_allgather.default, (full, 0, h.ds_id), test_utils=STATEFUL_UTILS
    )
    torch.testing.assert_close(full, h.shard.detach().view(h.shape))
    torch.library.opcheck(
        torch.ops.zrs.release_param.default,
        (full, 0, h.ds_id, 1, [full]),
        test_utils=STATEFUL_UTILS,
    )


def test_prefetch_params_fused(handles):
    shards = [h.shard for h in handles]
    ids = [h.ds_id for h in handles]
    torch.library.opcheck(
        torch.ops.zrs.prefetch_params_fused.default, (0, shards, ids), test_utils=STATEFUL_UTILS
    )
    for h in handles:  # the prefetched copies are what allgather_param then hands out
        full = torch.ops.zrs.wait_allgather(
            torch.ops.zrs.allgather_param(h.shard, 0, h.ds_id), 0, h.ds_id
        )
        torch.testing.assert_close(full, h.shard.detach().view(h.shape))


def test_group_ops(handles):
    """allgather_params / wait_allgathers / release_params: one call per group (compiler/coalesce.py).
    wait_allgathers declares its outputs aliases of the token, which stands for the gathered
    buffers, so only the fake is checked against the kernel (test_schema would want real views)."""
    shards = [h.shard for h in handles]
    ids = [h.ds_id for h in handles]
    dtypes = [torch.float32] * len(ids)
    token = torch.ops.zrs.allgather_params(0, shards, ids, dtypes)
    torch.library.opcheck(
        torch.ops.zrs.wait_allgathers.default, (token, 0, ids, dtypes), test_utils="test_faketensor"
    )
    fulls = torch.ops.zrs.wait_allgathers(token, 0, ids, dtypes)
    for h, full in zip(handles, fulls, strict=True):
        torch.testing.assert_close(full, h.shard.detach().view(h.shape))
    # Inductor's CUDA code asserts that each starts 16-byte aligned (a 15-element weight leaves
    # the next member unaligned if packed tight), and reads that from the fake, which must agree.
    with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        fakes = torch.ops.zrs.wait_allgathers(token, 0, ids, dtypes)
    assert [f.storage_offset() for f in fakes] == [f.storage_offset() for f in fulls]
    assert all(f.storage_offset() * f.element_size() % 16 == 0 for f in fulls), fulls
    state = handles[0].state
    assert all(state.registry.info(h.slot).holders == 1 for h in handles)
    torch.ops.zrs.release_params(fulls, 0, ids, [False] * len(ids))
    assert all(state.registry.info(h.slot).holders == 0 for h in handles)
    assert not state.step.buffers and not state.step.flat_of
    torch.library.opcheck(
        torch.ops.zrs.allgather_params.default,
        (0, shards, ids, dtypes),
        test_utils="test_faketensor",
    )


def test_reduce_grads_packs_like_one_reduce_per_gradient(handles):
    grads = [torch.randn(h.shape, device=h.shard.device) for h in handles]
    ids = [h.ds_id for h in handles]
    torch.ops.zrs.reduce_grads(grads, 0, ids, [0] * len(ids))
    torch.ops.zrs.end_backward(0, [])
    batched = [h.param.grad.clone() for h in handles]
    for h in handles:
        h.param.grad = None
    for g, i in zip(grads, ids, strict=True):
        torch.ops.zrs.reduce_grad(g, 0, i)
    torch.ops.zrs.end_backward(0, [])
    for h, b in zip(handles, batched, strict=True):
        torch.testing.assert_close(h.param.grad, b, rtol=0, atol=0)
        torch.testing.assert_close(b, grads[ids.index(h.ds_id)])


def test_reduce_grad_and_end_backward(handles):
    h = handles[0]
    grad = torch.randn(h.shape, device=h.shard.device)
    torch.library.opcheck(
        torch.ops.zrs.reduce_grad.default, (grad, 0, h.ds_id), test_utils=STATEFUL_UTILS
    )
    torch.library.opcheck(
        torch.ops.zrs.end_backward.default, (0, [grad]), test_utils=STATEFUL_UTILS
    )
    assert h.param.grad is not None
    calls = h.param.grad / grad  # every call accumulated the same gradient
    assert torch.allclose(calls, calls.flatten()[0].expand_as(calls))


def test_unknown_ds_id_is_a_clear_error():
    with pytest.raises(zrs.ZrsError, match="unknown parameter ds_id 123456"):
        torch.ops.zrs.gather_grad(torch.zeros(2), 123456)
