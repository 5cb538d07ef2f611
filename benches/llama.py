"""A Llama-style decoder for the step benchmark (benches/step.py).

RMSNorm, fused QKV projection, rotary position embeddings, causal SDPA attention, SwiGLU MLP and an
untied LM head; no biases. Build it on the meta device and let each module initialise its own
parameters and buffers with ``reset_parameters()`` (see ``init_weights``), so that a sharding
system never holds the full model:

    with torch.device("meta"):
        model = Llama(PRESETS["1b"])
    model.to_empty(device="cuda")
    init_weights(model)

Built on a real device, every module is initialised by its constructor as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    dim: int
    n_heads: int
    ffn_dim: int
    vocab_size: int = 32000
    seq_len: int = 2048
    micro_batch: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def n_params(self, embedding: bool = True) -> int:
        """Parameter count; without ``embedding`` the token embedding is left out (the head stays)."""
        d, f = self.dim, self.ffn_dim
        per_layer = 4 * d * d + 3 * d * f + 2 * d  # qkv + proj, w1 w2 w3, two norms
        n = self.n_layers * per_layer + d + self.vocab_size * d  # final norm, head
        return n + self.vocab_size * d if embedding else n

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), as PaLM and torchtitan count them.

        6 x (parameters other than the embedding) for the matrix products, plus
        12 x layers x dim x seq_len for the attention scores and values (counted as if not
        causal, the usual convention).
        """
        return 6 * self.n_params(embedding=False) + 12 * self.n_layers * self.dim * self.seq_len


PRESETS: dict[str, LlamaConfig] = {
    "1b": LlamaConfig(n_layers=16, dim=2048, n_heads=16, ffn_dim=5504),
    "7b": LlamaConfig(n_layers=32, dim=4096, n_heads=32, ffn_dim=11008),
    # Llama-2-13B's shape: for offload="params" on one GPU (the host holds 18 bytes a parameter).
    "13b": LlamaConfig(n_layers=40, dim=5120, n_heads=40, ffn_dim=13824),
    # CPU smoke tests only.
    "tiny": LlamaConfig(
        n_layers=2, dim=64, n_heads=4, ffn_dim=160, vocab_size=512, seq_len=64, micro_batch=2
    ),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (B, T, H, D) by the angles whose cos/sin are (T, D)."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        shape = (cfg.seq_len, cfg.head_dim)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if not self.rope_cos.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise this module's own state only (the rotary tables); children do their own."""
        cfg = self.cfg
        device = self.rope_cos.device
        inv = cfg.rope_theta ** -(
            torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim
        )
        angles = torch.outer(torch.arange(cfg.seq_len, device=device, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        with torch.no_grad():
            self.rope_cos.copy_(angles.cos())
            self.rope_sin.copy_(angles.sin())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def init_weights(model: nn.Module) -> None:
    """Initialise a model materialised with ``to_empty``: every module's own ``reset_parameters``.

    The method is looked up on the class, so wrappers that forward attribute access to a wrapped
    module (torch.compile's OptimizedModule) don't initialise it twice.
    """
    for module in model.modules():
        reset = getattr(type(module), "reset_parameters", None)
        if reset is not None:
            reset(module)
