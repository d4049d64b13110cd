"""After the fusion passes: fewer calls for the same values.

What a fused graph still runs is mostly calls that compute nothing new, and on an accelerator without device-graph
capture every call is a launch (or at least a trip through the dispatcher) from the host:

* :func:`dedupe` computes once what the graph computes several times: each of Flux's blocks takes ``silu(temb)``
  again for its adaLN, and every q/k rotation unsqueezes the same rotary tables. Two calls of one pure op on the
  same arguments become one.
* :func:`collapse_views` makes a chain of reshapes one view: a linear layer's ``view(addmm, [B, S, N])`` followed
  by the heads' ``view(., [B, S, H, D])`` is one view of the matmul's result.

Both keep the invariants of ``passes/README.md``: nothing that writes in place is touched (nor anything at all in
a graph that writes in place), the graph's inputs and outputs stay, and a replacement has the replaced node's
traced layout, checked on the traced values (a node without one is left alone).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Hashable, Optional, Tuple

import torch
from torch.fx import Graph, Node

from .fx_utils import fake_call, is_call, same_layout, tensor_val, writes_in_place

__all__ = ["dedupe", "collapse_views", "tidy"]

aten = torch.ops.aten

#: Views that only reshape (no offset, no new strides beyond what a view of the result's shape gives).
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
             aten.squeeze.dims, aten.squeeze.default)

#: Calls that allocate without computing: two of them are two buffers, never one.
_ALLOCATIONS = (aten.empty.memory_format, aten.empty_strided.default, aten.empty_permuted.default,
                aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default)


def tidy(graph: Graph) -> Dict[str, int]:
    """:func:`dedupe`, then :func:`collapse_views`; how many calls each removed."""
    if any(writes_in_place(node) for node in graph.nodes):
        return {"dedupe": 0, "collapse_views": 0}
    return {"dedupe": dedupe(graph), "collapse_views": collapse_views(graph)}


def _key(value: Any) -> Optional[Hashable]:
    """A hashable stand-in for an argument that equals another's only when the two are the same argument."""
    if isinstance(value, Node):
        return value
    if isinstance(value, (list, tuple)):
        parts = tuple(_key(v) for v in value)
        return None if any(p is None for p in parts) else (type(value).__name__, parts)
    if isinstance(value, float):
        return ("float", value.hex())  # 0.0 and -0.0 differ; a NaN equals itself
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value).__name__, value)
    return None


def _pure(node: Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable or target in _ALLOCATIONS:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def dedupe(graph: Graph) -> int:
    """Merge calls of one pure op on the same arguments into the first of them (outputs excepted, so that no two
    outputs come to be one tensor); returns how many were removed."""
    seen: Dict[Tuple[Any, ...], Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not _pure(node) or any(u.op == "output" for u in node.users):
            continue
        key = _key((node.args, tuple(sorted(node.kwargs.items()))))
        if key is None:
            continue
        key = (node.target, key)
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        if not same_layout(first.meta.get("val"), node.meta.get("val")):
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        removed += 1
    return removed


def collapse_views(graph: Graph) -> int:
    """Each reshape of a reshape becomes one view of the first one's input, where that view has the traced shape
    and strides; the reshapes in between go when nothing else reads them. Returns how many calls went."""
    before = sum(1 for n in graph.nodes if n.op == "call_function")
    for node in list(graph.nodes):
        if not is_call(node, *_RESHAPES) or not is_call(node.args[0], *_RESHAPES):
            continue
        base = node.args[0]
        while is_call(base, *_RESHAPES):
            base = base.args[0]
        out, source = tensor_val(node), tensor_val(base)
        if out is None or source is None or not _static(out) or not _static(source):
            continue
        shape = [int(s) for s in out.shape]
        try:
            value = fake_call(aten.view.default, (base, shape), {}, lambda n: n.meta["val"])
        except Exception:  # noqa: BLE001  (not a view of the base: leave the chain)
            continue
        if not same_layout(value, out) or value.storage_offset() != out.storage_offset():
            continue
        previous = node.args[0]
        with graph.inserting_before(node):
            view = graph.call_function(aten.view.default, (base, shape))
        view.meta = dict(node.meta, val=value)
        node.replace_all_uses_with(view)
        graph.erase_node(node)
        while is_call(previous, *_RESHAPES) and not previous.users:
            above = previous.args[0]
            graph.erase_node(previous)
            previous = above
    return before - sum(1 for n in graph.nodes if n.op == "call_function")


def _static(value: torch.Tensor) -> bool:
    return all(type(s) is int for s in (*value.shape, *value.stride()))
