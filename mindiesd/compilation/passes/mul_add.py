"""``x * y + z`` and ``z + x * y`` (the residual gate) replaced by ``mindiesd.mul_add``.

Fused only when eager's two roundings are the fused op's one: the product must already have the dtype of the
sum (z promotes nothing further), all three operands are tensors, and no one else uses the product.
Broadcasting is free: the result shape of ``x * y + z`` is the broadcast of the three, in any association.
"""

from __future__ import annotations

import torch

from ...ops.dtypes import is_compute_float
from ..fx_utils import tensor_val
from .matcher import Op, Var
from .base import FusionPass, Rule

aten = torch.ops.aten

_product = Op(aten.mul.Tensor, Var("x"), Var("y"), name="product")
_sum = Op(aten.add.Tensor, _product, Var("z"), commutative=True)


def _check(m, root):
    if any(tensor_val(m[name]) is None for name in ("x", "y", "z")):
        return "an operand is not a tensor"
    product, out = tensor_val(m["product"]), tensor_val(root)
    if not is_compute_float(out.dtype):
        return f"the sum is {out.dtype}, not a float the fused op computes in"
    if product.dtype != out.dtype:
        return f"the product is {product.dtype} and the sum {out.dtype}: eager rounds twice"
    return None


def _build(m, root, emit):
    addend_first = root.args[0] is not m["product"]  # z + x * y: eager's layout follows z first
    return emit(torch.ops.mindiesd.mul_add.default, m["x"], m["y"], m["z"], addend_first)


class MulAddPass(FusionPass):
    family = "mul_add"
    rules = (Rule("mul_add", _sum, _build, _check),)
