"""A linear layer followed by tanh-GELU replaced by ``mindiesd.linear_gelu`` (one matmul with a GELU epilogue).

The aten graph of ``F.gelu(F.linear(x, w, b), approximate="tanh")`` is ``gelu(view(addmm(b, x2d, t(w))))``
(``mm`` without a bias, no ``view`` for 2-D inputs); the GELU is either ``aten.gelu(approximate="tanh")`` or
the explicit formula (:mod:`.patterns`). The fused op takes the untransposed weight and the 2-D input, and
the ``view`` back to the layer's shape is kept after it. This pass runs before fast_gelu, which would
otherwise take the GELU away from its matmul; where the device has no fast epilogue (its family declaration
says so) it is skipped and fast_gelu fuses the GELU alone.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...ops.dtypes import is_compute_float
from ..fx_utils import tensor_val
from .matcher import Match, Pattern
from .base import FusionPass, Rule
from .patterns import LINEAR, ExplicitTanhGelu, aten_tanh_gelu, is_transpose


class _LinearUnder(Pattern):
    """``inner`` (which binds ``x`` to the GELU's input), where that input is a linear layer."""

    def __init__(self, inner: Pattern):
        self.inner = inner

    def roots(self):
        return self.inner.roots()

    def describe(self) -> str:
        return f"{self.inner.describe()} of a linear layer"

    def match(self, value: Any, m: Match) -> bool:
        if not self.inner.match(value, m):
            return False
        return LINEAR.match(m.bindings.pop("x"), m)


def _check(m: Match, root) -> Optional[str]:
    x, w, b = tensor_val(m["x"]), tensor_val(m["w"]), tensor_val(m.get("b"))
    if x is None or w is None or x.dim() != 2 or w.dim() != 2:
        return "the matmul's operands are not 2-D tensors"
    if "perm" in m.bindings and not is_transpose(m["perm"]):
        return "the weight's permutation is not a transpose"
    if not is_compute_float(x.dtype) or w.dtype != x.dtype or (b is not None and (b.dtype != x.dtype or b.dim() != 1)):
        return "the operands are not floating-point tensors of one dtype (a 1-D bias)"
    return None


def _build(m: Match, root, emit):
    fused = emit(torch.ops.mindiesd.linear_gelu.default, m["x"], m["w"], m.get("b"))
    shape = m.get("shape")
    return emit(torch.ops.aten.view.default, fused, shape) if shape is not None else fused


class LinearGeluPass(FusionPass):
    family = "linear_gelu"
    rules = (
        Rule("aten_gelu_tanh", aten_tanh_gelu(LINEAR), _build, _check),
        Rule("explicit_formula", _LinearUnder(ExplicitTanhGelu()), _build, _check),
    )
