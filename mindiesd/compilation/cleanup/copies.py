"""After the fusion passes: the copies that only duplicate a value the graph computed are dropped (an
inference-mode dropout's ``clone``, a ``cat`` of the slices of one tensor)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fx_utils import is_call, known_eq, same_layout, tensor_val, writes_in_place

__all__ = ["drop_copies"]


def _aliases_input(node: Node) -> bool:
    """Whether ``node``'s result may share memory with one of its inputs (a view, ``getitem`` of a split, ...)."""
    target = node.target
    if node.op != "call_function":
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return True  # operator.getitem and other Python callables: may hand an input on as it is
    return any(ret.alias_info is not None for ret in target._schema.returns)


def _escapes(node: Node) -> bool:
    """Whether ``node``'s memory may be seen outside the graph: it, or a view of it, is an output."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        for user in current.users:
            if user.op == "output":
                return True
            if user not in seen and _aliases_input(user):
                seen.add(user)
                pending.append(user)
    return False


def drop_copies(graph: Graph) -> int:
    """Remove the copies that only duplicate a value the graph computed:

    * ``clone`` (keeping the layout, or making contiguous what already is), as the decomposition of an
      inference-mode dropout leaves after every attention output and feed-forward of a diffusers block;
    * ``cat`` of consecutive slices of one tensor that cover it whole, in its layout: Flux's single blocks split
      the text and image tokens after each block and the next block concatenates them again.

    A copy stays where the graph writes in place anywhere, where its source is an input of the graph, and where
    it (or a view of it) is an output, so that no output shares memory it did not share before. Returns how many
    were removed."""
    if any(writes_in_place(node) for node in graph.nodes):
        return 0
    removed = 0
    for node in list(graph.nodes):
        source = _copied(node)
        if source is None or not isinstance(source, Node) or source.op != "call_function" or _escapes(node):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        removed += 1
    return removed


def _copied(node: Node) -> Optional[Node]:
    """The node whose value ``node`` copies unchanged (same layout), or None."""
    if is_call(node, torch.ops.aten.cat.default):
        return _reconcatenated(node)
    if not is_call(node, torch.ops.aten.clone.default) or len(node.args) != 1:
        return None
    source = node.args[0]
    src = tensor_val(source)
    if src is None or set(node.kwargs) - {"memory_format"}:
        return None
    fmt = node.kwargs.get("memory_format", torch.preserve_format)
    if fmt is not torch.preserve_format:
        if fmt is not torch.contiguous_format or not _known_contiguous(src):
            return None
    elif not _known_dense(src):
        return None
    return source


def _reconcatenated(node: Node) -> Optional[Node]:
    """x where ``node`` is ``cat([x[.., a0:a1], x[.., a1:a2], ...], d)`` with a0 = 0 and the last end x's size
    along d (unit steps), and the concatenation has x's layout; else None."""
    parts = node.args[0] if node.args else None
    out = tensor_val(node)
    if not isinstance(parts, (list, tuple)) or len(parts) < 2 or out is None or set(node.kwargs) - {"dim"}:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(dim, int):
        return None
    dim %= out.dim()
    source, position = None, 0
    for part in parts:
        if not is_call(part, torch.ops.aten.slice.Tensor) or part.kwargs:
            return None
        sliced_from, part_dim, start, end, step = (list(part.args) + [0, None, None, 1][len(part.args) - 1:])[:5]
        whole = tensor_val(sliced_from)
        if whole is None or source not in (None, sliced_from) or step != 1 or not isinstance(part_dim, int):
            return None
        if part_dim % whole.dim() != dim or not known_eq(start if start is not None else 0, position):
            return None
        size = whole.shape[dim]
        end = size if end is None or (isinstance(end, int) and isinstance(size, int) and end >= size) else end
        source, position = sliced_from, end
    if source is None or not known_eq(position, tensor_val(source).shape[dim]):
        return None
    return source if same_layout(tensor_val(source), out) else None


def _known_contiguous(value: torch.Tensor) -> bool:
    try:
        return bool(statically_known_true(value.is_contiguous()))
    except Exception:
        return False


def _known_dense(value: torch.Tensor) -> bool:
    """Contiguous in some dimension order without gaps or overlap: a preserving clone keeps its strides as they are."""
    try:
        return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(value))
    except Exception:
        return False
