"""benches/trainer_step.py on two CPU ranks (torchrun, gloo): Trainer with a zrs model and Trainer
with FSDP2 each write their record, and train the same tiny Llama to the same loss."""

from __future__ import annotations

import json

import pytest

from bench_runs import torchrun

pytestmark = pytest.mark.slow


def test_trainer_with_zrs_and_with_fsdp2_record_the_same_training(tmp_path):
    out = tmp_path / "trainer.jsonl"
    for system in ("zrs_eager", "fsdp2"):
        torchrun(
            "trainer_step.py",
            "--system",
            system,
            "--warmup",
            "1",
            "--steps",
            "2",
            "--out",
            str(out),
            cwd=tmp_path,
        )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["system"] for r in records] == ["trainer_zrs_eager", "trainer_fsdp2"]
    for r in records:
        assert r["world"] == 2 and len(r["step_ms_each"]) == 3, r
    assert records[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-4)
