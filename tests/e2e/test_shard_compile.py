"""zrs.shard(compile=...) trains as the unsharded model does (gloo ranks, SGD with momentum): the
tied GPT of the own zoo, the only one with a stack of layers, at world sizes 1, 2 and 3 on
AOTAutograd's backend, and at two ranks with inductor, with its layers compiled by hand
(`layer.compile()`, whose hooks break the graph and run eagerly), with the whole model
under `torch.compile`, and with the layers alone compiled (`compile_root=False`); dynamo never traces zrs's runtime (its hooks and the model's forward
guard are `torch.compiler.disable`d). Inductor's generated code
reads the layers' gathered parameters as graph inputs whose storage the eager path frees and
refills between the forward and the backward. test_hf_models.py runs three Hugging Face models
with compiled layers at two ranks; the GPU suite runs four cases with inductor on NCCL, a
Hugging Face Llama among them, and the layers alone. In one process below: the root's code
around a stack that a submodule runs (a Hugging Face model's head and loss) compiles too, a
training call builds no KV cache that would recompile each layer, and several calls of a
looped layer before one backward train as eagerly.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import zrs
from _dist import cached_run, reemit_warnings
from checks import compiled_problems, fp32_problems
from hf_zoo import HF_ZOO
from zoo import Case, Reference, case_outcome, run_cases, spec_of, train_reference
from zrs._core import ZrsError
from zrs.runtime import state as runtime

pytestmark = pytest.mark.slow

# world -> (backend, model) cases, one group of ranks per world
CASES = {
    1: (("shard:aot_eager", "gpt_tied"),),
    2: (
        ("shard:inductor", "gpt_tied"),  # a tied embedding and head around the stack
        ("hand:aot_eager", "gpt_tied"),
        ("whole:aot_eager", "gpt_tied"),  # torch.compile(zrs.shard(model))
        ("layers:aot_eager", "gpt_tied"),  # compile_root=False
    ),
    3: (("shard:aot_eager", "gpt_tied"),),
}
PARAMS = [
    pytest.param(world, backend, model, id=f"w{world}-{backend}-{model}")
    for world, cases in CASES.items()
    for backend, model in cases
]
RTOL, ATOL = 1e-5, 1e-6  # test_correctness.py's
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6


@functools.cache
def _reference(model: str, world: int) -> Reference:
    return train_reference(spec_of(model), world)


@pytest.mark.parametrize(("world", "backend", "model"), PARAMS)
def test_compiled_layers_match_reference(world: int, backend: str, model: str) -> None:
    cases = [Case(m, b) for b, m in CASES[world]]
    group = cached_run(("shard-compile", world), run_cases, world, cases)
    per_rank = case_outcome(group, Case(model, backend).key)
    spec = spec_of(model)
    problems = fp32_problems(
        per_rank,
        spec,
        _reference(model, world),
        rtol=RTOL,
        atol=ATOL,
        loss_rtol=LOSS_RTOL,
        loss_atol=LOSS_ATOL,
    )
    if backend.startswith("hand:"):  # by hand, the hooks break the graphs (run eagerly)
        problems += [
            f"dynamo traced zrs's runtime: {r['traced_runtime']}"
            for r in per_rank
            if r["traced_runtime"]
        ]
    else:
        problems += compiled_problems(per_rank, spec, backend)
    whole = backend.startswith("whole:")  # dynamo compiles what it can reach: no layer of its own
    if not all((r["compiled_units"] or whole) and r["graphs"] for r in per_rank):
        problems.append(
            f"compiled layers {[r['compiled_units'] for r in per_rank]}, "
            f"graphs {[r['graphs'] for r in per_rank]}"
        )
    assert not problems, "\n".join(problems)
    for rank, r in enumerate(per_rank):
        reemit_warnings(r["warnings"], where=f"rank {rank}, {model}")


# A backend that keeps the graphs dynamo hands it, for the test below to read.
_RECORDED: list[torch.fx.GraphModule] = []


@torch._dynamo.register_backend(name="zrs_tests_record")
def _record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    _RECORDED.append(gm)
    return aot_eager(gm, example_inputs)


def _train(model: nn.Module, spec, steps: int = 2) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        loss = spec.loss(model, spec.batch(0, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_head_and_the_loss_compile_as_one_graph_around_the_stack() -> None:
    """A Hugging Face causal LM runs its stack in an inner model and the head and the loss after
    it: zrs.shard(compile=...) compiles that code of the root's too, the head (tied to the token
    embedding) and the loss in one graph, with the inner model's call the one graph break.
    Trained as the eagerly run root trains."""
    spec = HF_ZOO["hf_gpt2"]
    torch._dynamo.reset()
    _RECORDED.clear()
    counters.clear()
    try:
        compiled = zrs.shard(spec.build(), compile="zrs_tests_record")
        losses = _train(compiled, spec)
        unit_names = [u.name for u in compiled._zrs_state.fetcher.units]
        eager = _train(zrs.shard(spec.build()), spec)
    finally:
        runtime.reset()
    calls = [
        {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes} for gm in _RECORDED
    ]
    assert any({"linear", "cross_entropy"} <= c for c in calls), calls
    assert "lm_head" not in unit_names, unit_names  # the root unit's: no hook splits the graph
    breaks = [reason for reason in counters["graph_break"] if "GPT2Model.forward" not in reason]
    assert not breaks, breaks
    torch.testing.assert_close(losses, eager, rtol=1e-6, atol=0)


def test_a_root_that_runs_the_stack_itself_compiles_around_its_layer_calls() -> None:
    """The own zoo's GPT loops over its layers in the root's forward, which no graph break can
    leave: each layer's call is one opaque op of the root's graph (its gathers and its own
    compiled forward inside), so the embedding, the loop and the head are one graph. Trained
    as the eagerly run root trains, bit for bit."""
    spec = spec_of("gpt_tied")
    torch._dynamo.reset()
    _RECORDED.clear()
    counters.clear()
    try:
        compiled = zrs.shard(spec.build(), compile="zrs_tests_record")
        losses = _train(compiled, spec, steps=3)
        unit_names = [u.name for u in compiled._zrs_state.fetcher.units]
        eager = _train(zrs.shard(spec.build()), spec, steps=3)
    finally:
        runtime.reset()
    roots = [gm for gm in _RECORDED if any(_is_unit_call(n) for n in gm.graph.nodes)]
    assert len(roots) == 1, [gm.graph for gm in _RECORDED]
    calls = [n for n in roots[0].graph.nodes if _is_unit_call(n)]
    assert len(calls) == len(compiled.blocks), roots[0].graph
    targets = {getattr(n.target, "__name__", str(n.target)) for n in roots[0].graph.nodes}
    assert {"embedding", "linear"} <= targets, targets
    assert unit_names == ["", "blocks.0", "blocks.1"], unit_names
    assert len(_RECORDED) == 2, [gm.graph for gm in _RECORDED]  # the root's and the layer's
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert losses == eager, (losses, eager)


@pytest.mark.parametrize("model", ["gpt_tied", "hf_gpt2"])
def test_compile_root_false_compiles_the_layers_only(model: str) -> None:
    """compile_root=False: the layers' forward is the one graph (a root that loops calls them
    as plain modules, an inner model that runs them is no graph break), the code around them
    runs eagerly with units of its own, and the model trains as the eagerly run one does."""
    spec = HF_ZOO[model] if model in HF_ZOO else spec_of(model)
    torch._dynamo.reset()
    _RECORDED.clear()
    try:
        compiled = zrs.shard(spec.build(), compile="zrs_tests_record", compile_root=False)
        losses = _train(compiled, spec, steps=3)
        unit_names = [u.name for u in compiled._zrs_state.fetcher.units]
        eager = _train(zrs.shard(spec.build()), spec, steps=3)
        with pytest.raises(ZrsError, match=r"compile_root='no': pass True or False"):
            zrs.shard(spec.build(), compile=True, compile_root="no")
    finally:
        runtime.reset()
    assert len(_RECORDED) == 1, [gm.graph for gm in _RECORDED]  # the layer's forward
    assert not any(_is_unit_call(n) for n in _RECORDED[0].graph.nodes), _RECORDED[0].graph
    head = "head" if model == "gpt_tied" else "lm_head"
    assert head in unit_names, unit_names  # its own unit, hooked, not the root's
    torch.testing.assert_close(losses, eager, rtol=1e-6, atol=0)


def _checkpointed_gpt(around: bool) -> nn.Module:
    """The zoo's tied GPT with activation checkpointing inside each layer's forward, or around
    each layer's call in the root's loop."""
    gpt = spec_of("gpt_tied").build()
    if not around:
        for block in gpt.blocks:
            block.forward = functools.partial(_checkpointed, type(block).forward, block)
        return gpt

    class AroundEachCall(type(gpt)):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return self.head(self.ln_f(x))

    gpt.__class__ = AroundEachCall
    return gpt


def _checkpointed(forward, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(forward, block, x, use_reentrant=False)


def test_activation_checkpointing_inside_a_looped_layer_and_around_its_call() -> None:
    """Inside a layer's forward, a recompute runs in the layer's own backward: trained as the
    eagerly run model, bit for bit. Around the root's call of a layer, the recompute would
    replay the opaque call, whose autograd graph is its own: a ZrsError that says where to
    checkpoint instead."""
    spec = spec_of("gpt_tied")
    torch._dynamo.reset()
    try:
        inside = _train(zrs.shard(_checkpointed_gpt(False), compile="aot_eager"), spec, steps=3)
        eager = _train(zrs.shard(_checkpointed_gpt(False)), spec, steps=3)
        runtime.reset()
        with pytest.raises(zrs.ZrsError, match="Checkpoint inside the layer's forward"):
            _train(zrs.shard(_checkpointed_gpt(True), compile="aot_eager"), spec, steps=1)
    finally:
        runtime.reset()
    assert inside == eager, (inside, eager)


class _ReachingRoot(nn.Module):
    """Runs its submodule's stack, embedding and head itself, never the submodule's forward,
    which zrs takes for the stack's runner (an nn.ModuleList's parent)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = spec_of("gpt_tied").build()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        x = gpt.tok(idx) + gpt.pos[: idx.shape[1]]
        for block in gpt.blocks:
            x = block(x)
        return gpt.head(gpt.ln_f(x))


def test_a_root_that_reaches_into_a_submodule_trains_as_eagerly() -> None:
    """The root's compiled code reads the submodule's own parameter (`pos`), whose unit's hook
    never ran: it is read eagerly, gathered at the read, not as a leaf nothing gathered."""
    spec = spec_of("gpt_tied")
    torch._dynamo.reset()
    try:
        losses = _train(zrs.shard(_ReachingRoot(), compile="aot_eager"), spec, steps=3)
        eager = _train(zrs.shard(_ReachingRoot()), spec, steps=3)
    finally:
        runtime.reset()
    assert losses == eager, (losses, eager)


def test_code_the_user_compiles_reads_a_units_leaves_only_inside_its_call() -> None:
    """torch.compile(zrs.shard(model)) on the reaching root: its graphs read the submodule's
    `pos`, which no hook gathered, eagerly (a leaf read there raised on its empty storage). A
    layer compiled by hand and called outside the model's forward reads its parameters gathered
    at the read, as the eager layer does."""
    spec = spec_of("gpt_tied")
    torch._dynamo.reset()
    x = torch.randn(
        2, 5, spec.build().tok.embedding_dim, generator=torch.Generator().manual_seed(9)
    )
    try:
        eager_model = zrs.shard(_ReachingRoot())
        eager = _train(eager_model, spec, steps=3)
        alone = eager_model.gpt.blocks[0](x)
        whole = _train(torch.compile(zrs.shard(_ReachingRoot()), backend="aot_eager"), spec, 3)
        hand_model = zrs.shard(_ReachingRoot())
        for block in hand_model.gpt.blocks:
            block.compile(backend="aot_eager")
        hand = _train(hand_model, spec, steps=3)
        hand_alone = hand_model.gpt.blocks[0](x)
    finally:
        runtime.reset()
    assert whole == eager, (whole, eager)
    assert hand == eager, (hand, eager)
    torch.testing.assert_close(hand_alone, alone, rtol=0, atol=0)


class _Widening(nn.Module):
    """A layer whose output's shape follows a flag of its own, not its class or parameters."""

    def __init__(self, widen: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.widen = widen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.proj(x))
        return torch.cat([y, y]) if self.widen else y


class _WideningStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Widening(False), _Widening(True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_equal_layers_whose_outputs_differ_raise() -> None:
    """The fake kernel's outputs are shared by the layers of a class with equal parameters,
    called with equal inputs; a layer that breaks that is found at its first call."""
    torch._dynamo.reset()
    try:
        model = zrs.shard(_WideningStack(), compile="aot_eager")
        with pytest.raises(zrs.ZrsError, match="classes of their own"):
            model(torch.randn(4, 6)).backward()
    finally:
        runtime.reset()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x)) * self.scale


class _ScaledStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Scaled() for _ in range(3))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _regression_losses(model: nn.Module) -> list[float]:
    """Three SGD-momentum steps of a model that maps a (4, 6) batch to its loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        loss = model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_looped_layer_that_reads_a_buffer_trains_and_evaluates_as_eagerly() -> None:
    """The fake kernel runs the layer on fake tensors, its buffers included. Each layer call's
    graph lives as long as the root's autograd graph: none after the backwards or a forward
    under no_grad, and an evaluation's with gradients on goes with its output."""
    torch._dynamo.reset()
    losses, evals = [], []
    try:
        for compile in ("aot_eager", False):
            torch.manual_seed(0)
            model = zrs.shard(_ScaledStack(), compile=compile)
            losses.append(_regression_losses(model))
            with torch.no_grad():
                evals.append(model(torch.ones(2, 6)).item())
            if compile:
                kept = model.layers[0]._zrs_site.shared.kept
                counts = [len(kept)]
                model.eval()
                out = model(torch.ones(2, 6))  # gradients on, and no backward
                counts.append(len(kept))
                del out
                counts.append(len(kept))
            runtime.reset()
    finally:
        runtime.reset()
    assert losses[0] == losses[1], losses
    assert evals[0] == evals[1], evals
    assert counts == [0, 3, 0], counts


class _TwiceStack(_ScaledStack):
    """Each layer called twice in a row: one forward, two calls of each layer's graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(layer(x))
        return self.head(x).square().mean()


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(i))


def _uneven_steps(model: nn.Module) -> list[torch.Tensor]:
    """Two forwards before one backward; two forwards and a backward of the second alone,
    whose end reduces what it held (the first's output stays alive, its graph a step old);
    one forward and backward. SGD with momentum after each. The gradients after the second
    and the parameters at the end; then the first's backward, which zrs.shard refuses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (model(_batch(0)) + model(_batch(1))).backward()
    opt.step()
    opt.zero_grad()
    first, second = model(_batch(2)), model(_batch(3))
    second.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    (model(_batch(4)) * 2).backward()
    opt.step()
    with pytest.raises(zrs.ZrsError, match="without a training forward before it"):
        first.backward()
    return grads + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stack", [_ScaledStack, _TwiceStack])
def test_several_calls_of_a_looped_layer_before_a_backward_train_as_eagerly(stack) -> None:
    """A layer's calls run their backwards one at a time (each its own graph). While another
    call of the layer in the step has its backward to come, its parameters' gradients wait in
    their leaves and the next call's backward adds to them: one reduce of the sum, as eagerly.
    A backward that leaves a call of the step without its backward reduces what it held at
    its end."""
    torch._dynamo.reset()
    outcomes = []
    try:
        for compile in ("aot_eager", False):
            torch.manual_seed(0)
            model = zrs.shard(stack(), compile=compile)
            outcomes.append(_uneven_steps(model))
            runtime.reset()
    finally:
        runtime.reset()
    torch.testing.assert_close(outcomes[0], outcomes[1], rtol=1e-6, atol=1e-7)


def _raising_then_clean(model: nn.Module) -> list[torch.Tensor]:
    """Two forwards before one backward that raises after the second's layers ran theirs (a
    hook on the first's output: the second's graph runs first), then one clean step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a fault in the backward")

    first, second = model(_batch(0)), model(_batch(1))
    first.register_hook(fail)
    with pytest.raises(RuntimeError, match="a fault in the backward"):
        (first + second).backward()
    del first, second
    opt.zero_grad()
    model(_batch(2)).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_backward_that_raises_while_a_layer_holds_its_gradients_leaves_none() -> None:
    """What a layer held for a call whose backward never came (the backward raised first) is
    dropped before the next step: its gradients are the clean step's alone, as eagerly."""
    torch._dynamo.reset()
    outcomes = []
    try:
        for compile in ("aot_eager", False):
            torch.manual_seed(0)
            model = zrs.shard(_ScaledStack(), compile=compile)
            outcomes.append(_raising_then_clean(model))
            runtime.reset()
    finally:
        runtime.reset()
    torch.testing.assert_close(outcomes[0], outcomes[1], rtol=1e-6, atol=1e-7)


class _Reading(nn.Module):
    """A layer that also reads a parameter of a module outside it (held in a plain list, not
    registered): the root unit's, gathered with it."""

    def __init__(self, shift: nn.Linear) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.shift = [shift]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x)) + self.shift[0].bias


class _ReadingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Linear(1, 6)
        self.layers = nn.ModuleList(_Reading(self.shift) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_looped_layer_that_reads_a_root_parameter_trains_as_eagerly() -> None:
    """The fake kernel gives the layer a fake of every parameter it reads, its own or not."""
    torch._dynamo.reset()
    losses = []
    try:
        for compile in ("aot_eager", False):
            torch.manual_seed(0)
            losses.append(_regression_losses(zrs.shard(_ReadingStack(), compile=compile)))
            runtime.reset()
    finally:
        runtime.reset()
    assert losses[0] == losses[1], losses


def _is_unit_call(node: torch.fx.Node) -> bool:
    return node.target in (torch.ops.zrs.unit_call, torch.ops.zrs.unit_call.default)


# peft 0.21's get_peft_model asks transformers 5.24 the deprecated is_gradient_checkpointing
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("wrapped", ["plain", "peft"])
def test_a_training_call_builds_no_cache_that_recompiles_each_layer(wrapped: str) -> None:
    """A four-layer Llama whose config says use_cache=True: each layer's compiled forward would
    guard on its own layer of the KV cache a training forward builds, one compile per layer.
    Training calls run without the cache: one compile for the stack and one for the root's
    code, PEFT's too (its forward passes use_cache on in **kwargs; LoRA's first layer, whose
    input needs no gradient, compiles once more). A call that asks for the cache gets it."""
    spec = HF_ZOO["hf_llama"]
    config = spec.build().config
    config.num_hidden_layers = 4
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = type(spec.build())(config)
        if wrapped == "peft":
            peft = pytest.importorskip("peft")
            lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
            model = peft.get_peft_model(model, lora)
        model = zrs.shard(model, compile="aot_eager")
        assert model.config.use_cache
        spec.loss(model, spec.batch(0, 0)).backward()
        graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            asked = model(input_ids=spec.batch(0, 1)[0], use_cache=True).past_key_values
    finally:
        runtime.reset()
    assert graphs == (3 if wrapped == "peft" else 2), graphs
    assert asked is not None


@pytest.mark.parametrize("model", ["hf_bert", "hf_vit"])
def test_an_encoder_compiled_around_its_stack_trains_as_eagerly(model: str) -> None:
    """Encoders whose root compiles more than a head around the stack's runner: BERT's
    embeddings and mask, ViT's patch embedding (a convolution) and classifier. One rank; the
    ranks' case is the decoders' (test_hf_models.py, shard:aot_eager)."""
    spec = HF_ZOO[model]
    torch._dynamo.reset()
    try:
        sharded = zrs.shard(spec.build(), compile="aot_eager")
        assert "forward" in vars(sharded), "the root's forward compiles"
        compiled = _train(sharded, spec, steps=3)
        eager = _train(zrs.shard(spec.build()), spec, steps=3)
    finally:
        runtime.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)
