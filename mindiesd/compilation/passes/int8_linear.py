"""torchao's int8 dynamic-quantization linear layer replaced by ``mindiesd.int8_linear``.

``Int8DynamicActivationInt8WeightConfig`` leaves about 25 aten ops per linear layer in the graph: the per-row
scale of x (``amin``, ``amax``, ``minimum``/``maximum`` with zeros, ``neg``, ``div`` by 127.5, ``clamp`` to eps and,
for 16-bit x, a cast to float32), its quantization (``reciprocal``, ``mul``, ``round``, ``add`` of the int8 zero
point, ``clamp`` to [-128, 127], cast to int8), ``_int_mm`` with the transposed int8 weight, and the rescale
(cast to float32, ``mul`` by the row scale, cast to x's type, ``mul`` by the weight scale, ``add`` of the bias and a
final cast), with views between them. The product takes one of two forms by CPU (torchao's
``_int_scaled_matmul_cpu``): int8 x int8 (with AMX tiles, or without VNNI), or, on CPUs with VNNI but no AMX, q
shifted to uint8 (``uint8(int32(q) + 128)``) times the weight less the compensation ``128 * sum(t(w), 0)``, which
the fused op takes (the two products are the same integers; the kernel picks its CPU's fastest). The fused op does
the same arithmetic with the same roundings (``mindiesd/ops/defs/int8_linear.py``), so its output is bit-exact with
the unfused graph's.

The match starts at the layer's output and walks up through the views: the nodes from the integer GEMM to the
output are replaced (they must have no other reader); the quantization of x is read, not claimed (a graph that
computes it once for several layers keeps it until its last reader is fused, and then drops it). The
arithmetic is checked literally: the zero point must be 0, the range [-128, 127], the divisor 127.5, the scale's
clamp a positive minimum; any other form (asymmetric, per-tensor, another range) is left alone.
"""

from __future__ import annotations

from typing import Any, Collection, List, Optional, Tuple

import torch
from torch.fx import Node

from ...ops.defs._quantized import X_DTYPES
from ..fx_utils import is_call, same_input, tensor_val, unfolded
from .matcher import CAST_OPS, Match, Pattern
from .base import FusionPass, Rule, last_dim_index
from .patterns import VIEW_RESHAPES

aten = torch.ops.aten

__all__ = ["Int8LinearPass", "DynamicInt8Linear", "QuantizedLayer", "check_layer"]



def _cast_to(node: Any) -> Optional[torch.dtype]:
    """The dtype a dtype-only cast converts to (None for anything else)."""
    if not is_call(node, *CAST_OPS):
        return None
    if node.target is aten._to_copy.default:
        if len(node.args) != 1 or not set(node.kwargs) <= {"dtype", "layout", "device"}:
            return None
        src, dst = tensor_val(node.args[0]), tensor_val(node)
        if src is None or dst is None or src.device != dst.device or src.layout != dst.layout:
            return None
        return dst.dtype
    value = tensor_val(node)
    return value.dtype if value is not None else None


def _views(value: Any, seen: List[Node]) -> Any:
    """``value`` under a chain of views, which are appended to ``seen``."""
    while is_call(value, *VIEW_RESHAPES):
        seen.append(value)
        value = value.args[0]
    return value


def _rows_of(value: Any, width: Any, seen: List[Node]) -> Any:
    """``value`` under the views that keep its last dimension ``width`` (appended to ``seen``): the tensor whose
    rows the layer reads. A view that regroups the last dimension (heads flattened into it) is where it stops."""
    while is_call(value, *VIEW_RESHAPES):
        inner = tensor_val(value.args[0])
        if inner is None or inner.dim() < 1 or inner.shape[-1] != width:
            break
        seen.append(value)
        value = value.args[0]
    return value


def _same_rows(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one value: the same node, or two views of one tensor to one shape."""
    if a is b:
        return True
    if not (is_call(a, *VIEW_RESHAPES) and is_call(b, *VIEW_RESHAPES)) or a.args[0] is not b.args[0]:
        return False
    va, vb = tensor_val(a), tensor_val(b)
    return va is not None and vb is not None and tuple(va.shape) == tuple(vb.shape)


def _transposed(node: Any) -> Optional[Node]:
    """The matrix under ``t(·)`` or a 2-D ``permute(·, [1, 0])``, or None."""
    if is_call(node, aten.t.default):
        return node.args[0]
    if is_call(node, aten.permute.default) and list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0]):
        return node.args[0]
    return None


def _integer_product(node: Any) -> Tuple[Optional[Node], Optional[Node]]:
    """(the ``_int_mm``, the compensation subtracted from it or None) of torchao's two CPU forms of the int32
    product: ``_int_mm(q, t(w))`` (int8 x int8), or ``_int_mm(q + 128 as uint8, t(w)) - compensation`` (uint8 x
    int8, on CPUs with VNNI but no AMX); (None, None) for anything else."""
    if is_call(node, aten._int_mm.default):
        return node, None
    if (is_call(node, aten.sub.Tensor) and len(node.args) == 2 and not node.kwargs
            and is_call(node.args[0], aten._int_mm.default) and isinstance(node.args[1], Node)):
        return node.args[0], node.args[1]
    return None, None


def _unsigned_shift(node: Any) -> Optional[List[Node]]:
    """The nodes of ``uint8(int32(q) + 128)`` from the outside in (the last one's argument is q), or None."""
    if _cast_to(node) != torch.uint8:
        return None
    shifted = node.args[0]
    if not (is_call(shifted, aten.add.Tensor) and len(shifted.args) == 2 and not shifted.kwargs
            and _literal(shifted.args[1], 128)):
        return None
    widened = shifted.args[0]
    if _cast_to(widened) != torch.int32:
        return None
    return [node, shifted, widened]


def _is_compensation(node: Any, w: Node, m: Match) -> bool:
    """Whether ``node`` is ``sum(t(w), 0, dtype=int32) * 128`` (under views), computed here or folded at freeze
    time: what the uint8 product of w over-counts per output column. Its nodes are read, not claimed."""
    seen: List[Node] = []
    node = _views(node, seen)
    if node.op == "placeholder":  # folded at freeze time: check what it was computed from
        seen.append(node)
        node = _views(unfolded(node), [])
    if not (is_call(node, aten.mul.Tensor) and len(node.args) == 2 and not node.kwargs):
        return False
    for summed, factor in _operands(node):
        if not _literal(factor, 128):
            continue
        summed_views: List[Node] = []
        summed = _views(summed, summed_views)
        if not (is_call(summed, aten.sum.dim_IntList) and summed.kwargs.get("dtype") == torch.int32
                and set(summed.kwargs) <= {"dtype"} and same_input(_transposed(summed.args[0]), w)):
            continue
        dims = list(summed.args[1]) if len(summed.args) > 1 and summed.args[1] is not None else None
        if dims not in ([0], [-2]):
            continue
        if seen and seen[-1].op == "placeholder":  # the fold graph's nodes are not this graph's
            m.shared.extend(seen)
        else:
            m.shared.extend([*seen, node, *summed_views, summed, summed.args[0]])
        return True
    return False


def _literal(value: Any, target: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == target


def _operands(node: Node) -> List[Tuple[Any, Any]]:
    """Both orders of a commutative binary call's operands."""
    a, b = node.args[0], node.args[1]
    return [(a, b), (b, a)]


class QuantizedLayer(Pattern):
    """A quantized linear layer from its output up: an optional final cast, views, then ``body + bias`` or the
    body alone (binds ``bias``, None without one). Subclasses match the body (:meth:`body`)."""

    #: What the body is, for the explain log.
    body_name = "the layer's product"

    def body(self, value: Any, m: Match) -> bool:
        raise NotImplementedError

    def match(self, value: Any, m: Match) -> bool:
        if not isinstance(value, Node):
            return m.fail("a node", value)
        node, head = value, []
        if _cast_to(node) is not None:
            head.append(node)
            node = node.args[0]
        node = _views(node, head)
        if is_call(node, aten.add.Tensor) and not node.kwargs:
            for top, bias in _operands(node):
                state = m.save()
                if isinstance(bias, Node) and self.body(top, m):
                    m.interior.extend([*head, node])
                    m.bindings["bias"] = bias
                    return True
                m.restore(state)
            return m.fail(f"the bias added to {self.body_name}", node)
        state = m.save()
        if self.body(node, m):
            m.interior.extend(head)
            m.bindings["bias"] = None
            return True
        m.restore(state)
        return m.fail(self.body_name, node)


class DynamicInt8Linear(QuantizedLayer):
    """A linear layer of torchao's int8 dynamic quantization, from its output up to x (see the module doc).

    Binds ``x``, ``w`` (int8 ``[N, K]``), ``ws`` (the weight scale), ``bias`` (or None), ``eps``, ``scale`` (the
    float32 row-scale node), ``product`` (the ``_int_mm``) and ``compensation`` (the uint8 form's, or None)."""

    body_name = "the rescaled integer product"

    def roots(self) -> frozenset:
        return frozenset({aten.add.Tensor, aten.mul.Tensor, *CAST_OPS, *VIEW_RESHAPES})

    def describe(self) -> str:
        return "rescale(_int_mm(quantize_rows(x), t(w))) [+ bias]"

    def body(self, value: Any, m: Match) -> bool:
        return self._rescale(value, m)

    def _rescale(self, value: Any, m: Match) -> bool:
        """``T(float32(_int_mm(q, t(w))) * scale) * ws`` (products in either order), views around it."""
        seen: List[Node] = []
        node = _views(value, seen)
        if not is_call(node, aten.mul.Tensor) or node.kwargs:
            return False
        for rows_scaled, ws in _operands(node):
            ws_views: List[Node] = []
            ws_base = _views(ws, ws_views)
            inner = rows_scaled
            casts = []
            if _cast_to(inner) is not None:
                casts.append(inner)
                inner = inner.args[0]
            if not is_call(inner, aten.mul.Tensor) or inner.kwargs:
                continue
            for acc, scale in _operands(inner):
                if _cast_to(acc) != torch.float32:
                    continue
                product, compensation = _integer_product(acc.args[0])
                if product is None:
                    continue
                state = m.save()
                scale_views: List[Node] = []
                scale_node = _views(scale, scale_views)
                if self._gemm(product, compensation, scale_node, m):
                    m.interior.extend([*seen, node, *casts, inner, acc, product])
                    if compensation is not None:
                        m.interior.append(acc.args[0])
                    m.shared.extend([*ws_views, *scale_views])
                    m.bindings.update(ws=ws_base, ws_view=ws, product=product, rows_scaled=inner,
                                      y1=casts[0] if casts else inner)
                    return True
                m.restore(state)
        return False

    def _gemm(self, product: Node, compensation: Optional[Node], scale: Any, m: Match) -> bool:
        """``_int_mm(view(q, [-1, K]), t(w))`` with q x quantized by ``scale``; with a ``compensation``, q is
        shifted to uint8 and the compensation is 128 times the column sums of the same ``t(w)``."""
        q, wt = product.args[0], product.args[1]
        w = _transposed(wt)
        if w is None:
            return False
        weight = tensor_val(w)
        if weight is None or weight.dim() != 2:
            return False
        width = weight.shape[1]
        q_views: List[Node] = []
        q = _views(q, q_views)
        if compensation is not None:
            shift = _unsigned_shift(q)
            if shift is None or not _is_compensation(compensation, w, m):
                return False
            q_views.extend(shift)
            q = _views(shift[-1].args[0], q_views)
        if _cast_to(q) != torch.int8:
            return False
        clamped = _views(q.args[0], q_views)
        if not (is_call(clamped, aten.clamp.default) and len(clamped.args) == 3 and not clamped.kwargs
                and _literal(clamped.args[1], -128) and _literal(clamped.args[2], 127)):
            return False
        rounded, zero = _views(clamped.args[0], q_views), []
        if is_call(rounded, aten.add.Tensor) and not rounded.kwargs:
            for r, zp in _operands(rounded):
                r = _views(r, zero)
                if is_call(r, aten.round.default) and self._zero_point(zp, zero):
                    zero.append(rounded)
                    rounded = r
                    break
            else:
                return False
        if not is_call(rounded, aten.round.default):
            return False
        scaled = _views(rounded.args[0], q_views)
        if not is_call(scaled, aten.mul.Tensor) or scaled.kwargs:
            return False
        for xv, inverse in _operands(scaled):
            seen: List[Node] = []
            inv = _views(inverse, seen)
            if is_call(inv, aten.mul.Tensor) and _literal(inv.args[1], 1.0) and not inv.kwargs:
                seen.append(inv)
                inv = _views(inv.args[0], seen)
            if not is_call(inv, aten.reciprocal.default) or _views(inv.args[0], seen) is not scale:
                continue
            x_views: List[Node] = []
            x = _rows_of(xv, width, x_views)
            if not self._row_scale(scale, x, width, m):
                continue
            m.shared.extend([*q_views, q, clamped, *zero, rounded, scaled, *seen, inv, *x_views, wt])
            m.bindings.update(x=x, x_view=xv, w=w, q=q_views[0] if q_views else q, compensation=compensation)
            return True
        return False

    @staticmethod
    def _zero_point(zp: Any, seen: List[Node]) -> bool:
        """An int8 zero point of 0: ``_to_copy(full_like(·, 0), int8)`` under views."""
        local: List[Node] = []
        zp = _views(zp, local)
        if _cast_to(zp) != torch.int8:
            return False
        full = _views(zp.args[0], local)
        if not (is_call(full, aten.full_like.default) and _literal(full.args[1], 0)):
            return False
        seen.extend([*local, zp, full])
        return True

    def _row_scale(self, scale: Any, x: Any, width: Any, m: Match) -> bool:
        """``scale`` = float32(clamp(max(-min(amin(x), 0), max(amax(x), 0)) / 127.5, eps)), x under views."""
        seen: List[Node] = []
        node = scale
        if _cast_to(node) == torch.float32:
            seen.append(node)
            node = node.args[0]
        node = _views(node, seen)
        if not is_call(node, aten.clamp.default):
            return False
        eps = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        if len(node.args) > 2 or set(node.kwargs) - {"min"} or not isinstance(eps, float) or not eps > 0:
            return False
        divided = node.args[0]
        if not (is_call(divided, aten.div.Tensor) and _literal(divided.args[1], 127.5) and not divided.kwargs):
            return False
        peak = divided.args[0]
        if not is_call(peak, aten.maximum.default):
            return False
        for negated, high in _operands(peak):
            if not (is_call(negated, aten.neg.default) and is_call(negated.args[0], aten.minimum.default)
                    and is_call(high, aten.maximum.default)):
                continue
            low = negated.args[0]
            lo, hi = self._bound(low, aten.amin.default, x, width), self._bound(high, aten.amax.default, x, width)
            if lo is None or hi is None:
                continue
            m.shared.extend([*seen, node, divided, peak, negated, low, high, *lo, *hi])
            m.bindings.update(eps=eps, scale=scale, reduced=lo[0])
            return True
        return False

    @staticmethod
    def _bound(node: Node, reduction: Any, x: Any, width: Any) -> Optional[List[Node]]:
        """The nodes of ``minimum(amin(x), zeros_like(·))`` (or maximum/amax), or None. The zeros may be made
        like any tensor of the reduction's shape (a graph that computes the reduction twice)."""
        for reduced, zeros in _operands(node):
            if not (is_call(reduced, reduction) and is_call(zeros, aten.zeros_like.default) and len(zeros.args) == 1
                    and set(zeros.kwargs) <= {"pin_memory", "dtype", "layout", "device"}):
                continue
            shape, zeros_shape = tensor_val(reduced), tensor_val(zeros)
            if shape is None or zeros_shape is None or tuple(shape.shape) != tuple(zeros_shape.shape) \
                    or shape.dtype != zeros_shape.dtype:
                continue
            if len(reduced.args) != 3 or reduced.args[2] is not True or reduced.kwargs:
                continue
            seen: List[Node] = [reduced, zeros]
            if not _same_rows(_rows_of(reduced.args[0], width, seen), x):
                continue
            return seen
        return None


def check_layer(m: Match, root: Node, storage: Collection[torch.dtype], storage_name: str) -> Optional[str]:
    """What the quantized linear layers' checks share (bindings ``x``, ``w``, ``ws``, ``ws_view``, ``bias``): None,
    or why the match is not one: x of a dtype the ops compute in, a 2-D weight of ``storage`` taking x's last
    dimension, one scale per output column, a bias of the output width, an output of the layer's rows."""
    x, w, ws, bias = (tensor_val(m[k]) for k in ("x", "w", "ws", "bias"))
    if x is None or w is None or ws is None:
        return "x, the weight or the weight scale is not a tensor"
    if x.dtype not in X_DTYPES:
        return f"x is {x.dtype}, not float32, bfloat16 or float16"
    if w.dtype not in storage or w.dim() != 2:
        return f"the weight is {w.dtype} of {w.dim()} dimensions, not a 2-D {storage_name} matrix"
    n, k = w.shape
    if x.dim() < 1 or x.shape[-1] != k:
        return "x's last dimension is not the weight's input width"
    if ws.dtype not in (x.dtype, torch.float32) or ws.numel() != n:
        return f"the weight scale is {ws.dtype} of {ws.numel()} values, not {n} of x's dtype or float32"
    ws_view = tensor_val(m["ws_view"])
    if ws_view is None or ws_view.shape[-1] != n or ws_view.numel() != n:
        return "the weight scale is not applied per output column"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.dtype not in (x.dtype, torch.float32)):
        return "the added tensor is not a bias of the output width in x's dtype or float32"
    out = tensor_val(root)
    if out is None or out.dtype not in X_DTYPES:
        return "the output is not float32, bfloat16 or float16"
    if out.shape[-1] != n or out.numel() != x.numel() // k * n:
        return "the output is not the layer's rows"
    return None


def _check(m: Match, root: Node) -> Optional[str]:
    reason = check_layer(m, root, (torch.int8,), "int8")
    if reason is not None:
        return reason
    x, k = tensor_val(m["x"]), tensor_val(m["w"]).shape[1]
    for name in ("x_view", "q"):
        viewed = tensor_val(m[name])
        if viewed is None or viewed.dim() < 1 or viewed.shape[-1] != k:
            return f"the quantized rows are regrouped ({name} does not end in the input width)"
    reduced = m["reduced"]
    rows_view = tensor_val(reduced.args[0])
    if rows_view is None or rows_view.shape[-1] != k or not last_dim_index(reduced.args[1], rows_view.dim()):
        return "the scale is not taken over the last dimension of x's rows"
    scale = tensor_val(m["scale"])
    if scale is None or scale.dtype != torch.float32 or scale.shape[-1] != 1:
        return "the row scale is not a float32 [..., 1] tensor"
    y1 = tensor_val(m["y1"])
    if y1 is None or y1.dtype != x.dtype or tensor_val(m["rows_scaled"]).dtype != torch.float32:
        return "the row rescale is not rounded to x's dtype"
    return None


def _build(m: Match, root: Node, emit) -> Optional[Node]:
    out = tensor_val(root)
    fused = emit(torch.ops.mindiesd.int8_linear.default, m["x"], m["w"], m["ws"], m["bias"], m["compensation"],
                 m["eps"], out.dtype)
    if tuple(tensor_val(fused).shape) != tuple(out.shape):
        fused = emit(aten.view.default, fused, list(out.shape))
    return fused


class Int8LinearPass(FusionPass):
    family = "int8_linear"
    rules = (Rule("dynamic_per_row", DynamicInt8Linear(), _build, _check),)
