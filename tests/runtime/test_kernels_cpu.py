"""The copy ops' torch implementations (CPU) against plain references, opcheck, and the fallback.

`zrs::pack_cast`, `zrs::unpack_rank_major` and `zrs::pack_grads` run through torch ops on CPU; the
CUDA kernels (tests/gpu/test_kernels.py) are checked against these same implementations.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import zrs  # noqa: F401  (defines the ops)
from zrs.runtime import kernels

SIZES = [1, 7, 2, 1000, 4097, 0, 33]
DTYPES = [torch.float32, torch.bfloat16]


def _randn(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_pack_cast(src_dtype, out_dtype):
    shards = [_randn(n, src_dtype, i) for i, n in enumerate(SIZES)]
    total = sum(SIZES)
    out = torch.full((total + 3,), 7.0, dtype=out_dtype)  # a larger buffer keeps its tail
    torch.ops.zrs.pack_cast(shards, out)
    expected = torch.cat([s.to(out_dtype) for s in shards])
    torch.testing.assert_close(out[:total], expected, rtol=0, atol=0)
    assert (out[total:] == 7).all()


def test_pack_cast_2d_shard_and_2d_out():
    shards = [torch.arange(6.0).view(2, 3).t(), torch.arange(5.0)]  # non-contiguous shard
    out = torch.empty(11, dtype=torch.bfloat16).view(1, 11)
    torch.ops.zrs.pack_cast(shards, out)
    expected = torch.cat([shards[0].reshape(-1), shards[1]]).to(torch.bfloat16)
    torch.testing.assert_close(out.view(-1), expected, rtol=0, atol=0)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_rank_major(world, dtype):
    numels = [3, 1, 1000, 0, 17]
    offsets, off = [], 0
    for n in numels:
        offsets.append(off)
        off += n + 2  # gaps between members are allowed
    block = off + 1
    recv = _randn(world * block, dtype, world)
    outs = [torch.full((world * n + 1,), 5.0, dtype=dtype) for n in numels]
    torch.ops.zrs.unpack_rank_major(recv, world, offsets, numels, outs)
    for o, off, n in zip(outs, offsets, numels, strict=True):
        for r in range(world):
            ref = recv[r * block + off : r * block + off + n]
            torch.testing.assert_close(o[r * n : (r + 1) * n], ref, rtol=0, atol=0)
        assert o[world * n] == 5  # past the member's elements: untouched


def _row_shards(grads, world):
    """Each gradient's shard as zrs cuts parameters: whole rows, ceil(rows / world) per rank."""
    return [-(-g.size(0) // world) * (g.numel() // g.size(0)) if g.dim() else 1 for g in grads]


def _pack_grads_reference(grads, world, scale, out_dtype):
    cols = []
    for g, shard in zip(grads, _row_shards(grads, world), strict=True):
        n = g.numel()
        flat = torch.zeros(world * shard, dtype=torch.float32)
        flat[:n] = g.reshape(-1).float()
        cols.append((flat * scale).to(out_dtype).view(world, shard))
    return torch.cat(cols, dim=1)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_pack_grads(world, grad_dtype, out_dtype):
    shapes = [(5, 3), (7,), (1,), (64, 33), (2, 2)]
    grads = [
        _randn(int(torch.Size(s).numel()), grad_dtype, i).view(s) for i, s in enumerate(shapes)
    ]
    grads[3] = grads[3].t()  # non-contiguous: a transposed weight gradient
    shards = _row_shards(grads, world)
    out = torch.full((world, sum(shards)), 9.0, dtype=out_dtype)
    torch.ops.zrs.pack_grads(grads, world, shards, 1.0 / world, out)
    expected = _pack_grads_reference(grads, world, 1.0 / world, out_dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_pack_grads_into_a_bucket_slice():
    """out may be a column range of a larger (world, bucket) buffer: rows strided."""
    world = 3
    grads = [torch.randn(10), torch.randn(4, 2)]
    bucket = torch.full((world, 20), -1.0)
    out = bucket[:, 5:13]
    torch.ops.zrs.pack_grads(grads, world, _row_shards(grads, world), 0.5, out)
    torch.testing.assert_close(out, _pack_grads_reference(grads, world, 0.5, torch.float32))
    assert (bucket[:, :5] == -1).all() and (bucket[:, 13:] == -1).all()


def test_pack_grads_padding_is_zero_even_for_tiny_grads():
    out = torch.full((3, 1), 4.0)
    torch.ops.zrs.pack_grads([torch.tensor([2.0])], 3, [1], 1.0, out)
    assert out.view(-1).tolist() == [2.0, 0.0, 0.0]


def test_errors():
    with pytest.raises(RuntimeError, match="out has only 3"):
        torch.ops.zrs.pack_cast([torch.zeros(4)], torch.empty(3))
    with pytest.raises(RuntimeError, match="outside the rank block"):
        torch.ops.zrs.unpack_rank_major(torch.zeros(8), 2, [2], [3], [torch.empty(6)])
    with pytest.raises(RuntimeError, match="not a multiple of world"):
        torch.ops.zrs.unpack_rank_major(torch.zeros(7), 2, [0], [3], [torch.empty(6)])
    with pytest.raises(RuntimeError, match=r"shape \(world, block\)"):
        torch.ops.zrs.pack_grads([torch.zeros(4)], 2, [2], 0.5, torch.empty(4))
    with pytest.raises(RuntimeError, match="need 3 elements per rank"):
        torch.ops.zrs.pack_grads(
            [torch.zeros(4), torch.zeros(1)], 2, [2, 1], 0.5, torch.empty(2, 2)
        )
    with pytest.raises(RuntimeError, match="more than 2 shards of 1"):
        torch.ops.zrs.pack_grads([torch.zeros(4)], 2, [1], 0.5, torch.empty(2, 2))


def test_opcheck():
    shards = [torch.randn(3), torch.randn(4).bfloat16()]
    torch.library.opcheck(torch.ops.zrs.pack_cast.default, (shards, torch.empty(7)))
    outs = [torch.empty(4), torch.empty(6)]
    torch.library.opcheck(
        torch.ops.zrs.unpack_rank_major.default, (torch.randn(10), 2, [0, 2], [2, 3], outs)
    )
    grads = [torch.randn(3, 2), torch.randn(5)]
    torch.library.opcheck(
        torch.ops.zrs.pack_grads.default,
        (grads, 2, [4, 3], 0.5, torch.empty(2, 7, dtype=torch.bfloat16)),
    )


def test_cpu_tensors_never_build():
    state = kernels.status()[0]
    torch.ops.zrs.pack_cast([torch.randn(3)], torch.empty(3))
    assert kernels.status()[0] == state  # no build attempt, no warning
    if not torch.cuda.is_available():
        assert state == "unloaded"


def test_kernel_source_is_found():
    assert (kernels.source_dir() / kernels.SOURCE).is_file()


def test_the_build_folder_is_named_by_the_source_and_sits_under_the_extensions_root(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    shipped = kernels.build_dir()
    assert shipped.parent == tmp_path / "ext" and shipped.name.startswith(kernels.EXT_NAME)
    edited = tmp_path / "src"
    edited.mkdir()
    source = (kernels.source_dir() / kernels.SOURCE).read_text()
    (edited / kernels.SOURCE).write_text(source + "\n// edited\n")
    monkeypatch.setenv("ZRS_CUDA_SRC", str(edited))
    assert kernels.build_dir() != shipped  # a changed kernel is never loaded from the old build


def _fresh_cuda_process(monkeypatch, build) -> None:
    """A process that never loaded the kernels, on a machine with CUDA, whose build is `build`."""
    monkeypatch.setattr(kernels, "LOADER", kernels.Loader())
    monkeypatch.delenv("ZRS_NO_CUDA_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(kernels, "build", build)


def test_failed_build_warns_once_then_falls_back(monkeypatch):
    def broken_build(verbose=False):
        raise RuntimeError("nvcc not found")

    _fresh_cuda_process(monkeypatch, broken_build)
    with pytest.warns(kernels.KernelBuildWarning, match="nvcc not found.*--build"):
        assert not kernels.load()
    assert not kernels.load()  # the second call neither retries nor warns again
    assert kernels.status() == ("failed", "RuntimeError: nvcc not found")


def test_background_build_is_joined_and_its_failure_warned_by_load(monkeypatch):
    started = threading.Event()
    release = threading.Event()

    def slow_broken_build(verbose=False):
        started.set()
        release.wait(10)
        raise RuntimeError("nvcc not found")

    _fresh_cuda_process(monkeypatch, slow_broken_build)
    kernels.build_in_background()
    assert started.wait(10)
    kernels.build_in_background()  # already building: no second thread
    assert kernels.status()[0] == "unloaded"
    assert not kernels.load()  # still building: the torch ops serve, nothing waits
    release.set()
    kernels.LOADER.builder.join(10)
    # the builder thread warned nothing; load() warns here, once
    with pytest.warns(kernels.KernelBuildWarning, match="nvcc not found"):
        assert not kernels.load()
    assert not kernels.load()
    assert kernels.LOADER.builder is None and kernels.status()[0] == "failed"


def test_wait_joins_the_background_build(monkeypatch):
    started = threading.Event()
    release = threading.Event()

    def slow_build(verbose=False):
        started.set()
        release.wait(10)
        return "zrs_kernels.so"

    _fresh_cuda_process(monkeypatch, slow_build)
    kernels.build_in_background()
    assert started.wait(10)
    assert not kernels.load()  # load() does not wait
    threading.Timer(0.2, release.set).start()
    assert kernels.wait()  # wait() does
    assert kernels.status()[0] == "loaded"


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread CPU priority is Linux's")
def test_the_background_build_and_its_compiler_run_at_the_lowest_cpu_priority(monkeypatch):
    seen = {}
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def build(verbose=False):
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        # a child (nvcc) inherits the priority of the thread that starts it
        out = subprocess.run(["sh", "-c", "cut -d' ' -f19 /proc/self/stat"], capture_output=True)
        seen["child"] = int(out.stdout)
        return "zrs_kernels.so"

    _fresh_cuda_process(monkeypatch, build)
    kernels.build_in_background()
    assert kernels.wait()
    assert seen == {"thread": 19, "child": 19}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # untouched


def test_disabled_by_env(monkeypatch):
    monkeypatch.setattr(kernels, "LOADER", kernels.Loader())  # a process that never loaded
    monkeypatch.setenv("ZRS_NO_CUDA_KERNELS", "1")
    assert not kernels.load()
    assert kernels.status()[0] == "disabled"


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    """cpp_extension waits forever for a build lock; one older than any build is a killed
    build's, and would leave every later process on the torch ops without a warning."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not kernels.clear_stale_lock(tmp_path) and lock.exists(), "a build in progress"
    old = time.time() - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert kernels.clear_stale_lock(tmp_path) and not lock.exists()
    assert not kernels.clear_stale_lock(tmp_path)  # none left
