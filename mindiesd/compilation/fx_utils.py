"""The FX toolkit that freezing, the matcher and every pass share: reading the traced values of nodes, comparing
layouts, the one definition of a foldable constant, emitting nodes with their fake values, and erasing leftovers.

Sizes and strides are compared with ``statically_known_true``, so that symbolic shapes (``dynamic=True``) never
add guards after tracing: what cannot be proven equal counts as different.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.dtypes import is_compute_float

try:
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput as _PlainInput
    from torch._functorch._aot_autograd.descriptors import SubclassGetAttrAOTInput as _SubclassPart
except ImportError:  # pragma: no cover - a torch without aot's input records: one placeholder per input
    _PlainInput = _SubclassPart = None

__all__ = [
    "is_number", "ALLOCATIONS",
    "val", "tensor_val", "float_tensor", "is_call", "writes_in_place", "placeholders", "input_source",
    "FOLDED_FROM", "unfolded", "same_input", "subclass_parts",
    "known_eq", "same_shape", "same_layout", "foldable_nodes", "is_packed", "fake_call", "Emitter", "erase_unused",
    "MAX_EXPANDED_NUMEL", "literal_value", "MAX_LITERAL_NUMEL", "replace_readers",
]

#: Calls that allocate without computing: two of them are two buffers, never one, and a write into one writes
#: nothing else.
ALLOCATIONS = frozenset({
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_permuted.default,
    torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
})

#: A folded value may be larger than the weights it is computed from only up to this many elements.
MAX_EXPANDED_NUMEL = 1 << 20


def val(node: Any) -> Any:
    """The example value (a FakeTensor) that tracing recorded for a node, or the literal itself."""
    if isinstance(node, Node):
        return node.meta.get("val")
    return node


def tensor_val(value: Any) -> Optional[torch.Tensor]:
    """The example tensor of a node, or None for literals and non-tensor nodes."""
    v = val(value) if isinstance(value, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def float_tensor(value: Any, min_rank: int = 0) -> Optional[torch.Tensor]:
    """The example tensor of a node when it is of a float dtype the fused ops compute in (not float8) with at least
    ``min_rank`` dims, else None."""
    v = tensor_val(value)
    return v if v is not None and is_compute_float(v.dtype) and v.dim() >= min_rank else None


def is_call(node: Any, *targets: Any) -> bool:
    """True when ``node`` is a call of one of ``targets``."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def writes_in_place(node: Node) -> bool:
    """True when ``node`` calls an op whose schema mutates one of its arguments."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def placeholders(graph: Graph) -> List[Node]:
    """The graph's inputs, in order."""
    return [n for n in graph.nodes if n.op == "placeholder"]


def input_source(placeholder: Node) -> Optional[Tuple[int, Tuple[str, ...]]]:
    """(the index of the Dynamo graph input an aot graph's ``placeholder`` comes from, the attributes read from it:
    empty for the input as it is, ``("qdata",)`` for an inner tensor of a tensor subclass), from aot's record; None
    for what aot adds itself (sizes included) and where aot recorded nothing."""
    desc, attrs = placeholder.meta.get("desc"), ()
    while _SubclassPart is not None and type(desc) is _SubclassPart:
        desc, attrs = desc.base, (desc.attr, *attrs)
    return (desc.idx, attrs) if _PlainInput is not None and type(desc) is _PlainInput else None


#: The meta key of a main graph's placeholder for a folded value: the fold graph's node that computes it.
FOLDED_FROM = "mindiesd_folded_from"


def unfolded(node: Any) -> Any:
    """The expression a folded value stands for (a node of the fold graph, whose placeholders have the names of the
    weights they are), else ``node`` itself: what a pass checks where a value may have been folded."""
    return node.meta.get(FOLDED_FROM, node) if isinstance(node, Node) and node.op == "placeholder" else node


def same_input(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one value: the same node, or placeholders of one input in the main and fold
    graphs of a split (which keep the input's name)."""
    return a is b or (isinstance(a, Node) and isinstance(b, Node) and a.op == b.op == "placeholder"
                      and a.name == b.name)


def subclass_parts(graph: Graph) -> Set[Node]:
    """The placeholders of an aot graph that are inner tensors of a tensor-subclass input (aot passes a quantized
    weight such as torchao's ``Int8Tensor`` as its data and scales)."""
    if _SubclassPart is None:
        return set()
    return {p for p in placeholders(graph) if type(p.meta.get("desc")) is _SubclassPart}


def known_eq(a: Any, b: Any) -> bool:
    """a == b, provably (False when symbolic and undecidable). A node stands for its traced value, as a size
    argument computed in the graph (``sym_size``) does under ``dynamic=True``."""
    a, b = (val(v) if isinstance(v, Node) else v for v in (a, b))
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def known_row_major(value: torch.Tensor) -> bool:
    """Whether the (possibly symbolic) strides of ``value`` are row-major for every value of its sizes, decided
    from the size expressions alone (no guard is added)."""
    expected, step = [], 1
    for size in reversed(value.shape):
        expected.append(step)
        step = step * (max(size, 1) if type(size) is int else size)
    return all(known_eq(stride, want) for stride, want in zip(value.stride(), reversed(expected)))


def same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Equal sizes (or strides), provably."""
    return len(a) == len(b) and all(known_eq(x, y) for x, y in zip(a, b))


def same_layout(a: Any, b: Any) -> bool:
    """Tensors of one dtype, device, shape and strides (element-wise through tuples): one can stand wherever the
    other is read. Two non-tensor values of one type count as the same."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.dtype == b.dtype and a.device == b.device and same_shape(a.shape, b.shape)
                and same_shape(a.stride(), b.stride()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_layout(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, torch.Tensor)


def _numel(value: Any) -> Optional[int]:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return int(value.numel())
    except Exception:  # symbolic
        return None


def _is_pure_aten(node: Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
        return False
    return target.namespace in ("aten", "prims")


def _foldable(node: Node) -> bool:
    """A pure aten call whose value has a known size that folding would not blow up (a materialised broadcast)."""
    if node.target is operator.getitem:
        return node.op == "call_function"
    if not _is_pure_aten(node):
        return False
    value = node.meta.get("val")
    numel = _numel(value)
    if numel is None:
        return isinstance(value, (list, tuple))  # a tensor of symbolic or unknown size is not folded
    input_numel = sum(_numel(i.meta.get("val")) or 0 for i in node.all_input_nodes)
    return numel <= max(input_numel, 1) or numel <= MAX_EXPANDED_NUMEL


def _bytes(value: Any) -> Optional[int]:
    numel = _numel(value)
    return None if numel is None else numel * value.dtype.itemsize


def is_packed(value: Any) -> bool:
    """Whether ``value`` (a node's, or a tensor) is packed in one byte per element or less (int8, uint8, float8, ...):
    as a weight, a quantized one."""
    value = val(value)
    return isinstance(value, torch.Tensor) and value.dtype != torch.bool and value.dtype.itemsize == 1


def _packed_bytes(node: Node) -> int:
    """The bytes of ``node``'s value when it is packed (:func:`is_packed`), else 0."""
    return (_bytes(node.meta.get("val")) or 0) if is_packed(node) else 0


def foldable_nodes(graph: Graph, constants: Set[Node]) -> Set[Node]:
    """``constants`` and every node computed from them alone that freezing folds: the one definition of a
    constant, shared by freezing's split and by the rewrites that run before it, so that they cannot disagree.

    A value computed from weights packed in one byte per element (int8, float8: quantized weights) that takes more
    bytes than they do is their dequantized copy: it is not folded, so that the model never holds the weight twice,
    and is computed per call, as eager does."""
    constant = set(constants)
    packed: Dict[Node, int] = {node: n for node in constants if (n := _packed_bytes(node))}
    for node in graph.nodes:
        if node.op != "call_function" or not all(i in constant for i in node.all_input_nodes) or not _foldable(node):
            continue
        source = sum(packed.get(i, 0) for i in node.all_input_nodes)
        if source:
            size = _bytes(node.meta.get("val"))
            if size is not None and size > source:
                continue
            packed[node] = source
        constant.add(node)
    return constant


def fake_call(target: Any, args: Sequence[Any], kwargs: Dict[str, Any], value_of: Callable[[Node], Any]) -> Any:
    """``target`` run on the fake values (``value_of(node)``) of its node arguments, in the graph's fake mode."""
    fake_args, fake_kwargs = torch.fx.node.map_arg((tuple(args), kwargs), value_of)
    fake_mode = detect_fake_mode((fake_args, fake_kwargs))
    if fake_mode is None:
        raise RuntimeError("no fake tensor mode on the graph's values")
    with fake_mode:
        return target(*fake_args, **fake_kwargs)


_HOST_SCALAR = "mindiesd_host_scalar"


def _fake_value(node: Node) -> Any:
    """A node's traced value; for a host scalar (read at run time), a stand-in number: a fused op's fake uses
    shapes and dtypes only, and an op schema's ``float`` does not take a symbol."""
    return node.meta[_HOST_SCALAR] if _HOST_SCALAR in node.meta else node.meta["val"]


class Emitter:
    """Creates nodes before ``anchor`` and gives each the example value its target computes on fake inputs."""

    def __init__(self, graph: Graph, anchor: Node):
        self.graph, self.anchor = graph, anchor
        self.created: List[Node] = []

    def _insert(self, target: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, tuple(args), kwargs)
        self.created.append(node)
        return node

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        node = self._insert(target, args, kwargs)
        node.meta["val"] = fake_call(target, args, kwargs, _fake_value)
        return node

    def host_scalar(self, tensor: Node) -> Node:
        """A node reading the value of a 0-dim CPU tensor as a Python number at run time (``.item()``); its traced
        value is a fresh unbacked symbol, as Dynamo's own ``.item()`` gives."""
        node = self._insert(torch.ops.aten._local_scalar_dense.default, (tensor,), {})
        value = tensor.meta["val"]
        shape_env = getattr(detect_fake_mode([value]), "shape_env", None)
        if shape_env is None:
            raise RuntimeError("a host scalar needs the symbolic shape environment of dynamic=True")
        floating = value.dtype.is_floating_point
        node.meta["val"] = shape_env.create_unbacked_symfloat() if floating else shape_env.create_unbacked_symint()
        node.meta[_HOST_SCALAR] = 1.0 if floating else 1
        return node

    def discard(self) -> None:
        """Erase the nodes this emitter created that nothing reads (all of them, when none was put to use)."""
        erase_unused(self.created)
        self.created.clear()


def erase_unused(nodes: Iterable[Any]) -> None:
    """Erase the calls among ``nodes`` that nothing reads any more; erasing one may free its inputs among
    ``nodes``, so repeat. Nodes outside ``nodes`` are left alone (no dead-code pass over the graph)."""
    pending = {node: None for node in nodes if isinstance(node, Node) and node.op == "call_function"}
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


_NUMBER_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def is_number(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a number (a ``SymInt``, ``SymFloat``, ``SymBool`` or plain one): from its traced
    value, or in a loaded graph, whose nodes carry none, from what was stored."""
    return isinstance(node.meta.get("val"), _NUMBER_TYPES) or node.meta.get("number", False)


def replace_readers(node: Node, value: Node) -> None:
    """Make every reader of ``node`` (each a view or copy that ``value`` stands for: a ``getitem`` of its first
    output, a copy into ``value``'s layout) read ``value`` instead, then erase those readers and ``node``."""
    for reader in list(node.users):
        reader.replace_all_uses_with(value)
        node.graph.erase_node(reader)
    node.graph.erase_node(node)


#: The most elements :func:`literal_value` computes for one node (index tables, block masks: small).
MAX_LITERAL_NUMEL = 1 << 20


def literal_value(node: Any, cache: Dict[Node, Any], depth: int = 0) -> Any:
    """The real value of ``node`` where it is computed from literals alone (aten calls on numbers and lists: no
    placeholder, no get_attr, at most 16 calls deep), by running those calls outside any fake mode; None otherwise.
    ``cache`` keeps the values found (and the Nones) across calls on one graph."""
    if not isinstance(node, Node):
        return node
    if node in cache:
        return cache[node]
    value = None
    traced = node.meta.get("val")
    small = not isinstance(traced, torch.Tensor) or (_numel(traced) or MAX_LITERAL_NUMEL + 1) <= MAX_LITERAL_NUMEL
    if node.op == "call_function" and depth < 16 and small and isinstance(node.target, torch._ops.OpOverload) \
            and node.target.namespace in ("aten", "prims") and not node.target._schema.is_mutable:
        missing = object()

        def arg(a: Any) -> Any:
            if isinstance(a, Node):
                v = literal_value(a, cache, depth + 1)
                return missing if v is None else v
            return a

        args = torch.fx.node.map_aggregate(node.args, arg)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, arg)
        flat = [*torch.utils._pytree.tree_leaves(args), *torch.utils._pytree.tree_leaves(kwargs)]
        if not any(a is missing for a in flat):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            try:
                with unset_fake_temporarily():  # real values, where aot's fake mode is active
                    value = node.target(*args, **kwargs)
            except Exception:
                value = None
    cache[node] = value
    return value
