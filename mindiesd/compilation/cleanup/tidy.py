"""After the fusion passes: fewer calls for the same values.

What a fused graph still runs is mostly calls that compute nothing new, and on an accelerator without device-graph
capture every call is a launch (or at least a trip through the dispatcher) from the host:

* :func:`dedupe` computes once what the graph computes several times: each of Flux's blocks takes ``silu(temb)``
  again for its adaLN, and every q/k rotation unsqueezes the same rotary tables. Two calls of one pure op on the
  same arguments become one.
* :func:`identities` drops what gives its input back: a product with the number 1, and a concatenation of
  slices of a concatenation that only reorders its parts (a sinusoidal embedding's ``flip_sin_to_cos``);
* :func:`concatenate_first` computes once over a concatenation what was computed for each of its parts: Flux's
  rotary tables take cos, repeat-interleave and cast each axis's angles and concatenate the results, where one
  cos, one repeat and one cast of the concatenated angles give the same values in a third of the calls;
* :func:`pair_tables` hands a rotation the per-pair table where it read one repeated for both elements of each
  pair: Flux's ``repeat_interleave(cos, 2)`` (an expand, a copy and views) is not run, and its cast casts half;
* :func:`linear_calls` gives a linear layer back the one call it was before aot decomposed it: ``linear(x, w, b)``
  runs the same ``addmm`` on the same operands as ``view(addmm(b, view(x, [M, K]), t(w)), ...)``, with the views
  and the transpose made in C++ instead of three calls from the host;
* :func:`unsqueeze_first` unsqueezes a tensor once before splitting it where every piece was unsqueezed after:
  adaLN's modulation, ``emb.chunk(6, dim=1)`` and then ``shift[:, None]`` for each of the six;
* :func:`collapse_views` makes a chain of reshapes one view, and drops a view that changes nothing: a linear
  layer's ``[B, S, N]`` view followed by the heads' ``[B, S, H, D]`` view is one view of the matmul's result.

Each keeps the invariants of ``passes/README.md``: nothing that writes in place is touched (nor anything at all in
a graph that writes in place), the graph's inputs and outputs stay, and a replacement has the replaced node's
traced layout, checked on the traced values (a node without one is left alone).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch
from torch.fx import Graph, Node

from ..fx_utils import ALLOCATIONS, fake_call, is_call, known_eq, known_row_major, same_layout, tensor_val, writes_in_place

__all__ = ["dedupe", "identities", "concatenate_first", "pair_tables", "linear_calls", "unsqueeze_first",
           "collapse_views", "tidy"]

aten = torch.ops.aten

#: Views that only reshape (no offset, no new strides beyond what a view of the result's shape gives).
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
             aten.squeeze.dims, aten.squeeze.default)



def tidy(graph: Graph) -> Dict[str, int]:
    """Every step in turn (:func:`dedupe` again after :func:`concatenate_first`, which makes calls the same); how
    many calls each removed."""
    steps = {"dedupe": 0, "identities": 0, "concatenate_first": 0, "pair_tables": 0, "linear_calls": 0,
             "unsqueeze_first": 0, "collapse_views": 0}
    if any(writes_in_place(node) for node in graph.nodes):
        return steps
    steps["dedupe"] = dedupe(graph)
    steps["identities"] = identities(graph)
    steps["concatenate_first"] = concatenate_first(graph)
    steps["dedupe"] += dedupe(graph)
    steps["pair_tables"] = pair_tables(graph)
    steps["linear_calls"] = linear_calls(graph)
    steps["unsqueeze_first"] = unsqueeze_first(graph)
    steps["collapse_views"] = collapse_views(graph)
    return steps


def _count(graph: Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")


def _traced(node: Node) -> Any:
    return node.meta["val"]


def _key(value: Any) -> Optional[Hashable]:
    """A hashable stand-in for an argument that equals another's only when the two are the same argument."""
    if isinstance(value, Node):
        return value
    if isinstance(value, (list, tuple)):
        parts = tuple(_key(v) for v in value)
        return None if any(p is None for p in parts) else (type(value).__name__, parts)
    if isinstance(value, float):
        return ("float", value.hex())  # 0.0 and -0.0 differ; a NaN equals itself
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value).__name__, value)
    return None


def _pure(node: Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable or target in ALLOCATIONS:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def dedupe(graph: Graph) -> int:
    """Merge calls of one pure op on the same arguments into the first of them (outputs excepted, so that no two
    outputs come to be one tensor); returns how many were removed."""
    seen: Dict[Tuple[Any, ...], Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not _pure(node) or any(u.op == "output" for u in node.users):
            continue
        key = _key((node.args, tuple(sorted(node.kwargs.items()))))
        if key is None:
            continue
        key = (node.target, key)
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        if not same_layout(first.meta.get("val"), node.meta.get("val")):
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        removed += 1
    return removed


def collapse_views(graph: Graph) -> int:
    """Each reshape of a reshape becomes one view of the first one's input, where that view has the traced shape
    and strides; the reshapes in between go when nothing else reads them. Returns how many calls went."""
    before = _count(graph)
    for node in list(graph.nodes):
        if is_call(node, *_RESHAPES) and _unchanged(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        if not is_call(node, *_RESHAPES) or not is_call(node.args[0], *_RESHAPES):
            continue
        base = node.args[0]
        while is_call(base, *_RESHAPES):
            base = base.args[0]
        out, source = tensor_val(node), tensor_val(base)
        if out is None or source is None:
            continue
        if _static(out) and _static(source):
            shape = [int(s) for s in out.shape]
        elif is_call(node, aten.view.default, aten._unsafe_view.default) and isinstance(node.args[1], (list, tuple)):
            shape = list(node.args[1])  # symbolic sizes: the last view's own size arguments
        else:
            continue
        try:
            value = fake_call(aten.view.default, (base, shape), {}, _traced)
        except Exception:  # noqa: BLE001  (not a view of the base: leave the chain)
            continue
        if not same_layout(value, out) or not known_eq(value.storage_offset(), out.storage_offset()):
            continue
        previous = node.args[0]
        with graph.inserting_before(node):
            view = graph.call_function(aten.view.default, (base, shape))
        view.meta = dict(node.meta, val=value)
        node.replace_all_uses_with(view)
        graph.erase_node(node)
        if _unchanged(view):  # the chain came back to its base's shape
            view.replace_all_uses_with(base)
            graph.erase_node(view)
        while is_call(previous, *_RESHAPES) and not previous.users:
            above = previous.args[0]
            graph.erase_node(previous)
            previous = above
    return before - _count(graph)


def identities(graph: Graph) -> int:
    """``x * 1`` and ``x / 1`` (of x's dtype) become ``x``; ``cat`` of slices of ``cat(parts, d)`` along ``d`` that
    each span whole parts becomes ``cat`` of those parts. Returns how many calls went."""
    before = _count(graph)
    for node in list(graph.nodes):
        if is_call(node, aten.mul.Tensor, aten.div.Tensor):  # x itself: never as an output of its own
            replacement = None if any(u.op == "output" for u in node.users) else _times_one(node)
        else:
            replacement = _reordered_parts(graph, node) if is_call(node, aten.cat.default) else None
        if replacement is None:
            continue
        node.replace_all_uses_with(replacement)
        _erase_chain(graph, node, set())
    for node in reversed(list(graph.nodes)):  # the slices and concatenations nothing reads now
        if is_call(node, aten.slice.Tensor, aten.cat.default) and not node.users:
            graph.erase_node(node)
    return before - _count(graph)


def _times_one(node: Node) -> Optional[Node]:
    x = node.args[0] if len(node.args) == 2 and not node.kwargs else None
    if not isinstance(x, Node) or type(node.args[1]) not in (int, float) or node.args[1] != 1:
        return None
    return x if same_layout(tensor_val(x), tensor_val(node)) else None


def _reordered_parts(graph: Graph, node: Node) -> Optional[Node]:
    """``cat(parts', d)`` in place of ``node``, a ``cat`` along ``d`` of slices that each span whole parts of one
    ``cat(parts, d)``; None where ``node`` is not that."""
    slices, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    out = tensor_val(node)
    if node.kwargs or not isinstance(slices, (list, tuple)) or out is None or not _static(out) \
            or not all(is_call(p, aten.slice.Tensor) for p in slices):
        return None
    dim %= out.dim()
    inner = slices[0].args[0]
    if not is_call(inner, aten.cat.default) or inner.kwargs:
        return None
    parts = inner.args[0]
    inner_dim = (inner.args[1] if len(inner.args) > 1 else 0) % out.dim()
    sizes = [tensor_val(p).shape[dim] if tensor_val(p) is not None else None for p in parts]
    if inner_dim != dim or any(type(size) is not int for size in sizes):
        return None
    starts = [sum(sizes[:i]) for i in range(len(parts) + 1)]
    picked: List[Node] = []
    for piece in slices:
        source, piece_dim, start, end, step = (list(piece.args) + [0, None, None, 1][len(piece.args) - 1:])[:5]
        end = starts[-1] if end is None else min(end, starts[-1])
        if source is not inner or piece_dim % out.dim() != dim or step != 1 or start not in starts \
                or end not in starts or end <= start:
            return None
        picked.extend(parts[starts.index(start):starts.index(end)])
    with graph.inserting_before(node):
        joined = graph.call_function(aten.cat.default, (picked, dim))
    joined.meta["val"] = fake_call(aten.cat.default, joined.args, {}, _traced)
    if not same_layout(joined.meta["val"], out):
        graph.erase_node(joined)
        return None
    return joined


#: Elementwise ops of one tensor: applied to a concatenation, they give the concatenation of their results.
_ELEMENTWISE = (aten.cos.default, aten.sin.default, aten.exp.default, aten.neg.default, aten.silu.default,
                aten.sigmoid.default, aten.tanh.default, aten._to_copy.default)


def concatenate_first(graph: Graph) -> int:
    """``cat([f(x_1), ..., f(x_n)], d)`` becomes ``f(cat([x_1, ..., x_n], d))`` where ``f`` is one elementwise op
    of one tensor (with the same keywords for every part) or the repeat-interleave along the last dim that aot
    makes of ``repeat_interleave`` (``view(clone(expand(unsqueeze(x, -1), [..., r])), [..., D * r])``, then with
    ``d`` the last dim), and nothing else reads the parts; repeated until nothing changes. Returns how many calls
    went."""
    before = _count(graph)
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if is_call(node, aten.cat.default) and not node.kwargs and _concatenate_first(graph, node):
                changed = True
    return before - _count(graph)


def _concatenate_first(graph: Graph, cat: Node) -> bool:
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else 0
    out = tensor_val(cat)
    if not isinstance(parts, (list, tuple)) or len(parts) < 2 or out is None or not _static(out) \
            or not all(isinstance(p, Node) and len(p.users) == 1 for p in parts):
        return False
    if len(set(parts)) < len(parts):  # a part repeated: f runs once on it already (and a pair table stays one)
        return False
    dim %= out.dim()
    chains = [_elementwise(p) or _repeat_interleave(p, out.dim(), dim) for p in parts]
    if any(c is None for c in chains) or len({c[0] for c in chains}) != 1:
        return False
    inputs = [c[1] for c in chains]
    values = [tensor_val(x) for x in inputs]
    if any(v is None or not _static(v) or v.dtype != values[0].dtype or v.device != values[0].device
           for v in values):
        return False
    with graph.inserting_before(cat):
        joined = graph.call_function(aten.cat.default, (list(inputs), dim))
        joined.meta["val"] = fake_call(aten.cat.default, joined.args, {}, _traced)
        result = joined
        for target, args, kwargs in chains[0][2](joined):  # the parts' calls, on the concatenation
            result = graph.call_function(target, (result, *args), kwargs)
            result.meta["val"] = fake_call(target, result.args, kwargs, _traced)
    if not same_layout(result.meta["val"], out):
        for node in [*_chain_above(result, joined), joined]:  # the last made first: each has no reader left
            graph.erase_node(node)
        return False
    cat.replace_all_uses_with(result)
    graph.erase_node(cat)
    for part in parts:
        _erase_chain(graph, part, set(inputs))
    return True


def _chain_above(node: Node, stop: Node) -> List[Node]:
    """``node`` and the first inputs above it, up to ``stop`` (left out)."""
    chain = []
    while node is not stop:
        chain.append(node)
        node = node.args[0]
    return chain


def _erase_chain(graph: Graph, node: Any, keep: set) -> None:
    """Erase ``node`` and the first inputs above it while nothing reads them (and they are not in ``keep``)."""
    while isinstance(node, Node) and node not in keep and node.op == "call_function" and not node.users:
        above = node.args[0]
        graph.erase_node(node)
        node = above


def _elementwise(part: Node):
    """``(key, x, calls)`` where ``part`` is an elementwise op of one tensor ``x``; ``calls(y)`` lists the call
    to make of the concatenation ``y``."""
    if not is_call(part, *_ELEMENTWISE) or len(part.args) != 1:
        return None
    if part.target is aten._to_copy.default and set(part.kwargs) - {"dtype"}:
        return None
    kwargs = dict(part.kwargs)
    return ((part.target, _key(tuple(sorted(kwargs.items())))), part.args[0], lambda y: [(part.target, (), kwargs)])


def _repeat_interleave(part: Node, rank: int, dim: int):
    """``(key, x, calls)`` where ``part`` is aot's repeat-interleave of ``x`` along its last dim and the parts are
    joined along that dim."""
    if dim != rank - 1 or not is_call(part, aten.view.default):
        return None
    clone = part.args[0]
    if not is_call(clone, aten.clone.default) or set(clone.kwargs) - {"memory_format"} \
            or clone.kwargs.get("memory_format", torch.contiguous_format) is not torch.contiguous_format:
        return None
    expand = clone.args[0]
    if not is_call(expand, aten.expand.default) or len(clone.users) != 1 or len(expand.users) != 1:
        return None
    unsqueeze = expand.args[0]
    if not is_call(unsqueeze, aten.unsqueeze.default) or len(unsqueeze.users) != 1:
        return None
    x = tensor_val(unsqueeze.args[0])
    if x is None or not _static(x) or x.dim() != rank or unsqueeze.args[1] not in (rank, -1):
        return None
    shape = [int(s) for s in x.shape]
    repeats = list(expand.args[1])[-1]
    if list(expand.args[1]) != shape + [repeats] or list(part.args[1]) != shape[:-1] + [shape[-1] * repeats]:
        return None

    def calls(y: Node):
        joined = [int(s) for s in y.meta["val"].shape]
        return [(aten.unsqueeze.default, (rank,), {}), (aten.expand.default, (joined + [repeats],), {}),
                (aten.clone.default, (), {"memory_format": torch.contiguous_format}),
                (aten.view.default, (joined[:-1] + [joined[-1] * repeats],), {})]

    return (("repeat_interleave", repeats), unsqueeze.args[0], calls)


def pair_tables(graph: Graph) -> int:
    """A rotary table that repeats each value for both elements of its pair (``repeat_interleave(t, 2, -1)`` for an
    interleaved rotation, ``cat([t, t], -1)`` for a rotation of halves), read (through casts and views that keep
    its last dim) only as ``cos``/``sin`` by ``mindiesd.rope``/``norm_rope`` calls of that form whose other table
    is one too, is passed as ``t``: the ops take a per-pair table, so the repeat (an ``expand``, a ``clone`` and
    views) is never run and the casts cast half the values. Returns how many calls went."""
    before = _count(graph)
    plans = []  # found on the graph as it was, then made: a consumer's other table is checked before it changes
    for node in list(graph.nodes):
        half = _per_pair(node)
        if half is None or not _static_val(node):
            continue
        tables: List[Node] = []
        leaves: List[Tuple[Node, int]] = []
        if _table_uses(node, half[1], tables, leaves):
            plans.append((node, half, tables, leaves))
    while True:  # a rotation's two tables change together or not at all (a kernel reads both in one form)
        changing = {table for node, _, tables, _ in plans for table in (node, *tables)}
        kept = [plan for plan in plans if all(_other_table(consumer, index) in changing
                                              for consumer, index in plan[3])]
        if len(kept) == len(plans):
            break
        plans = kept
    for node, half, tables, leaves in plans:
        made: Dict[Node, Node] = {node: half[0]}
        width = int(tensor_val(half[0]).shape[-1])
        for table in tables:  # parents before children
            source = made[table.args[0]]
            with graph.inserting_before(table):
                if is_call(table, aten._to_copy.default):
                    copy = graph.call_function(aten._to_copy.default, (source,), dict(table.kwargs))
                else:
                    shape = [int(n) for n in tensor_val(table).shape]
                    copy = graph.call_function(aten.view.default, (source, shape[:-1] + [width]))
            copy.meta = dict(table.meta, val=fake_call(copy.target, copy.args, copy.kwargs, _traced))
            made[table] = copy
        for consumer, index in leaves:
            args = list(consumer.args)
            args[index] = made[args[index]]
            consumer.args = tuple(args)
        for table in reversed([node, *tables]):
            if not table.users and not getattr(table, "_erased", False):
                _erase_chain(graph, table, {half[0]})
    return before - _count(graph)


#: The ops that take per-pair rotary tables: (op, index of cos, of sin, of interleaved).
_ROPE_TABLES = {"rope": (1, 2, 3), "norm_rope": (6, 7, 8)}


def _rope_tables(node: Node) -> Optional[Tuple[int, int, bool]]:
    """``(cos index, sin index, interleaved)`` of a ``mindiesd.rope``/``norm_rope`` call; None for other nodes."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
            or target.namespace != "mindiesd" or set(node.kwargs) - {"out_dtype"}:
        return None
    indices = _ROPE_TABLES.get(target._schema.name.split("::")[-1])
    if indices is None or len(node.args) <= indices[2] or not isinstance(node.args[indices[2]], bool):
        return None
    return indices[0], indices[1], node.args[indices[2]]


def _other_table(consumer: Node, index: int) -> Any:
    """The rotation's other table: its ``sin`` for ``cos`` and the reverse."""
    cos, sin, _ = _rope_tables(consumer)
    return consumer.args[sin if index == cos else cos]


def _per_pair(node: Node) -> Optional[Tuple[Node, bool]]:
    """``(t, interleaved)`` where ``node`` repeats each value of ``t`` for both elements of a pair along the last
    dim: aot's ``repeat_interleave(t, 2, -1)`` (interleaved pairs) or ``cat([t, t], -1)`` (halves)."""
    value = tensor_val(node)
    if value is None or value.dim() < 1:
        return None
    if is_call(node, aten.cat.default) and not node.kwargs:
        parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        if isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is parts[1] \
                and isinstance(parts[0], Node) and dim % value.dim() == value.dim() - 1:
            return parts[0], False
        return None
    repeat = _repeat_interleave(node, value.dim(), value.dim() - 1)
    if repeat is None or repeat[0] != ("repeat_interleave", 2):
        return None
    return repeat[1], True


def _table_uses(node: Node, interleaved: bool, tables: List[Node], leaves: List[Tuple[Node, int]]) -> bool:
    """Whether every reader of the pair-repeated table ``node`` is a cast or a view that keeps the last dim
    (collected into ``tables``, readers before their own readers) leading only to ``cos``/``sin`` arguments of
    rope calls of the ``interleaved`` form whose other table is pair-repeated too (into ``leaves``)."""
    for user in node.users:
        if user.op == "output":
            return False
        indices = _rope_tables(user)
        if indices is not None:
            cos, sin, form = indices
            if form != interleaved:
                return False
            positions = [i for i, a in enumerate(user.args) if a is node]
            if not positions or any(i not in (cos, sin) for i in positions):
                return False
            other = user.args[sin] if positions == [cos] else user.args[cos] if positions == [sin] else None
            if other is not None and _pair_source(other, interleaved) is None:
                return False
            leaves.extend((user, i) for i in positions)
            continue
        value, parent = tensor_val(user), tensor_val(node)
        if value is None or parent is None or not _static(value) or user.args[0] is not node:
            return False
        if is_call(user, aten._to_copy.default) and len(user.args) == 1 and set(user.kwargs) <= {"dtype"}:
            pass
        elif not (is_call(user, *_RESHAPES) and value.shape[-1] == parent.shape[-1] and parent.is_contiguous()):
            return False
        tables.append(user)
        if not _table_uses(user, interleaved, tables, leaves):
            return False
    return True


def _pair_source(node: Any, interleaved: bool) -> Optional[Node]:
    """The pair-repeated table that ``node`` casts or views (keeping the last dim), or None."""
    while isinstance(node, Node):
        half = _per_pair(node)
        if half is not None:
            return node if half[1] == interleaved else None
        if not is_call(node, aten._to_copy.default, *_RESHAPES):
            return None
        node = node.args[0]
    return None


def _static_val(node: Node) -> bool:
    value = tensor_val(node)
    return value is not None and _static(value)


_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


def unsqueeze_first(graph: Graph) -> int:
    """``split(x, s, d)`` whose pieces are all read only through ``unsqueeze(piece, k)`` (one ``k``) becomes
    ``split(unsqueeze(x, k), s, d')``, the pieces being those unsqueezed views (the same values, shapes and strides
    but for dims of size 1, which address nothing). Returns how many calls went."""
    before = _count(graph)
    for split in list(graph.nodes):
        if not is_call(split, *_SPLITS) or split.kwargs or len(split.args) < 2:
            continue
        source, sizes = split.args[0], split.args[1]
        x = tensor_val(source)
        pieces = list(split.users)
        if x is None or not _static(x) or not pieces or not all(p.target is operator.getitem for p in pieces):
            continue
        unsqueezes = [u for p in pieces for u in p.users]
        if not unsqueezes or not all(is_call(u, aten.unsqueeze.default) and isinstance(u.args[1], int)
                                     for u in unsqueezes):
            continue
        dims = {u.args[1] % (x.dim() + 1) for u in unsqueezes}
        if len(dims) != 1:
            continue
        (k,) = dims
        d = (split.args[2] if len(split.args) > 2 else 0) % x.dim()
        with graph.inserting_before(split):
            lifted = graph.call_function(aten.unsqueeze.default, (source, k))
            lifted.meta["val"] = fake_call(aten.unsqueeze.default, lifted.args, {}, _traced)
            resplit = graph.call_function(split.target, (lifted, sizes, d + 1 if k <= d else d))
            resplit.meta["val"] = fake_call(split.target, resplit.args, {}, _traced)
        new_pieces = {}
        for piece in pieces:
            with graph.inserting_before(split):
                new_pieces[piece] = graph.call_function(operator.getitem, (resplit, piece.args[1]))
            new_pieces[piece].meta["val"] = resplit.meta["val"][piece.args[1]]
        if not all(_same_memory(new_pieces[u.args[0]].meta["val"], u.meta.get("val")) for u in unsqueezes):
            for node in (*new_pieces.values(), resplit, lifted):
                graph.erase_node(node)
            continue
        for unsqueeze in unsqueezes:
            unsqueeze.replace_all_uses_with(new_pieces[unsqueeze.args[0]])
            graph.erase_node(unsqueeze)
        for piece in pieces:
            graph.erase_node(piece)
            if not new_pieces[piece].users:
                graph.erase_node(new_pieces[piece])
        graph.erase_node(split)
    return before - _count(graph)


def _same_memory(a: Any, b: Any) -> bool:
    """Tensors of one dtype, device and shape that address the same elements: equal offsets and equal strides
    in every dim of more than one element."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not _static(a) or not _static(b):
        return False
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
            and a.storage_offset() == b.storage_offset()
            and all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1))


def _unchanged(view: Node) -> bool:
    """A reshape whose result has its input's shape, strides and offset (and is not an output)."""
    out, source = tensor_val(view), tensor_val(view.args[0])
    return (out is not None and source is not None and same_layout(out, source)
            and known_eq(out.storage_offset(), source.storage_offset())
            and not any(user.op == "output" for user in view.users))


def linear_calls(graph: Graph) -> int:
    """Each ``addmm(b, x2, t(w))`` of a 1-D bias, where ``x2`` is 2-D or the row view ``view(x, [M, K])`` of a
    contiguous 3-D ``x``, becomes ``linear(x, w, b)`` (then viewed as ``[M, N]`` for the 3-D ``x``): ATen's linear
    computes exactly that addmm for these inputs. Returns how many calls went."""
    before = _count(graph)
    for node in list(graph.nodes):
        if not is_call(node, aten.addmm.default) or node.kwargs or len(node.args) != 3:
            continue
        bias, rows, transposed = node.args
        if not is_call(transposed, aten.t.default) or not isinstance(bias, Node):
            continue
        weight = transposed.args[0]
        b, w, out = tensor_val(bias), tensor_val(weight), tensor_val(node)
        if b is None or w is None or out is None or b.dim() != 1 or w.dim() != 2 or out.dim() != 2 \
                or type(out.shape[1]) is not int:
            continue
        source = rows
        if is_call(rows, aten.view.default) and _is_row_view(rows):
            source = rows.args[0]
        elif tensor_val(rows) is None or tensor_val(rows).dim() != 2:
            continue
        with graph.inserting_before(node):
            linear = graph.call_function(aten.linear.default, (source, weight, bias))
            linear.meta["val"] = fake_call(aten.linear.default, (source, weight, bias), {}, _traced)
            result = linear
            if source is not rows:  # the rows' count as the row view has it (a size the graph computes, or an int)
                result = graph.call_function(aten.view.default, (linear, [rows.args[1][0], int(out.shape[1])]))
                result.meta["val"] = fake_call(aten.view.default, result.args, {}, _traced)
        if not same_layout(result.meta["val"], out):
            for created in (result, linear) if result is not linear else (linear,):
                graph.erase_node(created)
            continue
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        for leftover in (transposed, rows):
            if leftover is not source and isinstance(leftover, Node) and not leftover.users:
                graph.erase_node(leftover)
    return before - _count(graph)


def _is_row_view(view: Node) -> bool:
    """``view(x, [M, K])`` of a contiguous 3-D ``x``: the rows ATen's linear flattens it into (with symbolic sizes:
    provably so at every size)."""
    x = tensor_val(view.args[0])
    shape = view.args[1] if len(view.args) == 2 else None
    if x is None or x.dim() != 3 or not isinstance(shape, (list, tuple)) or len(shape) != 2:
        return False
    if _static(x):
        return x.is_contiguous() and list(shape) == [int(x.shape[0]) * int(x.shape[1]), int(x.shape[2])]
    return known_row_major(x) and known_eq(shape[0], x.shape[0] * x.shape[1]) and known_eq(shape[1], x.shape[2])


def _static(value: torch.Tensor) -> bool:
    return all(type(s) is int for s in (*value.shape, *value.stride()))
