"""The rank check's signature holds what must agree across ranks and nothing that legitimately
differs per rank. Built in one process: each graph stands for one rank's capture."""

from __future__ import annotations

import torch
from torch import fx

from zrs.compiler.consistency import signature
from zrs.runtime.exchange import first_difference


def _graph(device: str, size: int = 3, offset_input: bool = False) -> fx.Graph:
    """A forward as a rank on `device` captures it (meta values): a tensor made on the rank's own
    device, added to an input. `offset_input`: dynamo gave the input's storage offset a symbol on
    this rank (a batch `X[rank]`), an input the graph only passes on to the backward."""
    graph = fx.Graph()
    x = graph.placeholder("primals_1")
    x.meta["val"] = torch.empty(size, device="meta")
    saved = []
    if offset_input:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        env = ShapeEnv()
        offset = graph.placeholder("primals_2")
        offset.meta["val"] = env.create_unbacked_symint()
        saved.append(offset)
    w = graph.placeholder(f"primals_{2 + len(saved)}")
    w.meta["val"] = torch.empty(size, device="meta")
    full = graph.call_function(
        torch.ops.aten.full.default,
        ([size], 0),
        {"dtype": torch.float32, "device": torch.device(device), "pin_memory": False},
    )
    full.meta["val"] = torch.empty(size, device="meta")
    out = graph.call_function(torch.ops.aten.add.Tensor, (x, full))
    out.meta["val"] = torch.empty(size, device="meta")
    graph.output((out, None, *saved, w))
    return graph


def test_each_ranks_own_device_is_no_difference():
    assert signature(_graph("cuda:0")) == signature(_graph("cuda:1"))
    assert "device(cuda)" in "\n".join(signature(_graph("cuda:1")))


def test_an_input_symbol_that_one_rank_lacks_is_no_difference():
    assert signature(_graph("cuda:0")) == signature(_graph("cuda:1", offset_input=True))


def test_a_real_difference_is_still_named():
    i, mine, theirs = first_difference(signature(_graph("cuda:0")), signature(_graph("cpu")))
    assert i == 2 and "device(cuda)" in mine and "device(cpu)" in theirs, (mine, theirs)
    i, mine, theirs = first_difference(signature(_graph("cuda:0")), signature(_graph("cuda:1", 4)))
    assert i == 0 and "[3]" in mine and "[4]" in theirs, (mine, theirs)
