"""Right after aot: the layout decisions it made on fake strides are made again on the real tensors at run time.

aot traces a composite op down to its kernel on fake tensors, so a composite that looks at its input's strides
decides once, on the fake strides. ``F.group_norm`` runs ``x.contiguous(x.suggest_memory_format())`` and then
``native_group_norm``, whose CPU kernel requires exactly that layout. A fake tensor's strides may differ from the
real one's in a dim of size 1, which addresses nothing but changes what ``suggest_memory_format`` says: a
transposed ``[1, HW, C]`` viewed as ``[1, C, H, W]`` (the output of AutoencoderKL's attention block) has the batch
stride 2048 in the trace and 32 when it runs, so the trace calls it channels-last (no copy), the real tensor
suggests the contiguous format and the kernel raises. ``torch.compile(backend="aot_eager")`` fails the same way.

:func:`restore_layout_checks` gives each such group norm back its composite, ``aten.group_norm``, which makes
the copy where the real input needs it, as eager does, and nothing where it does not.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from ..fx_utils import Emitter, is_call, same_layout, tensor_val

__all__ = ["restore_layout_checks"]

aten = torch.ops.aten


def restore_layout_checks(graph: Graph) -> int:
    """Each ``native_group_norm`` whose normalised output alone is read (inference: the mean and rstd that only a
    backward reads are not) becomes ``group_norm``, which checks the real input's layout when it runs. Returns how
    many were replaced."""
    replaced = 0
    for node in list(graph.nodes):
        output = _normalised_output(node)
        if output is None:
            continue
        x, weight, bias, group, eps = (node.args[i] for i in (0, 1, 2, 6, 7))
        emit = Emitter(graph, node)
        composite = emit(aten.group_norm.default, x, group, weight, bias, eps)
        if not same_layout(tensor_val(composite), tensor_val(output)):
            emit.discard()
            continue
        output.replace_all_uses_with(composite)
        graph.erase_node(output)
        graph.erase_node(node)
        replaced += 1
    return replaced


def _normalised_output(node: Node) -> Optional[Node]:
    """The ``getitem(node, 0)`` of a ``native_group_norm`` call that nothing else of it is read through."""
    if not is_call(node, aten.native_group_norm.default) or node.kwargs or len(node.args) != 8:
        return None
    users = list(node.users)
    if len(users) != 1 or not is_call(users[0], operator.getitem) or users[0].args[1] != 0:
        return None
    return users[0]
