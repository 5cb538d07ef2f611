"""Every zrs op: schema, fake (meta) implementation and runtime implementation, in one place.

`torch.library.custom_op` cannot declare outputs that alias inputs, so the ops are defined from
schema strings. The `(a)` annotations on `wait_allgather` and `release_param` are load-bearing:
they tell inductor the output is the input, so it neither frees the gathered tensor early nor
reorders its users across the wait or the release. `release_param` also takes the outputs of the
parameter's other uses (`after`): a data dependency on each is what keeps inductor from scheduling
a fused use after the free; `end_backward` takes the graph's returned gradients for the same
reason.

`gather` / `gather_grad` are the functional pair dynamo traces (forward all-gather, backward
reduce-scatter with pre-divide). The zero3 pass lowers them into the remaining ops.
"""

from __future__ import annotations

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
from torch.fx.node import has_side_effect

from zrs._core import ZrsError
from zrs.runtime import collectives, gather, grads, handles, kernels

LIB = torch.library.Library("zrs", "DEF")  # schemas as strings: they need alias annotations

SCHEMAS = {
    "gather": "gather(Tensor shard, int ds_id, SymInt[] shape, ScalarType? dtype=None) -> Tensor",
    "gather_grad": "gather_grad(Tensor grad, int ds_id) -> Tensor",
    "allgather_param": (
        "allgather_param(Tensor shard, int graph_id, int ds_id, ScalarType? dtype=None, "
        "Tensor? prefetched=None) -> Tensor"
    ),
    "wait_allgather": "wait_allgather(Tensor(a) x, int graph_id, int ds_id) -> Tensor(a)",
    "release_param": (
        "release_param(Tensor(a) x, int graph_id, int ds_id, int n_users, Tensor[] after, "
        "bool keep=False) -> Tensor(a)"
    ),
    "prefetch_params_fused": (
        "prefetch_params_fused(int graph_id, Tensor[] shards, int[] ds_ids, "
        "ScalarType[]? dtypes=None) -> Tensor"
    ),
    "reduce_grad": "reduce_grad(Tensor grad, int graph_id, int ds_id, int bucket_numel=0) -> ()",
    "end_backward": "end_backward(int graph_id, Tensor[] after) -> ()",
    # One op per group of the ops above (compiler/coalesce.py): the per-parameter host work of a
    # planned graph, batched. allgather_params returns a token that stands for the group's
    # gathered buffers; wait_allgathers returns the members' parameters, declared aliases of the
    # token so that inductor orders every use after the wait and AOTAutograd expects views.
    "allgather_params": (
        "allgather_params(int graph_id, Tensor[] shards, int[] ds_ids, ScalarType[] dtypes) "
        "-> Tensor"
    ),
    "wait_allgathers": (
        "wait_allgathers(Tensor(a) token, int graph_id, int[] ds_ids, ScalarType[] dtypes) "
        "-> Tensor(a)[]"
    ),
    "release_params": (
        "release_params(Tensor[] after, int graph_id, int[] ds_ids, bool[] keep) -> ()"
    ),
    "reduce_grads": (
        "reduce_grads(Tensor[] grads, int graph_id, int[] ds_ids, int[] bucket_numels) -> ()"
    ),
    # A layer's call inside a compiled root, run eagerly with its unit's gathers and its own
    # autograd graph, and that graph's backward (prepare/opaque.py; kernels there). The call's
    # last output is a token that holds its graph; `like`: the inputs whose gradients it returns.
    "unit_call": (
        "unit_call(Tensor?[] inputs, Tensor anchor, bool[] needs_grad, bool grad, int site, "
        "str kwnames) -> Tensor[]"
    ),
    "unit_call_backward": (
        "unit_call_backward(Tensor?[] grads, Tensor[] like, Tensor token, int site) -> Tensor[]"
    ),
}
for _schema in SCHEMAS.values():
    LIB.define(_schema)

# Ops that run for their effect: FX dead-code elimination and inductor must keep them.
SIDE_EFFECT_OPS = (
    "release_param",
    "prefetch_params_fused",
    "reduce_grad",
    "end_backward",
    "allgather_params",
    "release_params",
    "reduce_grads",
    "unit_call",
    "unit_call_backward",
)

# The runtime implementations work on any device through torch.distributed; CUDA kernels for
# packing and casting register on the CUDA key in `zrs.runtime.kernels`.
_KEY = "CompositeExplicitAutograd"


def _impl(name: str):
    def deco(fn):
        LIB.impl(name, outside_dynamo(fn), _KEY)
        return fn

    return deco


def outside_dynamo(fn):
    """`fn` run with dynamo's frame hook off. Kernels run eagerly in graph-break regions while the
    hook is live, and dynamo must not trace the runtime's Python. Compiled graphs call the ops
    with the hook already off: then the call skips `torch.compiler.disable`'s wrapper, which
    costs more than the runtime's own work for a small op, on every op call of a step
    (BENCHMARKS.md)."""
    disabled = torch.compiler.disable(fn, recursive=True)

    def kernel(*args, **kwargs):
        if _eval_frame_callback() is None:
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    return kernel


def _fake(name: str):
    return torch.library.register_fake(f"zrs::{name}", lib=LIB)


# --- gather / gather_grad: the functional pair ------------------------------------------------


@_impl("gather")
def _gather(shard, ds_id, shape, dtype=None):
    h = handles.handle(ds_id)
    offload = h.state.offload
    if offload is None:
        return collectives.gather_full(h, shard, dtype)
    offload.refresh([h])
    offload.stage([h])
    try:
        return collectives.gather_full(h, shard, dtype)
    finally:
        offload.unstage([h])  # read: the gather waited for its collective


@_fake("gather")
def _gather_fake(shard, ds_id, shape, dtype=None):
    return shard.new_empty(shape, dtype=dtype or shard.dtype)


@_impl("gather_grad")
def _gather_grad(grad, ds_id):
    return grads.reduce_scatter_full(handles.handle(ds_id), grad)


@_fake("gather_grad")
def _gather_grad_fake(grad, ds_id):
    h = handles.handle(ds_id)
    return grad.new_empty(h.shard_numel, dtype=h.source.dtype)


def _gather_setup(ctx, inputs, output):
    ctx.ds_id = inputs[1]


def _gather_backward(ctx, grad):
    return torch.ops.zrs.gather_grad(grad, ctx.ds_id), None, None, None


torch.library.register_autograd(
    "zrs::gather", _gather_backward, setup_context=_gather_setup, lib=LIB
)


# --- lowered ops ------------------------------------------------------------------------------


@_impl("allgather_param")
def _allgather_param(shard, graph_id, ds_id, dtype=None, prefetched=None):
    # `prefetched`: the token of the prefetch that issued this gather; only a data edge that
    # keeps inductor from scheduling the prefetch after its members.
    return gather.allgather_param(shard, graph_id, ds_id, dtype)


@_fake("allgather_param")
def _allgather_param_fake(shard, graph_id, ds_id, dtype=None, prefetched=None):
    h = handles.handle(ds_id)
    return shard.new_empty(h.shape, dtype=dtype or shard.dtype)


@_impl("wait_allgather")
def _wait_allgather(x, graph_id, ds_id):
    gather.wait_gather([ds_id])
    return x.view_as(x)  # kernels below autograd must return a fresh alias, never the input


@_fake("wait_allgather")
def _wait_allgather_fake(x, graph_id, ds_id):
    return x.view_as(x)


@_impl("release_param")
def _release_param(x, graph_id, ds_id, n_users, after, keep=False):
    gather.release([ds_id], [keep])
    return x.view_as(x)


@_fake("release_param")
def _release_param_fake(x, graph_id, ds_id, n_users, after, keep=False):
    return x.view_as(x)


# A `ScalarType[]` argument reaches a Python kernel as the ScalarType enum's ints (torch 2.11);
# these are c10's stable codes for the float dtypes a gather can use.
_SCALAR_TYPES = {5: torch.float16, 6: torch.float32, 7: torch.float64, 15: torch.bfloat16}


def _as_dtype(d: torch.dtype | int) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    try:
        return _SCALAR_TYPES[d]
    except KeyError:
        raise ZrsError(f"prefetch_params_fused: unsupported gather dtype code {d}") from None


@_impl("prefetch_params_fused")
def _prefetch_params_fused(graph_id, shards, ds_ids, dtypes=None):
    dtypes = [_as_dtype(d) for d in dtypes] if dtypes else [s.dtype for s in shards]
    gather.prefetch(graph_id, list(shards), list(ds_ids), list(dtypes))
    return shards[0].new_empty(0)  # the token its members' allgather_param take


@_fake("prefetch_params_fused")
def _prefetch_params_fused_fake(graph_id, shards, ds_ids, dtypes=None):
    return shards[0].new_empty(0)


@_impl("reduce_grad")
def _reduce_grad(grad, graph_id, ds_id, bucket_numel=0):
    grads.reduce_grads(graph_id, [grad], [ds_id], [bucket_numel])


@_fake("reduce_grad")
def _reduce_grad_fake(grad, graph_id, ds_id, bucket_numel=0):
    return None


@_impl("end_backward")
def _end_backward(graph_id, after):
    grads.end_backward(handles.LIVE.models())


@_fake("end_backward")
def _end_backward_fake(graph_id, after):
    return None


@_impl("allgather_params")
def _allgather_params(graph_id, shards, ds_ids, dtypes):
    gather.issue_group(graph_id, shards, ds_ids, [_as_dtype(d) for d in dtypes])
    return shards[0].new_empty(0)


@_fake("allgather_params")
def _allgather_params_fake(graph_id, shards, ds_ids, dtypes):
    return shards[0].new_empty(0)


@_impl("wait_allgathers")
def _wait_allgathers(token, graph_id, ds_ids, dtypes):
    return gather.wait_group(ds_ids)


@_fake("wait_allgathers")
def _wait_allgathers_fake(token, graph_id, ds_ids, dtypes):
    # A group's members are views of one buffer (gather.Flat); a group has one dtype.
    hs = [handles.handle(i) for i in ds_ids]
    dtype = _as_dtype(dtypes[0])
    starts, length = handles.group_layout([h.padded_numel for h in hs], dtype.itemsize)
    flat = token.new_empty(length, dtype=dtype)
    return [flat.narrow(0, s, h.numel).view(h.shape) for h, s in zip(hs, starts, strict=True)]


@_impl("release_params")
def _release_params(after, graph_id, ds_ids, keep):
    gather.release(ds_ids, keep)


@_fake("release_params")
def _release_params_fake(after, graph_id, ds_ids, keep):
    return None


@_impl("reduce_grads")
def _reduce_grads(gradients, graph_id, ds_ids, bucket_numels):
    grads.reduce_grads(graph_id, gradients, ds_ids, bucket_numels)


@_fake("reduce_grads")
def _reduce_grads_fake(grads, graph_id, ds_ids, bucket_numels):
    return None


for _name in SIDE_EFFECT_OPS:
    has_side_effect(getattr(torch.ops.zrs, _name).default)


# --- copy ops: internal ops of the runtime's copy-in, copy-out and gradient pack ------------------
# Kernels: torch ops on CompositeExplicitAutograd (CPU, and the CUDA fallback) and the CUDA kernels
# of cuda/zrs_kernels.cu on the CUDA key once built; both live in `zrs.runtime.kernels`.

COPY_SCHEMAS = {
    # cast each shard to out.dtype and write them back to back into the flat `out`
    "pack_cast": "pack_cast(Tensor[] shards, Tensor(a!) out) -> ()",
    # recv = `world` rank blocks; member i at offsets[i] (numels[i] elements) in every block:
    # outs[i][r * numels[i] + j] = recv[r * block + offsets[i] + j]
    "unpack_rank_major": (
        "unpack_rank_major(Tensor recv, int world, int[] offsets, int[] numels, "
        "Tensor(a!)[] outs) -> ()"
    ),
    # out (world, block): grad i * scale, cast, rank-major at columns off_i : off_i + shard_i,
    # shard_i = ceil(numel_i / world), off_i cumulative, padding zero-filled
    "pack_grads": (
        "pack_grads(Tensor[] grads, int world, int[] shards, float scale, Tensor(a!) out) -> ()"
    ),
}
for _schema in COPY_SCHEMAS.values():
    LIB.define(_schema)
kernels.register(LIB, outside_dynamo)
