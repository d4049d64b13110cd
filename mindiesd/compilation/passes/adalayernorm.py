"""adaLN modulation: ``layer_norm(x) * (1 + scale) + shift`` replaced by ``mindiesd.adalayernorm``.

Covered: AdaLayerNormZero (``scale[:, None]`` added to 1 after the unsqueeze), AdaLayerNormContinuous /
``norm_out`` (added to 1 before the unsqueeze or view), Wan (the norm computed in fp32 on an upcast input,
``[B, 1, D]`` modulation, a cast back), and ``addcmul(shift, norm, 1 + scale)``. The norm must be a
``native_layer_norm`` over the last dimension without affine parameters; any eps.
"""

from __future__ import annotations

import torch

from ..fx_utils import float_tensor, tensor_val
from .matcher import Alt, Cast, Lit, Op, OutCast, Var, exactly
from .base import FusionPass, Rule
from .patterns import item

aten = torch.ops.aten

_norm = item(Op(aten.native_layer_norm.default, Cast(Var("x")), Var("normalized_shape"), None, None, Lit("eps")), 0)
_one_plus_scale = Op((aten.add.Tensor, aten.add.Scalar), Var("scale"), Lit(check=exactly(1)), commutative=True)
# (1 + scale) may be reshaped after the addition; the reshape is then re-applied to scale itself.
_factor = Alt(
    _one_plus_scale,
    Op((aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default), _one_plus_scale,
       Var("reshape_arg"), name="reshape"),
)
_modulated = Op(aten.mul.Tensor, Cast(_norm, lossy=True, shared=False), _factor, commutative=True)
_shifted = Alt(
    Op(aten.add.Tensor, _modulated, Var("shift"), commutative=True),
    Op(aten.addcmul.default, Var("shift"), Cast(_norm, lossy=True, shared=False), _factor),
    Op(aten.addcmul.default, Var("shift"), _factor, Cast(_norm, lossy=True, shared=False)),
)


def _check(m, root):
    x = float_tensor(m["x"], min_rank=1)
    if x is None:
        return "x is not a floating-point tensor of rank >= 1"
    shape = m["normalized_shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or shape[0] != x.shape[-1]:
        return f"the layer norm runs over {shape}, not the last dimension alone"
    if tensor_val(m["scale"]) is None or tensor_val(m["shift"]) is None:
        return "scale or shift is not a tensor"
    return None


def _build(m, root, emit):
    scale, shift = m["scale"], m["shift"]
    if "reshape" in m.bindings:
        scale = emit(m["reshape"].target, scale, m["reshape_arg"])
    out_dtype = tensor_val(root).dtype
    return emit(torch.ops.mindiesd.adalayernorm.default, m["x"], scale, shift, float(m["eps"]), out_dtype=out_dtype)


class AdaLayerNormPass(FusionPass):
    family = "adalayernorm"
    rules = (Rule("modulate", OutCast(_shifted), _build, _check),)
