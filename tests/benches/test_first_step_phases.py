"""benches/first_step_phases.py on two CPU ranks (torchrun, gloo, the eager backend): each system
writes its phases, which add up to its first step, and both train the same tiny Llama."""

from __future__ import annotations

import json

import pytest

from bench_runs import torchrun

pytestmark = pytest.mark.slow


def test_both_systems_record_their_first_step_phase_by_phase(tmp_path):
    out = tmp_path / "phases.jsonl"
    for system in ("zrs", "fsdp2"):
        torchrun(
            "first_step_phases.py",
            "--system",
            system,
            "--backend",
            "eager",
            "--out",
            str(out),
            cwd=tmp_path,
        )
    zrs, fsdp2 = [json.loads(line) for line in out.read_text().splitlines()]
    assert (zrs["system"], fsdp2["system"]) == ("zrs_shard_compile", "fsdp2_compile")
    assert list(zrs["phases_s"])[1:5] == [
        "agree_and_connect", "make_state", "shard_parameters", "install_units"
    ]  # fmt: skip
    assert {"shard", "materialize"} <= fsdp2["phases_s"].keys()
    for r in (zrs, fsdp2):
        assert r["world"] == 2 and len(r["later_steps_ms"]) == 2, r
        assert r["first_step_s"] == pytest.approx(sum(r["phases_s"].values()), abs=0.02), r
