"""A small GPT for the main job and the tests.

Token and position embeddings, pre-LN transformer blocks (causal self-attention through
``F.scaled_dot_product_attention`` and a GELU MLP), a final LayerNorm and an LM head whose weight
is the token embedding's (tied: one ``nn.Parameter`` reachable from two modules).

The model can be built on the meta device. Every module that owns parameters initialises them in
its own ``reset_parameters()``, so zrs can materialise a meta model shard by shard;
``GPT.init_weights(seed)`` runs them all for a model built on a real device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level
    block_size: int = 128  # longest context
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=4, d_model=64),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, d_model=128),
    "medium": GPTConfig(block_size=256, n_layer=6, n_head=8, d_model=256),
}


def config_for(size: str, **overrides) -> GPTConfig:
    """The preset named ``size`` ("tiny", "small", "medium"), with fields replaced by overrides."""
    if size not in PRESETS:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(PRESETS)}")
    return GPTConfig(**{**PRESETS[size].__dict__, **overrides})


class Embedding(nn.Embedding):
    """An embedding initialised with N(0, 0.02), as GPT-2 does."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class TiedHead(nn.Linear):
    """A bias-free output projection whose weight belongs to the token embedding."""

    def __init__(self, embedding: nn.Embedding) -> None:
        vocab, dim = embedding.weight.shape
        super().__init__(dim, vocab, bias=False, device="meta")
        self.weight = embedding.weight

    def reset_parameters(self) -> None:
        pass  # the token embedding initialises the shared weight


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = TiedHead(self.wte)

    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter from ``seed``, leaving the global RNG untouched."""
        devices = [self.wte.weight.device] if self.wte.weight.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for module in self.modules():
                if module is not self and hasattr(module, "reset_parameters"):
                    module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for ``idx`` ``(B, T)``; the mean cross-entropy if
        ``targets``."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8
    ) -> torch.Tensor:
        """Sample ``new_tokens`` tokens after ``idx`` ``(B, T)``; returns
        ``(B, T + new_tokens)``."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1] / temperature
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        return idx
