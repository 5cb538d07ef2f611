"""What a whole-model graph of nested compile regions costs per layer in torch itself, against
one compile per block, with no zrs code (issue 34: which architecture can make the compile flat).

A decoder of L equal layers whose parameters are shards, read through a stand-in gather (a custom
op whose backward is a stand-in reduce-scatter, as zrs's gather property), compiled three ways:

* ``lifted``: the whole model, each layer a nested compile region whose gathers sit at its call
  site in the outer graph (zrs.compile today, `compiler/regions.py`);
* ``inbody``: the whole model, each layer a region that gathers its own shards inside the shared
  body (the design that would take the gathers out of the outer graph);
* ``perblock``: each layer compiled on its own (`module.compile()`), the model around it eager
  (as FSDP2 + compile, and `zrs.shard(compile=True)`); dynamo reuses one layer's code for all.

One process per mode and layer count, each with an empty inductor cache, under zrs's workarounds
for the regions' compile (`compiler/torch_fixes.py`; `--torch-only` without them). Per run: the first
forward and backward, torch's compile timers, and the nodes of every graph inductor lowers (the
outer graphs and the blocks; a region's body is lowered inside its outer graph).

    python benches/region_cost.py --layers 4,16 --modes lifted,inbody,perblock --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TIMERS = (
    "bytecode_tracing",
    "aot_trace_joint_graph",
    "create_aot_dispatcher_function",
    "compile_fx_inner",
    "GraphLowering.run",
    "GraphLowering.codegen",
)
WORLD = 2
DIM, HEADS, FFN, VOCAB = 256, 4, 512, 1000
SHAPES = {
    "n1": (DIM,),
    "q": (DIM, DIM),
    "k": (DIM, DIM),
    "v": (DIM, DIM),
    "o": (DIM, DIM),
    "n2": (DIM,),
    "g": (FFN, DIM),
    "u": (FFN, DIM),
    "d": (DIM, FFN),
}


def run(mode: str, layers: int, fixes: bool) -> dict:
    """One compile in this process: the record of `mode` at `layers`; `fixes`: under zrs's
    workarounds for the regions' compile (`compiler/torch_fixes.py`), as zrs.compile runs."""
    import contextlib

    import torch
    import torch._inductor.config as inductor_config
    import torch.nn.functional as F
    from torch import nn
    from torch._dynamo.utils import compilation_time_metrics

    @torch.library.custom_op(
        "region_cost::gather", mutates_args=(), schema="(Tensor shard) -> Tensor"
    )
    def gather(shard: torch.Tensor) -> torch.Tensor:
        return torch.cat([shard] * WORLD)

    @gather.register_fake
    def _(shard: torch.Tensor) -> torch.Tensor:
        return shard.new_empty((shard.shape[0] * WORLD, *shard.shape[1:]))

    @torch.library.custom_op(
        "region_cost::reduce", mutates_args=(), schema="(Tensor grad) -> Tensor"
    )
    def reduce(grad: torch.Tensor) -> torch.Tensor:
        return grad.reshape(WORLD, -1, *grad.shape[1:]).sum(0)

    @reduce.register_fake
    def _(grad: torch.Tensor) -> torch.Tensor:
        return grad.new_empty((grad.shape[0] // WORLD, *grad.shape[1:]))

    gather.register_autograd(lambda ctx, grad: reduce(grad))

    def block(x, n1, q, k, v, o, n2, g, u, d):
        b, s, _ = x.shape
        h = F.rms_norm(x, (DIM,), n1)
        heads = [F.linear(h, w).view(b, s, HEADS, -1).transpose(1, 2) for w in (q, k, v)]
        a = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2)
        x = x + F.linear(a.reshape(b, s, DIM), o)
        h = F.rms_norm(x, (DIM,), n2)
        return x + F.linear(F.silu(F.linear(h, g)) * F.linear(h, u), d)

    shared_block = torch.compiler.nested_compile_region(block)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, shape in SHAPES.items():
                shard = torch.randn(shape[0] // WORLD, *shape[1:]) * 0.02
                self.register_parameter(name, nn.Parameter(shard))

        def full(self) -> list[torch.Tensor]:
            return [gather(getattr(self, name)) for name in SHAPES]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if mode == "lifted":
                return shared_block(x, *self.full())
            return block(x, *self.full())

    if mode == "inbody":
        Layer.forward = torch.compiler.nested_compile_region(Layer.forward)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for layer in self.layers:
                x = layer(x)
            return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())

    graphs: list[dict] = []

    def count(graph) -> None:
        targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
        graphs.append(
            {
                "nodes": len(graph.nodes),
                "region_calls": sum("invoke_subgraph" in t for t in targets),
                "getitems": sum("getitem" in t for t in targets),
            }
        )

    inductor_config.post_grad_custom_post_pass = count
    torch.manual_seed(0)
    model = Model()
    if mode == "perblock":
        for layer in model.layers:
            layer.compile()
    else:
        model = torch.compile(model)
    ids = torch.randint(0, VOCAB, (2, 64))
    with contextlib.ExitStack() as stack:
        if fixes:
            from zrs.compiler.torch_fixes import (
                region_backwards_keyed_by_value,
                region_schemas_built_once,
            )

            stack.enter_context(region_schemas_built_once())
            stack.enter_context(region_backwards_keyed_by_value())
        t0 = time.perf_counter()
        model(ids).backward()
        first = time.perf_counter() - t0
    timers = {k: round(sum(v), 2) for k, v in compilation_time_metrics.items() if k in TIMERS}
    return {
        "mode": mode,
        "layers": layers,
        "zrs_fixes": fixes,
        "first_s": round(first, 2),
        "nodes_lowered": sum(g["nodes"] for g in graphs),
        "graphs": graphs,
        "timers": timers,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,16", help="comma-separated layer counts")
    p.add_argument("--modes", default="lifted,inbody,perblock")
    p.add_argument(
        "--torch-only",
        action="store_true",
        help="without zrs's workarounds for the regions' compile (torch 2.11 as it is)",
    )
    p.add_argument("--out", help="append each record to this JSON-lines file")
    p.add_argument("--one", nargs=2, metavar=("MODE", "LAYERS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run(args.one[0], int(args.one[1]), not args.torch_only)))
        return
    for layers in map(int, args.layers.split(",")):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory(prefix="region_cost_") as cache:
                done = subprocess.run(
                    [sys.executable, __file__, "--one", mode, str(layers)]
                    + (["--torch-only"] if args.torch_only else []),
                    env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=1800,
                )
            out = done.stdout.strip().splitlines()[-1]
            record = {**json.loads(out), "command": " ".join(sys.argv)}
            print(json.dumps(record), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
