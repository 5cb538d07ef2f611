"""The main job (`python -m zrs.train`, 2 CPU ranks) saves checkpoints and resumes from one exactly,
and trains alike with its layers compiled on their own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ARGS = ["--model-size", "tiny", "--backend", "eager", "--batch-size", "2", "--seq-len", "32"]


def _train(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "zrs.train", "--steps", "4", "--nproc", "2", *ARGS, "--out", out]
    done = subprocess.run(
        [str(c) for c in [*cmd, *extra]], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, dict]:
    """A run of 4 steps (zrs.compile) with checkpoints at steps 2 and 4: its folder, its summary."""
    out = tmp_path_factory.mktemp("whole")
    return out, _train(out, "--save-every", "2")


def test_resume_from_a_checkpoint_of_the_main_job_is_exact(tmp_path, whole):
    out, summary = whole
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    resumed = _train(tmp_path / "resumed", "--resume", out / "checkpoint-2")
    assert resumed["losses"] == summary["losses"]
    assert resumed["resumed_from"].endswith("checkpoint-2")
    a = torch.load(out / "model.pt")
    b = torch.load(tmp_path / "resumed" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_main_job_with_compiled_layers_trains_as_with_zrs_compile(tmp_path, whole):
    """`--compile layers` (zrs.shard, each layer compiled) computes what zrs.compile does: the
    same losses (printed to 4 decimals) and weights to fp32 rounding."""
    out, model = whole
    layers = _train(tmp_path / "layers", "--compile", "layers")
    assert layers["compile"] == "layers" and model["compile"] == "model"
    assert layers["losses"] == pytest.approx(model["losses"], abs=2e-4)
    a = torch.load(out / "model.pt")
    b = torch.load(tmp_path / "layers" / "model.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
