"""What every fusion pass shares: rules of (pattern, check, builder), the rewrite loop, and the safety checks.

A rule's pattern is tried only on nodes whose target its root can have (:meth:`Pattern.roots`). A match then
goes to the rule's check (after a shared one: no bound tensor of a storage-only dtype such as float8), which returns
None to accept it or the reason it is not fused (values the pattern cannot express: dtypes, dims, sizes), and only
then to its builder, which emits the fused node (and any small helper nodes) through
:class:`~mindiesd.compilation.fx_utils.Emitter`, which computes each new node's example value with the graph's
fake mode. The rewrite is kept only when the fused node's value has exactly the shape,
dtype and strides of the node it replaces (:func:`~mindiesd.compilation.fx_utils.same_layout`: a later ``view``,
or the next compiled region's stride guards, depend on the strides); otherwise the new nodes are removed and the
graph is left as it was. What cannot be proven equal under symbolic shapes is not fused. After a rewrite the
nodes of the match that nothing reads any more are erased (no dead-code pass per match).

With the logger ``mindiesd.compilation.explain`` at DEBUG, every node a rule could root at but that was not fused
is logged with the reason: the sub-pattern that failed (:func:`~mindiesd.compilation.passes.matcher.explain`), the
check's reason, or the layout/shape difference.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from torch.fx import GraphModule, Node

from ...ops.dtypes import promoted
from ..fx_utils import Emitter, erase_unused, same_layout, tensor_val
from .matcher import Match, Pattern, explain, is_self_contained, match

explain_log = logging.getLogger("mindiesd.compilation.explain")

__all__ = ["FusionPass", "LoweringPass", "Rule", "last_dim_index"]


def last_dim_index(dims: Any, rank: int) -> bool:
    """True when ``dims`` names exactly the last dimension of a tensor of ``rank``."""
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return False
    return dims[0] in (-1, rank - 1)


Builder = Callable[[Match, Node, Emitter], Optional[Node]]
Check = Callable[[Match, Node], Optional[str]]


@dataclass(frozen=True)
class Rule:
    """One form of a family: the pattern rooted at the replaced node, the check of the values the pattern does not
    constrain (None to accept, else the reason), and how to build its fused node."""

    name: str
    pattern: Pattern
    build: Builder
    check: Optional[Check] = None


def _accept(m: Match, root: Node) -> Optional[str]:
    return None


def _storage_only_binding(m: Match) -> Optional[str]:
    """Why a match binds a tensor of a dtype that takes no part in arithmetic (a float8 or packed weight, read
    only through a cast), or None: no fused op computes on one, so such a match is never fused."""
    for name, value in m.bindings.items():
        v = tensor_val(value)
        if v is not None and promoted(v.dtype) is None:
            return f"{name} is {v.dtype}, a storage format no fused op computes in"
    return None


class FusionPass:
    """Replaces every match of the family's rules by its fused op; returns how many it replaced.

    :attr:`hits` counts the rewrites per rule over the pass's lifetime (the report's per-rule counts).
    """

    family: str = ""
    rules: Sequence[Rule] = ()
    #: Whether the family's op takes storage-only tensors (a float8 weight) as they are; otherwise a match that
    #: binds one is not fused.
    reads_storage: bool = False

    def __init__(self) -> None:
        self.hits: Counter = Counter()
        self._by_target: Dict[Any, Tuple[Rule, ...]] = {}
        self._roots = [(rule, rule.pattern.roots()) for rule in self.rules]

    def rules_for(self, node: Node) -> Tuple[Rule, ...]:
        """The rules whose pattern can have ``node`` as its root, in declaration order."""
        target = node.target
        rules = self._by_target.get(target)
        if rules is None:
            packet = getattr(target, "overloadpacket", None)
            rules = tuple(rule for rule, roots in self._roots
                          if roots is None or target in roots or (packet is not None and packet in roots))
            self._by_target[target] = rules
        return rules

    def __call__(self, gm: GraphModule) -> int:
        graph = gm.graph
        replaced = 0
        explaining = explain_log.isEnabledFor(logging.DEBUG)
        for node in reversed(list(graph.nodes)):
            if getattr(node, "_erased", False) or node.op != "call_function" or not node.users:
                continue
            for rule in self.rules_for(node):
                m = match(rule.pattern, node)
                if m is None:
                    if explaining:
                        self._explain(rule, node, explain(rule.pattern, node))
                    continue
                if not is_self_contained(m, node):
                    if explaining:
                        self._explain(rule, node, "an intermediate value of the match is used outside it")
                    continue
                reason = (None if self.reads_storage else _storage_only_binding(m)) or (rule.check or _accept)(m, node)
                if reason is not None:
                    if explaining:
                        self._explain(rule, node, reason)
                    continue
                emit = Emitter(graph, node)
                try:
                    fused = rule.build(m, node, emit)
                    if fused is not None and not self._same_result(fused, node):
                        if explaining:
                            self._explain(rule, node, self._difference(fused, node))
                        fused = None
                except Exception:
                    emit.discard()
                    raise
                if fused is None:
                    emit.discard()
                    continue
                fused.meta["mindiesd_rule"] = f"{self.family}:{rule.name}"
                node.replace_all_uses_with(fused)
                erase_unused(m.interior + m.shared)  # so that no later match counts a dead leftover
                replaced += 1
                self.hits[rule.name] += 1
                break
        graph.lint()
        gm.recompile()
        return replaced

    def _explain(self, rule: Rule, node: Node, reason: Optional[str]) -> None:
        explain_log.debug("%s:%s not fused at %%%s (%s): %s", self.family, rule.name, node.name, node.target, reason)

    @staticmethod
    def _difference(fused: Node, original: Node) -> str:
        new, old = tensor_val(fused), tensor_val(original)
        if new is None or old is None:
            return "the fused node has no tensor value"
        return (f"the fused op gives {new.dtype} {list(new.shape)} strides {list(new.stride())} on {new.device}, "
                f"the replaced node {old.dtype} {list(old.shape)} strides {list(old.stride())} on {old.device}")

    @staticmethod
    def _same_result(fused: Node, original: Node) -> bool:
        """Shape, dtype and strides equal: the fused value can stand wherever the replaced one was read."""
        new, old = tensor_val(fused), tensor_val(original)
        return new is not None and old is not None and same_layout(new, old)


class LoweringPass:
    """A ``lower``-stage pass (on the whole aten graph, before freezing): each call of one of :attr:`targets` goes to
    :meth:`lower`, which rewrites it and returns the rule that did, or returns None and leaves it; :attr:`hits`
    counts the rewrites per rule. Returns how many calls it rewrote; the graph is linted and recompiled after any."""

    family = ""
    stage = "lower"
    #: The call targets the pass looks at.
    targets: Tuple[Any, ...] = ()

    def __init__(self) -> None:
        self.hits: Counter = Counter()

    def __call__(self, gm: GraphModule) -> int:
        cache: Dict[Node, Any] = {}  # values :func:`~mindiesd.compilation.fx_utils.literal_value` found
        self.begin(gm)
        lowered = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in self.targets:
                rule = self.lower(gm, node, cache, lowered)
                if rule is not None:
                    self.hits[rule] += 1
                    lowered += 1
        if lowered:
            self.finish(gm)
            gm.graph.lint()
            gm.recompile()
        return lowered

    def begin(self, gm: GraphModule) -> None:
        """Before the graph's calls are looked at."""

    def finish(self, gm: GraphModule) -> None:
        """After a graph in which at least one call was rewritten."""

    def lower(self, gm: GraphModule, node: Node, cache: Dict[Node, Any], index: int) -> Optional[str]:
        """Rewrite ``node`` (the ``index``-th rewrite of this graph); the rule's name, or None to leave it."""
        raise NotImplementedError
