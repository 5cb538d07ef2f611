"""The eager path's runtime: the gathered parameters that module code reads outside compiled
graphs, and the collectives that the coordinator (`zrs._core.Coordinator`, zrs-core) asks for;
Python executes its decisions only, once per module hook.

Every sharded parameter has one *leaf*: a tensor of its full shape in the compute dtype, which
autograd sees as a leaf and module code receives from the gather property. Its storage is
allocated when the coordinator gathers it and resized to 0 when it releases it; a parameter is
gathered again before the backward of any module that used it, so autograd's saved references
stay valid. The collectives write through a second tensor over the same storage (`raw`: flat,
padded), so the leaf's version counter never moves (FSDP2 writes its unsharded parameters the
same way). Its post-accumulate hook hands the gradient, summed over every use, to the compiled
path's bucketed, pre-divided reduce-scatter (`runtime/grads.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from zrs._core import Coordinator
from zrs.runtime import eager_trace, grads
from zrs.runtime.flights import Flight, finish, start
from zrs.runtime.handles import ParamHandle
from zrs.runtime.state import ZeroState


@dataclass(frozen=True)
class Unit:
    """A module whose hooks fetch parameters: its name (for messages) and own parameters."""

    name: str
    handles: tuple[ParamHandle, ...]


class Fetcher:
    """One model's eager path: the leaves, the collectives in flight, the coordinator.

    `depth` counts the unit activations running (the root's included): the gather property hands
    out leaves only while it is positive, and falls back to a synchronous gather otherwise (a
    parameter read outside any forward)."""

    def __init__(self, state: ZeroState, units: Sequence[Unit], **limits: int | None) -> None:
        self.state = state
        hs = sorted(state.handles, key=lambda h: h.slot)
        assert [h.slot for h in hs] == list(range(len(hs))), "one handle per registry slot"
        self.handles = hs
        self.slot_of = {h.ds_id: h.slot for h in hs}
        self.units = list(units)
        self.coordinator = Coordinator(
            [(h.padded_numel, h.shard_numel, h.param.requires_grad) for h in hs],
            [[h.slot for h in u.handles] for u in self.units],
            grads.GRAD_BUCKET_NUMEL,
            **limits,
        )
        self.raws: list[torch.Tensor] = []
        self.leaves: list[torch.Tensor] = []
        me = weakref.ref(self)
        for h in hs:
            raw, leaf = self._new_leaf(h)
            self.raws.append(raw)
            self.leaves.append(leaf)
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(
                    lambda _, slot=h.slot: _alive(me).grad_ready(slot)
                )
        self.ready = bytearray(len(hs))  # 1: gathered and waited for
        # Gradients autograd finished, not yet packed: packed together when a unit's backward
        # starts, their bucket fills or the backward ends, one kernel for many (the bucket's
        # reduce-scatter waits for it to fill anyway).
        self.pending: list[tuple[torch.Tensor, int, int]] = []  # (grad, ds_id, bucket numel)
        self.pending_numel = 0
        self.flights: dict[int, Flight] = {}
        self.depth = 0
        self.entered: list[bool] = []  # per unit hook running: whether it entered the coordinator
        self.open = False  # a step is open: from the root's forward to the end of its backward
        self.backward_task = -1  # the autograd task whose final callback ends the step
        self.training = False
        self.agreed = False  # the first complete trace was compared across the ranks
        self.nesting = 0  # such a backward runs: its own graph task is not the step's
        # A layer's calls in a compiled root's graph run their backwards one at a time
        # (prepare/opaque.py): while another call's is still to come, its parameters' gradients
        # are held in their leaves (`held`), and summed there by the next (`stashed`).
        self.held: set[int] = set()
        self.stashed: set[int] = set()
        self.backwards_ended = 0
        self.fake_like: torch.Tensor | None = None  # a fake kernel runs: its leaves' mode
        self.fakes: dict[int, torch.Tensor] = {}  # and the leaves it read

    def _new_leaf(self, h: ParamHandle) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = h.compute_dtype
        raw = torch.empty(h.padded_numel, dtype=dtype, device=h.source.device)
        with torch.no_grad():
            leaf = torch.empty(0, dtype=dtype, device=raw.device)
            stride = torch.empty(h.shape, device="meta").stride()
            leaf.set_(raw.untyped_storage(), 0, h.shape, stride)
        leaf.requires_grad_(h.param.requires_grad)
        raw.untyped_storage().resize_(0)
        return raw, leaf

    # --- what the hooks call ------------------------------------------------------------------

    def begin(self, training: bool) -> None:
        """The root's forward starts (`training`: a backward may follow)."""
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside the backward
            self.training = training
            # gradients of a backward that raised, waiting to be packed or held for a layer
            # call's backward that never came: never into this step's
            if self.pending or self.stashed:
                self.state.recover("the previous backward stopped part-way (it raised)")
        self.open = True
        self._free(self.coordinator.begin_forward(training))

    def enter(self, unit: int) -> None:
        # A module called outside the model's forward and backward (a submodule called on its
        # own, as generate() does with the embedding): its parameters are gathered as they are
        # read, synchronously, and the trace does not see it.
        self.entered.append(self.open)
        if self.open:
            self.depth += 1
            self._run(self.coordinator.pre_forward(unit))

    def exit(self, unit: int, output: object) -> None:
        if not self.entered.pop():
            return
        self.depth -= 1
        self._free(self.coordinator.post_forward(unit))
        if self.training and torch.is_grad_enabled():
            self._before_backward(unit, output)

    def end(self) -> None:
        """The root's forward returned."""
        self._free(self.coordinator.end_forward())
        if not self.training:
            self.open = False
            self._check_trace()

    def param(self, ds_id: int) -> torch.Tensor:
        """The gathered leaf of a parameter that module code reads (gathering it if needed)."""
        slot = self.slot_of[ds_id]
        if self.fake_like is not None:
            if slot not in self.fakes:
                leaf = self.leaves[slot]
                self.fakes[slot] = self.fake_like.new_empty_strided(
                    leaf.shape, leaf.stride(), dtype=leaf.dtype
                )
            return self.fakes[slot]
        if not self.ready[slot]:
            self._run(self.coordinator.fetch(slot))
        return self.leaves[slot]

    @contextlib.contextmanager
    def faked(self, like: torch.Tensor) -> Iterator[None]:
        """Module code reads fake leaves made by `like`'s mode (a fake kernel runs a layer)."""
        outer = self.fake_like, self.fakes
        self.fake_like, self.fakes = like, {}
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            self.fake_like, self.fakes = outer

    @contextlib.contextmanager
    def nested_backward(self) -> Iterator[None]:
        """A layer's backward run by an op of the step's backward, as a graph task of its own:
        the step's end is queued on the step's task, not on that one."""
        self._queue_end_of_backward()
        self.nesting += 1
        try:
            yield
        finally:
            self.nesting -= 1

    @contextlib.contextmanager
    def holding(self, slots: Sequence[int]) -> Iterator[None]:
        """Autograd's gradients of `slots` stay in their leaves inside the block, to be summed
        with a later backward's (the step's end reduces what no later one took)."""
        held = set(slots) - self.held
        self.held |= held
        try:
            yield
        finally:
            self.held -= held

    def gather_now(self, slots: list[int]) -> None:
        """Gather those of `slots` that are not ready (a compiled forward reads them all)."""
        for slot in slots:
            if not self.ready[slot]:
                self._run(self.coordinator.fetch(slot))

    def grad_ready(self, slot: int) -> None:
        """Autograd summed the leaf's gradient over every use: reduce it, release the leaf."""
        if slot in self.held:
            self.stashed.add(slot)
            return
        self.stashed.discard(slot)
        leaf = self.leaves[slot]
        grad, leaf.grad = leaf.grad, None
        release, bucket_numel = self.coordinator.grad_ready(slot)
        self._queue_end_of_backward()
        if grad is not None:
            h = self.handles[slot]
            self.pending.append((grad, h.ds_id, bucket_numel))
            self.pending_numel += h.shard_numel
            if self.pending_numel >= grads.bucket_room(self.state, bucket_numel):
                self.pack_grads()
        self._free(release)

    def pack_grads(self) -> None:
        """Pack the pending gradients into their buckets (grads.reduce_grads)."""
        if not self.pending:
            return
        pending, self.pending, self.pending_numel = self.pending, [], 0
        grads.reduce_grads(
            -1, [g for g, _, _ in pending], [i for _, i, _ in pending], [n for _, _, n in pending]
        )

    def reset(self) -> None:
        """Drop everything gathered, persistent parameters included (the shards changed, or a
        step stopped part-way); waits for the gathers in flight, which the peers issued too."""
        self._clear()
        self._free(self.coordinator.reset())
        for flight in {id(f): f for f in self.flights.values()}.values():
            self._complete(flight)

    def busy(self) -> bool:
        """True while something is gathered, in flight, running or waiting to be packed."""
        return self.depth > 0 or bool(self.flights) or any(self.ready) or bool(self.pending)

    def forget(self) -> None:
        """Drop everything without waiting for the collectives in flight (tests)."""
        self.flights.clear()
        self._clear()
        self._free(self.coordinator.reset())

    def _clear(self) -> None:
        for slot in self.stashed:
            self.leaves[slot].grad = None
        self.stashed.clear()
        self.held.clear()
        self.pending.clear()
        self.pending_numel = 0
        self.depth = 0
        self.entered.clear()
        self.open = False
        self.backward_task = -1
        self.nesting = 0

    # --- backward -----------------------------------------------------------------------------

    def _before_backward(self, unit: int, output: object) -> None:
        tensors = [
            t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not tensors:
            return
        me = weakref.ref(self)
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda _: _alive(me).pre_backward(unit), mode="any"
        )

    def pre_backward(self, unit: int) -> None:
        self._queue_end_of_backward()
        self.pack_grads()  # what the units before finished
        self._run(self.coordinator.pre_backward(unit))

    def after_backward(self, unit: int, inputs: object) -> None:
        """A unit with frozen parameters starts its forward: once the gradient of its `inputs`
        is complete its backward is over, and the coordinator may release its frozen
        parameters then rather than at the end of the backward (LoRA's base weights). Inputs
        that need no gradient never say so: what the unit fetched waits for the end."""
        if not (self.open and self.training and torch.is_grad_enabled()):
            return
        if torch._C._current_graph_task_id() != -1:  # a recompute: its backward follows at once
            return
        tensors = [
            t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            me = weakref.ref(self)
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _: _alive(me).post_backward(unit), mode="all"
            )

    def post_backward(self, unit: int) -> None:
        self._free(self.coordinator.post_backward(unit))

    def _queue_end_of_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self.backward_task or self.nesting:
            return
        self.backward_task = task
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _alive(me).end_backward())

    def end_backward(self) -> None:
        # This final callback runs before grads.finish_grads' (queued at the first pack), or
        # queues it with the first pack: autograd runs callbacks that callbacks queue.
        for slot in sorted(self.stashed):  # held for a layer call whose backward did not run
            self.grad_ready(slot)
        self.pack_grads()
        self.backward_task = -1
        self.backwards_ended += 1
        self.open = False
        released, recorded = self.coordinator.end_backward()
        self._free(released)
        if recorded:
            self._agree_trace()

    def _check_trace(self) -> None:
        """A step without backward may complete the trace too: compare it then."""
        if self.coordinator.mode == "complete" and not self.agreed:
            self._agree_trace()

    def _agree_trace(self) -> None:
        self.agreed = True  # the order agreed in runtime/eager_trace.py
        eager_trace.agree(self.state, self.coordinator, self.handles, [u.name for u in self.units])

    # --- executing a decision -----------------------------------------------------------------

    def _run(self, fetch: tuple) -> None:
        issue, wait, prefetch, diverged = fetch
        if diverged is not None:
            eager_trace.warn_diverged([u.name for u in self.units], diverged)
        now = self._gather(issue) if issue else []
        for group in prefetch:
            for flight in self._gather(group):
                for slot in flight.slots:
                    self.flights[slot] = flight
        for flight in now:
            self._complete(flight)
        for slot in wait:
            flight = self.flights.get(slot)
            if flight is not None:
                self._complete(flight)
        for slot in itertools.chain(issue, wait):
            self.ready[slot] = 1

    def _gather(self, slots: list[int]) -> list[Flight]:
        """Allocate the leaves' storage and start their all-gathers: one collective for each
        gathered dtype among them (a unit mixing fp16 and fp32 layers takes two). None is left in
        flight at one rank: the shards are cast into place."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for slot in slots:
            by_dtype.setdefault(self.raws[slot].dtype, []).append(slot)
        flights = (
            start(self.state, [self.handles[s] for s in group], self.raws, group)
            for group in by_dtype.values()
        )
        return [f for f in flights if f is not None]

    def _complete(self, flight: Flight) -> None:
        for slot in flight.slots:
            self.flights.pop(slot, None)
        finish(self.state, flight, [self.handles[s] for s in flight.slots], self.raws)

    def _free(self, slots: list[int]) -> None:
        for slot in slots:
            flight = self.flights.get(slot)
            if flight is not None:  # prefetched, never used: the collective still writes it
                self._complete(flight)
            self.ready[slot] = 0
            self.raws[slot].untyped_storage().resize_(0)


def _alive(ref: weakref.ref[Fetcher]) -> Fetcher:
    fetcher = ref()
    assert fetcher is not None, "a hook of a dropped model ran"
    return fetcher
