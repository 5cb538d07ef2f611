"""`zrs.CapturedStep`: a whole training step (forward, backward with its gathers and reductions,
clipping, the optimizer) captured as one CUDA graph and replayed (docs/cuda-graphs.md).

The zrs ops do their bookkeeping on the host (the registry's holds, the buffers, the gradient
buckets) while they issue the device work. A step leaves that bookkeeping as it found it: every
gather is released and every bucket reduced by the end of the backward. So the device work of one
step, recorded once, is the device work of every step of the same shapes, and a replay needs only
the counts the ops would have made on the host (`ZeroState.replayed`). The memory a step
allocates comes from one private pool that the graphs of all shapes share: the allocator's
addresses during capture are the pool's layout, fixed from then on.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from zrs._core import ZrsError
from zrs.runtime.exchange import first_line
from zrs.runtime.grad_store import GradStore
from zrs.runtime.handles import LIVE
from zrs.runtime.state import ZeroState
from zrs.step.replay import (
    MAX_RECAPTURES,
    Hyperparameters,
    collector_paused,
    replay_with_hooks,
    settle_before_capture,
)
from zrs.step.replay_watch import ReplayWatch, close_before_destroy, nccl_backends
from zrs.step.signature import held, mode, signature

_log = logging.getLogger("zrs")

WHO = "zrs.CapturedStep"


@dataclass(eq=False)
class Graph:
    """One input signature's step: its graph, static inputs and outputs, and what a replay
    repeats on the host."""

    graph: torch.cuda.CUDAGraph
    inputs: list[Any]  # the static input tensors (and the constants) in flattened order
    outputs: list[Any]
    out_spec: Any
    counts: list[tuple[weakref.ref[ZeroState], int, int]]  # model, forwards, backwards
    optimizers: list[Hyperparameters]  # the optimizers it steps, as captured
    held: Hashable  # what it assumes stays as captured (`_held`)
    keep: list[torch.Tensor]  # the gradient buffers the graph writes, kept alive with it
    # The NCCL backends its collectives replay on (none at one rank), and the timeout a replay
    # gets (the least of its models'): found once, at the capture (replay_watch.py).
    backends: list[Any] = field(default_factory=list)
    timeout: float = 0.0


@dataclass(eq=False)
class Signature:
    calls: int = 0
    captures: int = 0
    graph: Graph | None = None
    eager: bool = False  # run without a graph from now on (too many graphs or recaptures)


@dataclass(eq=False)
class _Stepped:
    """The optimizers stepped during a capture, in order."""

    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)

    def __call__(self, opt: torch.optim.Optimizer, *_: object) -> None:
        if all(o is not opt for o in self.optimizers):
            self.optimizers.append(opt)


class CapturedStep:
    """Run `step_fn` as one CUDA graph per input signature: warm up, capture, replay.

    ```python
    clip = zrs.GraphedStep(opt, max_norm=1.0)   # clip, check and step without a host sync
    def train_step(x, y):
        loss = model(x, y)
        loss.backward()
        clip()
        opt.zero_grad()
        return loss.detach()
    train_step = zrs.CapturedStep(train_step)
    for x, y in data:
        loss = train_step(x.cuda(), y.cuda())
    ```

    Each distinct signature (the tensors' shapes, dtypes, strides and devices, the values of the
    other arguments, grad mode and autocast) runs `warmup` times eagerly, is captured at the next
    call and replayed after that: the arguments are copied into the graph's static inputs and
    the outputs come back as fresh tensors (copies of the graph's, so that the next step does
    not overwrite them). At most `max_graphs` signatures are captured; other ones run eagerly,
    with a warning. On the CPU, or with `cuda_graphs=False`, every call runs `step_fn` eagerly.

    What a graph needs, and the error or behaviour otherwise:
    - No host synchronisation inside the step (`.item()`, `bool(tensor)`, printing a tensor,
      `torch.cuda.synchronize`, a copy from pageable host memory): the capture fails and
      `ZrsError` says so. Clip and skip non-finite steps with `zrs.GraphedStep`; an optimizer
      stepped directly needs `capturable=True` (torch checks it).
    - The optimizers' hyperparameters held as Python numbers are baked in: changing one raises
      ZrsError (hold it as a tensor). Their step hooks run around each replay.
    - The parameters, the optimizer state and the gradients must stay where they were captured,
      and the models in the mode they were captured in (train/eval, which parameters require
      grad). If a shard or an optimizer state tensor moved, or a mode changed, the signature is
      warmed up and captured again (`optimizer.load_state_dict` too); after MAX_RECAPTURES it
      runs eagerly, with a warning.
    - Python state that `step_fn` reads from outside its arguments (a closure variable, a
      global, a branch on a step counter) is frozen as it was at capture: pass what changes as
      an argument (a tensor, or a constant that makes its own signature).
    - At several ranks the step's collectives run from the graph, outside the process group's
      watchdog: before each replay the ranks check that they are at the same step (as before
      each compiled forward), and a replay that does not finish within the models' timeout (a
      peer stalled or died mid-step) aborts their communicators; the next call raises ZrsError.
      A graph that holds NCCL work keeps its communicators alive: `close()` frees the graphs,
      and `torch.distributed.destroy_process_group()` closes every live CapturedStep first
      (called through `torch.distributed`; a copy imported before the first capture does not).
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        *,
        warmup: int = 2,
        max_graphs: int = 8,
        cuda_graphs: bool | None = None,
    ) -> None:
        if not callable(step_fn):
            raise ZrsError(f"{WHO} takes the training step as a function, not {step_fn!r}")
        for name, value, least in (("warmup", warmup, 1), ("max_graphs", max_graphs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ZrsError(f"{WHO}: {name} must be an int >= {least}, not {value!r}")
        self.step_fn = step_fn
        self.warmup = warmup
        self.max_graphs = max_graphs
        self.graphs = torch.cuda.is_available() if cuda_graphs is None else cuda_graphs
        if self.graphs and not torch.cuda.is_available():
            raise ZrsError(f"{WHO}: cuda_graphs=True needs CUDA, which this process does not have")
        self.signatures: dict[Hashable, Signature] = {}
        self.pool: tuple[int, int] | None = None  # the graphs' shared memory pool
        self.warned = False
        # Optimizers whose load_state_dict drops the graphs (their state tensors are new).
        self.hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.watch = ReplayWatch()  # times the replays of collectives (several ranks)
        self.broken: str | None = None  # a replay timed out: why
        _LIVE.add(self)

    @property
    def captured(self) -> int:
        """How many signatures have a graph now."""
        return sum(s.graph is not None for s in self.signatures.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.broken is not None:
            self.close()
            raise ZrsError(self.broken)
        flat, spec = tree_flatten((args, kwargs))
        key = (spec, tuple(signature(v) for v in flat), mode())
        sig = self.signatures.get(key)
        if sig is None:
            sig = self.signatures[key] = Signature()
        sig.calls += 1
        if not self.graphs or sig.eager or sig.calls <= self.warmup:
            return self.step_fn(*args, **kwargs)
        if sig.graph is not None and sig.graph.held != _held(sig.graph):
            # A parameter or the optimizer state moved, or a model changed mode, since the
            # capture: warm up and capture again (a new mode may compile new code, which cannot
            # happen under capture).
            self._drop(sig)
            sig.calls = 1
            _log.info("%s: capturing again (parameters, optimizer state or mode changed)", WHO)
            return self.step_fn(*args, **kwargs)
        if sig.graph is None:
            if self._give_up(sig):
                return self.step_fn(*args, **kwargs)
            return self._capture(sig, flat, spec)
        return self._replay(sig.graph, flat)

    def _give_up(self, sig: Signature) -> bool:
        """Run `sig` eagerly from now on: too many graphs, or it keeps moving."""
        if sig.captures > MAX_RECAPTURES:
            why = f"its parameters, optimizer state or mode changed {sig.captures} times"
        elif sig.captures == 0 and self.captured >= self.max_graphs:
            why = f"{self.max_graphs} signatures are captured already (max_graphs)"
        else:
            return False
        sig.eager = True
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"{WHO}: a step runs without a CUDA graph: {why}. Pad the batches to a few "
                "shapes, or raise max_graphs",
                stacklevel=3,
            )
        return True

    # --- capture and replay ------------------------------------------------------------------

    def _capture(self, sig: Signature, flat: list[Any], spec: Any) -> Any:
        sig.captures += 1
        inputs = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in flat]
        args, kwargs = tree_unflatten(inputs, spec)
        models = LIVE.models()
        if any(s.offload is not None for s in models):
            raise ZrsError(
                f"{WHO} captures the optimizer step on the GPU; with offload it runs on "
                f"the host: step eagerly (call the step function without {WHO})"
            )
        if any(s.replicas > 1 for s in models):
            raise ZrsError(
                f"{WHO} does not capture hybrid sharding's all-reduce across replicas yet (a "
                f"2-D mesh): step eagerly (call the step function without {WHO})"
            )
        before = {id(s): (s.forwards, s.backwards) for s in models}
        for s in models:
            if s.grad_store is None:  # the gradients at fixed addresses (runtime/grad_store.py)
                s.grad_store = GradStore()
        stepped = _Stepped()
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        settle_before_capture()
        hook = register_optimizer_step_post_hook(stepped)
        try:
            with (
                collector_paused(),
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
            ):
                out = self.step_fn(*args, **kwargs)
        except Exception as exc:
            sig.eager = True
            raise ZrsError(
                f"{WHO}: the step could not be captured as a CUDA graph "
                f"({first_line(exc) or type(exc).__name__}). "
                "Inside a captured step nothing may wait for the GPU or copy from pageable host "
                "memory: no .item(), bool(tensor), print(tensor) or torch.cuda.synchronize(); "
                "pass the batch as CUDA tensors; clip and skip non-finite steps with "
                "zrs.GraphedStep (torch.amp.GradScaler reads its inf check on the host: train "
                "in bf16 without it), and step other optimizers with capturable=True. This "
                "signature runs eagerly from now on"
            ) from exc
        finally:
            hook.remove()
        outputs, out_spec = tree_flatten(out)
        entry = Graph(
            graph=graph,
            inputs=inputs,
            outputs=outputs,
            out_spec=out_spec,
            counts=[
                (weakref.ref(s), s.forwards - before[id(s)][0], s.backwards - before[id(s)][1])
                for s in models
                if (s.forwards, s.backwards) != before[id(s)]
            ],
            optimizers=[Hyperparameters(o, WHO) for o in stepped.optimizers],
            held=None,
            keep=[t for s in models if s.grad_store for t in s.grad_store.tensors()],
        )
        entry.held = _held(entry)
        entry.backends = nccl_backends(_states(entry))
        if entry.backends:
            entry.timeout = min(s.timeout.total_seconds() for s in _states(entry))
            close_before_destroy(_close_all)
        for fixed in entry.optimizers:
            if fixed.optimizer not in self.hooked:
                self.hooked.add(fixed.optimizer)
                fixed.optimizer.register_load_state_dict_post_hook(lambda _opt: self._forget())
        sig.graph = entry
        graph.replay()  # capture only recorded the step: run it
        self._watch(entry)
        return _fresh(entry)

    def _replay(self, entry: Graph, flat: list[Any]) -> Any:
        for fixed in entry.optimizers:
            fixed.check()
        for ref, forwards, backwards in entry.counts:
            state = ref()
            if state is None:
                raise ZrsError(f"{WHO}: a model this step was captured with was dropped")
            state.replayed(forwards, backwards)
        # The copies last, right before the launch: the host work above is not between them.
        for static, value in zip(entry.inputs, flat, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(value, non_blocking=True)
        replay_with_hooks([f.optimizer for f in entry.optimizers], entry.graph.replay, WHO)
        self._watch(entry)
        return _fresh(entry)

    def _watch(self, entry: Graph) -> None:
        """At several ranks, time the replay just launched (replay_watch.py)."""
        if not entry.backends:
            return
        done = torch.cuda.Event()
        done.record()
        self.watch.watch(done, entry.timeout, lambda: self._abandon(entry))

    def _abandon(self, entry: Graph) -> None:
        """A replay of `entry` did not finish within its timeout (on the watch's thread): mark
        the models broken, then abort their communicators so that the hung kernels return."""
        message = (
            f"{WHO}: a replayed step did not finish within the timeout ({entry.timeout:g} s): a "
            "peer stalled or died during the step, whose collectives run from a CUDA graph, where "
            "the process group's watchdog does not see them. Their NCCL communicators were "
            "aborted; the ranks can no longer be trusted to agree: restart the job, from the "
            "last checkpoint"
        )
        self.broken = message
        for state in _states(entry):
            if state.broken is None:
                state.broken = message
        _log.error("%s", message)
        # An abort can wait for the graphs that hold the communicators to be freed (the next
        # call frees them): never on this thread.
        for backend in entry.backends:
            threading.Thread(target=backend.abort, name="zrs-abort", daemon=True).start()

    def close(self) -> None:
        """Free the captured graphs and their memory; later calls warm up and capture again.
        At several ranks, call it (or let destroy_process_group do it) before the process
        groups are destroyed: a graph holding NCCL work keeps its communicators alive."""
        if self.broken is None and self.captured:
            torch.cuda.synchronize()  # no graph is freed while a replay of it runs
        for sig in self.signatures.values():
            if sig.graph is not None:
                sig.graph.graph.reset()
                sig.graph = None
                sig.calls = 0
        self.pool = None

    def _forget(self) -> None:
        """An optimizer loaded a state dict: its state tensors are new, so capture again."""
        for sig in self.signatures.values():
            self._drop(sig)

    def _drop(self, sig: Signature) -> None:
        """Forget `sig`'s graph. Once no graph holds the pool, the next capture takes a new
        one: torch refuses to capture into a pool whose graphs are all gone while tensors made
        in it live on (the gradient regions of runtime/grad_store.py, which stay in use)."""
        sig.graph = None
        if not self.captured:
            self.pool = None


# Every CapturedStep alive, for destroy_process_group to close (`close_before_destroy`).
_LIVE: weakref.WeakSet[CapturedStep] = weakref.WeakSet()


def _states(entry: Graph) -> list[ZeroState]:
    """The models `entry` steps (those still alive)."""
    return [s for ref, _, _ in entry.counts if (s := ref()) is not None]


def _close_all() -> None:
    for step in list(_LIVE):
        step.close()


def _held(entry: Graph) -> Hashable:
    """What `entry` assumes stays as captured (`signature.held`)."""
    return held([ref for ref, _, _ in entry.counts], [f.optimizer for f in entry.optimizers])


def _fresh(entry: Graph) -> Any:
    """The step's outputs, copied out of the graph's static ones."""
    outs = [o.clone() if isinstance(o, torch.Tensor) else o for o in entry.outputs]
    return tree_unflatten(outs, entry.out_spec)
