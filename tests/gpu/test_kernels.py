"""CUDA copy kernels against the torch implementations they replace (one GPU is enough).

Each kernel must match the torch implementation bit for bit: both compute in float32 (float64
when a side is float64), apply the scale there and cast once. Cases cover bf16/fp16/fp32 in and
out, odd sizes, misaligned pointers (the scalar path), many members (the segment table then
goes through device memory instead of the kernel parameters) and side streams. opcheck runs on
CUDA for all three ops. Not marked `gpu`: these need one CUDA device, not two.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import zrs  # noqa: F401  (defines the ops)
from zrs.runtime import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 4096, 0, 4097, 70001, 3, 1 << 16, 12345]


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels():
    assert kernels.load(), f"CUDA kernels not loaded: {kernels.status()}"
    assert all(kernels._has_cuda_kernel(op) for op in kernels.OPS)


def _randn(n: int, dtype: torch.dtype, seed: int, misalign: int = 0) -> torch.Tensor:
    """n random values; `misalign` elements into a larger buffer, so the pointer is unaligned."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(n + misalign, device="cuda", generator=g).to(dtype)
    return base[misalign:]


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("misalign", [0, 1])
def test_pack_cast(src_dtype, out_dtype, misalign):
    shards = [_randn(n, src_dtype, i, misalign * (i % 2)) for i, n in enumerate(SIZES)]
    total = sum(SIZES)
    out = torch.full((total + 5,), 3.0, dtype=out_dtype, device="cuda")
    ref = out.clone()
    torch.ops.zrs.pack_cast(shards, out[misalign:])
    kernels.pack_cast_torch(shards, ref[misalign:])
    _same(out, ref)


def test_pack_cast_mixed_dtypes_and_many_shards():
    # 150 members: more than fit in the kernel parameters, so the table goes through a buffer.
    shards = [_randn(100 + 37 * i, DTYPES[i % 3], i) for i in range(150)]
    out = torch.empty(sum(s.numel() for s in shards), dtype=torch.bfloat16, device="cuda")
    ref = torch.empty_like(out)
    torch.ops.zrs.pack_cast(shards, out)
    kernels.pack_cast_torch(shards, ref)
    _same(out, ref)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_members", [1, 5, 40])
def test_unpack_rank_major(world, dtype, n_members):
    numels = [SIZES[i % len(SIZES)] + i for i in range(n_members)]
    offsets, off = [], 0
    for n in numels:
        offsets.append(off)
        off += n
    recv = _randn(world * off, dtype, world)
    outs = [torch.full((world * n + 3,), 2.0, dtype=dtype, device="cuda") for n in numels]
    refs = [o.clone() for o in outs]
    torch.ops.zrs.unpack_rank_major(recv, world, offsets, numels, outs)
    kernels.unpack_rank_major_torch(recv, world, offsets, numels, refs)
    for o, r in zip(outs, refs, strict=True):
        _same(o, r)


def test_unpack_rank_major_casts_and_gaps():
    world, numels, offsets, block = 3, [5, 1000], [1, 9], 1013
    recv = _randn(world * block, torch.float32, 0)
    outs = [
        torch.empty(world * numels[0], dtype=torch.bfloat16, device="cuda"),
        torch.empty(world * numels[1], dtype=torch.float32, device="cuda"),
    ]
    refs = [torch.empty_like(o) for o in outs]
    torch.ops.zrs.unpack_rank_major(recv, world, offsets, numels, outs)
    kernels.unpack_rank_major_torch(recv, world, offsets, numels, refs)
    for o, r in zip(outs, refs, strict=True):
        _same(o, r)


def _row_shards(grads, world):
    """Each gradient's shard as zrs cuts parameters: whole rows, ceil(rows / world) per rank."""
    return [-(-g.size(0) // world) * (g.numel() // g.size(0)) for g in grads]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_pack_grads(world, grad_dtype, out_dtype):
    shapes = [(5, 3), (7,), (1,), (640, 333), (2048,), (3, 4097), (8, 8)]
    grads = [_randn(torch.Size(s).numel(), grad_dtype, i).view(s) for i, s in enumerate(shapes)]
    grads[3] = grads[3].t()  # non-contiguous, like a transposed weight gradient
    shards = _row_shards(grads, world)
    out = torch.full((world, sum(shards)), 9.0, dtype=out_dtype, device="cuda")
    ref = out.clone()
    torch.ops.zrs.pack_grads(grads, world, shards, 1.0 / world, out)
    kernels.pack_grads_torch(grads, world, shards, 1.0 / world, ref)
    _same(out, ref)


def test_pack_grads_into_a_bucket_slice_many_members():
    world = 2
    grads = [_randn(1 + 31 * i, torch.bfloat16, i) for i in range(60)]  # 120 segments
    shards = _row_shards(grads, world)
    cols = sum(shards)
    bucket = torch.full((world, cols + 11), -1.0, device="cuda")
    ref = bucket.clone()
    torch.ops.zrs.pack_grads(grads, world, shards, 0.5, bucket[:, 3 : 3 + cols])
    kernels.pack_grads_torch(grads, world, shards, 0.5, ref[:, 3 : 3 + cols])
    _same(bucket, ref)


def test_large_tensors():
    world = 8
    g = _randn((1 << 22) + 5, torch.bfloat16, 1)
    shard = -(-g.numel() // world)
    out = torch.empty(world, shard, device="cuda")
    ref = torch.empty_like(out)
    torch.ops.zrs.pack_grads([g], world, [shard], 1.0 / world, out)
    kernels.pack_grads_torch([g], world, [shard], 1.0 / world, ref)
    _same(out, ref)
    send = torch.empty(g.numel(), dtype=torch.float16, device="cuda")
    torch.ops.zrs.pack_cast([g], send)
    _same(send, g.to(torch.float16))


def test_current_stream_and_no_host_sync():
    side = torch.cuda.Stream()
    shards = [_randn(1000 + i, torch.float32, i) for i in range(100)]
    out = torch.empty(sum(s.numel() for s in shards), dtype=torch.bfloat16, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    try:
        with warnings.catch_warnings():  # "prototype feature" notice; errors stay errors
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        with torch.cuda.stream(side):
            torch.ops.zrs.pack_cast(shards, out)  # > 80 segments: the pinned-copy path too
            grads = [s.view(-1) for s in shards[:10]]
            sizes = _row_shards(grads, 2)
            bucket = torch.empty(2, sum(sizes), device="cuda")
            torch.ops.zrs.pack_grads(grads, 2, sizes, 0.5, bucket)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    _same(out, torch.cat(shards).to(torch.bfloat16))


def test_opcheck_cuda():
    shards = [_randn(3, torch.float32, 0), _randn(4, torch.bfloat16, 1)]
    out = torch.empty(7, device="cuda")
    torch.library.opcheck(torch.ops.zrs.pack_cast.default, (shards, out))
    outs = [torch.empty(4, device="cuda"), torch.empty(6, device="cuda")]
    recv = _randn(10, torch.float32, 2)
    torch.library.opcheck(torch.ops.zrs.unpack_rank_major.default, (recv, 2, [0, 2], [2, 3], outs))
    grads = [_randn(6, torch.float32, 3).view(3, 2), _randn(5, torch.bfloat16, 4)]
    bucket = torch.empty(2, 7, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.zrs.pack_grads.default, (grads, 2, [4, 3], 0.5, bucket))


def test_a_repeated_table_is_reused_across_streams_and_graphs():
    """A table over 80 segments is kept on the device (zrs_kernels.cu, TableCache): the same
    addresses with new values, from another stream and replayed from a CUDA graph, copy the new
    values; a table first seen under capture is copied by the graph itself, at each replay."""
    shards = [_randn(500 + i, torch.float32, i) for i in range(90)]
    out = torch.empty(sum(s.numel() for s in shards), dtype=torch.bfloat16, device="cuda")
    torch.ops.zrs.pack_cast(shards, out)
    _same(out, torch.cat(shards).to(torch.bfloat16))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in shards:
            s.mul_(2)
        torch.ops.zrs.pack_cast(shards, out)  # the cached table, first use on this stream
    torch.cuda.current_stream().wait_stream(side)
    _same(out, torch.cat(shards).to(torch.bfloat16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.zrs.pack_cast(shards, out)
    for s in shards:
        s.add_(1)
    graph.replay()
    _same(out, torch.cat(shards).to(torch.bfloat16))
    fresh = [_randn(7, torch.float32, i) for i in range(90)]
    out2 = torch.empty(sum(s.numel() for s in fresh), dtype=torch.bfloat16, device="cuda")
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        torch.ops.zrs.pack_cast(fresh, out2)  # never seen before: the graph copies the table
    for _ in range(2):
        for s in fresh:
            s.mul_(3)
        graph2.replay()
        _same(out2, torch.cat(fresh).to(torch.bfloat16))
