"""Hugging Face's Trainer with a zrs model (`zrs.trainers.hf.Trainer`), on CPU ranks: it trains as
Trainer trains the unsharded model under DDP (gradient accumulation and clipping included), its
checkpoint resumes the run bit for bit, and loaded at another world size it gives every rank the
saved weights and optimizer state, then trains on as DDP resumed from its own checkpoint does
(`zrs.compile` there). The same with sharded checkpoints (`state_dict_type="sharded"`,
torch.distributed.checkpoint folders), and with offload="optimizer" (the SGD step on the host,
Trainer's clip on host gradients)."""

from __future__ import annotations

import os

import pytest
import torch

import zrs
from _dist import as_torchrun, run_workers
from zoo import spec_of

pytestmark = pytest.mark.slow

MODEL = "hf_gpt2"  # biases and a tied head
STEPS, SAVE_AT, LR, MOMENTUM, MAX_NORM = 4, 2, 0.1, 0.9, 0.5


class _Tokens(torch.utils.data.Dataset):
    """Fixed-length rows of a seeded token matrix: Trainer's sampler decides who trains on which."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(2, 48, (64, 8), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _trainer(model, root: str, name: str, *, sharded: bool, state_dict_type: str = "full"):
    import transformers

    from zrs.trainers.hf import Trainer

    args = transformers.TrainingArguments(
        output_dir=os.path.join(root, name),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=MAX_NORM,
        save_strategy="steps",
        save_steps=SAVE_AT,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    if not sharded:
        return transformers.Trainer(
            model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, schedule)
        )
    return Trainer(
        model=model,
        args=args,
        train_dataset=_Tokens(),
        optimizers=(opt, schedule),
        state_dict_type=state_dict_type,
    )


def _momenta(trainer) -> list[torch.Tensor]:
    from zrs.checkpointing import optimizer_state

    inner = trainer.optimizer.optimizer
    state = optimizer_state.gather(inner, inner.state_dict())["state"]
    return [state[i]["momentum_buffer"] for i in sorted(state)]


def _runs(rank: int, world: int, root: str) -> dict:
    as_torchrun(rank, world)
    spec = spec_of(MODEL)
    plain = spec.build()
    _trainer(plain, root, "ddp", sharded=False).train()
    out = {"ddp": {k: v.detach().clone() for k, v in plain.state_dict().items()}}
    out["ddp_processes"] = torch.distributed.get_world_size()
    sharded = zrs.shard(spec.build())
    trainer = _trainer(sharded, root, "zrs", sharded=True)
    trainer.train()
    out["zrs"] = zrs.full_state_dict(sharded)
    trainer.save_model(os.path.join(root, "saved"))  # the user's call, on every rank
    resumed = zrs.shard(spec.build())
    trainer = _trainer(resumed, root, "zrs", sharded=True)
    trainer.train(resume_from_checkpoint=os.path.join(root, "zrs", f"checkpoint-{SAVE_AT}"))
    out["resumed"] = zrs.full_state_dict(resumed)
    for run in ("offload", "offload_resumed"):
        model = zrs.shard(spec.build(), offload="optimizer")
        trainer = _trainer(model, root, "offload", sharded=True)
        resume = (
            os.path.join(root, "offload", f"checkpoint-{SAVE_AT}")
            if run == "offload_resumed"
            else None
        )
        trainer.train(resume_from_checkpoint=resume)
        out[run] = zrs.full_state_dict(model)
    for run in ("dcp", "dcp_resumed"):
        model = zrs.shard(spec.build())
        trainer = _trainer(model, root, "dcp", sharded=True, state_dict_type="sharded")
        resume = (
            os.path.join(root, "dcp", f"checkpoint-{SAVE_AT}") if run == "dcp_resumed" else None
        )
        trainer.train(resume_from_checkpoint=resume)
        out[run] = zrs.full_state_dict(model)
    return out


def _at_checkpoint(rank: int, world: int, root: str) -> dict:
    """Runs of world 3 resumed from the world-2 checkpoints, full (on zrs.compile) and sharded:
    what each holds when training begins, and where it ends against DDP's run resumed alike."""
    import transformers

    as_torchrun(rank, world)
    seen: dict = {}
    for name in ("zrs", "dcp"):
        build = spec_of(MODEL).build()
        model = zrs.compile(build, backend="eager") if name == "zrs" else zrs.shard(build)
        trainer = _trainer(model, os.path.join(root, "w3"), name, sharded=True)

        class Loaded(transformers.TrainerCallback):
            def on_train_begin(self, *args, _name=name, _model=model, _trainer=trainer, **kw):
                # after the checkpoint's load
                seen[_name] = {"loaded": zrs.full_state_dict(_model), "momenta": _momenta(_trainer)}

        trainer.add_callback(Loaded())
        trainer.train(resume_from_checkpoint=os.path.join(root, name, f"checkpoint-{SAVE_AT}"))
        seen[name]["final"] = zrs.full_state_dict(model)
    plain = spec_of(MODEL).build()
    trainer = _trainer(plain, os.path.join(root, "w3"), "ddp", sharded=False)
    trainer.train(resume_from_checkpoint=os.path.join(root, "ddp", f"checkpoint-{SAVE_AT}"))
    seen["ddp"] = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    return seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], str]:
    root = str(tmp_path_factory.mktemp("trainer"))
    return run_workers(_runs, 2, root, timeout=900), root


def test_trains_as_trainer_trains_the_unsharded_model_under_ddp(runs):
    per_rank, _ = runs
    zrs_final, ddp = per_rank[0]["zrs"], per_rank[0]["ddp"]
    for key, value in ddp.items():
        assert torch.allclose(zrs_final[key], value, rtol=1e-5, atol=1e-6), key
    assert not torch.equal(zrs_final["transformer.h.0.mlp.c_fc.weight"],
                           spec_of(MODEL).build().state_dict()["transformer.h.0.mlp.c_fc.weight"])  # fmt: skip


def test_save_model_writes_the_trained_weights_that_from_pretrained_reads(runs):
    per_rank, root = runs
    loaded = type(spec_of(MODEL).build()).from_pretrained(os.path.join(root, "saved"))
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, per_rank[0]["zrs"][key]), key


def test_offloaded_it_trains_as_ddp_and_resumes_exactly(runs):
    """offload="optimizer": Trainer's optimizer steps on the host (zrs-core's SGD, torch's order
    of operations) after its clip of the host gradients; its checkpoint resumes the run."""
    per_rank, _ = runs
    ddp = per_rank[0]["ddp"]
    for rank, r in enumerate(per_rank):
        for key, value in ddp.items():
            assert torch.allclose(r["offload"][key], value, rtol=1e-5, atol=1e-6), (rank, key)
        for key, value in r["offload"].items():
            assert torch.equal(r["offload_resumed"][key], value), f"rank {rank}: {key}"


def test_a_checkpoint_resumes_the_run_exactly(runs):
    per_rank, _ = runs
    for rank, r in enumerate(per_rank):
        for key, value in r["zrs"].items():
            assert torch.equal(r["resumed"][key], value), f"rank {rank}: {key}"
            assert torch.equal(r["dcp"][key], value), f"rank {rank}: {key}"
            assert torch.equal(r["dcp_resumed"][key], value), f"rank {rank}: {key}"


def test_a_sharded_checkpoint_is_folders_and_plain_trainer_refuses_its_optimizer(runs):
    _, root = runs
    checkpoint = os.path.join(root, "dcp", f"checkpoint-{SAVE_AT}")
    for folder in ("zrs_model", "zrs_optimizer"):
        assert os.path.isfile(os.path.join(checkpoint, folder, ".metadata")), folder
    assert not os.path.exists(os.path.join(checkpoint, "model.safetensors"))
    pointer = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    assert pointer["state"] == {} and pointer["param_groups"] == []
    plain = torch.optim.SGD(spec_of(MODEL).build().parameters(), lr=LR, momentum=MOMENTUM)
    with pytest.raises(ValueError, match="parameter groups"):
        plain.load_state_dict(pointer)


def test_a_checkpoint_of_2_ranks_loads_on_3_and_trains_on_as_ddp_resumed_alike(runs):
    _, root = runs
    import safetensors.torch

    checkpoint = os.path.join(root, "zrs", f"checkpoint-{SAVE_AT}")
    saved = safetensors.torch.load_file(os.path.join(checkpoint, "model.safetensors"))
    saved_optim = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    momenta = [saved_optim["state"][i]["momentum_buffer"] for i in sorted(saved_optim["state"])]
    for r in run_workers(_at_checkpoint, 3, root, timeout=900):
        for name in ("zrs", "dcp"):  # the sharded checkpoint holds the same training's state
            for key, value in saved.items():
                assert torch.equal(r[name]["loaded"][key], value), (name, key)
            assert len(r[name]["momenta"]) == len(momenta)
            for got, want in zip(r[name]["momenta"], momenta, strict=True):
                assert torch.equal(got, want), name
            for key, value in r["ddp"].items():
                assert torch.allclose(r[name]["final"][key], value, rtol=1e-5, atol=1e-6), (
                    name,
                    key,
                )
            # it trained on after the load (the steps from SAVE_AT to STEPS)
            assert any(not torch.equal(r[name]["final"][k], v) for k, v in saved.items()), name
