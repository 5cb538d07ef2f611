"""Copy kernels behind the zrs copy ops (schemas: `zrs.runtime.ops`'s `COPY_SCHEMAS`): cast+pack
(copy-in), rank-major unpack (copy-out) and gradient pack (pre-divide, cast, zero padding).

Each op has a torch implementation, plain tensor ops on CompositeExplicitAutograd that serve CPU
tensors and CUDA ones while the kernels are not loaded. It is also the kernels' reference: it
computes in float32 (float64 if either side is), scales there and casts once. The CUDA kernels of
`cuda/zrs_kernels.cu` (the wheel's `zrs/cuda/zrs_kernels.cu`) register on the ops' CUDA key when
the extension loads; `torch.utils.cpp_extension` builds it (JIT, cached in the torch extensions
folder) when a CUDA tensor first reaches an op, or ahead: `python -m zrs.runtime.kernels --build`.
A failed build (no nvcc, ninja or CUDA) leaves the torch ops in charge and warns once;
`ZRS_NO_CUDA_KERNELS=1` skips the kernels without a warning. CPU tensors never build.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

EXT_NAME = "zrs_kernels"
SOURCE = "zrs_kernels.cu"
OPS = ("pack_cast", "unpack_rank_major", "pack_grads")
_DISABLE_ENV = "ZRS_NO_CUDA_KERNELS"
_SRC_ENV = "ZRS_CUDA_SRC"


class KernelBuildWarning(UserWarning):
    """The CUDA copy kernels could not be built or loaded; the torch fallback is used."""


# --- finding, building and loading the extension ------------------------------------------------


def source_dir() -> Path:
    """The folder that holds `zrs_kernels.cu`: `$ZRS_CUDA_SRC` if set, else the package's own
    `cuda/`. An installed wheel has the file there; in a source checkout it is a symbolic link to
    the top-level `cuda/zrs_kernels.cu`, whose folder this returns."""
    override = os.environ.get(_SRC_ENV)
    folder = Path(override) if override else Path(__file__).resolve().parents[1] / "cuda"
    if not (folder / SOURCE).is_file():
        raise FileNotFoundError(
            f"{SOURCE} not found in {folder}" + (f" (${_SRC_ENV})" if override else "")
        )
    return (folder / SOURCE).resolve().parent


CUDA_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo")


def build_dir() -> Path:
    """The folder this source, these flags, this torch and these GPUs build the library in. Its
    name is their hash, so a library found there is current without asking ninja, and loading
    it needs neither torch.utils.cpp_extension nor setuptools (~0.3 s of imports that would
    slow the first step). `TORCH_EXTENSIONS_DIR` moves the root, as for any torch extension."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
    )
    archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    facts = (CUDA_FLAGS, torch.__version__, torch.version.cuda, archs)
    digest = hashlib.sha256((source_dir() / SOURCE).read_bytes())
    digest.update(repr((facts, os.environ.get("TORCH_CUDA_ARCH_LIST"))).encode())
    return Path(root) / f"{EXT_NAME}_{digest.hexdigest()[:16]}"


def build(verbose: bool = False) -> str:
    """Load the extension from its build folder, building it there first if needed; return the
    library's path. Raises on any failure. Loading registers the kernels on the zrs ops' CUDA
    key."""
    folder = build_dir()
    path = folder / f"{EXT_NAME}.so"
    clear_stale_lock(folder)
    # cpp_extension holds `lock` in the folder while it builds: then wait for it there.
    if path.is_file() and not (folder / "lock").exists():
        torch.ops.load_library(str(path))
    else:
        from torch.utils import cpp_extension

        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=EXT_NAME,
            sources=[str(source_dir() / SOURCE)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=list(CUDA_FLAGS),
            build_directory=str(folder),
            is_python_module=False,
            verbose=verbose,
        )
    missing = [op for op in OPS if not _has_cuda_kernel(op)]
    if missing:
        raise RuntimeError(f"{path} loaded but registered no CUDA kernel for {missing}")
    return str(path)


# A build takes ~30 s; an older lock was left by a killed build, and cpp_extension would wait for
# it forever: every later process would run the torch ops, its builder never done, and never warn.
STALE_LOCK_S = 600.0


def clear_stale_lock(folder: Path) -> bool:
    """Remove `folder`'s build lock if a killed build left it; True if one was removed."""
    lock = folder / "lock"
    try:
        stale = time.time() - lock.stat().st_mtime > STALE_LOCK_S
    except FileNotFoundError:
        return False
    if stale:
        lock.unlink(missing_ok=True)
    return stale


def _has_cuda_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"zrs::{op}", "CUDA")


class Loader:
    """Whether the CUDA extension is loaded: a fact about the process (a loaded library cannot be
    unloaded), hence one object, `LOADER`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status = "unloaded"  # "unloaded" | "loaded" | "failed" | "disabled"
        self.reason = ""
        self.warned = False
        self.builder: threading.Thread | None = None  # the background build, until load() joins

    def attempt(self) -> None:
        """Build and load once, recording the outcome. Warns nothing: it may run on the builder
        thread, and `load()` warns in the caller's thread."""
        if os.environ.get(_DISABLE_ENV, "") not in ("", "0"):
            self.status, self.reason = "disabled", f"{_DISABLE_ENV} is set"
        elif not torch.cuda.is_available() or torch.version.cuda is None:
            self.status, self.reason = "failed", "CUDA is not available"
        else:
            try:
                build()
                self.status = "loaded"
            except Exception as e:  # any failure means: fall back, and say so once
                self.status, self.reason = "failed", f"{type(e).__name__}: {e}"

    def _attempt_yielding(self) -> None:
        """`attempt` at the lowest CPU priority, which nvcc inherits: the compile beside it first."""
        if sys.platform == "linux":
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        self.attempt()

    def build_in_background(self) -> None:
        with self.lock:
            if self.status != "unloaded" or self.builder is not None:
                return
            self.builder = threading.Thread(
                target=self._attempt_yielding, name="zrs-kernel-build", daemon=True
            )
            self.builder.start()

    def load(self) -> bool:
        if self.status == "loaded":
            return True
        builder = self.builder
        if builder is not None and builder.is_alive():
            # Still building: the torch ops serve meanwhile, so that no step waits for nvcc
            # (zrs.shard's first step has no compile for the build to hide behind).
            return False
        with self.lock:
            if self.builder is not None:
                self.builder.join()
                self.builder = None
            elif self.status == "unloaded":
                self.attempt()
            if self.status == "failed" and not self.warned and torch.cuda.is_available():
                self.warned = True
                warnings.warn(
                    "zrs: the CUDA copy kernels could not be built or loaded, so packing and "
                    f"unpacking fall back to slower torch ops. Reason: {self.reason.strip()[:2000]}. "
                    "To fix: install nvcc matching torch's CUDA "
                    f"{torch.version.cuda} (set CUDA_HOME) and ninja, then run "
                    f"`python -m zrs.runtime.kernels --build`; set {_DISABLE_ENV}=1 to use the "
                    "torch ops without this warning.",
                    KernelBuildWarning,
                    stacklevel=4,
                )
            return self.status == "loaded"


LOADER = Loader()


def build_in_background() -> None:
    """Start building (or loading from the cache) on a thread, so that nvcc's ~20 s overlap
    the first steps instead of adding to them: until it is done the copy ops run as torch ops.
    `zrs.compile` and `zrs.shard` call this for CUDA models."""
    LOADER.build_in_background()


def load() -> bool:
    """Load the CUDA kernels once per process (building them if needed); True when loaded.

    Never builds without CUDA. On failure, warns once and returns False from then on.
    """
    return LOADER.load()


def wait() -> bool:
    """`load()`, after waiting for a build running in the background: True when loaded."""
    if (builder := LOADER.builder) is not None:
        builder.join()
    return LOADER.load()


def status() -> tuple[str, str]:
    """("unloaded" | "loaded" | "failed" | "disabled", the reason when not loaded)."""
    return LOADER.status, LOADER.reason


# --- torch implementations (CPU, and the CUDA fallback) -----------------------------------------


def _acc(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def pack_cast_torch(shards: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    _check(out.is_contiguous(), "zrs::pack_cast: out must be contiguous")
    total = sum(s.numel() for s in shards)
    _check(
        total <= out.numel(),
        f"zrs::pack_cast: the shards hold {total} elements but out has only {out.numel()}",
    )
    flat = out.view(-1)
    off = 0
    for s in shards:
        n = s.numel()
        flat.narrow(0, off, n).copy_(s.reshape(-1))
        off += n


def unpack_rank_major_torch(
    recv: torch.Tensor,
    world: int,
    offsets: Sequence[int],
    numels: Sequence[int],
    outs: Sequence[torch.Tensor],
) -> None:
    _check(world >= 1, f"zrs::unpack_rank_major: world must be >= 1, got {world}")
    _check(
        len(offsets) == len(numels) == len(outs),
        "zrs::unpack_rank_major: offsets, numels and outs differ in length "
        f"({len(offsets)}, {len(numels)}, {len(outs)})",
    )
    _check(recv.is_contiguous(), "zrs::unpack_rank_major: recv must be contiguous")
    _check(
        recv.numel() % world == 0,
        f"zrs::unpack_rank_major: recv holds {recv.numel()} elements, "
        f"not a multiple of world {world}",
    )
    block = recv.numel() // world
    blocks = recv.view(world, block)
    for i, (off, n, o) in enumerate(zip(offsets, numels, outs, strict=True)):
        _check(
            off >= 0 and n >= 0 and off + n <= block,
            f"zrs::unpack_rank_major: member {i} (offset {off}, numel {n}) lies outside the "
            f"rank block of {block} elements",
        )
        _check(o.is_contiguous(), f"zrs::unpack_rank_major: outs[{i}] must be contiguous")
        _check(
            o.numel() >= world * n,
            f"zrs::unpack_rank_major: outs[{i}] has {o.numel()} elements, needs {world * n}",
        )
        o.view(-1).narrow(0, 0, world * n).view(world, n).copy_(blocks.narrow(1, off, n))


def pack_grads_torch(
    grads: Sequence[torch.Tensor],
    world: int,
    shards: Sequence[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    _check(world >= 1, f"zrs::pack_grads: world must be >= 1, got {world}")
    _check(
        len(shards) == len(grads),
        f"zrs::pack_grads: {len(grads)} gradients but {len(shards)} shard sizes",
    )
    for i, (g, shard) in enumerate(zip(grads, shards, strict=True)):
        _check(
            shard >= 0 and shard * world >= g.numel(),
            f"zrs::pack_grads: gradient {i} has {g.numel()} elements, more than {world} shards "
            f"of {shard}",
        )
    _check(
        out.dim() == 2 and out.size(0) == world,
        f"zrs::pack_grads: out must have shape (world, block) = ({world}, ...), "
        f"got {tuple(out.shape)}",
    )
    _check(
        out.size(1) <= 1 or out.stride(1) == 1,
        "zrs::pack_grads: out's rows must be contiguous (stride(1) == 1)",
    )
    _check(
        sum(shards) <= out.size(1),
        f"zrs::pack_grads: the gradients need {sum(shards)} elements per rank but out's rows "
        f"hold {out.size(1)}",
    )
    off = 0
    for g, shard in zip(grads, shards, strict=True):
        n = g.numel()
        flat = torch.zeros(world * shard, dtype=_acc(g.dtype, out.dtype), device=g.device)
        flat[:n].copy_(g.reshape(-1))
        if scale != 1.0:
            flat.mul_(scale)
        out.narrow(1, off, shard).copy_(flat.view(world, shard))
        off += shard


# --- op implementations -------------------------------------------------------------------------
# Registered on CompositeExplicitAutograd. A backend kernel (the CUDA one, once loaded) takes
# precedence, so after the first CUDA call these only ever see CPU tensors or the fallback case.


def _pack_cast(shards, out):
    if out.is_cuda and load():
        return torch.ops.zrs.pack_cast.default(shards, out)
    pack_cast_torch(shards, out)


def _unpack_rank_major(recv, world, offsets, numels, outs):
    if recv.is_cuda and load():
        return torch.ops.zrs.unpack_rank_major.default(recv, world, offsets, numels, outs)
    unpack_rank_major_torch(recv, world, offsets, numels, outs)


def _pack_grads(grads, world, shards, scale, out):
    if out.is_cuda and load():
        return torch.ops.zrs.pack_grads.default(grads, world, shards, scale, out)
    pack_grads_torch(grads, world, shards, scale, out)


def _fake_none(*args, **kwargs):
    return None


def register(lib: torch.library.Library, outside_dynamo: Callable[[Callable], Callable]) -> None:
    """Register the torch implementations and the fakes of the copy ops on `lib` (zrs.runtime.ops), each
    wrapped by `outside_dynamo` (zrs.runtime.ops: dynamo's frame hook off while it runs)."""
    impls = {
        "pack_cast": _pack_cast,
        "unpack_rank_major": _unpack_rank_major,
        "pack_grads": _pack_grads,
    }
    for name, fn in impls.items():
        # Keep dynamo out of these when they run eagerly inside a compiled region's frame.
        lib.impl(name, outside_dynamo(fn), "CompositeExplicitAutograd")
        torch.library.register_fake(f"zrs::{name}", _fake_none, lib=lib)


# --- command line: prebuild -----------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zrs.runtime.kernels",
        description="Build and check the zrs CUDA copy kernels.",
    )
    p.add_argument("--build", action="store_true", help="build (or find cached) and load them")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = p.parse_args(argv)
    if not args.build:
        p.print_help()
        return 0
    import zrs.runtime.kernels as k  # the package's copy of this module, not __main__'s

    t0 = time.perf_counter()
    try:
        import zrs  # noqa: F401  (defines the ops the kernels register on)

        path = k.build(verbose=args.verbose)
        k.LOADER.status = "loaded"
    except Exception as e:
        print(f"zrs kernels: build failed after {time.perf_counter() - t0:.1f} s: {e}")
        return 1
    print(f"zrs kernels: {path} ready in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
