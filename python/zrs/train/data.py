"""The bundled corpus, a byte-level tokenizer and a deterministic per-rank batch sampler.

The corpus is Lewis Carroll's *Alice's Adventures in Wonderland* (public domain; see
``corpus/SOURCE.md``). Tokens are UTF-8 bytes, so the vocabulary has 256 entries and needs no
training.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

VOCAB_SIZE = 256
CORPUS_PATH = Path(__file__).parent / "corpus" / "alice.txt"


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor of token ids."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids: torch.Tensor) -> str:
    """The text of token ids; invalid UTF-8 (possible in samples) becomes U+FFFD."""
    return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def corpus_text() -> str:
    """The bundled corpus as text."""
    return CORPUS_PATH.read_text(encoding="utf-8")


def load_corpus(split: str | None = None, val_fraction: float = 0.1) -> torch.Tensor:
    """Token ids of the bundled corpus: all of it, or its "train" head or "val" tail."""
    ids = encode(corpus_text())
    n_train = int(len(ids) * (1.0 - val_fraction))
    if split is None:
        return ids
    if split == "train":
        return ids[:n_train]
    if split == "val":
        return ids[n_train:]
    raise ValueError(f"split must be None, 'train' or 'val', not {split!r}")


def batch_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed that depends on (seed, step, rank) only: stable across runs and machines."""
    digest = hashlib.blake2b(f"zrs:{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens; each (step, rank) pair gets its own batch.

    The batch for a step is a pure function of (seed, step, rank), so a run can be resumed or
    replayed, and an unsharded reference can rebuild every rank's batch.
    """

    def __init__(
        self, data: torch.Tensor, batch_size: int, seq_len: int, *, rank: int = 0, seed: int = 0
    ) -> None:
        if len(data) <= seq_len:
            raise ValueError(f"corpus of {len(data)} tokens is too short for seq_len={seq_len}")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.rank, self.seed = rank, seed

    def batch(self, step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both ``(batch_size, seq_len)`` int64."""
        rank = self.rank if rank is None else rank
        g = torch.Generator().manual_seed(batch_seed(self.seed, step, rank))
        starts = torch.randint(len(self.data) - self.seq_len, (self.batch_size,), generator=g)
        windows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
