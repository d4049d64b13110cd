"""Sibling linear layers over one input merged into one matmul over the concatenated weight.

The Q, K and V projections of an attention read the same hidden states, as do the context K/V projections and,
in Flux's single blocks, ``proj_mlp`` beside Q/K/V. In the aten graph each is ``addmm(b_i, x, t(w_i))`` (``mm``
without a bias), ``x`` often a separate ``view`` of the same tensor per layer. They become::

    w = cat([w_1, ..., w_n]); b = cat([b_1, ..., b_n])      # weights alone: folded at freeze time
    y = addmm(b, x, t(w))
    out_i = y[:, o_i : o_i + m_i]                          # a view per former layer

A group never spans an attention (the blocks of a model read the same text states for their context K/V; one
matmul for all blocks would keep all their K/V alive at once). This pass runs on the aten graph *before* it is split into fold and main graphs, so the concatenations are
folded with the other constants, once per weight set, and made again when a weight is replaced; freezing makes
the merged weights views of the concatenation (``mindiesd.compilation.freezing``), so writes to them in place,
through ``.data`` too, reach the merged matmul. LoRA adapter weights are left out by the backend.

Each ``out_i`` is a column slice of ``y``, so its strides are not those of the separate layer's output. A merge
is kept only when every value computed from the slices is still computable and, where its layout changes, the
change stays inside the graph: the new layouts are propagated through the consumers with the graph's fake
mode (a ``view`` that needs the dense layout raises there), and a merge whose changed layout would reach the
graph's outputs, or an op that writes in place, is not made. The nodes' example values are updated, so the
fusion passes that follow see the real layouts.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node

explain_log = logging.getLogger("mindiesd.compilation.explain")
aten = torch.ops.aten

__all__ = ["MergeProjectionsPass"]

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclass
class _Projection:
    node: Node  # the addmm / mm
    x: Node  # its 2-D input
    weight: Node  # [m, k], computed from weights alone
    bias: Optional[Node]  # [m] or None
    width: int  # m


def _is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _tensor(node: Any) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _constant_nodes(graph: Graph, constant_inputs: Set[Node]) -> Set[Node]:
    """The nodes computed from the weights alone (what freezing can fold)."""
    constant = set(constant_inputs)
    for node in graph.nodes:
        if node.op != "call_function" or not node.all_input_nodes:
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
            continue
        if torch.Tag.nondeterministic_seeded in target.tags:
            continue
        if all(i in constant for i in node.all_input_nodes):
            constant.add(node)
    return constant


def _transposed(node: Any) -> Optional[Node]:
    """w where ``node`` is ``w.T`` of a 2-D w."""
    if _is_call(node, aten.t.default) or (
        _is_call(node, aten.permute.default) and list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])
    ):
        return node.args[0] if isinstance(node.args[0], Node) else None
    return None


def _projection(node: Node, constant: Set[Node]) -> Optional[_Projection]:
    if _is_call(node, aten.addmm.default):
        if len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or \
                set(node.kwargs) - {"beta", "alpha"}:
            return None
        bias, x, weight_t = node.args
    elif _is_call(node, aten.mm.default) and not node.kwargs:
        bias, (x, weight_t) = None, node.args
    else:
        return None
    weight = _transposed(weight_t)
    xv, wv = _tensor(x), _tensor(weight)
    if weight is None or weight not in constant or xv is None or wv is None or xv.dim() != 2 or wv.dim() != 2:
        return None
    if not isinstance(wv.shape[0], int) or wv.dtype != xv.dtype or not xv.dtype.is_floating_point:
        return None
    if bias is not None:
        bv = _tensor(bias)
        if bias not in constant or bv is None or bv.dim() != 1 or bv.dtype != xv.dtype or bv.shape[0] != wv.shape[0]:
            return None
    return _Projection(node, x, weight, bias, int(wv.shape[0]))


def _source(x: Node) -> Tuple[Any, ...]:
    """What ``x`` reads: a view of another node counts as that node with the view's sizes (each linear layer
    of a block views the same hidden states again)."""
    if _is_call(x, *_VIEWS) and isinstance(x.args[0], Node) and _tensor(x) is not None:
        return (x.args[0], tuple(str(size) for size in _tensor(x).shape))  # symbolic sizes print alike
    return (x, None)


def _is_attention(node: Node) -> bool:
    return node.op == "call_function" and "attention" in str(node.target)


def _within_blocks(graph: Graph, group: List[_Projection]) -> List[List[_Projection]]:
    """``group`` cut where an attention lies between two members: the context K/V of every block of a model
    read the same text states, and one matmul for all blocks would keep every block's K/V alive at once."""
    runs: List[List[_Projection]] = [[]]
    members = {p.node: p for p in group}
    for node in graph.nodes:
        if node in members:
            runs[-1].append(members[node])
        elif runs[-1] and _is_attention(node):
            runs.append([])
    return [run for run in runs if run]


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.dtype == b.dtype and a.device == b.device and tuple(a.shape) == tuple(b.shape)
                and tuple(a.stride()) == tuple(b.stride()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, torch.Tensor)


class MergeProjectionsPass:
    """Merges each group of sibling projections; returns how many merged matmuls it made."""

    family = "merge_projections"
    stage = "freeze"

    def __init__(self) -> None:
        self.hits: Counter = Counter()

    def __call__(self, gm: GraphModule, constant_inputs: Set[Node]) -> int:
        graph = gm.graph
        constant = _constant_nodes(graph, constant_inputs)
        groups: Dict[Tuple[Any, ...], List[_Projection]] = {}
        for node in graph.nodes:
            projection = _projection(node, constant)
            if projection is not None:
                key = (node.target, _source(projection.x), projection.weight.meta["val"].shape[1])
                groups.setdefault(key, []).append(projection)
        merged = 0
        for members in (run for group in groups.values() for run in _within_blocks(graph, group)):
            if len(members) < 2:
                continue
            if self._merge(graph, members):
                merged += 1
                self.hits[f"{len(members)}_{'addmm' if members[0].bias is not None else 'mm'}"] += 1
        if merged:
            graph.lint()
            gm.recompile()
        return merged

    def _merge(self, graph: Graph, members: List[_Projection]) -> bool:
        order = {node: i for i, node in enumerate(graph.nodes)}
        anchor = members[0].node
        # what the merged matmul reads must exist where it goes (the first member's place)
        members = [p for p in members if all(order[n] < order[anchor] for n in (p.weight, p.bias) if n is not None)
                   or p.node is anchor]
        if len(members) < 2:
            return False
        fake_mode = detect_fake_mode([members[0].x.meta["val"]])
        if fake_mode is None:
            return False
        created: List[Node] = []

        def emit(target: Any, *args: Any) -> Node:
            with graph.inserting_before(anchor):
                node = graph.call_function(target, args)
            created.append(node)
            fake_args = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
            with fake_mode:
                node.meta["val"] = target(*fake_args)
            return node

        try:
            weight = emit(aten.cat.default, [p.weight for p in members], 0)
            weight_t = emit(aten.t.default, weight)
            if members[0].bias is not None:
                bias = emit(aten.cat.default, [p.bias for p in members], 0)
                out = emit(aten.addmm.default, bias, members[0].x, weight_t)
            else:
                out = emit(aten.mm.default, members[0].x, weight_t)
            slices, offset = [], 0
            for p in members:
                slices.append(emit(aten.slice.Tensor, out, 1, offset, offset + p.width))
                offset += p.width
            updates = self._propagate(graph, {p.node: s.meta["val"] for p, s in zip(members, slices)}, anchor)
        except Exception as exc:  # a fake kernel refused the merged shapes: leave the layers as they were
            explain_log.debug("merge_projections: not merged at %%%s: %s", anchor.name, exc)
            updates = None
        if updates is None:
            for node in reversed(created):
                graph.erase_node(node)
            return False
        for p, s in zip(members, slices):
            p.node.replace_all_uses_with(s)
        for node, value in updates.items():
            node.meta["val"] = value
            node.meta.pop("tensor_meta", None)
        for p in members:
            _erase_dead([p.node, p.node.args[-1], p.x])
        return True

    @staticmethod
    def _propagate(graph: Graph, changed: Dict[Node, Any], anchor: Node) -> Optional[Dict[Node, Any]]:
        """The new example value of every node whose value changes when ``changed`` nodes take their new values
        (None when a consumer cannot take them: it raises, writes in place, or is the graph's output)."""
        values: Dict[Node, Any] = dict(changed)
        updates: Dict[Node, Any] = {}
        fake_mode = detect_fake_mode([v for v in changed.values() if isinstance(v, torch.Tensor)])
        started = False
        for node in graph.nodes:
            if node is anchor:
                started = True
            if not started or node in changed or not any(i in values for i in node.all_input_nodes):
                continue
            if node.op == "output":
                explain_log.debug("merge_projections: not merged at %%%s: a slice's layout reaches the output",
                                  anchor.name)
                return None
            target = node.target
            if node.op != "call_function" or (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable):
                return None
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                 lambda n: values[n] if n in values else n.meta.get("val"))
            try:
                with fake_mode:
                    value = target(*args, **kwargs)
            except Exception as exc:
                explain_log.debug("merge_projections: not merged at %%%s: %s (%s) cannot take a slice: %s",
                                  anchor.name, node.name, target, exc)
                return None
            if not _same_value(value, node.meta.get("val")):
                values[node] = value
                updates[node] = value
        return updates


def _erase_dead(nodes: Sequence[Any]) -> None:
    for node in nodes:
        if isinstance(node, Node) and not getattr(node, "_erased", False) and not node.users and \
                node.op == "call_function":
            node.graph.erase_node(node)
