"""The zrs CUDA copy kernels against their torch fallbacks on the current GPU: time per call and
effective GB/s, at a transformer block's shapes.

    python benches/copy_kernels.py
"""

from __future__ import annotations

import torch

import zrs  # noqa: F401  (defines the ops)
from zrs.runtime import kernels


def main(iters: int = 50) -> None:
    """Kernel against torch fallback on the current GPU: time per call and effective GB/s."""
    if not kernels.load():
        raise SystemExit(f"the zrs CUDA kernels are not available: {kernels.status()}")

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    def row(name: str, nbytes: int, k, t) -> None:
        tk, tt = timed(k), timed(t)
        print(
            f"{name:44s} kernel {tk * 1e3:8.1f} us {nbytes / tk / 1e6:7.0f} GB/s | "
            f"torch {tt * 1e3:8.1f} us {nbytes / tt / 1e6:7.0f} GB/s | x{tt / tk:5.2f}"
        )

    # A transformer block's shards (dim 2048, FFN 5504, world 2): fp32 shards -> bf16 send buffer.
    world = 2
    numels = [2048, 3 * 2048 * 2048, 2048 * 2048, 2048, 2 * 5504 * 2048, 5504 * 2048]
    shards = [torch.randn(-(-n // world), device=dev, generator=g) for n in numels]
    out = torch.empty(sum(s.numel() for s in shards), dtype=torch.bfloat16, device=dev)
    nb = sum(s.numel() for s in shards) * 6
    row(
        "pack_cast fp32->bf16, 6 shards, 1 block",
        nb,
        lambda: torch.ops.zrs.pack_cast(shards, out),
        lambda: kernels.pack_cast_torch(shards, out),
    )
    # copy-out of that block's all-gather, world 2 and 8.
    for w in (2, 8):
        sh = [-(-n // w) for n in numels]
        offs = [sum(sh[:i]) for i in range(len(sh))]
        recv = torch.randn(w * sum(sh), device=dev, generator=g).to(torch.bfloat16)
        outs = [torch.empty(w * s, dtype=torch.bfloat16, device=dev) for s in sh]
        row(
            f"unpack_rank_major bf16, 6 members, world {w}",
            recv.numel() * 4,
            lambda r=recv, w=w, o=offs, s=sh, x=outs: torch.ops.zrs.unpack_rank_major(
                r, w, o, s, x
            ),
            lambda r=recv, w=w, o=offs, s=sh, x=outs: kernels.unpack_rank_major_torch(
                r, w, o, s, x
            ),
        )
    # grad pack: bf16 grads -> fp32 rank-major bucket with pre-divide; and fp32 -> bf16.
    for gdt, odt in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        grads = [torch.randn(n, device=dev, generator=g).to(gdt) for n in numels]
        shards = [-(-n // world) for n in numels]
        block = sum(shards)
        bucket = torch.empty(world, block, dtype=odt, device=dev)
        nb = sum(x.numel() for x in grads) * gdt.itemsize + bucket.numel() * odt.itemsize
        row(
            f"pack_grads {str(gdt)[6:]}->{str(odt)[6:]}, 6 grads, world {world}",
            nb,
            lambda gr=grads, s=shards, b=bucket: torch.ops.zrs.pack_grads(
                gr, world, s, 1.0 / world, b
            ),
            lambda gr=grads, s=shards, b=bucket: kernels.pack_grads_torch(
                gr, world, s, 1.0 / world, b
            ),
        )
    # Latency: many small members (> the inline table, so the device table path too).
    small = [torch.randn(1000 + i, device=dev, generator=g) for i in range(120)]
    out_s = torch.empty(sum(s.numel() for s in small), dtype=torch.bfloat16, device=dev)
    row(
        "pack_cast fp32->bf16, 120 small shards",
        sum(s.numel() for s in small) * 6,
        lambda: torch.ops.zrs.pack_cast(small, out_s),
        lambda: kernels.pack_cast_torch(small, out_s),
    )


if __name__ == "__main__":
    main()
