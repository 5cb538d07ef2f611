"""Running a benchmark script as its users do, for the smoke tests in tests/benches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parents[2] / "benches"


def torchrun(script: str, *args: str, cwd: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc benches/<script> args` from `cwd`, bounded;
    asserts that it succeeded, showing the end of its output if not."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), str(BENCHES / script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
