"""What every fusion pass shares: rules of (pattern, builder), the rewrite loop, and the safety checks.

A rule's builder receives the match and emits the fused node (and any small helper nodes) through
:class:`Emitter`, which computes each new node's example value with the graph's fake mode. The rewrite is kept
only when the fused node's value has exactly the shape, dtype and strides of the node it replaces (the layout
rule of ``mindiesd.ops._layout``: a later ``view``, or the next compiled region's stride guards, depend on the
strides); otherwise the new nodes are removed and the graph is left as it was. Sizes and strides are compared with ``statically_known_true`` so that symbolic shapes
(``dynamic=True``) never add guards after tracing: what cannot be proven equal is not fused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..matcher import Match, Pattern, is_self_contained, match, val

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
        fake_args = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
        fake_kwargs = torch.fx.node.map_arg(kwargs, lambda n: n.meta["val"])
        fake_mode = detect_fake_mode(_flat((fake_args, fake_kwargs)))
        if fake_mode is None:
            raise RuntimeError("no fake tensor mode on the graph's values")
        with fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def discard(self) -> None:
        for node in reversed(self.created):
            if not node.users:
                self.graph.erase_node(node)
        self.created.clear()


def _flat(args: Any) -> List[Any]:
    out: List[Any] = []
    torch.fx.node.map_aggregate(args, lambda x: out.append(x) if isinstance(x, torch.Tensor) else None)
    return out


Builder = Callable[[Match, Node, Emitter], Optional[Node]]


@dataclass(frozen=True)
class Rule:
    """One form of a family: the pattern rooted at the replaced node, and how to build its fused node."""

    name: str
    pattern: Pattern
    build: Builder


class FusionPass:
    """Replaces every match of the family's rules by its fused op; returns how many it replaced."""

    family: str = ""
    rules: Sequence[Rule] = ()

    def __call__(self, gm: GraphModule) -> int:
        graph = gm.graph
        replaced = 0
        for node in reversed(list(graph.nodes)):
            if getattr(node, "_erased", False) or node.op != "call_function" or not node.users:
                continue
            for rule in self.rules:
                m = match(rule.pattern, node)
                if m is None or not is_self_contained(m, node):
                    continue
                emit = Emitter(graph, node)
                try:
                    fused = rule.build(m, node, emit)
                    if fused is not None and not self._same_result(fused, node):
                        fused = None
                except Exception:
                    emit.discard()
                    raise
                if fused is None:
                    emit.discard()
                    continue
                fused.meta["mindiesd_rule"] = f"{self.family}:{rule.name}"
                node.replace_all_uses_with(fused)
                graph.eliminate_dead_code()  # so that no later match counts a dead leftover
                replaced += 1
                break
        graph.lint()
        gm.recompile()
        return replaced

    @staticmethod
    def _same_result(fused: Node, original: Node) -> bool:
        """Shape, dtype and strides equal: the fused value can stand wherever the replaced one was read."""
        new, old = tensor_val(fused), tensor_val(original)
        return (
            new is not None and old is not None and new.dtype == old.dtype and new.device == old.device
            and same_shape(new.shape, old.shape) and same_shape(new.stride(), old.stride())
        )
