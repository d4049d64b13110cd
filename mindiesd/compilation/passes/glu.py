"""Gated activations ``act(gate) * value`` replaced by ``mindiesd.glu``.

``act`` is ``aten.silu``, ``aten.gelu`` (exact) or ``aten.gelu(approximate="tanh")``, optionally run on an fp32
upcast of the gate and cast back (Lumina2's ``FP32SiLU``); the product's operands may come in either order.
Three forms, tried in this order:

- ``split_halves``: the two outputs of ``split(x, D/2, -1)`` or ``split_with_sizes(x, [D/2, D/2], -1)``, as aot
  writes ``chunk(2, dim=-1)`` (diffusers' ``SwiGLU`` and ``GEGLU``, OmniGen: the second half gated; the first
  half gated works alike);
- ``slice_halves``: ``x[..., :D/2]`` and ``x[..., D/2:]`` (Flux2's ``Flux2SwiGLU``, the first half gated);
- ``two_tensors``: any two tensors of one shape, as in ``silu(w1(x)) * w3(x)`` (HiDream, Lumina2, AuraFlow) or
  ``gelu_tanh(gate_proj(x)) * up_proj(x)`` (PRX).

Fused only when no value of the sequence is used elsewhere, and the gate, the value and the product have one
dtype (so eager's product rounds as the fused op does once; an fp32 activation cast back to the gate's dtype is
computed without that intermediate rounding). Halves split along another dimension are fused as two tensors (they
are strided views of one tensor, read in place).
"""

from __future__ import annotations

import torch

from ...ops.dtypes import is_compute_float
from ..fx_utils import known_eq, same_shape, tensor_val, val
from .matcher import Alt, Cast, Lit, Op, OutCast, Var, exactly
from .base import FusionPass, Rule
from .patterns import item

aten = torch.ops.aten

_HALVES = (0, 1)


def _activation(gate):
    """``act(gate)``, with exact casts of the gate before it and any casts of the result after it (binds ``act``,
    and ``approximate`` for a GELU that names its approximation)."""
    inner = Cast(gate)
    return OutCast(Alt(
        Op(aten.silu.default, inner, name="act"),
        Op(aten.gelu.default, inner, kwargs={"approximate": Var("approximate")}, name="act"),
        Op(aten.gelu.default, inner, Var("approximate"), name="act"),
    ))


def _product(gate, value):
    return Op(aten.mul.Tensor, _activation(gate), value, commutative=True)


_SPLIT = Alt(
    Op(aten.split.Tensor, Var("x"), Lit("split_size"), Lit("split_dim"), name="split"),
    Op(aten.split_with_sizes.default, Var("x"), Var("split_sizes"), Lit("split_dim"), name="split"),
)


def _slice(part):
    """``x[..., start:end]`` along one dim, bound as ``<part>_dim``, ``<part>_start``, ``<part>_end``."""
    args = (Var("x"), Lit(f"{part}_dim"), Lit(f"{part}_start"), Lit(f"{part}_end"))
    return Alt(Op(aten.slice.Tensor, *args), Op(aten.slice.Tensor, *args, Lit(check=exactly(1))))


def _last_dim(dim, rank):
    return isinstance(dim, int) and dim in (-1, rank - 1)


def _dtypes_agree(m, root, *operands):
    """None when the operands and the product share one floating dtype, else why not."""
    out = tensor_val(root)
    if out is None or not is_compute_float(out.dtype):
        return "the product is not a floating-point tensor"
    for operand in operands:
        value = tensor_val(operand)
        if value is None:
            return "an operand is not a tensor"
        if value.dtype != out.dtype:
            return f"an operand is {value.dtype} and the product {out.dtype}: eager rounds in between"
    return None


def _halved(m, root):
    """(x, None) when the one tensor whose halves are gate and value has the product's dtype, else (None, why)."""
    reason = _dtypes_agree(m, root, m["x"])
    return (None, reason) if reason is not None else (tensor_val(m["x"]), None)


def _check_split(m, root):
    x, reason = _halved(m, root)
    if reason is not None:
        return reason
    if x.dim() < 1 or not _last_dim(m["split_dim"], x.dim()):
        return "x is not split along its last dimension"
    pieces = val(m["split"])
    if not isinstance(pieces, (list, tuple)) or len(pieces) != 2:
        return "x is not split in two"
    if "split_sizes" in m.bindings:
        sizes = m["split_sizes"]
        if not isinstance(sizes, (list, tuple)) or len(sizes) != 2 or not known_eq(sizes[0], sizes[1]):
            return "the two pieces differ in size"
    elif not known_eq(2 * m["split_size"], x.shape[-1]):
        return "the pieces are not halves"
    if {m["gate_index"], m["value_index"]} != set(_HALVES):
        return "the gate and the value are not the two halves"
    return None


def _check_slices(m, root):
    x, reason = _halved(m, root)
    if reason is not None:
        return reason
    rank = x.dim()
    if rank < 1 or not (_last_dim(m["gate_dim"], rank) and _last_dim(m["value_dim"], rank)):
        return "x is not sliced along its last dimension"
    width = x.shape[-1]
    if not isinstance(width, int) or width % 2:
        return "x's last dimension is not of a known even size"
    half = width // 2
    ranges = {part: (m[f"{part}_start"], min(m[f"{part}_end"], width)) for part in ("gate", "value")}
    if sorted(ranges.values()) != [(0, half), (half, width)]:
        return "the slices are not the two halves of x"
    return None


def _check_two(m, root):
    reason = _dtypes_agree(m, root, m["gate"], m["value"])
    if reason is not None:
        return reason
    gate, value = tensor_val(m["gate"]), tensor_val(m["value"])
    if gate.dim() < 1 or not same_shape(gate.shape, value.shape):
        return "the gate and the value differ in shape (a broadcast is not fused)"
    return None


def _activation_name(m):
    if m["act"].target is aten.silu.default:
        return "silu"
    return "gelu_tanh" if m.get("approximate", "none") == "tanh" else "gelu"


def _emit(emit, x, y, m, gate_first):
    return emit(torch.ops.mindiesd.glu.default, x, y, _activation_name(m), gate_first)


def _build_split(m, root, emit):
    return _emit(emit, m["x"], None, m, m["gate_index"] == 0)


def _build_slices(m, root, emit):
    return _emit(emit, m["x"], None, m, m["gate_start"] == 0)


def _build_two(m, root, emit):
    # eager's layout follows the product's first operand: it becomes the op's x
    value_second = root.args[1] is m["value"]
    if value_second:
        return _emit(emit, m["gate"], m["value"], m, True)
    return _emit(emit, m["value"], m["gate"], m, False)


class GluPass(FusionPass):
    family = "glu"
    rules = (
        Rule("split_halves", _product(item(_SPLIT, Lit("gate_index")), item(_SPLIT, Lit("value_index"))),
             _build_split, _check_split),
        Rule("slice_halves", _product(_slice("gate"), _slice("value")), _build_slices, _check_slices),
        Rule("two_tensors", _product(Var("gate"), Var("value")), _build_two, _check_two),
    )
