"""The training data of the step benchmark: each rank's random-token batches (Data), the
--varlen lengths, and the --varlen record's throughput over the tokens really processed."""

from __future__ import annotations

import random
import statistics

import torch

from systems.common import Ctx


def varlen_range(seq_len: int) -> tuple[int, int]:
    """--varlen: the lengths drawn from, inclusive: [seq_len // 16 (at least 2), seq_len]."""
    return max(2, seq_len // 16), seq_len


def varlen_length(seed: int, rank: int, step: int, seq_len: int) -> int:
    """--varlen: the sequence length of ``step`` on ``rank``, uniform in ``varlen_range``; the
    same in every run, and computable on any rank."""
    return random.Random(f"varlen/{seed}/{rank}/{step}").randint(*varlen_range(seq_len))


class Data:
    """The batches of one rank: ``n`` fixed random-token batches of (micro_batch, seq_len) per
    rank, each rank its own (seeded by --seed and the rank), cycled through the steps. With
    --varlen, step ``i`` takes the first ``varlen_length(.., i, ..)`` tokens of its batch (copied
    to a contiguous tensor, before the timed steps)."""

    def __init__(self, ctx: Ctx, n: int = 4):
        self.ctx = ctx
        g = torch.Generator().manual_seed(ctx.args.seed * 1000 + ctx.rank)
        spec = ctx.spec
        self.batches = []
        for _ in range(n):
            tok = torch.randint(
                0, spec.vocab_size, (spec.micro_batch, spec.seq_len + 1), generator=g
            )
            self.batches.append(
                (tok[:, :-1].contiguous().to(ctx.device), tok[:, 1:].contiguous().to(ctx.device))
            )
        self.sliced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def length(self, step: int, rank: int | None = None) -> int:
        spec = self.ctx.spec
        if not self.ctx.args.varlen:
            return spec.seq_len
        rank = self.ctx.rank if rank is None else rank
        return varlen_length(self.ctx.args.seed, rank, step, spec.seq_len)

    def prepare(self, steps: range) -> None:
        for i in steps:
            self(i)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batches[step % len(self.batches)]
        if not self.ctx.args.varlen:
            return x, y
        if step not in self.sliced:
            t = self.length(step)
            self.sliced[step] = (x[:, :t].contiguous(), y[:, :t].contiguous())
        return self.sliced[step]


def varlen_metrics(data: Data, world: int, warmup: int, step_s: list[float]) -> dict:
    """--varlen: throughput over the tokens really processed. Every rank's lengths follow from the
    seed, the step and the rank, so rank 0 computes them all; ``step_s`` are the timed steps'
    times (slowest rank per step)."""
    spec, n = data.ctx.spec, len(step_s)
    timed = [data.length(warmup + i, r) for i in range(n) for r in range(world)]
    seen = {data.length(i, r) for i in range(warmup + n) for r in range(world)}
    tokens = spec.micro_batch * sum(timed)  # all ranks
    flops = spec.micro_batch * sum(t * spec.flops_per_token(t) for t in timed)
    total_s = sum(step_s)
    peak = data.ctx.args.peak_tflops * 1e12
    per_step = [
        spec.micro_batch * sum(timed[i * world : (i + 1) * world]) / world / t
        for i, t in enumerate(step_s)
    ]
    return {
        "varlen": True,
        "tok_s_gpu_real": round(tokens / world / total_s, 1),
        "tok_s_gpu_real_med": round(statistics.median(per_step), 1),
        "mfu_real": round(flops / world / total_s / peak, 4),
        "seq_len_mean": round(sum(timed) / len(timed), 1),
        "varlen_range": list(varlen_range(spec.seq_len)),
        "distinct_lengths": len(seen),
    }
