"""A small declarative matcher over aten FX graphs.

A pattern is a tree of :class:`Op` (a call of one of some aten ops), :class:`Var` (any value, bound by name),
:class:`Lit` (a Python number satisfying a predicate) and :class:`Cast` (zero or more dtype casts). Commutative
ops try both operand orders. A name bound twice must bind the same value, so shared sub-expressions (the same
``x`` feeding a square and a multiply) are expressed by reusing the name.

Constants such as eps are read from the graph, not written into the pattern, so one pattern serves every eps,
dtype and rank. A match also lists the nodes it would replace; :func:`is_self_contained` checks that none of
them is used outside the match, so that a replacement never recomputes a value somebody else still needs.

:class:`Alt` takes the *first* branch that matches (no backtracking into a later branch when an enclosing
pattern then fails), so put the more specific branch first. :meth:`Pattern.roots` gives the targets a pattern's
root node can have, so a pass tries only the rules that can match a node. :func:`explain` says why a pattern
does not match a node: the sub-pattern where the match got furthest before failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import operator

import torch
from torch.fx import Node

from ...ops.dtypes import is_compute_float, widens
from ..fx_utils import is_call, val

aten = torch.ops.aten

__all__ = [
    "Pattern", "Op", "Var", "Lit", "Cast", "OutCast", "Alt", "Match", "match", "is_self_contained", "strip_casts",
    "exactly", "near", "CAST_OPS", "explain",
]

#: Ops that change only the dtype of a tensor (when called with a dtype alone).
CAST_OPS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


@dataclass
class Match:
    """The state of one match: bound names and the nodes the match covers."""

    bindings: Dict[str, Any] = field(default_factory=dict)
    interior: List[Node] = field(default_factory=list)  # replaced nodes, used only inside the match
    shared: List[Node] = field(default_factory=list)  # matched casts of inputs, which may have other users
    #: When explaining a failure: (progress, what was expected, the value found) of every failed sub-pattern.
    failures: Optional[List[Tuple[int, str, Any]]] = None

    def fail(self, expected: str, value: Any) -> bool:
        """Record a failed sub-pattern (when explaining) and return False."""
        if self.failures is not None:
            self.failures.append((len(self.interior) + len(self.shared) + len(self.bindings), expected, value))
        return False

    def save(self) -> Tuple[Dict[str, Any], int, int]:
        return dict(self.bindings), len(self.interior), len(self.shared)

    def restore(self, state: Tuple[Dict[str, Any], int, int]) -> None:
        self.bindings, n_interior, n_shared = state[0], state[1], state[2]
        del self.interior[n_interior:]
        del self.shared[n_shared:]

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.bindings.get(name, default)


class Pattern:
    def match(self, value: Any, m: Match) -> bool:
        raise NotImplementedError

    def roots(self) -> Optional[frozenset]:
        """The targets (OpOverloads or packets) a matching root node can have; None when any node may match."""
        return None

    def describe(self) -> str:
        return type(self).__name__


PatternLike = Union[Pattern, int, float, bool, str, None, Sequence[Any]]


def _bind(m: Match, name: Optional[str], value: Any) -> bool:
    if name is None:
        return True
    if name in m.bindings:
        bound = m.bindings[name]
        return bound is value or (not isinstance(bound, Node) and not isinstance(value, Node) and bound == value)
    m.bindings[name] = value
    return True


def _match_arg(pattern: PatternLike, value: Any, m: Match) -> bool:
    if isinstance(pattern, Pattern):
        return pattern.match(value, m)
    if isinstance(pattern, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(pattern):
            return False
        return all(_match_arg(p, v, m) for p, v in zip(pattern, value))
    if isinstance(value, Node):
        return m.fail(f"the literal {pattern!r}", value)
    ok = type(pattern) is type(value) and pattern == value if isinstance(pattern, bool) else pattern == value
    return ok or m.fail(f"the literal {pattern!r}", value)


class Var(Pattern):
    """Any value (node or literal), bound to ``name``; ``check`` filters what it accepts."""

    def __init__(self, name: Optional[str] = None, check: Optional[Callable[[Any], bool]] = None):
        self.name, self.check = name, check

    def match(self, value: Any, m: Match) -> bool:
        if self.check is not None and not self.check(value):
            return m.fail(f"{self.describe()} accepted by its check", value)
        return _bind(m, self.name, value) or m.fail(f"the value already bound to {self.name!r}", value)

    def describe(self) -> str:
        return f"Var({self.name!r})" if self.name else "Var()"


class Lit(Pattern):
    """A Python number (not a node), optionally bound, accepted by ``check``."""

    def __init__(self, name: Optional[str] = None, check: Optional[Callable[[Any], bool]] = None):
        self.name, self.check = name, check

    def match(self, value: Any, m: Match) -> bool:
        if isinstance(value, Node) or isinstance(value, bool) or not isinstance(value, (int, float)):
            return m.fail(f"{self.describe()}, a Python number", value)
        if self.check is not None and not self.check(value):
            return m.fail(f"{self.describe()} accepted by its check", value)
        return _bind(m, self.name, value) or m.fail(f"the value already bound to {self.name!r}", value)

    def describe(self) -> str:
        return f"Lit({self.name!r})" if self.name else "Lit()"


def exactly(target: float) -> Callable[[Any], bool]:
    """A predicate for a literal equal to ``target`` (``1`` and ``1.0`` alike)."""
    return lambda v: v == target


def near(target: float, rel: float = 1e-6) -> Callable[[Any], bool]:
    """A predicate for a literal equal to ``target`` up to a relative tolerance (fp32-rounded constants)."""
    return lambda v: abs(float(v) - target) <= rel * max(1.0, abs(target))


class Op(Pattern):
    """A call of one of ``targets`` (OpOverloads, or packets meaning every overload) with matching arguments.

    ``kwargs`` lists the keyword arguments the node may carry (pattern or literal); any other keyword makes the
    match fail, so an ``add`` with ``alpha=2`` is never mistaken for a plain add. ``commutative`` tries the first
    two arguments in both orders. ``name`` binds the node (and a second Op with the same name must be that node).
    """

    def __init__(
        self,
        targets: Union[Any, Iterable[Any]],
        *args: PatternLike,
        kwargs: Optional[Dict[str, PatternLike]] = None,
        commutative: bool = False,
        name: Optional[str] = None,
        shared: bool = False,
    ):
        targets = targets if isinstance(targets, (tuple, list, set, frozenset)) else (targets,)
        self.overloads = frozenset(t for t in targets if isinstance(t, torch._ops.OpOverload) or t is operator.getitem)
        self.packets = frozenset(t for t in targets if isinstance(t, torch._ops.OpOverloadPacket))
        self.args, self.kwargs = args, kwargs or {}
        # A literal keyword (approximate="tanh") must be present: its absence means the op's default.
        self.required = frozenset(k for k, p in self.kwargs.items() if not isinstance(p, Pattern))
        self.commutative, self.name, self.shared = commutative, name, shared

    def _target_ok(self, node: Node) -> bool:
        target = node.target
        if target in self.overloads:
            return True
        return getattr(target, "overloadpacket", None) in self.packets

    def roots(self) -> Optional[frozenset]:
        return self.overloads | self.packets

    def describe(self) -> str:
        names = sorted(str(t) if t is not operator.getitem else "getitem" for t in self.overloads | self.packets)
        return " or ".join(names)

    def match(self, value: Any, m: Match) -> bool:
        if not isinstance(value, Node) or value.op != "call_function" or not self._target_ok(value):
            return m.fail(f"a call of {self.describe()}", value)
        if self.name is not None and self.name in m.bindings:
            return m.bindings[self.name] is value or m.fail(f"the node already bound to {self.name!r}", value)
        if len(value.args) != len(self.args) or not self.required <= set(value.kwargs) <= set(self.kwargs):
            return m.fail(f"{self.describe()} with {len(self.args)} arguments and keywords "
                          f"{sorted(self.kwargs)} ({sorted(self.required)} required)", value)
        orders = [list(self.args)]
        if self.commutative and len(self.args) >= 2:
            orders.append([self.args[1], self.args[0], *self.args[2:]])
        for order in orders:
            state = m.save()
            if all(_match_arg(p, v, m) for p, v in zip(order, value.args)) and all(
                _match_arg(self.kwargs[k], v, m) for k, v in value.kwargs.items()
            ):
                if _bind(m, self.name, value):
                    (m.shared if self.shared else m.interior).append(value)
                    return True
            m.restore(state)
        return False


class Cast(Pattern):
    """Zero or more dtype-only casts around ``inner``; the casts are recorded as shared nodes.

    Only casts between the floats the fused ops compute in are looked through (never one from a float8 or integer
    weight: that value is no operand of a fused op). By default only exact (widening) casts, as on an input that is
    upcast before the math: dropping such a cast changes no value. ``lossy=True`` also looks through narrowing
    casts; use it only where the fused op computes at least as precisely as the cast chain (intermediate roundings).
    """

    def __init__(self, inner: Pattern, lossy: bool = False, shared: bool = True):
        self.inner, self.lossy, self.shared = inner, lossy, shared

    def roots(self) -> Optional[frozenset]:
        inner = self.inner.roots()
        return None if inner is None else inner | frozenset(CAST_OPS)

    def describe(self) -> str:
        return f"Cast({self.inner.describe()})"

    def match(self, value: Any, m: Match) -> bool:
        casts = []
        while _is_dtype_cast(value, self.lossy):
            casts.append(value)
            value = value.args[0]
        state = m.save()
        if self.inner.match(value, m):
            (m.shared if self.shared else m.interior).extend(casts)
            return True
        m.restore(state)
        return False


def OutCast(inner: Pattern) -> Cast:
    """Casts applied to a result: any float cast, and the casts are replaced with the rest of the match."""
    return Cast(inner, lossy=True, shared=False)


class Alt(Pattern):
    """The first of several patterns that matches."""

    def __init__(self, *options: Pattern):
        self.options = options

    def roots(self) -> Optional[frozenset]:
        out: frozenset = frozenset()
        for option in self.options:
            roots = option.roots()
            if roots is None:
                return None
            out |= roots
        return out

    def describe(self) -> str:
        return "Alt(" + " | ".join(o.describe() for o in self.options) + ")"

    def match(self, value: Any, m: Match) -> bool:
        for option in self.options:
            state = m.save()
            if option.match(value, m):
                return True
            m.restore(state)
        return False


def _is_dtype_cast(value: Any, lossy: bool = False) -> bool:
    if not is_call(value, *CAST_OPS):
        return False
    if value.target is aten._to_copy.default and (
        not set(value.kwargs) <= {"dtype", "layout", "device"} or len(value.args) != 1
    ):
        return False
    src, dst = val(value.args[0]), val(value)
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        return False
    if src.device != dst.device or src.layout != dst.layout:
        return False
    if not (is_compute_float(src.dtype) and is_compute_float(dst.dtype)):
        return False  # a float8 (or integer) value under the cast is not one a fused op computes on
    return lossy or widens(src, dst)


def strip_casts(value: Any, lossy: bool = False) -> Any:
    """The value under a chain of dtype casts (exact ones only, unless ``lossy``)."""
    while _is_dtype_cast(value, lossy):
        value = value.args[0]
    return value


def match(pattern: Pattern, node: Node) -> Optional[Match]:
    """Match ``pattern`` with ``node`` as its root; None when it does not match."""
    m = Match()
    if not pattern.match(node, m):
        return None
    return m


def _show(value: Any) -> str:
    if isinstance(value, Node):
        target = value.target if value.op == "call_function" else value.op
        return f"%{value.name} ({'getitem' if target is operator.getitem else target})"
    return repr(value)


def explain(pattern: Pattern, node: Node) -> Optional[str]:
    """Why ``pattern`` does not match at ``node``: the sub-pattern the match got furthest with before it failed
    (None when it matches)."""
    m = Match(failures=[])
    if pattern.match(node, m):
        return None
    if not m.failures:
        return f"no match at {_show(node)}"
    progress, expected, found = max(m.failures, key=lambda f: f[0])  # the first of the furthest failures
    return f"expected {expected}, found {_show(found)}"


#: Users that read only a tensor's metadata (dynamic=True adds them); they do not need its values.
_SIZE_QUERIES = frozenset(
    getattr(aten, name).int if name != "sym_numel" else aten.sym_numel.default
    for name in ("sym_size", "sym_stride", "sym_numel")
)


def is_self_contained(m: Match, root: Node) -> bool:
    """True when every interior node but the root is used only by nodes of the match (or for its sizes)."""
    covered = set(m.interior) | set(m.shared)
    for node in m.interior:
        if node is root:
            continue
        if any(user not in covered and user.target not in _SIZE_QUERIES for user in node.users):
            return False
    return True
