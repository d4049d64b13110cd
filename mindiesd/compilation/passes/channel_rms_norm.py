"""The channel-wise RMS norm of Wan's and Qwen-Image's VAEs replaced by ``mindiesd.channel_rms_norm``.

The form: ``F.normalize(x, dim=1, eps) * scale * gamma + bias``, then optionally ``silu``, which aot writes as
``linalg_vector_norm(x, 2, [1], True)`` → ``clamp_min(eps)`` → ``expand`` → ``div(x, ·)`` (in float32 on an
upcast x, cast back, for 16-bit x) → ``mul`` by the
scale (a number) → ``mul`` by gamma → ``add`` of the bias (a tensor, or the number 0 of a module without one). The
scale, gamma and bias may each be absent, the two products in either order; gamma and bias hold one value per
channel ([C, 1, ..., 1], as they broadcast against x). x has a batch, channel and at least one spatial dim,
contiguous or channels-last (the output keeps x's layout, as eager's). Rooted at the SiLU when there is one, else
at the last op of the norm.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import float_tensor, tensor_val
from .matcher import Alt, Cast, Lit, Op, Var, exactly
from .base import FusionPass, Rule

aten = torch.ops.aten

# a 16-bit x is upcast for the norm and the division, and the quotient cast back (aot's form in bf16): the op
# computes in float32 throughout and rounds once
_x = Cast(Var("x"))
_vector_norm = Op(aten.linalg_vector_norm.default, _x, Lit(check=exactly(2)), Var("dims"),
                  Var(check=lambda v: v is True))
_denominator = Op(aten.clamp_min.default, _vector_norm, Lit("eps"))
_normalized = Cast(Op(aten.div.Tensor, _x, Alt(Op(aten.expand.default, _denominator, Var()), _denominator)),
                   lossy=True, shared=False)
_scale = Lit("scale")
_weighted = Alt(
    Op(aten.mul.Tensor, Op(aten.mul.Tensor, _normalized, _scale, commutative=True), Var("weight"), commutative=True),
    Op(aten.mul.Tensor, Op(aten.mul.Tensor, _normalized, Var("weight"), commutative=True), _scale, commutative=True),
    Op(aten.mul.Tensor, _normalized, _scale, commutative=True),
    Op(aten.mul.Tensor, _normalized, Var("weight"), commutative=True),
    _normalized,
)
_norm = Alt(
    Op(aten.add.Tensor, _weighted, Lit(check=exactly(0)), commutative=True),
    Op(aten.add.Tensor, _weighted, Var("bias"), commutative=True),
    _weighted,
)


def _per_channel(value, x) -> bool:
    t = tensor_val(value)
    return (t is not None and isinstance(value, Node) and t.dim() == x.dim() - 1 and t.shape[0] == x.shape[1]
            and all(s == 1 for s in t.shape[1:]))


def _check(m, root):
    x = float_tensor(m["x"], min_rank=3)
    if x is None:
        return "x is not a floating-point tensor with a batch, a channel and a spatial dim"
    if list(m["dims"]) not in ([1], [1 - x.dim()]):
        return f"the norm runs over dims {m['dims']}, not the channels (dim 1)"
    for name in ("weight", "bias"):
        if name in m.bindings and not _per_channel(m[name], x):
            return f"{name} is not one value per channel ([C, 1, ...] broadcast against x)"
    return None


def _arguments(m):
    return (m["x"], m.bindings.get("weight"), m.bindings.get("bias"), float(m.bindings.get("scale", 1.0)),
            float(m["eps"]))


def _build_silu(m, root, emit):
    return emit(torch.ops.mindiesd.channel_rms_norm.default, *_arguments(m), True)


def _build(m, root, emit):
    return emit(torch.ops.mindiesd.channel_rms_norm.default, *_arguments(m), False)


class ChannelRmsNormPass(FusionPass):
    family = "channel_rms_norm"
    rules = (
        Rule("norm_silu", Op(aten.silu.default, _norm), _build_silu, _check),
        Rule("norm", _norm, _build, _check),
    )
