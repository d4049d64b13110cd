"""After tidying: elementwise ops write their results where the graph reads them, not where they are copied from.

Two copies remain in a fused graph where an elementwise op's result only feeds one:

* :func:`cast_into`: ``_to_copy(f(x), dtype)``, an op computed in a wider float dtype and rounded by a second call
  (Flux's rotary tables: ``cos`` and ``sin`` of float64 angles, cast to float32). ``f.out(x, out=empty(dtype))``
  computes in the same dtype and rounds as it stores: one call, and the wide result is never written out whole;
* :func:`cat_into`: ``cat([f_1(..), ..., f_n(..)], dim)`` of results that nothing else reads: elementwise ops (the
  sinusoidal timestep embedding's ``cat([cos, sin])``, the rotary angles' ``cat`` of one product per axis) or a
  view of a matrix product (joint attention's value: the text and image streams' projections in heads, joined
  along the tokens). Each ``f_i.out`` writes into its slice of one buffer (``split_with_sizes`` of it), and the
  concatenation is never copied: one call fewer, one pass over the values fewer. A linear layer writes as ATen
  runs it on a contiguous input: ``linear.out`` of its rows into the slice's rows, the very ``addmm`` (``mm``
  without a bias) that its functional form runs, so its slice must be contiguous.

Both keep the values exactly. An out variant computes in the dtype the functional op computes in (its inputs'
common dtype: the output takes no part in it) and rounds once, as the cast did; a slice that the op writes as it
would write its own result (contiguous) sees the same loop; where a slice is strided, only ops that round each
element exactly once (products, sums, differences, quotients) are moved, whose values cannot depend on the loop.

What the graph needs for this: static shapes (the buffers are allocated with traced sizes), a contiguous traced
result, the same device and dtype, and no write in place anywhere before (the graph is functional until here).
These are the only writes in place of a final graph, each into a buffer the graph allocated for it in the same
call, never into an input or a value anything else reads.
"""

from __future__ import annotations

import operator
from typing import List, Optional

import torch
from torch.fx import Graph, Node

from ...ops.dtypes import is_compute_float
from ..fx_utils import Emitter, is_call, tensor_val, writes_in_place

__all__ = ["write_into", "cast_into", "cat_into", "EXACT", "ROUNDED"]

aten = torch.ops.aten

#: Elementwise ops whose every element is one correctly rounded operation: the same value however they loop.
EXACT = (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor)
#: Elementwise ops whose vector and scalar paths may round differently: moved only where they loop as before.
ROUNDED = (aten.cos.default, aten.sin.default, aten.exp.default, aten.sigmoid.default, aten.tanh.default,
           aten.rsqrt.default)


def write_into(graph: Graph) -> int:
    """:func:`cast_into`, then :func:`cat_into`; how many copies went (none in a graph that writes in place)."""
    if any(writes_in_place(node) for node in graph.nodes):
        return 0
    return cast_into(graph) + cat_into(graph)


def _out_variant(node: Node) -> Optional[torch._ops.OpOverload]:
    """The ``out`` overload of the elementwise op of ``node``, where its other arguments are the op's own."""
    if node.op != "call_function" or node.target not in EXACT + ROUNDED:
        return None
    out = getattr(node.target.overloadpacket, "out", None)
    if out is None:
        return None
    names = [a.name for a in node.target._schema.arguments]
    if [a.name for a in out._schema.arguments if not a.is_out] != names:
        return None
    return out


def _static_contiguous(value: Optional[torch.Tensor]) -> bool:
    return value is not None and all(type(s) is int for s in value.shape) and value.is_contiguous() \
        and not value.is_complex()


def _sole_reader(node: Node, reader: Node) -> bool:
    return list(node.users) == [reader]


def _empty(emit: Emitter, like: torch.Tensor) -> Node:
    return emit(aten.empty.memory_format, list(like.shape), dtype=like.dtype, device=like.device,
                pin_memory=False)


def cast_into(graph: Graph) -> int:
    """``_to_copy(f(x), dtype=D)`` -> ``f.out(x, out=empty(D))`` where ``f`` computes in a wider float dtype than
    D and only the cast reads it. Returns how many casts went."""
    removed = 0
    for cast in list(graph.nodes):
        if not is_call(cast, aten._to_copy.default) or len(cast.args) != 1 or set(cast.kwargs) != {"dtype"}:
            continue
        source = cast.args[0]
        if not isinstance(source, Node) or _out_variant(source) is None or not _sole_reader(source, cast):
            continue
        wide, narrow = tensor_val(source), tensor_val(cast)
        if wide is None or not _static_contiguous(narrow) or not is_compute_float(wide.dtype) \
                or not is_compute_float(narrow.dtype) or narrow.dtype.itemsize >= wide.dtype.itemsize \
                or wide.device != narrow.device or wide.shape != narrow.shape:
            continue
        emit = Emitter(graph, source)
        buffer = _empty(emit, narrow)
        written = emit(_out_variant(source), *source.args, **source.kwargs, out=buffer)
        cast.replace_all_uses_with(written)
        graph.erase_node(cast)
        graph.erase_node(source)
        removed += 1
    return removed


def cat_into(graph: Graph) -> int:
    """``cat(parts, dim)`` -> each part written into its slice of one buffer, where every part is an elementwise
    op or a view of a matrix product, of the buffer's dtype, that only the concatenation reads (see the module doc
    for which may write a strided slice). Returns how many concatenations went."""
    removed = 0
    for cat in list(graph.nodes):
        if not is_call(cat, aten.cat.default) or cat.kwargs or not cat.args:
            continue
        parts = _writable_parts(cat)
        if parts is None:
            continue
        whole = tensor_val(cat)
        dim = (cat.args[1] if len(cat.args) > 1 else 0) % whole.dim()
        order = {node: index for index, node in enumerate(graph.nodes)}
        first = min(parts, key=order.__getitem__)
        emit = Emitter(graph, first)
        buffer = _empty(emit, whole)
        sizes = [tensor_val(p).shape[dim] for p in parts]
        pieces = emit(aten.split_with_sizes.default, buffer, sizes, dim)
        slices = [emit(operator.getitem, pieces, index) for index in range(len(parts))]
        if not all(_fits(part, piece) for part, piece in zip(parts, slices)):
            emit.discard()
            continue
        for part, piece in zip(parts, slices):
            _write(graph, part, piece)
        cat.replace_all_uses_with(buffer)
        graph.erase_node(cat)
        for part in parts:
            source = _linear_under(part)
            graph.erase_node(part)
            if source is not None:
                graph.erase_node(source)
        removed += 1
    return removed


def _writable_parts(cat: Node) -> Optional[List[Node]]:
    """The parts of ``cat`` if each can write into its slice (not yet checked: a rounded op's slice layout)."""
    parts = cat.args[0]
    whole = tensor_val(cat)
    if not isinstance(parts, (list, tuple)) or len(parts) < 2 or not _static_contiguous(whole) \
            or len(set(parts)) != len(parts):
        return None
    if any(user.op == "output" for user in cat.users):
        return None  # an output stays the op it was: its memory is the caller's from here on
    for part in parts:
        if not isinstance(part, Node) or not _sole_reader(part, cat) \
                or (_out_variant(part) is None and _linear_under(part) is None):
            return None
        value = tensor_val(part)
        if value is None or value.dtype != whole.dtype or value.device != whole.device or value.dim() != whole.dim():
            return None
    return list(parts)


#: Matrix products whose out variant runs the very same kernel into a contiguous out of the result's shape.
_GEMMS = (aten.linear.default, aten.mm.default, aten.addmm.default)


def _linear_under(part: Node) -> Optional[Node]:
    """The matrix product (a linear layer, ``mm`` or ``addmm``) whose result ``part`` views, where only ``part``
    reads it."""
    if not is_call(part, aten.view.default) or not isinstance(part.args[0], Node):
        return None
    source = part.args[0]
    if not is_call(source, *_GEMMS) or not _sole_reader(source, part):
        return None
    if source.target is aten.linear.default:
        if source.kwargs or not all(isinstance(a, Node) or a is None for a in source.args):
            return None
        x = tensor_val(source.args[0])
        if x is None or not _static_contiguous(x) or x.dim() < 2:
            return None
    if not _static_contiguous(tensor_val(source)):
        return None
    return source


def _fits(part: Node, piece: Node) -> bool:
    """Whether ``part`` can write its values into ``piece`` (its slice of the buffer) as they are."""
    if _linear_under(part) is not None:
        return piece.meta["val"].is_contiguous()  # viewed as the GEMM's rows
    return part.target in EXACT or piece.meta["val"].is_contiguous()


def _write(graph: Graph, part: Node, piece: Node) -> None:
    """The call that writes the values of ``part`` into ``piece``, in place of ``part``."""
    emit = Emitter(graph, part)
    source = _linear_under(part)
    if source is None:
        emit(_out_variant(part), *part.args, **part.kwargs, out=piece)
        return
    result = tensor_val(source)
    if source.target is not aten.linear.default:
        out = emit(aten.view.default, piece, list(result.shape))
        emit(source.target.overloadpacket.out, *source.args, **source.kwargs, out=out)
        return
    # linear(x, w, b) on rows, as ATen runs a contiguous input of any rank: addmm(b, x as [M, K], w.t()) viewed
    # back. linear.out on 2-D rows runs that very addmm (mm without a bias) into the buffer's rows.
    x, weight = source.args[0], source.args[1]
    width = tensor_val(x).shape[-1]
    rows = tensor_val(x).numel() // width
    x_rows = emit(aten.view.default, x, [rows, width])
    out_rows = emit(aten.view.default, piece, [rows, result.shape[-1]])
    bias = source.args[2] if len(source.args) > 2 else None
    emit(aten.linear.out, x_rows, weight, bias, out=out_rows)
