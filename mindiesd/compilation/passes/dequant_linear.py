"""torchao's weight-only int8 and float8 linear layers replaced by ``mindiesd.dequant_linear``.

``Float8WeightOnlyConfig`` leaves ``mm(x, T(float32(t(q)) * t(scale)))`` (the cast to x's type T only for 16-bit
x) and ``Int8WeightOnlyConfig`` ``mm(x, T(t(q))) * scale`` (the scale cast to T first for 16-bit x); both then add
the bias, with views around. Eager's sequence writes one or two full-size copies of each weight per call; the
fused op dequantizes into a buffer it keeps and finishes the output in one pass, with the same roundings
(``mindiesd/ops/defs/dequant_linear.py``).

The nodes from the weight's cast to the layer's output are replaced (they must have no other reader); the weight,
its transpose and the scale are read where they are. Other storage dtypes (uint8 with a zero point, packed int4)
and a scale that is not one per output channel are left alone.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.fx import Node

from ...ops.defs.dequant_linear import STORAGE_DTYPES
from ..fx_utils import is_call, tensor_val
from .matcher import CAST_OPS, Match
from .base import FusionPass, Rule
from .int8_linear import QuantizedLayer, _cast_to, _operands, _rows_of, _transposed, _views, check_layer
from .patterns import VIEW_RESHAPES

aten = torch.ops.aten

__all__ = ["DequantLinearPass", "WeightOnlyLinear"]

class WeightOnlyLinear(QuantizedLayer):
    """A weight-only quantized linear layer, from its output up to x (see the module doc).

    Binds ``x``, ``rows`` (x as the GEMM reads it), ``w`` (the stored weight), ``ws`` (the scale as the op reads
    it), ``ws_view`` (as the graph applies it), ``scale_first``, ``bias`` (or None) and ``dequantized`` (the weight
    the GEMM reads)."""

    body_name = "a GEMM with a dequantized weight"

    def roots(self) -> frozenset:
        return frozenset({aten.add.Tensor, aten.mul.Tensor, aten.mm.default, *CAST_OPS, *VIEW_RESHAPES})

    def describe(self) -> str:
        return "mm(x, dequantize(t(w))) [* scale] [+ bias]"

    def body(self, value: Any, m: Match) -> bool:
        seen: List[Node] = []
        node = _views(value, seen)
        if is_call(node, aten.mul.Tensor) and not node.kwargs:  # the int8 form: the scale after the GEMM
            for gemm, scale in _operands(node):
                scale_views: List[Node] = []
                ws = _views(scale, scale_views)
                gemm_views = list(seen)
                gemm = _views(gemm, gemm_views)
                if isinstance(ws, Node) and self._gemm(gemm, m, scale_first=False):
                    m.interior.extend([*gemm_views, node])
                    m.shared.extend(scale_views)
                    m.bindings.update(ws=ws, ws_view=scale, scale_first=False)
                    return True
            return False
        if self._gemm(node, m, scale_first=True):
            m.interior.extend(seen)
            return True
        return False

    def _gemm(self, node: Any, m: Match, scale_first: bool) -> bool:
        """``mm(rows, dequantized)`` with the dequantized weight of the form."""
        if not is_call(node, aten.mm.default) or node.kwargs:
            return False
        rows, weight = node.args
        interior: List[Node] = [node]
        if scale_first:  # T(float32(t(q)) * t(scale))
            if _cast_to(weight) is not None and _cast_to(weight) != torch.float32:
                interior.append(weight)
                weight = weight.args[0]
            if not is_call(weight, aten.mul.Tensor) or weight.kwargs:
                return False
            interior.append(weight)
            for widened, scale in _operands(weight):
                if _cast_to(widened) != torch.float32:
                    continue
                q = _transposed(widened.args[0])
                scale_views: List[Node] = []
                scale_t = _views(scale, scale_views)
                ws = _transposed(scale_t)
                if q is None or ws is None:
                    continue
                m.interior.extend([*interior, widened])
                m.shared.extend([widened.args[0], scale_t, *scale_views])
                m.bindings.update(w=q, ws=ws, ws_view=scale, scale_first=True, dequantized=node.args[1])
                break
            else:
                return False
        else:  # T(t(q))
            if _cast_to(weight) is None:
                return False
            q = _transposed(weight.args[0])
            if q is None:
                return False
            m.interior.extend([*interior, weight])
            m.shared.append(weight.args[0])
            m.bindings.update(w=q, dequantized=weight)
        row_views: List[Node] = []
        stored = tensor_val(m["w"])
        x = _rows_of(rows, stored.shape[1], row_views) if stored is not None and stored.dim() == 2 else rows
        m.shared.extend(row_views)
        m.bindings.update(x=x, rows=rows)
        return True


def _check(m: Match, root: Node) -> Optional[str]:
    reason = check_layer(m, root, STORAGE_DTYPES, "int8 or float8")
    if reason is not None:
        return reason
    x, k = tensor_val(m["x"]), tensor_val(m["w"]).shape[1]
    rows, dequantized = tensor_val(m["rows"]), tensor_val(m["dequantized"])
    if rows is None or rows.dim() != 2 or rows.shape[-1] != k:
        return "x's rows are not the GEMM's rows"
    if dequantized is None or dequantized.dtype != x.dtype:
        return f"the dequantized weight is not of x's dtype {x.dtype}"
    return None


def _build(m: Match, root: Node, emit) -> Optional[Node]:
    out = tensor_val(root)
    fused = emit(torch.ops.mindiesd.dequant_linear.default, m["x"], m["w"], m["ws"], m["bias"], m["scale_first"],
                 out.dtype)
    if tuple(tensor_val(fused).shape) != tuple(out.shape):
        fused = emit(aten.view.default, fused, list(out.shape))
    return fused


class DequantLinearPass(FusionPass):
    family = "dequant_linear"
    reads_storage = True  # its op takes the stored int8 or float8 weight itself
    rules = (Rule("weight_only", WeightOnlyLinear(), _build, _check),)
