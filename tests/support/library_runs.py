"""What the PEFT and Lightning tests run on every rank, on the CPU (gloo: tests/e2e/test_peft.py,
test_lightning.py) or on this rank's GPU (NCCL: tests/gpu/test_libraries_gpu.py), and how the
parent checks what the ranks return (on the CPU)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch.utils._pytree import tree_map

import zrs
from _dist import as_torchrun
from zoo import spec_of

# --- PEFT: LoRA over a frozen bf16 base --------------------------------------------------------

PEFT_MODEL, PEFT_STEPS, LR, MOMENTUM = "hf_llama", 3, 0.1, 0.9
LORA_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def peft_base(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return spec_of(PEFT_MODEL).build().to(device=_device(device), dtype=torch.bfloat16)


def _peft_model(device: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    base = peft_base(device)
    # B starts non-zero, so that A's gradients are too; the adapters are fp32 (PEFT's default).
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    return get_peft_model(base, config)


def _device(device: str) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else torch.device(device)
    )


def _batch(rank: int, step: int, device: str) -> Any:
    where = _device(device)
    return tree_map(
        lambda t: t.to(where) if isinstance(t, torch.Tensor) else t,
        spec_of(PEFT_MODEL).batch(rank, step),
    )


def _train_peft(model, rank: int, world: int, device: str, reference: bool) -> None:
    spec = spec_of(PEFT_MODEL)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR, momentum=MOMENTUM)
    for step in range(PEFT_STEPS):
        opt.zero_grad(set_to_none=True)
        if reference:
            # One process: the mean of every rank's gradient, each from its unscaled loss as
            # on the ranks (a loss divided by 3 before the backward rounds differently in the
            # bf16 base's activations).
            mean = [torch.zeros_like(p) for p in trained]
            for r in range(world):
                spec.loss(model, _batch(r, step, device)).backward()
                for m, p in zip(mean, trained, strict=True):
                    m += p.grad / world
                    p.grad = None
            for m, p in zip(mean, trained, strict=True):
                p.grad = m
        else:
            spec.loss(model, _batch(rank, step, device)).backward()
        opt.step()


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _adapter_file(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "adapter_model.safetensors"))


def peft_runs(rank: int, world: int, root: str, paths: tuple[str, ...], device: str) -> dict:
    """The reference, then each path ("shard", "compile") trained, gathered and saved by
    `save_pretrained` from rank 0 and from the last rank; rank 0 loads the file with PEFT; then
    rank 0 alone saves a model with a 5 s timeout."""
    from peft import PeftModel

    out: dict = {}
    reference = _peft_model(device)
    _train_peft(reference, rank, world, device, reference=True)
    out["reference"] = _cpu(reference.state_dict())
    for path in paths:
        model = _peft_model(device)
        initial = _cpu(model.state_dict())
        wrap = zrs.shard if path == "shard" else functools.partial(zrs.compile, backend="eager")
        model = wrap(model)
        _train_peft(model, rank, world, device, reference=False)
        out[path] = {"full": zrs.full_state_dict(model, cpu_offload=True), "initial": initial}
        rank0 = os.path.join(root, path, "rank0")
        model.save_pretrained(rank0)  # every rank; rank 0 writes
        last = os.path.join(root, path, "last")
        model.save_pretrained(last, is_main_process=rank == world - 1)
        torch.distributed.barrier()  # the last rank has written
        if rank == 0:
            out[path]["files"] = {"rank0": _adapter_file(rank0), "last": _adapter_file(last)}
            loaded = PeftModel.from_pretrained(peft_base(), rank0)
            out[path]["loaded"] = _cpu(loaded.state_dict())
    saved = os.path.join(root, paths[0], "rank0")
    out["load_adapter"] = _load_adapter_runs(rank, world, saved, device)
    # Rank 0 alone: its meeting times out (5 s) and raises; the others do not come. The ranks
    # meet in zrs.shard with that timeout too: they start it together.
    torch.distributed.barrier()
    lone = zrs.shard(_peft_model(device), timeout=5)
    if rank == 0:
        try:
            lone.save_pretrained(os.path.join(root, "alone"))
            out["alone"] = None
        except zrs.ZrsError as e:
            out["alone"] = str(e)
        out["alone_wrote"] = os.path.exists(
            os.path.join(root, "alone", "adapter_model.safetensors")
        )
    torch.distributed.barrier()
    return out


def _load_adapter_runs(rank: int, world: int, saved: str, device: str) -> dict:
    """PEFT's `load_adapter` on a sharded model: the saved adapter into the untrained one's
    "default" (each rank keeps its rows), and as a frozen second adapter; then adapters added
    to a sharded base by `get_peft_model`, which the optimizer must not step."""
    from peft import LoraConfig, get_peft_model

    out: dict = {}
    model = zrs.shard(_peft_model(device))
    model.load_adapter(saved, adapter_name="default")
    out["default"] = _adapter(zrs.full_state_dict(model, cpu_offload=True))
    model.load_adapter(saved, adapter_name="second")
    out["second_frozen"] = all(
        not p.requires_grad for n, p in model.named_parameters() if ".second." in n
    )
    late = get_peft_model(zrs.shard(peft_base(device)), LoraConfig(r=4, target_modules=["q_proj"]))
    try:
        _train_peft(late, rank, world, device, reference=False)
        out["late"] = None
    except zrs.ZrsError as e:
        out["late"] = str(e)
    return out


# --- Lightning: zrs.trainers.lightning.Strategy against Lightning's DDP ------------------------

LIGHTNING_MODEL, STEPS, SAVE_AT = "hf_gpt2", 4, 2


def lightning_module(shard: bool, offload: bool = False):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.net is not None:
                return
            torch.manual_seed(0)
            net = spec_of(LIGHTNING_MODEL).build()
            self.net = zrs.shard(net, offload="optimizer" if offload else None) if shard else net

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


def _trainer(world: int, steps: int, strategy, device: str):
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
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
    return [state[i]["momentum_buffer"].cpu() for i in sorted(state)]


def lightning_runs(rank: int, world: int, root: str, device: str) -> dict:
    """DDP uninterrupted, saved at SAVE_AT and resumed; zrs the same, and with offload; a
    data-parallel size of 1."""
    from zrs.trainers.lightning import Strategy

    as_torchrun(rank, world)
    out: dict = {}

    def fit(
        shard: bool,
        steps: int,
        strategy,
        save: str | None = None,
        resume: str | None = None,
        offload: bool = False,
    ):
        module = lightning_module(shard, offload)
        trainer = _trainer(world, steps, strategy, device)
        trainer.fit(module, _loader(), ckpt_path=resume and os.path.join(root, resume))
        if save is not None:
            trainer.save_checkpoint(os.path.join(root, save))
        return module

    def weights(module) -> dict[str, torch.Tensor]:
        if hasattr(module.net, "_zrs_state"):
            return zrs.full_state_dict(module.net, cpu_offload=True)
        return _cpu(module.net.state_dict())

    out["ddp"] = weights(fit(False, STEPS, "ddp"))
    fit(False, SAVE_AT, "ddp", save="ddp.ckpt")
    out["ddp_resumed"] = weights(fit(False, STEPS, "ddp", resume="ddp.ckpt"))
    out["zrs"] = weights(fit(True, STEPS, Strategy()))
    out["offload"] = weights(fit(True, STEPS, Strategy(), offload=True))
    first = fit(True, SAVE_AT, Strategy(), save="ckpt")
    out["at_save"] = {"weights": weights(first), "momenta": _momenta(first)}
    out["resumed"] = weights(fit(True, STEPS, Strategy(), resume="ckpt"))
    try:
        fit(True, STEPS, Strategy(data_parallel_size=1, tensor_parallel_size=world))
        out["wrong_mesh"] = None
    except zrs.ZrsError as e:
        out["wrong_mesh"] = str(e)
    return out


def lightning_loaded(rank: int, world: int, root: str, device: str) -> dict:
    """A checkpoint of `lightning_runs` loaded at this world size (no step left to train); then
    zrs and DDP each trained from the start at this world size."""
    from zrs.trainers.lightning import Strategy

    as_torchrun(rank, world)
    module = lightning_module(shard=True)
    trainer = _trainer(world, SAVE_AT, Strategy(), device)
    trainer.fit(module, _loader(), ckpt_path=os.path.join(root, "ckpt"))
    out = {
        "weights": zrs.full_state_dict(module.net, cpu_offload=True),
        "momenta": _momenta(module),
    }
    for name, shard, strategy in (("zrs", True, Strategy()), ("ddp", False, "ddp")):
        module = lightning_module(shard)
        _trainer(world, STEPS, strategy, device).fit(module, _loader())
        net = module.net
        out[name] = zrs.full_state_dict(net, cpu_offload=True) if shard else _cpu(net.state_dict())
    return out


def gpu_runs(rank: int, world: int, root: str) -> dict:
    """Both of the above on this rank's GPU, in one group (tests/gpu/test_libraries_gpu.py)."""
    return {
        "peft": peft_runs(rank, world, root, ("shard", "compile"), "cuda"),
        "lightning": lightning_runs(rank, world, root, "cuda"),
    }


# --- the parent's checks ------------------------------------------------------------------------


def _adapter(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "lora_" in k}


def check_peft_training(first: dict, path: str, rtol: float, atol: float) -> None:
    """The adapters trained as the reference's; the bf16 base stayed where it was, in bf16."""
    reference, got = first["reference"], first[path]
    assert len(_adapter(reference)) == 2 * len(LORA_TARGETS) * 2  # A and B, each target, 2 layers
    for key, value in reference.items():
        torch.testing.assert_close(got["full"][key], value, rtol=rtol, atol=atol, msg=key)
        if "lora_" in key:
            assert got["full"][key].dtype == torch.float32, key
            assert not torch.equal(value, got["initial"][key]), f"{key} did not train"
        elif value.is_floating_point():
            assert got["full"][key].dtype == torch.bfloat16, key
            torch.testing.assert_close(got["full"][key], got["initial"][key], rtol=0, atol=0)


def check_adapter_files(got: dict) -> None:
    """Both writers' files hold the trained adapter alone; PEFT loaded it as trained."""
    trained = _adapter(got["full"])
    for writer in ("rank0", "last"):
        saved = got["files"][writer]
        assert len(saved) == len(trained), sorted(saved)
        for key, value in saved.items():
            name = key.replace(".weight", ".default.weight")
            torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=key)
    for key, value in trained.items():
        torch.testing.assert_close(got["loaded"][key], value, rtol=0, atol=0, msg=key)


def check_load_adapter(first: dict, path: str) -> None:
    """load_adapter put the saved adapter into the sharded model; adapters added to a sharded
    base were refused at the optimizer's step."""
    got = first["load_adapter"]
    trained = _adapter(first[path]["full"])
    assert got["default"].keys() == trained.keys()
    for key, value in trained.items():
        torch.testing.assert_close(got["default"][key], value, rtol=0, atol=0, msg=key)
    assert got["second_frozen"]
    assert got["late"] is not None, "adapters added after sharding trained without an error"
    assert "added to the model after zrs sharded it" in got["late"], got["late"]
    assert "q_proj.lora_A.default.weight" in got["late"], got["late"]


def check_alone(first: dict) -> None:
    assert first["alone"] is not None, "rank 0 saved alone without an error"
    assert "did not reach full_state_dict's entries" in first["alone"], first["alone"]
    assert not first["alone_wrote"]


def close(a: dict, b: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=key)


def check_lightning_training(
    first: dict, rtol: float, atol: float, reference: dict | None = None
) -> None:
    """zrs trained and resumed as DDP did: DDP of the same run, or of `reference` (a CPU run)."""
    reference = first if reference is None else reference
    close(first["zrs"], reference["ddp"], rtol, atol)
    close(first["offload"], reference["ddp"], rtol, atol)  # the step on the host
    initial = lightning_module(shard=False)
    initial.configure_model()
    assert any(not torch.equal(v, first["zrs"][k]) for k, v in initial.net.state_dict().items()), (
        "nothing trained"
    )
    # Lightning's resume of a plain DataLoader is not the uninterrupted run (DDP's is not
    # either): the standard is DDP's resume from its own checkpoint.
    close(first["resumed"], reference["ddp_resumed"], rtol, atol)


def check_mesh(runs: list[dict], world: int) -> None:
    for r in runs:
        assert r["wrong_mesh"] is not None, "ranks trained on the same batches without an error"
        assert f"data_parallel_size={world}" in r["wrong_mesh"], r["wrong_mesh"]
