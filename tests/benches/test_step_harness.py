"""benches/step.py end to end on the CPU: the harness (benches/harness/) runs systems of several
families (benches/systems/) at world 1, writes one record per system, and --table shows them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEP = Path(__file__).resolve().parents[2] / "benches" / "step.py"
SYSTEMS = ("zrs_eager", "fsdp2_eager", "single")
# Every successful record has these (more where a system or an option adds some).
FIELDS = {
    "system", "preset", "tag", "world", "step_ms_med", "step_ms_min", "step_ms_mean_wall",
    "step_ms_each", "tok_s_gpu", "mfu", "peak_GiB", "peak_GiB_all", "build_s", "warmup_s",
    "warmup_total_s", "compile_phases_s", "loss", "warmup_steps", "steps", "params_M",
    "micro_batch", "seq_len", "layers", "param_dtype", "master_dtype", "reduce_dtype",
    "cudnn_sdpa", "device", "torch", "nccl", "env", "command", "time", "first_step_gc_s",
    "compile_graphs",
}  # fmt: skip


def _step(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # A plain `python benches/step.py` (world 1), from another folder: benches/ comes from the
    # script's own path, as under torchrun.
    done = subprocess.run(
        [sys.executable, str(STEP), *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_step_writes_a_record_per_system_and_tables_them(tmp_path):
    out = tmp_path / "step.jsonl"
    _step("--preset", "tiny", "--systems", ",".join(SYSTEMS), "--device", "cpu",
          "--compile-backend", "aot_eager", "--warmup", "1", "--steps", "1", "--out", str(out),
          "--first-profile", str(tmp_path / "first"), cwd=tmp_path)  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["system"] for r in records] == list(SYSTEMS)
    for r in records:
        assert "error" not in r, r["error"]
        assert r.keys() >= FIELDS, FIELDS - r.keys()
        assert r["world"] == 1 and r["preset"] == "tiny" and len(r["step_ms_each"]) == 1
        gc_s = r["first_step_gc_s"]
        assert gc_s.keys() == {"young_s", "full_s", "full_collections"}, gc_s
        # The first step's sampled stacks: a file of collapsed stacks, and the harness's own
        # frame holding (nearly) every sample.
        first = r["first_profile"]
        stacks = Path(first["stacks"]).read_text().splitlines()
        assert stacks and all(line.rsplit(" ", 1)[1].isdigit() for line in stacks), stacks[:3]
        held = dict(first["held_s"])
        measured = [s for name, s in held.items() if name.endswith(":measure")]
        assert measured and measured[0] >= 0.9 * first["seconds"] > 0, first
    assert "zrs" in records[0] and records[2]["compile_backend"] == "aot_eager"
    graphs = records[2]["compile_graphs"]  # single's compiled model, with its backward
    assert graphs and all({"id", "fw_s", "bw_s"} <= g.keys() for g in graphs), graphs

    lines = _step("--table", str(out), cwd=tmp_path).stdout.splitlines()
    assert lines[0].startswith("| preset | GPUs | system |")
    rows = [line for line in lines[2:] if line.startswith("| tiny | 1 |")]
    assert [row.split(" | ")[2] for row in rows] == list(SYSTEMS)
