"""Hugging Face conventions on a zrs model: num_parameters() counts full parameters,
save_pretrained() gathers the full weights (or saves the state given), from_pretrained() loads them
into a new model that zrs shards again (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import zrs
from hf_zoo import HF_ZOO
from zrs.compiler import backend as dynamo_backend
from zrs.runtime import state as runtime


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_qwen2", "hf_t5"])
def test_num_parameters_counts_full_parameters(name):
    spec = HF_ZOO[name]
    expected = [
        spec.build().num_parameters(**kw)
        for kw in ({}, {"only_trainable": True}, {"exclude_embeddings": True})
    ]
    model = zrs.compile(spec.build(), backend="eager")
    try:
        got = [
            model.num_parameters(**kw)
            for kw in ({}, {"only_trainable": True}, {"exclude_embeddings": True})
        ]
    finally:
        runtime.reset()
    assert got == expected


def test_save_pretrained_writes_full_weights_that_from_pretrained_loads(tmp_path):
    spec = HF_ZOO["hf_gpt2"]
    model = zrs.compile(spec.build(), backend="eager")
    try:
        spec.loss(model, spec.batch(0, 0)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad)  # the saved weights differ from the initial ones
        state = zrs.full_state_dict(model)
        model.save_pretrained(tmp_path / "gathered")  # zrs gathers (a collective at 2+ ranks)
        model.save_pretrained(tmp_path / "full", state_dict=dict(state))  # it drops tied keys
        for where in ("gathered", "full"):
            loaded = type(model).from_pretrained(tmp_path / where).train()
            assert not hasattr(loaded, "_zrs_state"), "from_pretrained builds an unsharded model"
            for key, value in loaded.state_dict().items():
                torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
        reference = type(model).from_pretrained(tmp_path / "full").train()
        again = zrs.compile(loaded, backend="eager")
        batch = spec.batch(0, 1)
        torch.testing.assert_close(spec.loss(again, batch), spec.loss(reference, batch))
    finally:
        runtime.reset()


class _OtherLibraryModel(torch.nn.Module):
    """A save_pretrained with no state_dict parameter (diffusers' kind): it writes its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def save_pretrained(self, save_directory, **kwargs):
        torch.save(self.state_dict(), f"{save_directory}/weights.pt")


def test_save_pretrained_of_another_library_raises_without_the_full_state(tmp_path):
    model = zrs.shard(_OtherLibraryModel())
    try:
        with pytest.raises(zrs.ZrsError, match="full_state_dict"):
            model.save_pretrained(tmp_path)
        assert not (tmp_path / "weights.pt").exists()
        model.save_pretrained(tmp_path, state_dict=zrs.full_state_dict(model))  # the user's call
        assert (tmp_path / "weights.pt").exists()
    finally:
        runtime.reset()


def test_the_loss_is_compiled_with_the_model_without_a_graph_break():
    """Transformers' `loss_function` property logs a warning when the config names no loss type;
    dynamo broke the graph there and traced the whole forward twice. zrs resolves it before the
    compile, to the function the property gives."""
    from torch._dynamo.utils import counters

    spec = HF_ZOO["hf_gpt2"]
    expected = spec.build().loss_function
    model = zrs.compile(spec.build(), backend="eager")
    counters.clear()
    try:
        spec.loss(model, spec.batch(0, 0)).backward()
    finally:
        runtime.reset()
    assert model.loss_function is expected
    assert not counters["graph_break"], dict(counters["graph_break"])


def _attention_masks(monkeypatch) -> list[bool]:
    """Whether each SDPA call dynamo captured got a mask (blocks' bodies included)."""
    masked: list[bool] = []
    lift = dynamo_backend.lift_region_gathers

    def spy(gm):
        for module in gm.modules():
            for n in getattr(module, "graph", fx.Graph()).nodes:
                if n.target is torch._C._nn.scaled_dot_product_attention:
                    mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                    masked.append(mask is not None or not n.kwargs.get("is_causal", False))
        return lift(gm)

    monkeypatch.setattr(dynamo_backend, "lift_region_gathers", spy)
    return masked


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_a_causal_lm_without_masks_attends_causally_without_a_mask(name, monkeypatch):
    """Compiled whole, transformers built a causal mask for every call (it cannot tell that the
    positions are not packed, and torch 2.11's dynamo says it exports), and SDPA could not take its
    fastest kernels. zrs tells it; with an attention mask, transformers decides as before."""
    spec = HF_ZOO[name]
    reference = spec.build()
    model = zrs.compile(spec.build(), backend="eager", dynamic=True)
    masked = _attention_masks(monkeypatch)
    (x,) = spec.batch(0, 0)
    try:
        loss = model(input_ids=x, labels=x).loss
        assert masked and not any(masked), masked
        masked.clear()
        padded = model(input_ids=x, labels=x, attention_mask=torch.ones_like(x)).loss
        assert masked and all(masked), masked
    finally:
        runtime.reset()
    expected = reference(input_ids=x, labels=x).loss
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(padded, expected)
