"""The runs that fill compile caches, and what a cache folder holds of torch's, for the tests of
warm restarts and of the ranks' caches: on CPU ranks (tests/e2e/test_warm_restart.py) and on
GPUs, one device per process (tests/gpu/test_shared_cache_gpu.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

# The compile's rank meetings that a cold compile holds and a warm one skips.
MEETINGS = ("rank_check", "sweep")

# zrs's own records stay with a rank when it takes another rank's torch caches; the lock files
# are per machine.
_NOT_TORCHS = ("zrs_records", "locks")


def torch_entries(cache: Path) -> set[str]:
    """The keys of a cache folder's AOTAutograd and inductor entries, and the hashes of
    inductor's generated code, the folder's own path in it written as `<cache>`. On GPUs the
    code names its kernels' files there, in comments; a code file's own name is a hash of its
    bytes, that path included, so it is left out. An entry's own bytes are left out: they hold
    its compile time and the cache folder's path."""
    entries = set()
    for path in cache.rglob("*"):
        parts = path.relative_to(cache).parts
        if parts[0] == "aotautograd" and len(parts) == 3:
            entries.add(f"aotautograd key {parts[1]}")
        elif parts[0] == "fxgraph" and len(parts) == 4:
            entries.add(f"inductor key {parts[2]}")
        elif path.suffix in (".py", ".cpp"):
            code = path.read_bytes().replace(str(cache).encode(), b"<cache>")
            entries.add(f"code {hashlib.sha256(code).hexdigest()}{path.suffix}")
    return entries


def drop_torch_caches(cache: Path) -> None:
    """Empty a cache folder of everything but zrs's records."""
    for kept in cache.iterdir():
        if kept.name != "zrs_records":
            shutil.rmtree(kept)


def take_torch_caches(source: Path, dest: Path) -> None:
    """`dest` gives up its torch caches for copies of `source`'s, and keeps its zrs records."""
    drop_torch_caches(dest)
    for theirs in source.iterdir():
        if theirs.name not in _NOT_TORCHS:
            shutil.copytree(theirs, dest / theirs.name)


def train_tiny_llama(
    rank: int, world: int, cache: str, per_rank: bool, layers: int, options: dict
) -> dict:
    """A run_workers worker: two steps of a tiny Llama under zrs.compile(**options), compiled
    into `cache` (its folder `rank{rank}` with `per_rank`), on this rank's GPU under NCCL. Test
    options: `caches_off` (inductor's cache off on rank 1), `version` (another zrs version),
    `artifacts` (the folder of the saved cache artifacts) and `load` (load them first)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{cache}/rank{rank}" if per_rank else cache
    if options.pop("caches_off", False) and rank == 1:
        from torch._inductor import config as inductor_config

        inductor_config.fx_graph_cache = False
    from torch._dynamo.utils import counters

    import zrs
    from llama import PRESETS, Llama

    if options.pop("version", None):
        zrs.__version__ = "0.0.0+changed"
    artifacts = Path(options.pop("artifacts", cache)) / f"artifacts{rank}"
    if options.pop("load", False):
        zrs.load_cache_artifacts(artifacts.read_bytes())
    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=layers)
    model = zrs.compile(Llama(cfg).to(device), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len), generator=g)
        model(x.to(device)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    artifacts.write_bytes(zrs.save_cache_artifacts())
    return {
        "device": str(device),
        "state": {k: v.cpu() for k, v in zrs.full_state_dict(model).items()},
        "meetings": [m for m in MEETINGS if m in model._zrs_state.compile_s],
        "aot_hits": counters["aot_autograd"].get("autograd_cache_hit", 0),
    }
