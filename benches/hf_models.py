"""Hugging Face transformers models for the step benchmark (benches/step.py), built from configs:
nothing is downloaded.

Presets (``--preset``):

  hf_llama_1b    LlamaForCausalLM, TinyLlama-1.1B shape: 22 layers, hidden 2048, intermediate 5632,
                 32 heads, 4 KV heads, vocab 32000, 2048 positions, untied head; seq 2048, batch 4
  hf_gpt2_xl     GPT2LMHeadModel, GPT-2 XL shape: 48 layers, n_embd 1600, 25 heads, vocab 50257,
                 1024 positions (Conv1D with biases, head tied to the token embedding); seq 1024,
                 batch 4
  hf_llama_tiny  / hf_gpt2_tiny: 2 layers, dim 64, 4 heads, vocab 512; seq 64, batch 2 (CPU smoke)

Every model uses attn_implementation="sdpa", use_cache=False and no dropout, and computes its own
loss: ``model(input_ids=x, labels=x).loss``. Built on the meta device, a model is initialised module
by module with ``init_fn(model)`` (the model's own ``_init_weights``, GPT-2's scaled init of the
residual projections included), so that a sharding system never holds the full model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HFPreset:
    family: str  # "llama" or "gpt2"
    n_layers: int
    dim: int
    n_heads: int
    vocab_size: int
    max_positions: int
    seq_len: int
    micro_batch: int
    ffn_dim: int | None = None  # Llama's intermediate_size (GPT-2: 4 * dim)
    n_kv_heads: int | None = None  # Llama only

    @property
    def model_class(self) -> str:
        return {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[self.family]


HF_PRESETS: dict[str, HFPreset] = {
    "hf_llama_1b": HFPreset(
        "llama", 22, 2048, 32, 32000, 2048, 2048, 4, ffn_dim=5632, n_kv_heads=4
    ),
    "hf_gpt2_xl": HFPreset("gpt2", 48, 1600, 25, 50257, 1024, 1024, 4),
    # CPU smoke tests only.
    "hf_llama_tiny": HFPreset("llama", 2, 64, 4, 512, 64, 64, 2, ffn_dim=160, n_kv_heads=2),
    "hf_gpt2_tiny": HFPreset("gpt2", 2, 64, 4, 512, 64, 64, 2),
}


def hf_config(p: HFPreset, n_layers: int | None = None, seq_len: int | None = None):
    """The transformers config of ``p``; ``n_layers`` overrides its depth, and the position limit
    grows to ``seq_len`` where that is longer (GPT-2's learned positions need it)."""
    import transformers as hf

    layers = n_layers or p.n_layers
    positions = max(p.max_positions, seq_len or 0)
    if p.family == "llama":
        return hf.LlamaConfig(
            vocab_size=p.vocab_size,
            hidden_size=p.dim,
            intermediate_size=p.ffn_dim,
            num_hidden_layers=layers,
            num_attention_heads=p.n_heads,
            num_key_value_heads=p.n_kv_heads,
            max_position_embeddings=positions,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="sdpa",
        )
    if p.family == "gpt2":
        return hf.GPT2Config(
            vocab_size=p.vocab_size,
            n_positions=positions,
            n_embd=p.dim,
            n_layer=layers,
            n_head=p.n_heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=p.vocab_size - 1,  # GPT-2's <|endoftext|> (50256), inside a tiny vocab
            eos_token_id=p.vocab_size - 1,
            use_cache=False,
            attn_implementation="sdpa",
        )
    raise ValueError(f"unknown family {p.family!r}")


def build(p: HFPreset, config) -> nn.Module:
    """The model, on torch's current default device (meta for the sharded systems)."""
    import transformers as hf

    model = getattr(hf, p.model_class)(config)
    model.train()
    return model


def retie(model: nn.Module) -> None:
    """Tie the head to the token embedding again where the config ties them: ``to_empty`` gives
    each module a new parameter (FSDP2's ``to_empty`` keeps them tied)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if model.config.tie_word_embeddings and head is not None and head.weight is not emb.weight:
        model.tie_weights()


def blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: LlamaDecoderLayer's or GPT2Block's."""
    if hasattr(model, "model") and hasattr(model.model, "layers"):
        return model.model.layers
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):
        return model.transformer.h
    raise TypeError(f"no decoder blocks found in {type(model).__name__}")


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss (it shifts the labels itself; ``y`` is not used)."""
    return model(input_ids=x, labels=x).loss


def init_fn(model: nn.Module) -> Callable[[nn.Module], None]:
    """``fn(module)`` initialises one module's own parameters and buffers as ``from_config`` would:
    the model's ``_init_weights`` (normal(0, 0.02) weights, zero biases, unit norms, the rotary
    ``inv_freq`` buffers), and GPT-2's residual projections (``c_proj`` of attention and MLP) at
    std 0.02 / sqrt(2 * layers). GPT-2's ``_init_weights`` does the latter from the parent module,
    which owns no parameter (zrs never calls ``fn`` on it): here ``c_proj`` does it itself."""
    scaled: dict[int, float] = {}  # id(c_proj) -> its std
    parents: tuple[type, ...] = ()
    config = model.config
    if config.model_type == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention

        parents = (GPT2Attention, GPT2MLP)
        std = config.initializer_range / math.sqrt(2 * config.n_layer)
        scaled = {id(m.c_proj): std for m in model.modules() if isinstance(m, parents)}
    init_weights = model._init_weights

    def fn(module: nn.Module) -> None:
        if isinstance(module, parents):
            return
        init_weights(module)
        std = scaled.get(id(module))
        if std is not None:
            with torch.no_grad():
                module.weight.normal_(0.0, std)

    return fn


def init_all(model: nn.Module) -> None:
    """Initialise a model materialised with ``to_empty``, module by module."""
    fn = init_fn(model)
    for module in model.modules():
        fn(module)


def n_params(model: nn.Module) -> tuple[int, int]:
    """(all parameters, tied ones once; the parameters that multiply activations: all less the
    input embeddings, token and position, with the LM head counted even when it is tied)."""
    total = sum(p.numel() for p in model.parameters())
    embeddings = [model.get_input_embeddings()]
    wpe = getattr(getattr(model, "transformer", None), "wpe", None)
    if wpe is not None:
        embeddings.append(wpe)
    matmul = total - sum(m.weight.numel() for m in embeddings)
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        matmul += head.weight.numel()
    return total, matmul
