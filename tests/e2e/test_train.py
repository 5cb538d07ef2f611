"""The main job (`python -m zrs.train`, 2 CPU ranks) says what it compiles, saves checkpoints and
resumes from one exactly, and trains alike with its layers compiled on their own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ARGS = ["--model-size", "tiny", "--backend", "eager", "--batch-size", "2", "--seq-len", "32"]


def _train(out: Path, *extra: str) -> dict:
    """The run's summary.json, with its printed output under "output"."""
    cmd = [sys.executable, "-m", "zrs.train", "--steps", "4", "--nproc", "2", *ARGS, "--out", out]
    done = subprocess.run(
        [str(c) for c in [*cmd, *extra]], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {**json.loads((out / "summary.json").read_text()), "output": done.stdout + done.stderr}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, dict]:
    """A run of 4 steps (zrs.compile) with checkpoints at steps 2 and 4: its folder, its summary."""
    out = tmp_path_factory.mktemp("whole")
    return out, _train(out, "--save-every", "2")


def test_the_main_job_says_what_it_compiles(whole):
    """A long compile is never a silent terminal: rank 0 prints each graph's compile and zrs's
    passes above the progress bar, once each (the other rank stays quiet)."""
    _, summary = whole
    said = [x.strip() for x in summary["output"].splitlines() if x.strip().startswith("zrs: ")]
    started = r"zrs: graph 0: compiling \d+ FX nodes, 1 repeated-block bodies, cold"
    assert sum(bool(re.fullmatch(started, x)) for x in said) == 1, said
    for phase in ("forward", "backward"):
        assert said.count(f"zrs: {phase} graph 0: zrs's passes (lower, profile, plan)") == 1, said
    for part in ("forward graph 0", "backward graph 0", "graph 0"):
        assert sum(bool(re.fullmatch(f"zrs: {part}: done in [0-9.]+ s", x)) for x in said) == 1


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
