"""What every fusion pass shares: rules of (pattern, check, builder), the rewrite loop, and the safety checks.

A rule's pattern is tried only on nodes whose target its root can have (:meth:`Pattern.roots`). A match then
goes to the rule's check, which returns None to accept it or the reason it is not fused (values the pattern
cannot express: dtypes, dims, sizes), and only then to its builder, which emits the fused node (and any small
helper nodes) through :class:`Emitter`, which computes each new node's example value with the graph's fake mode. The rewrite is kept
only when the fused node's value has exactly the shape, dtype and strides of the node it replaces (the layout
rule of ``mindiesd.ops._layout``: a later ``view``, or the next compiled region's stride guards, depend on the
strides); otherwise the new nodes are removed and the graph is left as it was. Sizes and strides are compared
with ``statically_known_true`` so that symbolic shapes (``dynamic=True``) never add guards after tracing: what
cannot be proven equal is not fused. After a rewrite the nodes of the match that nothing reads any more are
erased (no dead-code pass per match).

With the logger ``mindiesd.compilation.explain`` at DEBUG, every node a rule could root at but that was not fused
is logged with the reason: the sub-pattern that failed (:func:`~mindiesd.compilation.matcher.explain`), the
check's reason, or the layout/shape difference.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..matcher import Match, Pattern, explain, is_self_contained, match, val

explain_log = logging.getLogger("mindiesd.compilation.explain")

__all__ = ["FusionPass", "Rule", "Emitter", "same_shape", "known_eq", "tensor_val", "last_dim_index"]


def known_eq(a: Any, b: Any) -> bool:
    """a == b, provably (False when symbolic and undecidable). A node stands for its traced value, as a size
    argument computed in the graph (``sym_size``) does under ``dynamic=True``."""
    a, b = (val(v) if isinstance(v, Node) else v for v in (a, b))
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(known_eq(x, y) for x, y in zip(a, b))


def tensor_val(value: Any) -> Optional[torch.Tensor]:
    """The example tensor of a node, or None for literals and non-tensor nodes."""
    v = val(value) if isinstance(value, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def last_dim_index(dims: Any, rank: int) -> bool:
    """True when ``dims`` names exactly the last dimension of a tensor of ``rank``."""
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return False
    return dims[0] in (-1, rank - 1)


class Emitter:
    """Creates nodes before ``anchor`` and gives each the example value its target computes on fake inputs."""

    def __init__(self, graph: Graph, anchor: Node):
        self.graph, self.anchor = graph, anchor
        self.created: List[Node] = []

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, tuple(args), kwargs)
        self.created.append(node)
        fake_args = torch.fx.node.map_arg(args, _fake_value)
        fake_kwargs = torch.fx.node.map_arg(kwargs, _fake_value)
        fake_mode = detect_fake_mode(_flat((fake_args, fake_kwargs)))
        if fake_mode is None:
            raise RuntimeError("no fake tensor mode on the graph's values")
        with fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def host_scalar(self, tensor: Node) -> Node:
        """A node reading the value of a 0-dim CPU tensor as a Python number at run time (``.item()``); its traced
        value is a fresh unbacked symbol, as Dynamo's own ``.item()`` gives."""
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(torch.ops.aten._local_scalar_dense.default, (tensor,))
        self.created.append(node)
        value = tensor.meta["val"]
        fake_mode = detect_fake_mode([value])
        shape_env = getattr(fake_mode, "shape_env", None)
        if shape_env is None:
            raise RuntimeError("a host scalar needs the symbolic shape environment of dynamic=True")
        node.meta["val"] = (shape_env.create_unbacked_symfloat() if value.dtype.is_floating_point
                            else shape_env.create_unbacked_symint())
        node.meta[_HOST_SCALAR] = 1.0 if value.dtype.is_floating_point else 1
        return node

    def discard(self) -> None:
        for node in reversed(self.created):
            if not node.users:
                self.graph.erase_node(node)
        self.created.clear()


_HOST_SCALAR = "mindiesd_host_scalar"


def _fake_value(node: Node) -> Any:
    """A node's traced value; for a host scalar (read at run time), a stand-in number: a fused op's fake uses
    shapes and dtypes only, and an op schema's ``float`` does not take a symbol."""
    return node.meta.get(_HOST_SCALAR, node.meta["val"]) if _HOST_SCALAR in node.meta else node.meta["val"]


def _flat(args: Any) -> List[Any]:
    out: List[Any] = []
    torch.fx.node.map_aggregate(args, lambda x: out.append(x) if isinstance(x, torch.Tensor) else None)
    return out


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


class FusionPass:
    """Replaces every match of the family's rules by its fused op; returns how many it replaced.

    :attr:`hits` counts the rewrites per rule over the pass's lifetime (the report's per-rule counts).
    """

    family: str = ""
    rules: Sequence[Rule] = ()

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
                reason = (rule.check or _accept)(m, node)
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
                _erase_unused(m.interior + m.shared)  # so that no later match counts a dead leftover
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
        return (
            new is not None and old is not None and new.dtype == old.dtype and new.device == old.device
            and same_shape(new.shape, old.shape) and same_shape(new.stride(), old.stride())
        )


def _erase_unused(nodes: Sequence[Node]) -> None:
    """Erase the nodes nothing reads any more; erasing one may free its inputs among ``nodes``, so repeat."""
    pending = {node: None for node in nodes}  # ordered, unique
    progress = True
    while pending and progress:
        progress = False
        for node in list(pending):
            if getattr(node, "_erased", False):
                del pending[node]
            elif not node.users:
                node.graph.erase_node(node)
                del pending[node]
                progress = True
