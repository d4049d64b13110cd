"""Tanh-approximated GELU replaced by ``mindiesd.fast_gelu``.

Two forms: ``aten.gelu(x, approximate="tanh")``, and the explicit formula
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x³)))`` in any association and order of its products, with
``x³`` as ``pow(x, 3)``, ``x * x * x`` or ``pow(x, 2) * x``. The fused op computes that same function (it is not
the sigmoid approximation ``x * sigmoid(1.702 x)``).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch.fx import Node

from ..matcher import Match, Op, Pattern, Var, near
from .base import FusionPass, Rule, tensor_val

aten = torch.ops.aten
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_MUL = (aten.mul.Tensor, aten.mul.Scalar)
_ADD = (aten.add.Tensor, aten.add.Scalar)


def _is_call(node, targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _factors(value, m: Match, top: bool) -> Tuple[float, List[object]]:
    """Split a product tree into (literal coefficient, non-literal factors), recording the interior muls."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), []
    if _is_call(value, _MUL) and not value.kwargs and (top or len(value.users) == 1):
        m.interior.append(value)
        c0, f0 = _factors(value.args[0], m, False)
        c1, f1 = _factors(value.args[1], m, False)
        return c0 * c1, f0 + f1
    return 1.0, [value]


def _is_cube_of(factors: List[object], x, m: Match) -> bool:
    """factors multiply to x³."""
    if len(factors) == 3 and all(f is x for f in factors):
        return True
    powers = []
    for f in factors:
        if f is x:
            powers.append(1)
        elif _is_call(f, (aten.pow.Tensor_Scalar,)) and f.args[0] is x and f.args[1] in (2, 3) and len(f.users) == 1:
            powers.append(int(f.args[1]))
            m.interior.append(f)
        else:
            return False
    return sum(powers) == 3


def _plus(node, m: Match) -> Optional[Tuple[object, object]]:
    if _is_call(node, _ADD) and not node.kwargs and len(node.users) == 1:
        m.interior.append(node)
        return node.args[0], node.args[1]
    return None


class _ExplicitTanhGelu(Pattern):
    """Binds ``x`` when the value is the explicit tanh-GELU formula of x."""

    def roots(self):
        return frozenset(_MUL)

    def describe(self) -> str:
        return "0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))"

    def match(self, value, m: Match) -> bool:
        if not _is_call(value, _MUL):
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

    def _is_one_plus_tanh_of(self, node, x, m: Match) -> bool:
        terms = _plus(node, m)
        if terms is None:
            return False
        one, tanh = terms if not isinstance(terms[0], Node) else terms[::-1]
        if one != 1 or not _is_call(tanh, (aten.tanh.default,)) or len(tanh.users) != 1:
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


def _check(m, root):
    x = tensor_val(m["x"])
    return None if x is not None and x.dtype.is_floating_point else "x is not a floating-point tensor"


def _build(m, root, emit):
    return emit(torch.ops.mindiesd.fast_gelu.default, m["x"])


class FastGeluPass(FusionPass):
    family = "fast_gelu"
    rules = (
        Rule("aten_gelu_tanh", Op(aten.gelu.default, Var("x"), kwargs={"approximate": "tanh"}), _build, _check),
        Rule("explicit_formula", _ExplicitTanhGelu(), _build, _check),
    )
