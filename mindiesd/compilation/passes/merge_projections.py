"""Sibling linear layers over one input merged into one matmul over the concatenated weight.

The Q, K and V projections of an attention read the same hidden states, as do the context K/V projections and,
in Flux's single blocks, ``proj_mlp`` beside Q/K/V. In the aten graph each is ``addmm(b_i, x, t(w_i))`` (``mm``
without a bias), ``x`` often a separate ``view`` of the same tensor per layer. They become::

    w = cat([w_1, ..., w_n]); b = cat([b_1, ..., b_n])      # weights alone: folded at freeze time
    y = addmm(b, x, t(w))
    out_i = y[:, o_i : o_i + m_i]                          # a view per former layer

A group never spans an attention (the blocks of a model read the same text states for their context K/V; one
matmul for all blocks would keep all their K/V alive at once). This pass runs on the aten graph *before* it is
split into fold and main graphs, and merges only layers whose weights and biases are constants by freezing's own
definition (:func:`~mindiesd.compilation.fx_utils.foldable_nodes`), so the concatenations are folded with the
other constants, once per weight set, and made again when a weight is replaced; freezing makes
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
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.fx import Graph, GraphModule, Node

from ...ops.dtypes import is_compute_float
from ..fx_utils import (Emitter, erase_unused, fake_call, foldable_nodes, is_call, is_packed, same_layout,
                        subclass_parts, tensor_val, val, writes_in_place)
from .matcher import match
from .patterns import GEMM, VIEW_RESHAPES, is_transpose

log = logging.getLogger("mindiesd.compilation")
explain_log = logging.getLogger("mindiesd.compilation.explain")
aten = torch.ops.aten

__all__ = ["MergeProjectionsPass"]



@dataclass
class _Projection:
    node: Node  # the addmm / mm
    x: Node  # its 2-D input
    weight: Node  # [m, k], computed from weights alone
    bias: Optional[Node]  # [m] or None
    width: int  # m


def _projection(node: Node, constant: Set[Node]) -> Optional[_Projection]:
    """The linear layer at ``node`` when its weight and bias are constants (freezing folds their concatenation)."""
    if not is_call(node, aten.addmm.default, aten.mm.default):
        return None
    m = match(GEMM, node)
    if m is None or ("perm" in m.bindings and not is_transpose(m["perm"])):
        return None
    x, weight, bias = m["x"], m["w"], m.get("b")
    xv, wv = tensor_val(x), tensor_val(weight)
    if xv is None or wv is None or weight not in constant or xv.dim() != 2 or wv.dim() != 2:
        return None
    if not isinstance(wv.shape[0], int) or wv.dtype != xv.dtype or not is_compute_float(xv.dtype):
        return None
    if bias is not None:
        bv = tensor_val(bias)
        if bv is None or bias not in constant or bv.dim() != 1 or bv.dtype != xv.dtype or bv.shape[0] != wv.shape[0]:
            return None
    return _Projection(node, x, weight, bias, int(wv.shape[0]))


#: The matmuls of a linear layer, with the position of the weight operand.
_MATMUL_WEIGHT = {aten.mm.default: 1, aten.addmm.default: 2, aten._int_mm.default: 1}


def _reads_quantized(node: Node, quantized: Set[Node]) -> bool:
    """Whether ``node`` is a matmul whose weight operand is computed from a quantized weight (``quantized``: its
    data and scales), through the few ops of a dequantization (transpose, cast, scale)."""
    position = _MATMUL_WEIGHT.get(node.target) if node.op == "call_function" else None
    if position is None or len(node.args) <= position or not isinstance(node.args[position], Node):
        return False
    pending, seen = [node.args[position]], set()
    while pending and len(seen) < 16:
        current = pending.pop()
        if current in quantized:
            return True
        if current not in seen and current.op == "call_function":
            seen.add(current)
            pending.extend(current.all_input_nodes)
    return False


def _source(x: Node) -> Tuple[Any, ...]:
    """What ``x`` reads: a view of another node counts as that node with the view's sizes (each linear layer
    of a block views the same hidden states again)."""
    viewed = tensor_val(x)
    if is_call(x, *VIEW_RESHAPES) and isinstance(x.args[0], Node) and viewed is not None:
        return (x.args[0], tuple(str(size) for size in viewed.shape))  # symbolic sizes print alike
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


class MergeProjectionsPass:
    """Merges each group of sibling projections; returns how many merged matmuls it made."""

    family = "merge_projections"
    stage = "freeze"

    def __init__(self) -> None:
        self.hits: Counter = Counter()
        #: Why the last graph had linear layers that cannot be merged, or None.
        self.why_not: Optional[str] = None

    def __call__(self, gm: GraphModule, constant_inputs: Set[Node]) -> int:
        graph = gm.graph
        constant = foldable_nodes(graph, constant_inputs)
        quantized = subclass_parts(graph) | {p for p in constant_inputs if is_packed(p)}
        groups: Dict[Tuple[Any, ...], List[_Projection]] = {}
        dequantizing = 0
        for node in graph.nodes:
            projection = _projection(node, constant)
            if projection is not None:
                key = (node.target, _source(projection.x), tensor_val(projection.weight).shape[1])
                groups.setdefault(key, []).append(projection)
            elif quantized and _reads_quantized(node, quantized):
                dequantizing += 1
        self.why_not = None
        if dequantizing:
            self.why_not = (f"{dequantizing} linear layers read quantized weights: a merged weight would be a "
                            "dequantized full-precision copy of them, so they stay separate")
            log.info("merge_projections: %s", self.why_not)
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
        emit = Emitter(graph, anchor)
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
            updates = self._propagate(graph, {p.node: val(s) for p, s in zip(members, slices)}, anchor)
        except Exception as exc:  # a fake kernel refused the merged shapes: leave the layers as they were
            explain_log.debug("merge_projections: not merged at %%%s: %s", anchor.name, exc)
            updates = None
        if updates is None:
            emit.discard()
            return False
        for p, s in zip(members, slices):
            p.node.replace_all_uses_with(s)
        for node, value in updates.items():
            node.meta["val"] = value
            node.meta.pop("tensor_meta", None)
        for p in members:
            erase_unused([p.node, p.node.args[-1], p.x])
        return True

    @staticmethod
    def _propagate(graph: Graph, changed: Dict[Node, Any], anchor: Node) -> Optional[Dict[Node, Any]]:
        """The new example value of every node whose value changes when ``changed`` nodes take their new values
        (None when a consumer cannot take them: it raises, writes in place, or is the graph's output)."""
        values: Dict[Node, Any] = dict(changed)
        updates: Dict[Node, Any] = {}
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
            if node.op != "call_function" or writes_in_place(node):
                return None
            try:
                value = fake_call(node.target, node.args, node.kwargs,
                                  lambda n: values[n] if n in values else val(n))
            except Exception as exc:
                explain_log.debug("merge_projections: not merged at %%%s: %s (%s) cannot take a slice: %s",
                                  anchor.name, node.name, node.target, exc)
                return None
            if not same_layout(value, val(node)):
                values[node] = value
                updates[node] = value
        return updates

