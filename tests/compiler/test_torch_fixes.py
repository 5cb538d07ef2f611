"""Inductor lowers zrs's ops without rerunning their fake kernels (compiler/torch_fixes.py), to
the same output layouts as when it reruns them."""

from __future__ import annotations

import pytest
import torch
from test_compile_work import VOCAB, Decoder
from torch._inductor import config as inductor_config
from torch._inductor import ir

import zrs
from lowered import as_several_ranks
from zrs.compiler import backend as dynamo_backend
from zrs.runtime import state as runtime


def _layouts(out) -> list[tuple[str, str, str]]:
    if out is None:
        return []
    if isinstance(out, (list, tuple)):
        return [layout for o in out for layout in _layouts(o)]
    return [(str(out.get_size()), str(out.get_stride()), str(out.get_dtype()))]


def _lowered_zrs_ops(shortcut: bool) -> tuple[list[tuple], int]:
    """Each zrs op inductor lowered with its outputs' layouts, and the fake inputs it made for
    them."""
    lowered: list[tuple] = []
    fake_inputs = [0]
    create, to_tensor = ir.FallbackKernel.create.__func__, ir.ir_node_to_tensor
    in_zrs_op = [False]

    def spy_create(cls, kernel, *args, **kwargs):
        zrs_op = getattr(kernel, "namespace", None) == "zrs"
        in_zrs_op[0] = zrs_op
        try:
            packed = create(cls, kernel, *args, **kwargs)
        finally:
            in_zrs_op[0] = False
        if zrs_op:
            lowered.append((str(kernel), _layouts(packed)))
        return packed

    def spy_to_tensor(*args, **kwargs):
        fake_inputs[0] += in_zrs_op[0]
        return to_tensor(*args, **kwargs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp, inductor_config.patch(fx_graph_cache=False):
        mp.setattr(ir.FallbackKernel, "create", classmethod(spy_create))
        mp.setattr(ir, "ir_node_to_tensor", spy_to_tensor)
        if not shortcut:
            mp.setattr(dynamo_backend, "RECORDED_OUTPUTS", ())
            mp.setattr(dynamo_backend, "VIEW_OF_FIRST_INPUT", ())
        try:
            model = as_several_ranks(zrs.compile(Decoder(3), backend="inductor", dynamic=True))
            model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
        finally:
            runtime.reset()
    return lowered, fake_inputs[0]


@pytest.mark.slow
def test_zrs_ops_lower_to_the_layouts_their_fake_kernels_give() -> None:
    fast, fast_inputs = _lowered_zrs_ops(shortcut=True)
    slow, slow_inputs = _lowered_zrs_ops(shortcut=False)
    assert fast == slow
    kinds = {name.split(".")[1] for name, _ in fast}
    assert {"allgather_param", "wait_allgather", "release_params", "reduce_grads"} <= kinds
    # Only wait_allgather and release_param make a fake copy, of their first input.
    assert fast_inputs == sum(
        op.split(".")[1] in ("wait_allgather", "release_param") for op, _ in fast
    )
    assert slow_inputs > 3 * fast_inputs, (slow_inputs, fast_inputs)


def test_aot_graphs_are_formatted_for_the_logs_only_when_a_log_is_on(monkeypatch) -> None:
    from types import SimpleNamespace

    from torch._functorch._aot_autograd import graph_compile
    from torch._logging._internal import LazyTraceHandler, trace_log

    from zrs.compiler.torch_fixes import aot_graph_logs_only_when_read

    # pytest's log capture hangs its handlers on torch's trace log too: a log that is read.
    torch_only = [h for h in trace_log.handlers if isinstance(h, LazyTraceHandler)]
    monkeypatch.setattr(trace_log, "handlers", torch_only)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    config = SimpleNamespace(enable_log=True, aot_id=0)
    with aot_graph_logs_only_when_read():
        assert graph_compile._log_joint_graph(gm, config) is None
        try:
            torch._logging.set_logs(aot_joint_graph=True)
            assert "def forward" in graph_compile._log_joint_graph(gm, config)
        finally:
            torch._logging.set_logs()
    assert "def forward" in graph_compile._log_joint_graph(gm, config), "restored"
