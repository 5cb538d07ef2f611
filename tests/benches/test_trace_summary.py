"""benches/trace_summary.py: exposed communication, kernel groups and the GPU-only trace."""

from __future__ import annotations

import gzip
import json

from trace_summary import gpu_events, kernel_group, load, summarize


def _kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
            "args": {"stream": stream}}  # fmt: skip


# One step (microseconds): a matmul 0-1000 beside a gather 500-1500 (500 of it exposed), a
# Triton kernel 1600-1700, a reduce-scatter 1800-2000 with nothing beside it; idle 1500-1600 and
# 1700-1800. A CPU op is no GPU event.
EVENTS = [
    _kernel("nvjet_sm90_tst_256x128", 0, 1000, 7),
    _kernel("ncclDevKernel_AllGather_RING_LL(x)", 500, 1000, 19),
    _kernel("triton_poi_fused_add_0", 1600, 100, 7),
    _kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", 1800, 200, 23),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
]


def test_exposed_communication_and_kernel_groups():
    out = summarize(EVENTS, steps=1)
    assert out["window_ms"] == 2.0
    assert out["compute_ms"] == 1.1
    assert out["comm_ms"] == 1.2
    assert out["comm_exposed_ms"] == 0.7  # 1000-1500 and 1800-2000
    assert out["idle_ms"] == 0.2
    assert out["main_stream"] == "7"
    assert out["kernel_groups_ms"] == {
        "matmul": 1.0,
        "all_gather": 1.0,
        "reduce_scatter": 0.2,
        "triton": 0.1,
    }
    assert out["kernel_groups_count"] == {
        "matmul": 1,
        "all_gather": 1,
        "triton": 1,
        "reduce_scatter": 1,
    }
    # Stream 7 runs the matmul and the Triton kernel, 600 us apart.
    assert out["main_stream_kernels"] == 2
    assert out["main_stream_gap_sizes"]["gt_100us"] == {"count": 1, "ms": 0.6}
    assert out["main_stream_gap_sizes"]["le_2us"] == {"count": 0, "ms": 0.0}


def test_a_matmul_beside_nccl_counts_what_it_took_beyond_its_speed_alone():
    # One kernel mostly beside an all-gather once (150 us, 100 of them shared) and alone, or
    # barely beside it (30 of 130 us shared), three times: 100, 120 and 130 us, median 120, so
    # 30 us lost. A Triton kernel beside NCCL and a matmul never seen alone do not count.
    events = [
        _kernel("nvjet_a", 0, 100, 7),
        _kernel("nvjet_a", 200, 120, 7),
        _kernel("nvjet_a", 400, 150, 7),
        _kernel("ncclDevKernel_AllGather_RING_LL(x)", 450, 100, 19),
        _kernel("triton_poi_fused_add_0", 460, 50, 7),
        _kernel("nvjet_b", 500, 60, 8),
        _kernel("nvjet_a", 520, 130, 7),
    ]
    assert summarize(events, steps=1)["slowed_beside_comm"] == {"launches": 1, "ms": 0.03}


def test_kernel_names_fall_into_their_groups():
    assert kernel_group("void (anonymous namespace)::seg_copy_kernel<float>(x)") == "zrs_copy"
    assert kernel_group("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert kernel_group("ncclDevKernel_Broadcast_RING_LL") == "nccl_other"
    assert kernel_group("void at::native::elementwise_kernel<128, 2>") == "other"


def test_the_gpu_only_trace_keeps_every_gpu_event_and_loads_back(tmp_path):
    path = tmp_path / "t.gpu.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": gpu_events(EVENTS)}, fh)
    events = load(path)
    assert [e["name"] for e in events] == [e["name"] for e in EVENTS[:4]]
    assert summarize(events, steps=1) == summarize(EVENTS, steps=1)
