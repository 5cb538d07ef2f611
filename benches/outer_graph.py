"""What the outer forward and backward graphs hold after zrs's passes, at two layer counts, on CPU
ranks (gloo): the FX nodes inductor would lower around the repeated block's body, by target, and
what each added layer adds (issue 34: the outer graphs are most of inductor's work).

    python benches/outer_graph.py --layers 2,6 --world 2
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "support")]
from _dist import run_workers  # noqa: E402


def _target(node) -> str:
    name = str(node.target)
    return name.split(".")[-2] if "." in name and not name.startswith("<") else name


def worker(rank: int, world: int, layers: int) -> list[dict]:
    """Per graph zrs lowered (forward, then backward): its node count and nodes by target."""
    import dataclasses

    import torch

    import zrs
    from llama import PRESETS, Llama
    from zrs.compiler import pipeline

    graphs: list[dict] = []
    lower = pipeline.lower

    def counting(state, graph_id, graph, is_backward, keep, ctx):
        result = lower(state, graph_id, graph, is_backward, keep, ctx)
        calls = [_target(n) for n in graph.nodes if n.op == "call_function"]
        graphs.append(
            {"backward": is_backward, "nodes": len(graph.nodes), **collections.Counter(calls)}
        )
        return result

    pipeline.lower = counting
    torch.manual_seed(0)
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=layers)
    model = zrs.compile(Llama(cfg), backend="eager")
    x = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len))
    model(x).float().pow(2).mean().backward()
    return graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,6", help="two comma-separated layer counts")
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    few, many = map(int, args.layers.split(","))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    counts = {n: run_workers(worker, args.world, n, timeout=600)[0] for n in (few, many)}
    for a, b in zip(counts[few], counts[many], strict=True):
        per_layer = {
            k: round((b.get(k, 0) - a.get(k, 0)) / (many - few), 2)
            for k in b
            if k != "backward" and b.get(k, 0) != a.get(k, 0)
        }
        row = {"backward": b["backward"], "world": args.world, "layers": [few, many]}
        print(
            json.dumps(row | {"per_layer": dict(sorted(per_layer.items(), key=lambda kv: -kv[1]))})
        )


if __name__ == "__main__":
    main()
