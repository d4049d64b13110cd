"""CPU convolutions on oneDNN, in channels-last layout.

aten picks a CPU convolution's kernel by a size rule: a float32 convolution whose batch is 1 and whose input's
first four dims hold few elements goes to the reference kernels (``slow_conv3d_forward``,
``_slow_conv2d_forward``), which the causal 3-D convolutions of Wan's and Qwen-Image's VAEs hit at most of their
sizes (up to 17x slower than oneDNN on them); and a convolution over contiguous NCHW activations and weights makes
oneDNN reorder both on every call. This pass, on the whole aten graph before freezing, replaces every float32
2-D and 3-D CPU convolution (bfloat16 too where oneDNN has native bfloat16 kernels on this CPU: AVX-512 BF16,
AMX) (not transposed, static sizes) by ``aten.mkldnn_convolution`` over channels-last
operands (rule ``conv2d`` or ``conv3d``): the weight's copy into channels-last reads weights alone, so freezing
folds it (one copy per weight set, not per call); the input is made channels-last with ``contiguous``, a copy only
where it is not already, which after the first convolution it mostly is.

This is the one pass that changes layouts inside the graph. The new layouts flow through the ops of
:data:`_FOLLOWS` (elementwise ops, group norms, paddings, concatenations, slices, upsamplings: each computes the same
values in any layout, so a VAE's activations stay channels-last from one convolution to the next); their example
values are propagated with the graph's fake mode (``mkldnn_convolution`` has no fake kernel: its value is
``convolution``'s over the same operands, in the layout oneDNN returns). Every other reader of a changed value (a
view, an attention, a matmul, the graph's outputs) reads it back in its traced layout (``contiguous``), so that
nothing downstream meets a layout it was not traced with: aten's kernels may lay out an op's output otherwise than
its fake kernel does (size-1 dims, broadcasts), which is harmless where the values are all that is read and not
where a kernel trusts the traced strides (the CPU flash attention reads its inputs' last dim as contiguous).
oneDNN's own choice of output layout is made certain the same way (see :meth:`ConvChannelsLastPass._conv`).
Where a changed value's traced layout is neither contiguous nor channels-last, the graph is left as it was and
:attr:`why_not` says why.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from ..fx_utils import fake_call, same_layout, tensor_val, writes_in_place
from .base import LoweringPass

explain_log = logging.getLogger("mindiesd.compilation.explain")
aten = torch.ops.aten

__all__ = ["ConvChannelsLastPass"]

_CONV = aten.convolution.default
_LAYOUTS = {4: torch.channels_last, 5: torch.channels_last_3d}
#: The ops a changed layout flows through: each computes the same values in any layout of its inputs (aten's
#: kernels, not the traced strides, decide its output's layout at run time, which the next convolution's operand
#: copy makes certain again). Every other reader of a changed value reads it in its traced layout.
_FOLLOWS = frozenset({
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.mul.Scalar,
    aten.div.Scalar, aten.silu.default, aten.sigmoid.default, aten.relu.default, aten.gelu.default,
    aten.tanh.default, aten.neg.default, aten.clamp_min.default, aten.clamp.default, aten.rsqrt.default,
    aten.sqrt.default, aten.exp.default, aten.pow.Tensor_Scalar, aten.where.self, aten.native_group_norm.default,
    aten.group_norm.default, aten.constant_pad_nd.default, aten.cat.default, aten.slice.Tensor, aten.clone.default,
    aten.upsample_nearest2d.vec, aten._upsample_nearest_exact2d.vec, aten.upsample_nearest3d.vec,
    aten._upsample_nearest_exact3d.vec, aten.linalg_vector_norm.default, aten.expand.default, aten.convolution.default,
    aten.mkldnn_convolution.default, aten._to_copy.default,
})


#: The views among them: a reader that needs one in its traced layout gets the view again, of its input in the
#: input's traced layout.
_VIEWS = frozenset({aten.slice.Tensor, aten.expand.default})


class _Refused(Exception):
    """The new layouts reach a node they cannot be proven safe through."""


def _static(value: torch.Tensor) -> bool:
    return all(type(s) is int for s in value.shape)


def _dtypes() -> Tuple[torch.dtype, ...]:
    """The dtypes whose convolutions are rewritten: float32, and bfloat16 where oneDNN has native bfloat16 kernels
    on this CPU (AVX-512 BF16, AMX)."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def _eligible(node: Node) -> Optional[str]:
    """Why the convolution ``node`` is not rewritten, or None."""
    x, weight, bias = (tensor_val(a) for a in node.args[:3])
    if x is None or weight is None or len(node.args) != 9:
        return "not a tensor convolution"
    if node.args[6]:
        return "transposed"
    if x.dim() not in _LAYOUTS or weight.dim() != x.dim():
        return f"{x.dim() - 2}-D (2-D and 3-D only)"
    dtypes = _dtypes()
    if x.device.type != "cpu" or x.dtype not in dtypes or weight.dtype != x.dtype \
            or (node.args[2] is not None and (bias is None or bias.dtype != x.dtype)):
        return f"not {' or '.join(str(d).replace('torch.', '') for d in dtypes)} on the CPU"
    if not (_static(x) and _static(weight)):
        return "symbolic sizes"
    return None


class ConvChannelsLastPass(LoweringPass):
    """Rewrites every eligible convolution (see the module); returns how many, 0 where it left the graph."""

    family = "conv_channels_last"
    targets = (_CONV,)

    def __init__(self) -> None:
        super().__init__()
        self.device_type, self.training = "cpu", False
        self.why_not: Optional[str] = None

    def __call__(self, gm: GraphModule) -> int:
        self.why_not = None
        if self.device_type != "cpu" or self.training:
            return 0
        if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            self.why_not = "oneDNN is not available or torch.backends.mkldnn.enabled is False"
            return 0
        graph = gm.graph
        convs = [n for n in graph.nodes if n.op == "call_function" and n.target is _CONV and _eligible(n) is None]
        if not convs:
            return 0
        saved = {n: n.meta.get("val") for n in graph.nodes}
        created: List[Node] = []
        replaced: Dict[Node, Node] = {}  # a convolution -> its replacement
        rewired: List[tuple] = []  # (reader, changed value, the copy in its traced layout that it reads instead)
        try:
            rules = self._rewrite(graph, set(convs), saved, created, replaced, rewired)
        except Exception as refused:  # noqa: BLE001  (_Refused, or a fake kernel that failed: the graph as it was)
            self._undo(gm, saved, created, replaced, rewired)
            reason = str(refused) if isinstance(refused, _Refused) else f"{type(refused).__name__}: {refused}"
            self.why_not = f"left in aten's layout: {reason}"
            explain_log.debug("conv_channels_last: %s", self.why_not)
            return 0
        for rule in rules:
            self.hits[rule] += 1
        for old in replaced:
            graph.erase_node(old)
        graph.lint()
        gm.recompile()
        return len(rules)

    def _rewrite(self, graph, convs, saved, created, replaced, rewired) -> List[str]:
        values: Dict[Node, Any] = {}  # the new example values of the nodes whose value changed
        rules: List[str] = []

        def value(n: Node) -> Any:
            return values[n] if n in values else n.meta.get("val")

        def emit(anchor: Node, target: Any, *args: Any, **kwargs: Any) -> Node:
            with graph.inserting_before(anchor):
                new = graph.call_function(target, args, kwargs)
            created.append(new)
            new.meta["val"] = fake_call(target, args, kwargs, value)
            return new

        origin: Dict[Node, Node] = {}  # a rewritten convolution -> the one it replaced
        restored: Dict[Node, Node] = {}  # a changed value -> its copy in the traced layout

        def restore(changed: Node, reader: Node) -> Node:
            """``changed`` in its traced layout, for ``reader``: a copy into that layout, or where that layout is a
            view's (a slice, an expansion), the view again of its input in the input's traced layout."""
            if changed not in restored:
                before, after = saved.get(origin.get(changed, changed)), values[changed]
                if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
                    raise _Refused(f"%{changed.name} changed layout and is not a tensor")
                layouts = [torch.contiguous_format] + ([_LAYOUTS[before.dim()]] if before.dim() in _LAYOUTS else [])
                layout = next((f for f in layouts if before.is_contiguous(memory_format=f)), None)
                if layout is not None:
                    restored[changed] = emit(reader, aten.contiguous.default, changed, memory_format=layout)
                elif changed.target in _VIEWS and changed.args and changed.args[0] in values:
                    view = emit(reader, changed.target, restore(changed.args[0], reader), *changed.args[1:],
                                **changed.kwargs)
                    if not same_layout(view.meta["val"], before):
                        raise _Refused(f"%{changed.name} was traced with strides {before.stride()}, which its "
                                       "input's traced layout does not give back")
                    restored[changed] = view
                else:
                    raise _Refused(f"%{changed.name}, read by %{reader.name}, was traced with strides "
                                   f"{before.stride()}, which no copy restores")
            return restored[changed]

        def rewire(reader: Node, changed: Node) -> None:
            copy = restore(changed, reader)
            reader.replace_input_with(changed, copy)
            rewired.append((reader, changed, copy))

        for node in list(graph.nodes):
            new = self._conv(graph, node, value, emit, created) if node in convs else None
            if new is not None:
                node.replace_all_uses_with(new)
                replaced[node] = new
                origin[new] = node
                values[new] = new.meta["val"]
                rules.append(f"conv{new.meta['val'].dim() - 2}d")
            elif node not in created and any(i in values for i in node.all_input_nodes):
                if node.op == "output":
                    for changed in [n for n in node.all_input_nodes if n in values]:
                        rewire(node, changed)
                else:
                    self._propagate(node, values, value, rewire)
        for node, new_value in values.items():
            node.meta["val"] = new_value
            node.meta.pop("tensor_meta", None)
        return rules

    @staticmethod
    def _conv(graph, node: Node, value, emit, created: List[Node]) -> Optional[Node]:
        """``mkldnn_convolution`` over channels-last operands of the convolution ``node``, before it; None (and
        nothing added) where neither operand is unambiguously channels-last (one input channel, 1x1 sizes), for
        which oneDNN returns the contiguous layout.

        oneDNN's output layout follows ``suggest_memory_format`` of its operands, which also reads the strides of
        size-1 dims, where a real tensor and its traced value may differ. A weight with a kernel wider than 1x1
        settles it (its copy has exactly the traced strides: frozen, it is made once), and the input then only
        needs to be channels-last (``contiguous``: a copy only where it is not); a 1x1 weight does not, and the input
        is copied into exactly the traced strides."""
        x, weight, bias, stride, padding, dilation, _, _, groups = node.args
        layout = _LAYOUTS[value(x).dim()]
        start = len(created)
        w_cl = weight if value(weight).is_contiguous(memory_format=layout) \
            else emit(node, aten.clone.default, weight, memory_format=layout)
        settled = _channels_last_only(value(w_cl), layout)
        x_cl = emit(node, aten.contiguous.default if settled else aten.clone.default, x, memory_format=layout)
        if not (settled or _channels_last_only(value(x_cl), layout)):
            for extra in reversed(created[start:]):
                graph.erase_node(extra)
            del created[start:]
            return None
        args = (x_cl, w_cl, bias, list(padding), list(stride), list(dilation), groups)
        with graph.inserting_before(node):
            new = graph.call_function(aten.mkldnn_convolution.default, args, {})
        created.append(new)
        # no fake kernel for it: convolution's value over the same operands, in the layout oneDNN gives
        traced = fake_call(_CONV, (x_cl, w_cl, bias, stride, padding, dilation, False, [0] * len(stride), groups),
                           {}, value)
        with detect_fake_mode([traced]):
            new.meta = {**node.meta, "val": traced.contiguous(memory_format=layout)}
        return new

    @staticmethod
    def _propagate(node: Node, values, value, rewire) -> None:
        """``node`` reads a value whose layout changed: an op of :data:`_FOLLOWS` gets its new example value; any
        other reader reads the changed values in their traced layouts (``rewire``)."""
        target = node.target
        follows = node.op == "call_function" and (target is operator.getitem or target in _FOLLOWS)
        if follows and not writes_in_place(node):
            try:
                new_value = fake_call(target, node.args, node.kwargs, value)
            except Exception:  # noqa: BLE001  (a fake kernel refused the new layout: restore it, as below)
                new_value = None
            if new_value is not None:
                if not _same_values(new_value, node.meta.get("val")):
                    values[node] = new_value
                return
        for changed in [n for n in node.all_input_nodes if n in values]:
            rewire(node, changed)

    @staticmethod
    def _undo(gm: GraphModule, saved, created: List[Node], replaced: Dict[Node, Node], rewired: List[tuple]) -> None:
        graph = gm.graph
        for old, new in replaced.items():
            new.replace_all_uses_with(old)
        for reader, changed, copy in reversed(rewired):
            reader.replace_input_with(copy, changed)
        for node in reversed(created):  # nothing outside them reads them any more
            graph.erase_node(node)
        for node, old_value in saved.items():
            if not getattr(node, "_erased", False) and old_value is not None:
                node.meta["val"] = old_value


def _channels_last_only(value: torch.Tensor, layout: torch.memory_format) -> bool:
    """Whether ``value`` is channels-last and not also contiguous (what oneDNN's choice of layout looks at)."""
    return value.is_contiguous(memory_format=layout) and not value.is_contiguous()


def _same_values(a: Any, b: Any) -> bool:
    """Whether two example values (tensors, or tuples of them) have the same layouts."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return same_layout(a, b)
    return True
