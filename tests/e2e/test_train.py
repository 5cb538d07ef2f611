"""The main job saves checkpoints and resumes from one exactly (`python -m zrs.train`, 2 CPU ranks)."""

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


def test_resume_from_a_checkpoint_of_the_main_job_is_exact(tmp_path):
    whole = _train(tmp_path / "whole", "--save-every", "2")
    assert sorted(p.name for p in (tmp_path / "whole").glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    resumed = _train(tmp_path / "resumed", "--resume", tmp_path / "whole" / "checkpoint-2")
    assert resumed["losses"] == whole["losses"]
    assert resumed["resumed_from"].endswith("checkpoint-2")
    a = torch.load(tmp_path / "whole" / "model.pt")
    b = torch.load(tmp_path / "resumed" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
