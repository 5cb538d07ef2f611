"""zrs.CapturedStep where there is no GPU: every call runs the step eagerly, with the same results as
the plain loop; the arguments are checked as a GPU run checks them. The graphs themselves are
tested on a GPU (tests/gpu/test_captured_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import zrs
from zoo import spec_of

pytestmark = pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")


def _train(captured: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    spec = spec_of("bias_stack")
    model = zrs.compile(spec.build(), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    clip = zrs.GraphedStep(opt, max_norm=0.05)

    def train_step(batch: tuple, scale: torch.Tensor) -> torch.Tensor:
        loss = spec.loss(model, batch) * scale
        loss.backward()
        clip()
        opt.zero_grad()
        return loss.detach()

    step = zrs.CapturedStep(train_step) if captured else train_step
    losses = [step(spec.batch(0, i), torch.tensor(1.0)) for i in range(4)]
    return losses, {k: v.clone() for k, v in zrs.full_state_dict(model).items()}


def test_on_the_cpu_it_runs_the_step_eagerly_bit_for_bit() -> None:
    plain_losses, plain = _train(captured=False)
    losses, params = _train(captured=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    assert all(torch.equal(plain[k], params[k]) for k in plain)


def test_arguments_and_options_are_checked() -> None:
    with pytest.raises(zrs.ZrsError, match="takes the training step as a function"):
        zrs.CapturedStep(3)  # type: ignore[arg-type]
    with pytest.raises(zrs.ZrsError, match="warmup must be an int >= 1"):
        zrs.CapturedStep(lambda: None, warmup=0)
    with pytest.raises(zrs.ZrsError, match="max_graphs must be an int >= 1"):
        zrs.CapturedStep(lambda: None, max_graphs=True)
    if not torch.cuda.is_available():
        with pytest.raises(zrs.ZrsError, match="cuda_graphs=True needs CUDA"):
            zrs.CapturedStep(lambda: None, cuda_graphs=True)
    step = zrs.CapturedStep(lambda x, opts: x * 2, cuda_graphs=False)
    assert torch.equal(step(torch.ones(2), "fast"), torch.full((2,), 2.0))
    with pytest.raises(zrs.ZrsError, match="neither a tensor nor hashable"):
        step(torch.ones(2), {"a set"})


def test_grad_mode_and_autocast_make_new_signatures() -> None:
    step = zrs.CapturedStep(lambda x: x * 2, cuda_graphs=False)
    step(torch.ones(2))
    with torch.no_grad():
        step(torch.ones(2))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available()):
        step(torch.ones(2))  # a new signature where autocast is on, the first one where not
    assert len(step.signatures) == 2 + torch.cuda.is_available()
