"""Check that every rank lowered the same graph, before any of its collectives can hang.

Ranks that trace different graphs (data-dependent control flow, different input shapes) would issue
different collectives and deadlock. Each rank hashes a signature of its lowered graph; the hashes
are compared in one small exchange (`zrs.runtime.exchange`, which cannot deadlock under gloo as
`all_gather_object` can), and only on a mismatch are the signatures exchanged to name the first
differing node.

The signature holds what must agree and nothing that legitimately differs per rank: ops, shapes,
dtypes and constants, but no node names, addresses, device indices (rank r computes on `cuda:r`),
and no unused symbolic input (a batch `X[rank]` is a view at another storage offset on each
rank, which dynamo makes an input symbol on some ranks only: `_fx.rank_local_inputs`).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from zrs._core import ZrsError
from zrs.compiler._fx import rank_local_inputs
from zrs.runtime.exchange import all_gather_bytes, first_difference


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    return f"{getattr(value, 'dtype', '')}{list(shape)}" if shape is not None else ""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_NUMBERED = re.compile(r"_\d+$")


def _stable(x: Any, index: dict[fx.Node, int]) -> str:
    """`x` as text that is the same in every process: no address or id. A Python function's
    default repr holds its address (`<function sym_sum at 0x7f..>`): name it by module and
    qualified name instead."""
    if isinstance(x, fx.Node):
        return f"%{index[x]}"
    if isinstance(x, (list, tuple)):  # without the inputs left out of `index`
        inner = ", ".join(_stable(v, index) for v in x if not isinstance(v, fx.Node) or v in index)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_stable(v, index)}" for k, v in x.items()) + "}"
    if isinstance(x, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, str)):
        return str(x)
    if callable(x) and hasattr(x, "__qualname__"):
        return f"{getattr(x, '__module__', None) or '?'}.{x.__qualname__}"
    if isinstance(x, torch.Tensor):  # a constant the graph holds: its kind, not its address
        return _describe(x)
    if isinstance(x, torch.device):  # each rank's own device: its kind, not its index
        return f"device({x.type})"
    return _ADDRESS.sub("", repr(x))


def _without_none(x: Any) -> Any:
    """A backward's outputs without their Nones: it returns one per input of the forward that gets
    no gradient, and the symbolic inputs (`rank_local_inputs`) are among them on some ranks."""
    if isinstance(x, (list, tuple)):
        return type(x)(_without_none(v) for v in x if v is not None)
    return x


def signature(graph: fx.Graph) -> list[str]:
    """One line per node: op, target, constant arguments and output shape; no names, and no line
    for an input that may differ per rank without changing any collective."""
    local = rank_local_inputs(graph)
    nodes = [n for n in graph.nodes if n not in local]
    index = {n: i for i, n in enumerate(nodes)}
    lines = []
    for n in nodes:
        # An input's name counts its kind (primals_6 after a left-out primals_5): keep the kind.
        target = _NUMBERED.sub("", n.target) if n.op == "placeholder" else n.target
        call = _stable(target, index)
        args = _stable(_without_none(n.args) if n.op == "output" else tuple(n.args), index)
        kwargs = f" {_stable(dict(n.kwargs), index)}" if n.kwargs else ""
        lines.append(f"{n.op} {call} {args}{kwargs} -> {_describe(n.meta.get('val'))}")
    return lines


def check_same_graph(graph: fx.Graph, group: dist.ProcessGroup | None, what: str) -> None:
    different = _first_difference(signature(graph), group)
    if different is None:
        return
    other, i, node_a, node_b = different
    raise ZrsError(
        f"ranks captured different {what}: the first difference is node #{i}, which is "
        f"`{node_a}` on rank 0 but `{node_b}` on rank {other}. Every rank must run the same model "
        "code on inputs of the same shapes and dtypes; make control flow independent of the rank "
        "and pad or bucket the batches to equal shapes"
    )


def check_same_plan(lines: list[str], group: dist.ProcessGroup | None, what: str) -> None:
    """Every rank planned `what` alike (its budget, order and prefetch groups): a plan that
    differs pairs one rank's collectives with another's."""
    different = _first_difference(lines, group)
    if different is None:
        return
    other, i, line_a, line_b = different
    raise ZrsError(
        f"ranks planned {what} differently: line {i} is `{line_a}` on rank 0 but `{line_b}` on "
        f"rank {other}. The planner's inputs must agree: pass the same memory_budget on every "
        "rank, or leave it to zrs"
    )


def _first_difference(
    lines: list[str], group: dist.ProcessGroup | None
) -> tuple[int, int, str, str] | None:
    """None if every rank has the same `lines`, else (a rank that differs from rank 0, the
    index of the first differing line, rank 0's line, that rank's line). The lines themselves
    are exchanged only when their digests differ."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    text = "\n".join(lines).encode()
    digests = all_gather_bytes(hashlib.sha256(text).digest(), group)
    if len(set(digests)) == 1:
        return None
    everyone = [t.decode().split("\n") for t in all_gather_bytes(text, group)]
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    return (other, *first_difference(everyone[0], everyone[other]))
