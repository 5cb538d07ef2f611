"""PEFT adapters on a sharded model, on CPU ranks: LoRA on the attention and MLP projections of a
tiny Llama whose base is frozen in bf16 (QLoRA's layout without the quantisation: the adapters
stay fp32), under zrs.shard and zrs.compile, trains as the unsharded model does with the
per-rank gradients averaged; the base does not move; `save_pretrained` of the adapter, called on
every rank, writes the full adapter (only its entries gathered), from whichever rank
`is_main_process` names, and PEFT loads it into a fresh model; called on one rank alone it
raises ZrsError there instead of waiting in a gather."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import zrs
from _dist import cached_run
from zoo import spec_of

pytest.importorskip("peft")
pytestmark = [
    pytest.mark.slow,
    # peft 0.21's get_peft_model asks transformers 5.24 the deprecated is_gradient_checkpointing
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

MODEL, STEPS, LR, MOMENTUM = "hf_llama", 3, 0.1, 0.9
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
PATHS = {2: ("shard", "compile"), 3: ("shard",)}


def _base():
    torch.manual_seed(0)
    return spec_of(MODEL).build().to(torch.bfloat16)


def _peft_model():
    from peft import LoraConfig, get_peft_model

    base = _base()
    # B starts non-zero, so that A's gradients are too; the adapters are fp32 (PEFT's default).
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(base, config)


def _train(model, rank: int, world: int, reference: bool) -> None:
    spec = spec_of(MODEL)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        if reference:
            # One process: the mean of every rank's gradient, each from its unscaled loss as
            # on the ranks (a loss divided by 3 before the backward rounds differently in the
            # bf16 base's activations).
            mean = [torch.zeros_like(p) for p in trained]
            for r in range(world):
                spec.loss(model, spec.batch(r, step)).backward()
                for m, p in zip(mean, trained, strict=True):
                    m += p.grad / world
                    p.grad = None
            for m, p in zip(mean, trained, strict=True):
                p.grad = m
        else:
            spec.loss(model, spec.batch(rank, step)).backward()
        opt.step()


def _saved(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "adapter_model.safetensors"))


def _runs(rank: int, world: int, root: str) -> dict:
    from peft import PeftModel

    out: dict = {}
    reference = _peft_model()
    _train(reference, rank, world, reference=True)
    out["reference"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    for path in PATHS[world]:
        model = _peft_model()
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        wrap = zrs.shard if path == "shard" else functools.partial(zrs.compile, backend="eager")
        model = wrap(model)
        _train(model, rank, world, reference=False)
        full = zrs.full_state_dict(model)
        out[path] = {"full": full, "initial": initial}
        rank0 = os.path.join(root, path, "rank0")
        model.save_pretrained(rank0)  # every rank; rank 0 writes
        last = os.path.join(root, path, "last")
        model.save_pretrained(last, is_main_process=rank == world - 1)
        torch.distributed.barrier()  # the last rank has written
        if rank == 0:
            out[path]["files"] = {"rank0": _saved(rank0), "last": _saved(last)}
            loaded = PeftModel.from_pretrained(_base(), rank0)
            out[path]["loaded"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    # Rank 0 alone: its meeting times out (5 s) and raises; the others do not come.
    lone = zrs.shard(_peft_model(), timeout=5)
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


@functools.cache
def _group(world: int) -> list[dict]:
    import tempfile

    root = tempfile.mkdtemp(prefix="zrs-peft-")
    return cached_run(("peft", world), _runs, world, root, timeout=300)


CASES = [
    pytest.param(world, path, id=f"w{world}-{path}")
    for world, paths in PATHS.items()
    for path in paths
]


def _adapter(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "lora_" in k}


@pytest.mark.parametrize(("world", "path"), CASES)
def test_adapters_train_as_the_unsharded_model_and_the_base_stays(world, path):
    first = _group(world)[0]
    reference, got = first["reference"], first[path]
    assert len(_adapter(reference)) == 2 * len(TARGETS) * 2  # A and B, each target, 2 layers
    for key, value in reference.items():
        torch.testing.assert_close(got["full"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        if "lora_" in key:
            assert got["full"][key].dtype == torch.float32, key
            assert not torch.equal(value, got["initial"][key]), f"{key} did not train"
        elif value.is_floating_point():
            assert got["full"][key].dtype == torch.bfloat16, key
            torch.testing.assert_close(got["full"][key], got["initial"][key], rtol=0, atol=0)


@pytest.mark.parametrize(("world", "path"), CASES)
def test_save_pretrained_writes_the_full_adapter_that_peft_loads(world, path):
    got = _group(world)[0][path]
    trained = _adapter(got["full"])
    for writer in ("rank0", "last"):
        saved = got["files"][writer]
        assert len(saved) == len(trained), sorted(saved)  # the adapter alone
        for key, value in saved.items():
            name = key.replace(".weight", ".default.weight")
            torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=key)
    for key, value in trained.items():
        torch.testing.assert_close(got["loaded"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("world", sorted(PATHS))
def test_save_pretrained_on_one_rank_alone_raises(world):
    first = _group(world)[0]
    assert first["alone"] is not None, "rank 0 saved alone without an error"
    assert "did not reach full_state_dict's entries" in first["alone"], first["alone"]
    assert not first["alone_wrote"]
