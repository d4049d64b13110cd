"""RMSNorm: ``x * rsqrt(mean(x², -1) + eps) [* weight]`` in every form aot produces.

Covered: ``torch.nn.RMSNorm`` / ``F.rms_norm`` / ``torch.rms_norm`` (square by ``pow``, the upcast input in the
final multiply, eps as ``add.Scalar``) and diffusers' ``RMSNorm`` class (the original input in the multiply, a
downcast before the weight, eps as ``add.Tensor``); also ``x * x`` for the square and ``x / sqrt(·)``. Any eps
(read from the graph), any rank, fp32/bf16/fp16, with and without weight. The mean must run over the last
dimension alone; the fused op normalises in fp32 and rounds once to the dtype of the replaced node.
"""

from __future__ import annotations

import torch

from ...ops.dtypes import is_compute_float
from ..fx_utils import float_tensor, tensor_val
from .matcher import Alt, Cast, Lit, Op, OutCast, Var, exactly
from .base import FusionPass, Rule, last_dim_index

aten = torch.ops.aten

_x = Cast(Var("x"))
_square = Alt(
    Op(aten.pow.Tensor_Scalar, _x, Lit(check=exactly(2))),
    Op(aten.mul.Tensor, _x, _x),
)
_mean_square = Op(aten.mean.dim, _square, Var("dims"), True)
# eps is a literal, or (dynamic=True makes a module's float attribute a graph input) a 0-dim tensor input.
_eps = Alt(Lit("eps", check=lambda v: v >= 0), Cast(Var("eps_tensor"), lossy=True))
_variance = Op((aten.add.Scalar, aten.add.Tensor), _mean_square, _eps, commutative=True)
_normalized = Alt(
    Op(aten.mul.Tensor, Op(aten.rsqrt.default, _variance), _x, commutative=True),
    Op(aten.div.Tensor, _x, Op(aten.sqrt.default, _variance)),
)
_weighted = Op(aten.mul.Tensor, Cast(_normalized, lossy=True, shared=False), Cast(Var("weight")), commutative=True)


def _check(m, root):
    x = float_tensor(m["x"], min_rank=1)
    if x is None:
        return "x is not a floating-point tensor of rank >= 1"
    if not last_dim_index(m["dims"], x.dim()):
        return f"the mean runs over dims {m['dims']}, not the last dimension alone"
    weight = m.get("weight")
    if weight is not None and tensor_val(weight) is None:
        return "the weight is not a tensor"
    if "eps_tensor" in m.bindings:
        eps = tensor_val(m["eps_tensor"])
        if eps is None or eps.dim() != 0 or not is_compute_float(eps.dtype) or eps.device.type != "cpu":
            return "eps is neither a literal nor a 0-dim floating-point CPU tensor (a float Dynamo made an input)"
    return None


def _build(m, root, emit):
    out_dtype = tensor_val(root).dtype
    if "eps_tensor" in m.bindings:  # read on the host at each call, as eager's add reads it
        eps = emit.host_scalar(m["eps_tensor"])
    else:
        eps = float(m["eps"])
    return emit(torch.ops.mindiesd.rms_norm.default, m["x"], m.get("weight"), eps, out_dtype=out_dtype)


class RMSNormPass(FusionPass):
    family = "rms_norm"
    rules = (
        Rule("weighted", OutCast(_weighted), _build, _check),
        Rule("unweighted", OutCast(_normalized), _build, _check),
    )
