"""A group norm and the SiLU after it replaced by ``mindiesd.group_norm_silu``.

Two forms of the norm: ``aten.group_norm`` (what inference graphs hold, with any of its optional arguments), and
``native_group_norm(...)[0]`` (graphs traced with gradients on). The SiLU is ``aten.silu``. Any eps, any number of
groups, with or without the affine weight and bias; x is [N, C, *] (2-D to any rank: NCHW, NCDHW), contiguous or
channels-last (what the CPU's convolutions often return): the fused op's output has x's layout, as eager's has. A
site whose traced output has other strides than that is left unfused by the rewrite loop's layout check.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import float_tensor, tensor_val
from .matcher import Alt, Lit, Op, Var
from .base import FusionPass, Rule
from .patterns import item

aten = torch.ops.aten

_GROUPS = Lit("groups", check=lambda v: isinstance(v, int) and v > 0)
_GROUP_NORM = aten.group_norm.default
# group_norm(input, num_groups, weight=None, bias=None, eps=1e-05, cudnn_enabled=True): the trailing optional
# arguments may be left out, positionally.
_norm = Alt(
    Op(_GROUP_NORM, Var("x"), _GROUPS, Var("weight"), Var("bias"), Var("eps"), Var("cudnn_enabled")),
    Op(_GROUP_NORM, Var("x"), _GROUPS, Var("weight"), Var("bias"), Var("eps")),
    Op(_GROUP_NORM, Var("x"), _GROUPS, Var("weight"), Var("bias")),
    Op(_GROUP_NORM, Var("x"), _GROUPS, Var("weight")),
    Op(_GROUP_NORM, Var("x"), _GROUPS),
    # native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)
    item(Op(aten.native_group_norm.default, Var("x"), Var("weight"), Var("bias"), Var(), Var(), Var(), _GROUPS,
            Var("eps")), 0),
)


def _check(m, root):
    x = float_tensor(m["x"], min_rank=2)
    if x is None:
        return "x is not a floating-point tensor of rank >= 2"
    for name in ("weight", "bias"):
        value = m.bindings.get(name)
        if value is not None and tensor_val(value) is None:
            return f"{name} is neither a tensor nor None"
    eps = m.bindings.get("eps", 1e-5)
    if isinstance(eps, (Node, bool)) or not isinstance(eps, (int, float)):
        return "eps is not a Python number"
    return None


def _build(m, root, emit):
    return emit(torch.ops.mindiesd.group_norm_silu.default, m["x"], m["groups"], m.bindings.get("weight"),
                m.bindings.get("bias"), float(m.bindings.get("eps", 1e-5)))


class GroupNormSiluPass(FusionPass):
    family = "group_norm_silu"
    rules = (Rule("group_norm_silu", Op(aten.silu.default, _norm), _build, _check),)
