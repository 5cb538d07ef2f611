"""What a compile cache folder holds of torch's, for the tests of the ranks' caches: on CPU ranks
(tests/e2e/test_warm_restart.py) and on GPUs, one device per process
(tests/gpu/test_shared_cache_gpu.py)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

# zrs's own records stay with a rank when it takes another rank's torch caches; the lock files
# are per machine.
_NOT_TORCHS = ("zrs_records", "locks")


def torch_entries(cache: Path) -> set[str]:
    """The keys of a cache folder's AOTAutograd and inductor entries, and inductor's generated
    code with its bytes, the folder's own path in them written as `<cache>` (the code names its
    kernels' files there, in comments). An entry's own bytes are left out: they hold its compile
    time and the cache folder's path."""
    entries = set()
    for path in cache.rglob("*"):
        parts = path.relative_to(cache).parts
        if parts[0] == "aotautograd" and len(parts) == 3:
            entries.add(f"aotautograd key {parts[1]}")
        elif parts[0] == "fxgraph" and len(parts) == 4:
            entries.add(f"inductor key {parts[2]}")
        elif path.suffix in (".py", ".cpp"):
            code = path.read_bytes().replace(str(cache).encode(), b"<cache>")
            entries.add(f"code {'/'.join(parts)} {hashlib.sha256(code).hexdigest()}")
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
