"""Sub-patterns that several passes match: a linear layer as aot writes it, and tanh-GELU in both its forms.

Each binds fixed names (listed in its doc) that the rules built on it read.
"""

from __future__ import annotations

import math
import operator
from typing import Any, List, Optional, Tuple

import torch
from torch.fx import Node

from ..fx_utils import is_call
from .matcher import Alt, Lit, Match, Op, Pattern, PatternLike, Var, exactly, near

aten = torch.ops.aten

#: The calls that give a tensor another shape over the same elements, as a projection's input and output are
#: flattened and restored.
VIEW_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)

__all__ = ["item", "WEIGHT_T", "GEMM", "LINEAR", "is_transpose", "aten_tanh_gelu", "ExplicitTanhGelu"]


def item(source: Pattern, index: PatternLike) -> Op:
    """``source[index]``: one output of a multi-output op (``unbind``, ``split``, ``native_layer_norm``)."""
    return Op(operator.getitem, source, index)


_UNIT = Lit(check=exactly(1))

#: ``w.T`` (binds ``w``, and ``perm`` for a permute: see :func:`is_transpose`); shared, as it may feed other nodes.
WEIGHT_T = Alt(
    Op(aten.t.default, Var("w"), shared=True),
    Op(aten.permute.default, Var("w"), Var("perm"), shared=True),
)
#: ``addmm(b, x, w.T)`` or ``mm(x, w.T)``: a linear layer on a 2-D input (binds ``x``, ``w``, ``b`` with a bias).
GEMM = Alt(
    Op(aten.addmm.default, Var("b"), Var("x"), WEIGHT_T, kwargs={"beta": _UNIT, "alpha": _UNIT}),
    Op(aten.mm.default, Var("x"), WEIGHT_T),
)
#: The linear layer's output: the GEMM, or its view back to the input's leading dimensions (binds ``shape``).
LINEAR = Alt(Op((aten.view.default, aten._unsafe_view.default), GEMM, Var("shape")), GEMM)


def is_transpose(perm: Any) -> bool:
    """True when ``perm`` permutes the two dimensions of a 2-D tensor."""
    return isinstance(perm, (list, tuple)) and list(perm) in ([1, 0], [-1, -2], [1, -2], [-1, 0])


def aten_tanh_gelu(x: Pattern) -> Op:
    """``aten.gelu(x, approximate="tanh")``."""
    return Op(aten.gelu.default, x, kwargs={"approximate": "tanh"})


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_MUL = (aten.mul.Tensor, aten.mul.Scalar)
_ADD = (aten.add.Tensor, aten.add.Scalar)


def _factors(value: Any, m: Match, top: bool) -> Tuple[float, List[Any]]:
    """Split a product tree into (literal coefficient, non-literal factors), recording the interior muls."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), []
    if is_call(value, *_MUL) and not value.kwargs and (top or len(value.users) == 1):
        m.interior.append(value)
        c0, f0 = _factors(value.args[0], m, False)
        c1, f1 = _factors(value.args[1], m, False)
        return c0 * c1, f0 + f1
    return 1.0, [value]


def _is_cube_of(factors: List[Any], x: Node, m: Match) -> bool:
    """factors multiply to x³."""
    if len(factors) == 3 and all(f is x for f in factors):
        return True
    powers = []
    for f in factors:
        if f is x:
            powers.append(1)
        elif is_call(f, aten.pow.Tensor_Scalar) and f.args[0] is x and f.args[1] in (2, 3) and len(f.users) == 1:
            powers.append(int(f.args[1]))
            m.interior.append(f)
        else:
            return False
    return sum(powers) == 3


def _plus(node: Any, m: Match) -> Optional[Tuple[Any, Any]]:
    if is_call(node, *_ADD) and not node.kwargs and len(node.users) == 1:
        m.interior.append(node)
        return node.args[0], node.args[1]
    return None


class ExplicitTanhGelu(Pattern):
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x³)))`` in any association and order of its products,
    ``x³`` as ``pow(x, 3)``, ``x * x * x`` or ``pow(x, 2) * x``; binds ``x``."""

    def roots(self) -> frozenset:
        return frozenset(_MUL)

    def describe(self) -> str:
        return "0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))"

    def match(self, value: Any, m: Match) -> bool:
        if not is_call(value, *_MUL):
            return m.fail("a multiplication", value)
        coeff, factors = _factors(value, m, True)
        if len(factors) != 2 or not near(0.5, 1e-6)(coeff):
            return m.fail("a product of 0.5 and two factors", value)
        for x, one_plus_tanh in (factors, factors[::-1]):
            state = m.save()
            if isinstance(x, Node) and self._is_one_plus_tanh_of(one_plus_tanh, x, m):
                m.bindings["x"] = x
                return True
            m.restore(state)
        return m.fail("x * (1 + tanh(...)) of one x", value)

    @staticmethod
    def _is_one_plus_tanh_of(node: Any, x: Node, m: Match) -> bool:
        terms = _plus(node, m)
        if terms is None:
            return False
        one, tanh = terms if not isinstance(terms[0], Node) else terms[::-1]
        if one != 1 or not is_call(tanh, aten.tanh.default) or len(tanh.users) != 1:
            return False
        m.interior.append(tanh)
        coeff, factors = _factors(tanh.args[0], m, False)
        if len(factors) != 1 or not near(_SQRT_2_OVER_PI, 1e-6)(coeff):
            return False
        terms = _plus(factors[0], m)
        if terms is None:
            return False
        for lone, cubic in (terms, terms[::-1]):
            if lone is not x:
                continue
            state = m.save()
            c, cube = _factors(cubic, m, False)
            if near(0.044715, 1e-5)(c) and _is_cube_of(cube, x, m):
                return True
            m.restore(state)
        return False
