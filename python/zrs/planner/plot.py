"""Memory over time of detailed plans, as a PNG: matplotlib when installed, else a plain plot."""

from __future__ import annotations

import struct
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]


def _png(width: int, height: int, pixels: bytearray) -> bytes:
    """Encode RGB rows (no filter) as a PNG."""
    raw = b"".join(
        b"\x00" + bytes(pixels[y * width * 3 : (y + 1) * width * 3]) for y in range(height)
    )

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def _plot_plain(
    series: list[tuple[str, list[float], list[float]]], budget: int | None, path: Path
) -> None:
    """A dependency-free step plot: one colored line per plan, the budget as a red dashed line."""
    w, h, m = 900, 360, 20
    px = bytearray(b"\xff" * (w * h * 3))

    def put(x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            i = (y * w + x) * 3
            px[i : i + 3] = bytes(c)

    t_max = max((max(t) for _, t, _ in series if t), default=1.0) or 1.0
    b_max = max([max(b) for _, _, b in series if b] + [budget or 0]) or 1.0

    def sx(t: float) -> int:
        return m + int((w - 2 * m) * t / t_max)

    def sy(b: float) -> int:
        return h - m - int((h - 2 * m) * b / b_max)

    for x in range(m, w - m):
        put(x, h - m, (0, 0, 0))
    for y in range(m, h - m):
        put(m, y, (0, 0, 0))
    if budget:
        for x in range(m, w - m):
            if (x // 6) % 2 == 0:
                put(x, sy(budget), (214, 39, 40))
    for k, (_, ts, bs) in enumerate(series):
        c = _COLORS[k % len(_COLORS)]
        px_prev, py_prev = sx(0), sy(bs[0] if bs else 0)
        for t, b in zip(ts, bs, strict=True):
            x1, y1 = sx(t), sy(b)
            for x in range(min(px_prev, x1), max(px_prev, x1) + 1):
                put(x, py_prev, c)
            for y in range(min(py_prev, y1), max(py_prev, y1) + 1):
                put(x1, y, c)
            px_prev, py_prev = x1, y1
    path.write_bytes(_png(w, h, px))


def plot_memory(plans: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Plot memory over time of detailed plans (``plan(..., detail=True)``) to a PNG.

    Uses matplotlib when it is installed; otherwise writes a plain plot (lines only, no text:
    greedy blue, search orange, budget red dashed) with a built-in PNG writer.
    """
    path = Path(path)
    series = [
        (
            p["scheduler"],
            [t / 1e3 for t in p["mem_t_us"]],
            [b / 2**30 for b in p["mem_bytes"]],
        )
        for p in plans
    ]
    budget = next((p.get("budget_bytes") for p in plans if p.get("budget_bytes")), None)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "zrs.planner: matplotlib is not installed; writing a plain plot without labels "
            "(greedy blue, search orange, budget red dashed)",
            file=sys.stderr,
        )
        _plot_plain(
            [(n, t, [b * 2**30 for b in bs]) for n, t, bs in series],
            budget,
            path,
        )
        return path
    fig, ax = plt.subplots(figsize=(10, 4))
    for name, ts, bs in series:
        ax.step(ts, bs, where="post", label=name)
    if budget:
        ax.axhline(budget / 2**30, color="red", linestyle="--", label="budget")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("live memory (GiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
