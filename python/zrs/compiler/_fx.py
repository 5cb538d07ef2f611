"""Small pure predicates over FX nodes, shared by the passes."""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

from zrs.runtime import ops as _ops  # noqa: F401  (defines torch.ops.zrs)

OPS = torch.ops.zrs
# "-> Tensor(a)" or "-> Tensor(a)[]" (a view), but not "-> Tensor(a!)" (an in-place op).
_RETURN_ALIAS = re.compile(r"->\s*Tensor\((\w+)\)")
CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def is_op(node: fx.Node, name: str) -> bool:
    return node.op == "call_function" and node.target is getattr(OPS, name).default


def region_body(node: fx.Node) -> fx.GraphModule | None:
    """The body an invoke_subgraph call runs (a nested compile region); None for other nodes."""
    if node.op != "call_function" or node.target is not INVOKE_SUBGRAPH:
        return None
    owner, attr = node.graph.owning_module, node.args[0]
    if owner is None or not isinstance(attr, fx.Node) or attr.op != "get_attr":
        return None
    return getattr(owner, attr.target)


def is_view(node: fx.Node) -> bool:
    """True if `node`'s output aliases its first input (a view op, or a getitem of a view tuple)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and is_view(src)
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or schema.arguments[0].alias_info is None:
        return False
    # The Python schema API does not expose the alias set of a list element (`Tensor(a)[]` of
    # split/chunk/unbind), so read the return annotation from the schema text.
    ret = _RETURN_ALIAS.search(str(schema))
    return ret is not None and ret.group(1) in schema.arguments[0].alias_info.before_set


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The target dtype if `node` is a pure dtype cast, else None."""
    if node.op != "call_function" or node.target not in CASTS:
        return None
    if node.target is CASTS[0]:
        return node.args[1]
    if set(node.kwargs) - {"dtype", "layout", "device"}:
        return None  # e.g. a memory format change, not a plain cast
    if node.kwargs.get("layout", torch.strided) is not torch.strided:
        return None
    # AOT autograd's backward of a cast names the device and layout it keeps: still a cast.
    if "device" in node.kwargs and not _same_device(node):
        return None  # a device move
    return node.kwargs.get("dtype")


def _same_device(cast: fx.Node) -> bool:
    """The device a cast names is its input's own (an index-less name matches any index)."""
    want = cast.kwargs["device"]
    if want is None:
        return True
    src = val(cast.args[0]) if cast.args and isinstance(cast.args[0], fx.Node) else None
    if not isinstance(src, torch.Tensor):
        return False
    want = torch.device(want)
    return want.type == src.device.type and want.index in (None, src.device.index)


def alias_closure(node: fx.Node) -> list[fx.Node]:
    """`node` and every node whose output aliases it through views, in discovery order."""
    seen, stack, members = [node], [node], {node}
    while stack:
        for user in stack.pop().users:
            if user not in members and is_view(user):
                members.add(user)
                seen.append(user)
                stack.append(user)
    return seen


def val(node: fx.Node):
    return node.meta.get("val")


def rank_local_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The graph's symbolic integer inputs that no op reads (at most the output passes them on,
    for the backward). Dynamo makes a tensor input's storage offset a symbol where it is not 0 or
    1 (a batch `X[rank]` on rank 1, not on rank 0), so such an input exists on some ranks only;
    no collective depends on it. The rank check, the size hints and the planner IR leave them
    out, so that every rank compares and plans alike."""
    return {
        n
        for n in graph.find_nodes(op="placeholder")
        if isinstance(val(n), torch.SymInt) and all(u.op == "output" for u in n.users)
    }


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a node's value: itself, or those in a (nested) tuple or list."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []
