"""A model built on the meta device is sharded module by module, never as a full copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zrs
from _dist import run_workers
from zrs.prepare import sharding


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))


def _reference() -> dict[str, torch.Tensor]:
    """What module-by-module initialisation in `modules()` order gives, from the same seed."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _build()
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    for m in model.modules():
        if next(m.parameters(recurse=False), None) is not None:
            m.reset_parameters()
    return model.state_dict()


def _meta_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = _build()
    seen = []
    materialize = sharding._materialize

    def spy(module, device, init_fn):
        # Only the module being sharded may hold full tensors at this point.
        seen.append(sum(p.numel() for p in module.parameters(recurse=False)))
        materialize(module, device, init_fn)

    sharding._materialize = spy
    torch.manual_seed(1)
    zrs.compile(model, backend="eager")
    assert all(not p.is_meta for p in model.parameters())
    assert seen == [5 * 7 + 7, 7 + 7, 7 * 3], seen
    x = torch.randn(2, 5)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    return zrs.full_state_dict(model)


@pytest.mark.parametrize("world", [1, 2])
def test_meta_model_matches_module_by_module_init(world):
    ref = _reference()
    for sd in run_workers(_meta_worker, world, timeout=600):
        assert sd.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(sd[k], ref[k])


class _Mixed(nn.Module):
    """Real modules (random per rank), a meta-built one, a bf16 one and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        with torch.device("meta"):
            self.meta = nn.Linear(6, 5)
        self.low = nn.Linear(5, 6).to(torch.bfloat16)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.meta(self.body(self.embed(x)))
        return self.head(self.low(h.to(torch.bfloat16)).float())


def _rank0_worker(rank: int, world: int) -> dict:
    # Buckets of 64 bytes: a module's parameters travel in several broadcasts.
    sharding.BROADCAST_BUCKET_BYTES = 64
    torch.manual_seed(123 + rank)  # every rank draws other weights
    model = _Mixed()
    own = {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}
    zrs.shard(model)
    model(torch.tensor([[1, 2, 3]])).sum().backward()  # trains: ties and dtypes held
    out = {"own": own, "sharded": zrs.full_state_dict(model)}
    # A conversion that keeps the parameters where they are (a copy of each, on `cpu:0`) leaves
    # them zrs's: the next step still trains what the gathers read.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.to("cpu:0")
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    out["trained_after_to"] = not torch.equal(
        zrs.full_state_dict(model)["body.weight"], out["sharded"]["body.weight"]
    )
    try:
        model.double()
        out["double"] = None
    except zrs.ZrsError as e:
        out["double"] = str(e)
    # A group of ranks 1 and 2: its rank 0 is global rank 1.
    sub = torch.distributed.new_group([1, 2])
    if rank in (1, 2):
        other = nn.Linear(4, 4)
        out["sub_own"] = other.weight.detach().clone()
        zrs.shard(other, process_group=sub)
        out["sub"] = zrs.full_state_dict(other)["weight"]
    return out


def test_every_rank_starts_from_rank_0s_weights():
    """Ranks whose RNGs differ end with rank 0's weights (real, meta-built, bf16, tied),
    broadcast a module at a time in buckets; in a group of ranks 1 and 2, rank 1's."""
    per_rank = run_workers(_rank0_worker, 3, timeout=600)
    rank0 = per_rank[0]["sharded"]
    assert not torch.equal(per_rank[0]["own"]["body.weight"], per_rank[1]["own"]["body.weight"])
    for name, value in per_rank[0]["own"].items():
        torch.testing.assert_close(rank0[name], value, rtol=0, atol=0, msg=name)
    for rank, r in enumerate(per_rank[1:], start=1):
        for name, value in rank0.items():
            assert torch.equal(r["sharded"][name], value), f"rank {rank}: {name}"
    assert all(r["trained_after_to"] for r in per_rank), "model.to('cpu:0') stopped training"
    assert all(r["double"] and "cannot move or cast" in r["double"] for r in per_rank)
    assert torch.equal(per_rank[1]["sub"], per_rank[1]["sub_own"])
    assert torch.equal(per_rank[2]["sub"], per_rank[1]["sub_own"])
    assert rank0["low.weight"].dtype == torch.bfloat16
    assert torch.equal(rank0["head.weight"], rank0["embed.weight"])
