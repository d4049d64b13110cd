"""Nearest-neighbour upsampling given back its kernel.

aot decomposes ``F.interpolate(x, mode="nearest" | "nearest-exact")`` (the upsampling of every VAE decoder) into a
gather, ``_unsafe_index(x, [None, None, rows[:, None], cols])``, whose index tables are computed in the graph from
sizes alone. The gather is slower than aten's upsampling kernel, and its output is contiguous where the kernel's
follows x (channels-last, the layout CPU convolutions return), so aot adds a copy into channels-last before the
next convolution. This pass, on the whole aten graph before freezing (where the tables are still computed from
literals), evaluates the tables and, where they are exactly those of ``upsample_nearest2d`` (rule ``nearest``) or
``_upsample_nearest_exact2d`` (rule ``nearest_exact``) at the output size, calls that kernel instead. Where the
kernel's output has other strides than the gather's, the rewrite is kept only when every reader is such a copy
into the kernel's own layout, which is then dropped.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch
from torch.fx import GraphModule, Node

from ..fx_utils import Emitter, erase_unused, literal_value, replace_readers, same_layout, tensor_val
from .base import LoweringPass

log = logging.getLogger("mindiesd.compilation")
aten = torch.ops.aten

__all__ = ["UpsampleNearestPass"]

_GATHERS = (aten._unsafe_index.Tensor, aten.index.Tensor)
_KERNELS = {"nearest": aten.upsample_nearest2d.vec, "nearest_exact": aten._upsample_nearest_exact2d.vec}


def _kernel_for(size: int, out: int, table: torch.Tensor) -> Optional[str]:
    """Which kernel reads source row ``table[i]`` for output row ``i`` of ``out`` rows from ``size``, if one does."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # real values, where aot's fake mode is active
        probe = torch.arange(size, dtype=torch.float32).view(1, 1, size, 1)
        wanted = table.reshape(-1).to(torch.float32)
        for rule, kernel in _KERNELS.items():
            got = kernel(probe, [out, 1], None).reshape(-1)
            if got.shape == wanted.shape and torch.equal(got, wanted):
                return rule
    return None


class UpsampleNearestPass(LoweringPass):
    """Replaces each gather that is a nearest upsampling by aten's kernel; returns how many it replaced."""

    family = "upsample_nearest"
    targets = _GATHERS

    def lower(self, gm: GraphModule, node: Node, cache: Dict[Node, Any], index: int) -> Optional[str]:
        return self._rewrite(node, cache)

    @staticmethod
    def _rule(node: Node, cache: Dict[Node, Any]) -> Optional[tuple]:
        x, indices = node.args[0], node.args[1]
        xv, out = tensor_val(x), tensor_val(node)
        if xv is None or out is None or xv.dim() != 4 or not isinstance(indices, (list, tuple)) or len(indices) != 4:
            return None
        if indices[0] is not None or indices[1] is not None or not all(isinstance(i, Node) for i in indices[2:]):
            return None
        sizes = (*xv.shape[2:], *out.shape[2:])
        if not all(type(s) is int for s in sizes):  # symbolic sizes: no table to compare (and no guard added)
            return None
        height, width, out_h, out_w = sizes
        rows, cols = (literal_value(i, cache) for i in indices[2:])
        if not isinstance(rows, torch.Tensor) or not isinstance(cols, torch.Tensor) \
                or tuple(rows.shape) != (out_h, 1) or tuple(cols.shape) != (out_w,):
            return None
        rule = _kernel_for(height, out_h, rows)
        if rule is None or _kernel_for(width, out_w, cols) != rule:
            return None
        return rule, x, [out_h, out_w]

    def _rewrite(self, node: Node, cache: Dict[Node, Any]) -> Optional[str]:
        found = self._rule(node, cache)
        if found is None:
            return None
        rule, x, size = found
        tables = _computing(node.args[1][2:])
        emit = Emitter(node.graph, node)
        new = emit(_KERNELS[rule], x, size, None)
        if same_layout(new.meta["val"], node.meta["val"]):
            node.replace_all_uses_with(new)
            node.graph.erase_node(node)
        else:  # kept only where every reader copies it into the kernel's own layout: those copies go
            users = list(node.users)
            if not users or not all(u.target is aten.clone.default and "memory_format" in u.kwargs
                                    and same_layout(new.meta["val"], u.meta.get("val")) for u in users):
                emit.discard()
                return None
            replace_readers(node, new)
        erase_unused(tables)  # the index tables' computation, where nothing else reads it
        return rule


def _computing(nodes: Any) -> List[Node]:
    """The calls that compute ``nodes`` (literals only: no placeholder among them)."""
    found: List[Node] = []
    stack = [n for n in nodes if isinstance(n, Node)]
    while stack:
        node = stack.pop()
        if node.op == "call_function" and node not in found:
            found.append(node)
            stack.extend(node.all_input_nodes)
    return found
