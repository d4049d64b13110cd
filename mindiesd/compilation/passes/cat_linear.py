"""A linear layer over a concatenation along the last dimension replaced by ``mindiesd.cat_linear``, which
multiplies each input by its block of weight columns and never writes the concatenation.

Flux's and Chroma's single blocks (and HunyuanVideo's single-token blocks) concatenate the attention output and
the MLP branch before ``proj_out``: ``proj_out(cat([attn, mlp], -1))``. In the aten graph that is
``addmm(b, view(cat([attn, mlp], -1), [rows, K]), t(w))`` (``mm`` without a bias, no ``view`` for 2-D inputs).
The fused op takes the concatenation's inputs, the untransposed weight and the bias; a ``view`` to the GEMM's
2-D shape follows it where the inputs have more dimensions. The weight is not split in the graph: the kernels
read its column blocks as views, so a weight replaced in place or hot-swapped is read as it is.

Fused only when the concatenation and its view are read by the linear layer alone, the inputs, weight and bias
share one dtype, float32 or float64, the inputs' widths are static, and the rows are not known to be fewer than
:data:`MIN_ROWS` (a timestep embedding's ``linear_1(cat([sin, cos]))`` has one row per sample: its GEMM is a
matrix-vector product that reads the whole weight either way, and the split only adds a call). In bfloat16 and
float16 the output would hold the partial sum between the GEMMs, one more rounding than eager's single GEMM, so
those are left alone.
"""

from __future__ import annotations

import torch

from ..fx_utils import tensor_val
from .matcher import Alt, Lit, Op, Var, exactly
from .base import FusionPass, Rule, last_dim_index
from .patterns import WEIGHT_T, is_transpose

aten = torch.ops.aten

#: Fewer rows than this (when known) are left alone: the concatenation is smaller than the GEMM call it saves.
MIN_ROWS = 16

_CAT = Op(aten.cat.default, Var("xs"), Var("dim"))
_ROWS = Alt(Op((aten.view.default, aten._unsafe_view.default), _CAT, Var("rows")), _CAT)
_UNIT = Lit(check=exactly(1))
_GEMM_OF_CAT = Alt(
    Op(aten.addmm.default, Var("b"), _ROWS, WEIGHT_T, kwargs={"beta": _UNIT, "alpha": _UNIT}),
    Op(aten.mm.default, _ROWS, WEIGHT_T),
)


def _check(m, root):
    xs = m["xs"]
    if not isinstance(xs, (list, tuple)) or len(xs) < 2:
        return "the concatenation has fewer than two inputs"
    values = [tensor_val(x) for x in xs]
    if any(v is None for v in values):
        return "an input of the concatenation is not a tensor"
    rank = values[0].dim()
    if not last_dim_index(m["dim"], rank):
        return "the concatenation is not along the last dimension"
    w, b = tensor_val(m["w"]), tensor_val(m.get("b"))
    if w is None or w.dim() != 2 or ("perm" in m.bindings and not is_transpose(m["perm"])):
        return "the weight is not a transposed 2-D tensor"
    dtype = values[0].dtype
    if dtype not in (torch.float32, torch.float64):
        return f"{dtype}: the partial sum would round once more than eager's single GEMM"
    if any(v.dtype != dtype or v.dim() != rank for v in values) or w.dtype != dtype:
        return "the inputs and the weight are not tensors of one dtype and rank"
    if b is not None and (b.dtype != dtype or b.dim() != 1):
        return "the bias is not a 1-D tensor of the inputs' dtype"
    if not all(isinstance(v.shape[-1], int) for v in values):
        return "an input's width is symbolic"
    if w.shape[1] != sum(v.shape[-1] for v in values):
        return "the GEMM's inner dimension is not the concatenation's width (the view regroups it)"
    out = tensor_val(root)
    if out is None or out.dim() != 2 or not isinstance(out.shape[1], int):
        return "the linear layer's output is not 2-D with a static width"
    if isinstance(out.shape[0], int) and out.shape[0] < MIN_ROWS:
        rows = "1 row" if out.shape[0] == 1 else f"{out.shape[0]} rows"
        return f"{rows} (fewer than {MIN_ROWS}): the concatenation costs less than a second GEMM call"
    return None


def _build(m, root, emit):
    fused = emit(torch.ops.mindiesd.cat_linear.default, list(m["xs"]), m["w"], m.get("b"))
    if "rows" in m.bindings:
        return emit(aten.view.default, fused, [-1, tensor_val(root).shape[1]])
    return fused


class CatLinearPass(FusionPass):
    family = "cat_linear"
    rules = (Rule("cat_last_dim", _GEMM_OF_CAT, _build, _check),)
