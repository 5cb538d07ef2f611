"""The eager path's recorded order of module fetches, checked: the first complete step's order
compared across the ranks, and a step that departs from it reported (`runtime/fetch.py` calls
both; zrs-core's coordinator records the order and finds the departure)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from zrs._core import Coordinator
from zrs.runtime.handles import ParamHandle
from zrs.runtime.state import ZeroState

_log = logging.getLogger("zrs")


def agree(
    state: ZeroState,
    coordinator: Coordinator,
    handles: Sequence[ParamHandle],
    unit_names: Sequence[str],
) -> None:
    """At the end of the first recorded step every rank must have fetched the same modules'
    parameters in the same order; else a ZrsError on every rank naming the first module
    that differs (the gathers of the next step would pair up wrongly, or hang)."""
    peers = state.peers
    if peers is None:
        return
    params: dict[int, list[str]] = {}
    for position, slot in coordinator.trace_params():
        params.setdefault(position, []).append(handles[slot].name)
    lines = [
        f"module {unit_names[u] or '(root)'} fetched {', '.join(params.get(i, [])) or '-'}"
        for i, u in enumerate(coordinator.trace_units())
    ]
    with state.exchanging("the comparison of the eager trace"):
        peers.agree(
            "the order in which modules fetched their parameters in the first step",
            lines,
            hint="every rank must run the same modules in the same order (data-dependent "
            "control flow must agree across ranks)",
        )


def warn_diverged(unit_names: Sequence[str], diverged: tuple[int, int | None, int]) -> None:
    position, expected, got = diverged
    wanted = unit_names[expected] if expected is not None else "the end of the forward"
    _log.warning(
        "zrs: the forward ran module %s where the recorded trace had %s (module fetch %d): "
        "the eager path stops prefetching for this step and records the order again",
        unit_names[got] or "(root)",
        wanted or "(root)",
        position,
    )
