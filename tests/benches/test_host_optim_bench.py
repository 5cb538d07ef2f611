"""benches/host_optim.py on this machine's CPU, tiny: each system and thread count writes a row
with its rate; a system that cannot run here (DeepSpeed, where it is not installed) writes an
error row instead of stopping the others; an unknown system stops the run before it starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a process per row, each importing torch

BENCH = Path(__file__).resolve().parents[2] / "benches" / "host_optim.py"


def test_every_row_is_written(tmp_path):
    out = tmp_path / "host_optim.jsonl"
    systems = "zrs_adamw_bf16_copy,torch_adamw_fused"
    cmd = [sys.executable, str(BENCH), "--numel", "4096", "--threads", "1,2", "--reps", "2",
           "--systems", systems, "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["system"], r["threads"]) for r in rows] == [
        (s, t) for t in (1, 2) for s in systems.split(",")
    ]
    for row in rows:
        assert row["params_per_s"] > 0 and row["numel"] == 4096, row
    assert {r["isa"] for r in rows if r["system"].startswith("zrs")} <= {
        "avx512",
        "avx2",
        "baseline",
    }


def test_a_system_that_fails_leaves_an_error_row_and_unknown_ones_stop_the_run(tmp_path):
    out = tmp_path / "host_optim.jsonl"
    base = [sys.executable, str(BENCH), "--numel", "64", "--threads", "1", "--reps", "1"]
    # DeepSpeed is no dev dependency: without it, its row says why; with it, it runs.
    cmd = [*base, "--systems", "deepspeed_cpu_adam,zrs_sgd", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    ds, sgd = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" in ds or ds["params_per_s"] > 0
    assert sgd["params_per_s"] > 0
    bad = subprocess.run([*base, "--systems", "zrs_adam"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown systems ['zrs_adam']" in bad.stderr
