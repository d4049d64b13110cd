"""Tanh-approximated GELU replaced by ``mindiesd.fast_gelu``.

Two forms: ``aten.gelu(x, approximate="tanh")``, and the explicit formula
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x³)))`` (:class:`.patterns.ExplicitTanhGelu`). The fused op
computes that same function (it is not the sigmoid approximation ``x * sigmoid(1.702 x)``).
"""

from __future__ import annotations

import torch

from ..fx_utils import float_tensor
from .matcher import Var
from .base import FusionPass, Rule
from .patterns import ExplicitTanhGelu, aten_tanh_gelu


def _check(m, root):
    return None if float_tensor(m["x"]) is not None else "x is not a floating-point tensor"


def _build(m, root, emit):
    return emit(torch.ops.mindiesd.fast_gelu.default, m["x"])


class FastGeluPass(FusionPass):
    family = "fast_gelu"
    rules = (
        Rule("aten_gelu_tanh", aten_tanh_gelu(Var("x")), _build, _check),
        Rule("explicit_formula", ExplicitTanhGelu(), _build, _check),
    )
