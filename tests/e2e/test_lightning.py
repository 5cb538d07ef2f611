"""PyTorch Lightning with a zrs model (`zrs.trainers.lightning.Strategy`, the model sharded in
`configure_model`), on CPU ranks: it trains as Lightning's DDP trains the unsharded model, its
torch.distributed.checkpoint folder resumes the run as DDP's own checkpoint does and loads at
another world size with every rank's weights and optimizer rows, and a data-parallel size that
would leave ranks on the same batches raises ZrsError on every rank."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

import zrs
from _dist import as_torchrun, cached_run
from zoo import spec_of

pytest.importorskip("lightning")
pytestmark = [
    pytest.mark.slow,
    # lightning 2.6 under torch 2.11: its pytree helper asks the deprecated LeafSpec
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]

MODEL, STEPS, SAVE_AT, LR, MOMENTUM = "hf_gpt2", 4, 2, 0.1, 0.9


def _module(shard: bool):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.net is not None:
                return
            torch.manual_seed(0)
            net = spec_of(MODEL).build()
            self.net = zrs.shard(net) if shard else net

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return self.net(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    return Module()


def _loader() -> torch.utils.data.DataLoader:
    # Two batches a rank at world 2: the checkpoint at SAVE_AT ends an epoch, where Lightning
    # resumes a plain DataLoader (mid-epoch it would replay the epoch's first batches).
    rows = torch.randint(2, 48, (8, 8), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(list(rows), batch_size=2)


def _trainer(world: int, steps: int, strategy):
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _momenta(module) -> list[torch.Tensor]:
    from zrs.checkpointing import optimizer_state

    opt = module.trainer.optimizers[0]
    state = optimizer_state.gather(opt, opt.state_dict())["state"]
    return [state[i]["momentum_buffer"] for i in sorted(state)]


def _saved(rank: int, world: int, root: str) -> dict:
    """World 2: DDP, zrs uninterrupted, zrs to SAVE_AT and saved, resumed to STEPS."""
    from zrs.trainers.lightning import Strategy

    as_torchrun(rank, world)
    out: dict = {}
    plain = _module(shard=False)
    _trainer(world, STEPS, "ddp").fit(plain, _loader())
    out["ddp"] = {k: v.detach().clone() for k, v in plain.net.state_dict().items()}
    plain = _module(shard=False)
    trainer = _trainer(world, SAVE_AT, "ddp")
    trainer.fit(plain, _loader())
    trainer.save_checkpoint(os.path.join(root, "ddp.ckpt"))
    plain = _module(shard=False)
    _trainer(world, STEPS, "ddp").fit(plain, _loader(), ckpt_path=os.path.join(root, "ddp.ckpt"))
    out["ddp_resumed"] = {k: v.detach().clone() for k, v in plain.net.state_dict().items()}
    whole = _module(shard=True)
    _trainer(world, STEPS, Strategy()).fit(whole, _loader())
    out["zrs"] = zrs.full_state_dict(whole.net)
    first = _module(shard=True)
    trainer = _trainer(world, SAVE_AT, Strategy())
    trainer.fit(first, _loader())
    trainer.save_checkpoint(os.path.join(root, "ckpt"))
    out["at_save"] = {"weights": zrs.full_state_dict(first.net), "momenta": _momenta(first)}
    resumed = _module(shard=True)
    _trainer(world, STEPS, Strategy()).fit(resumed, _loader(), ckpt_path=os.path.join(root, "ckpt"))
    out["resumed"] = zrs.full_state_dict(resumed.net)
    wrong = _module(shard=True)
    try:
        _trainer(world, STEPS, Strategy(data_parallel_size=1, tensor_parallel_size=world)).fit(
            wrong, _loader()
        )
        out["wrong_mesh"] = None
    except zrs.ZrsError as e:
        out["wrong_mesh"] = str(e)
    return out


def _loaded(rank: int, world: int, root: str) -> dict:
    """World 3: the world-2 checkpoint loaded (no step left to train)."""
    from zrs.trainers.lightning import Strategy

    as_torchrun(rank, world)
    module = _module(shard=True)
    _trainer(world, SAVE_AT, Strategy()).fit(
        module, _loader(), ckpt_path=os.path.join(root, "ckpt")
    )
    return {"weights": zrs.full_state_dict(module.net), "momenta": _momenta(module)}


@functools.cache
def _root() -> str:
    return tempfile.mkdtemp(prefix="zrs-lightning-")


def _runs(world: int) -> list[dict]:
    fn = _saved if world == 2 else _loaded
    if world != 2:
        _runs(2)  # the checkpoint
    return cached_run(("lightning", world), fn, world, _root(), timeout=300)


def _close(a: dict, b: dict, exact: bool = False) -> None:
    assert a.keys() == b.keys()
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for key in a:
        torch.testing.assert_close(a[key], b[key], **tol, msg=key)


def test_trains_as_lightning_ddp_trains_the_plain_model():
    first = _runs(2)[0]
    _close(first["zrs"], first["ddp"])
    initial = _module(shard=False)
    initial.configure_model()
    assert any(not torch.equal(v, first["zrs"][k]) for k, v in initial.net.state_dict().items()), (
        "nothing trained"
    )


def test_the_checkpoint_resumes_as_lightning_ddp_resumes():
    """Lightning's resume of a plain DataLoader is not the uninterrupted run (DDP's is not
    either): the standard is DDP's resume from its own checkpoint."""
    first = _runs(2)[0]
    _close(first["resumed"], first["ddp_resumed"])


def test_the_checkpoint_loads_at_another_world_size():
    saved = _runs(2)[0]["at_save"]
    for rank, got in enumerate(_runs(3)):
        _close(got["weights"], saved["weights"], exact=True)
        assert len(got["momenta"]) == len(saved["momenta"]), rank
        for a, b in zip(got["momenta"], saved["momenta"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_data_parallel_size_that_repeats_batches_raises_on_every_rank():
    for r in _runs(2):
        assert r["wrong_mesh"] is not None, "ranks trained on the same batches without an error"
        assert "data_parallel_size=2" in r["wrong_mesh"], r["wrong_mesh"]
