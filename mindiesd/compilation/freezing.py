"""Freezing: parameters and buffers become constants, and what depends on them alone is folded.

The aten graph is split in two: a *fold* graph that computes, from the weights alone, every value the rest of the
graph needs (a transposed or upcast weight, RoPE frequency tables built from buffers, ``arange`` tables...),
and a *main* graph that takes those folded values as inputs in place of the weights they came from. What can be
folded is :func:`~mindiesd.compilation.fx_utils.foldable_nodes`, the definition the freeze-stage rewrites use too.
Quantized weights are never folded into a full-precision copy: a weight packed in int8 or float8 is folded only into
values no larger than itself (its column sums, its scales in x's dtype), whether it is a plain tensor or an inner
tensor of a tensor-subclass weight (torchao's), which aot passes as its parts (:func:`weight_placeholders`).

Folded values are computed on the first call and cached per set of weights. The cache is keyed on the identity
of the weight tensors and checked against their storage pointer and version counter on every call, so one
compiled graph serving several module instances (a class-decorated block, ``compile_repeated_blocks``) gives
each instance the result of its own weights, and weights replaced (``param.data = ...``) or modified in place
(``load_state_dict``, ``with torch.no_grad(): p.copy_(...)``) are folded again before the next use.
Writes through ``param.data.copy_(...)`` bypass the version counter; call :func:`clear_frozen_caches` after them.

A folded value that is the concatenation of whole weights along their first dimension (the merged projection
weight of ``merge_projections``) is not kept as a copy: the weights themselves are moved into it
(``param.data`` becomes a view of the concatenation), so the model holds each weight once and every later write
to a weight, ``.data`` writes included (PEFT's ``merge()``), lands in what the merged matmul reads. Where the
weights already lie side by side in that order (a second compiled graph, for another input shape, over the same
weights), the folded value is a view of them and nothing is copied.

Whenever folded values leave the cache (cleared, evicted, or replaced by a new fold), the listeners added with
:func:`add_release_listener` are told, so that device-graph captures reading them are dropped too.
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.fx import Graph, GraphModule, Node

from .fx_utils import FOLDED_FROM, foldable_nodes, input_source, is_call, placeholders, tensor_val, writes_in_place

log = logging.getLogger("mindiesd.compilation")

__all__ = ["split_constants", "constant_inputs", "weight_placeholders", "FrozenGraph", "clear_frozen_caches",
           "add_release_listener", "MAX_WEIGHT_SETS"]

#: How many weight sets one compiled graph keeps folded values for (least recently used evicted first).
MAX_WEIGHT_SETS = 256

_live_graphs: "weakref.WeakSet[FrozenGraph]" = weakref.WeakSet()
_release_listeners: List[Callable[[Sequence[torch.Tensor]], None]] = []


def clear_frozen_caches() -> None:
    """Drop every cached folded value, and the device-graph captures that read them; the next call folds again."""
    for frozen in list(_live_graphs):
        frozen.clear()


def add_release_listener(listener: Callable[[Sequence[torch.Tensor]], None]) -> None:
    """Call ``listener(tensors)`` with the folded values each time they leave a cache (while still alive)."""
    if listener not in _release_listeners:
        _release_listeners.append(listener)


def _released(tensors: Sequence[torch.Tensor]) -> None:
    if tensors:
        for listener in list(_release_listeners):
            listener(tensors)


def _mutated_placeholders(gm: GraphModule) -> Set[Node]:
    mutated = set()
    for node in gm.graph.nodes:
        if writes_in_place(node):
            for arg, schema_arg in zip(node.args, node.target._schema.arguments):
                if isinstance(arg, Node) and arg.op == "placeholder" and schema_arg.alias_info is not None and schema_arg.alias_info.is_write:
                    mutated.add(arg)
    return mutated


def weight_placeholders(gm: GraphModule, weights: Sequence[int]) -> Set[Node]:
    """The placeholders of ``gm`` that are the weights at ``weights`` (indices of the inputs Dynamo passes), or
    parts of them.

    aot passes a tensor-subclass weight (a quantized weight: torchao's ``Int8Tensor``, ``Float8Tensor``) as its
    inner tensors, so the placeholders no longer line up with the inputs; they are matched through aot's record of
    each placeholder's input. What is computed from packed inner tensors alone is folded only where it is no larger
    than they are (:func:`~mindiesd.compilation.fx_utils.foldable_nodes`): never the dequantized weight."""
    inputs = placeholders(gm.graph)
    wanted = set(weights)
    if not any("desc" in p.meta for p in inputs):  # no record: one placeholder per input
        return {inputs[i] for i in wanted if i < len(inputs)}
    return {p for p in inputs if (source := input_source(p)) is not None and source[0] in wanted}


def constant_inputs(gm: GraphModule, weights: Sequence[int]) -> Set[Node]:
    """The placeholders of ``gm`` that freezing treats as constants: the weights (``weights``, indices of the
    inputs Dynamo passes; see :func:`weight_placeholders`) that the graph does not write to."""
    return weight_placeholders(gm, weights) - _mutated_placeholders(gm)


def split_constants(gm: GraphModule, weights: Sequence[int]) -> Optional["FrozenGraph"]:
    """Split ``gm`` into fold and main graphs (``weights``: indices of the inputs Dynamo passes); None when nothing
    can be folded."""
    inputs = placeholders(gm.graph)
    static = constant_inputs(gm, weights)
    if not static:
        return None

    constant = foldable_nodes(gm.graph, static)

    # A view computes nothing: folding one only pins the weight's storage in the cache. Views at the boundary
    # are left to the main graph, which recomputes them from their (folded or weight) inputs.
    while True:
        frontier = _frontier(gm, constant, static)
        unfold = [n for n in frontier if _is_view(n) or tensor_val(n) is None]
        if not unfold:
            break
        constant.difference_update(unfold)
    if not frontier:
        return None

    fold_graph = Graph()
    env: Dict[Node, Node] = {}
    needed = _ancestors(frontier)
    # Only the weights the folded values are computed from: each is checked on every call (folded_for), and a
    # value computed from none (Flux's rotary and timestep frequencies) is valid for every weight set.
    fold_inputs = [i for i, p in enumerate(inputs) if p in static and p in needed]
    for i in fold_inputs:
        env[inputs[i]] = fold_graph.placeholder(inputs[i].name)
        env[inputs[i]].meta = dict(inputs[i].meta)
    for node in gm.graph.nodes:
        if node in needed and node.op == "call_function":
            env[node] = fold_graph.node_copy(node, lambda n: env[n])
    fold_graph.output(tuple(env[n] for n in frontier))
    fold_gm = GraphModule(gm, fold_graph)

    main_graph = Graph()
    main_env: Dict[Node, Node] = {}
    for node in frontier:
        main_env[node] = main_graph.placeholder(f"folded_{node.name}")
        main_env[node].meta = {**node.meta, FOLDED_FROM: env[node]}
    main_inputs: List[int] = []
    for i, p in enumerate(inputs):
        if p in static and all(u in constant for u in p.users):
            continue
        main_env[p] = main_graph.placeholder(p.name)
        main_env[p].meta = dict(p.meta)
        main_inputs.append(i)
    for node in gm.graph.nodes:
        if node.op in ("placeholder",) or node in main_env:
            continue
        if node in constant:
            continue
        main_env[node] = main_graph.node_copy(node, lambda n: main_env[n])
    _copy_folded_outputs(main_graph, [main_env[node] for node in frontier])
    main_graph.eliminate_dead_code()
    main_gm = GraphModule(gm, main_graph)
    recorded = any("desc" in p.meta for p in inputs)
    sources = [input_source(inputs[i]) if recorded else (i, ()) for i in fold_inputs]
    return FrozenGraph(fold_gm, main_gm, fold_inputs, main_inputs, n_folded=len(frontier), fold_sources=sources)


def _copy_folded_outputs(graph: Graph, folded: Sequence[Node]) -> int:
    """Make each output that is a folded value, or a view of one, a fresh tensor per call: a clone of the folded
    value that its output views read in its place. Eager computes such an output anew on every call, and the
    cached folded value must not be shared with (or written through by) a caller. Returns the clones made."""
    output = next(node for node in graph.nodes if node.op == "output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    folded_set = set(folded)
    clones: Dict[Node, Node] = {}

    last_input = [node for node in graph.nodes if node.op == "placeholder"][-1]

    def clone_of(value: Node) -> Node:
        if value not in clones:
            with graph.inserting_after(last_input):
                clones[value] = graph.call_function(torch.ops.aten.clone.default, (value,))
            clones[value].meta = dict(value.meta)
        return clones[value]

    for value in values:
        if value in folded_set:
            output.replace_input_with(value, clone_of(value))
            continue
        chain = value
        while isinstance(chain, Node) and chain.op == "call_function" and _is_view(chain):
            source = chain.args[0]
            if source in folded_set:
                chain.replace_input_with(source, clone_of(source))
                break
            chain = source
    return len(clones)


def _is_view(node: Node) -> bool:
    if node.target is operator.getitem:
        return True
    schema = node.target._schema
    return bool(schema.returns) and schema.returns[0].alias_info is not None


def _frontier(gm: GraphModule, constant: Set[Node], static: Set[Node]) -> List[Node]:
    """Folded nodes whose value the rest of the graph reads."""
    return [
        n for n in gm.graph.nodes
        if n in constant and n not in static and any(u not in constant for u in n.users)
    ]


def _ancestors(nodes: Sequence[Node]) -> Set[Node]:
    seen: Set[Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _concatenations(fold: GraphModule) -> List[Tuple[int, List[int]]]:
    """The fold's outputs that are ``cat(dim 0)`` of two or more distinct inputs, each input in one of them only."""
    positions_of = {n: i for i, n in enumerate(placeholders(fold.graph))}
    output = next(n for n in fold.graph.nodes if n.op == "output")
    found: List[Tuple[int, List[int]]] = []
    used: Set[int] = set()
    for index, node in enumerate(output.args[0]):
        if not is_call(node, torch.ops.aten.cat.default):
            continue
        parts = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if dim != 0 or len(parts) < 2 or not all(isinstance(p, Node) and p in positions_of for p in parts):
            continue
        positions = [positions_of[p] for p in parts]
        if len(set(positions)) != len(positions) or used & set(positions):
            continue
        used.update(positions)
        found.append((index, positions))
    return found


def _share_concatenations(folded: Tuple[torch.Tensor, ...], weights: Sequence[torch.Tensor],
                          plan: Sequence[Tuple[int, List[int]]]) -> Tuple[torch.Tensor, ...]:
    """Each concatenation of whole weights made the storage of those weights (see the module doc)."""
    out = list(folded)
    for index, positions in plan:
        parts = [weights[p] for p in positions]
        merged = out[index]
        if not all(isinstance(w, torch.Tensor) and w.is_contiguous() and w.dim() >= 1 and w.dtype == merged.dtype
                   and w.device == merged.device and not w.is_inference() for w in parts) or not merged.is_contiguous():
            continue  # kept as a copy
        adjacent = _adjacent_view(parts, merged)
        if adjacent is not None:
            out[index] = adjacent
            continue
        row = 0
        for w in parts:
            w.data = merged[row:row + w.shape[0]]  # same values: the weight now lives in the concatenation
            row += w.shape[0]
    return tuple(out)


def _adjacent_view(parts: Sequence[torch.Tensor], merged: torch.Tensor) -> Optional[torch.Tensor]:
    """A view spanning ``parts`` when they lie back to back in one storage, in order, shaped as ``merged``."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for w in parts:
        if w.untyped_storage().data_ptr() != storage or w.storage_offset() != offset:
            return None
        offset += w.numel()
    return first.as_strided(merged.shape, merged.stride(), first.storage_offset())


class _Entry:
    __slots__ = ("refs", "ptrs", "versions", "folded")

    def __init__(self, weights: Sequence[torch.Tensor], folded: Tuple[torch.Tensor, ...]):
        self.refs = [weakref.ref(w) for w in weights]
        self.ptrs = [w.data_ptr() for w in weights]
        self.versions = [w._version for w in weights]
        self.folded = folded

    def valid_for(self, weights: Sequence[torch.Tensor]) -> bool:
        for ref, ptr, version, w in zip(self.refs, self.ptrs, self.versions, weights):
            if ref() is not w or w._version != version or w.data_ptr() != ptr:
                return False
        return True


class FrozenGraph:
    """The split graph and its cache of folded values per weight set.

    ``main`` is the graph that fusion passes work on; call :meth:`bind` once they are done to get the callable
    that takes the original inputs.
    """

    def __init__(self, fold: GraphModule, main: GraphModule, fold_inputs: List[int], main_inputs: List[int],
                 n_folded: int, fold_sources: Optional[List[Tuple[int, Tuple[str, ...]]]] = None):
        self.fold, self.main = fold, main
        self.fold_inputs, self.main_inputs, self.n_folded = fold_inputs, main_inputs, n_folded
        #: Where each fold input lies among the inputs Dynamo passes: (index, attributes read from that input). They
        #: differ from ``fold_inputs``, indices of aot's inputs, where aot passes a tensor-subclass input as its
        #: inner tensors (a quantized weight's ``qdata`` is ``(i, ("qdata",))``).
        self.fold_sources = [(i, ()) for i in fold_inputs] if fold_sources is None else list(fold_sources)
        #: Folded outputs that concatenate whole weights: (output index, positions of those weights in the
        #: fold's inputs), see the module doc.
        self.concatenations = _concatenations(fold)
        self._cache: "OrderedDict[Tuple[int, ...], _Entry]" = OrderedDict()
        self._lock = threading.Lock()
        _live_graphs.add(self)

    def clear(self) -> None:
        with self._lock:
            released = [t for entry in self._cache.values() for t in entry.folded]
            self._cache.clear()
        _released(released)

    def folded_for(self, args: Sequence[Any]) -> Tuple[torch.Tensor, ...]:
        """The folded values for aot's inputs ``args`` (computed once per weight set)."""
        return self._folded([args[i] for i in self.fold_inputs])

    def folded_for_inputs(self, inputs: Sequence[Any]) -> Tuple[torch.Tensor, ...]:
        """:meth:`folded_for` from the inputs Dynamo passes (what a device-graph capture of the call sees)."""
        weights = []
        for index, attrs in self.fold_sources:
            value = inputs[index]
            for attr in attrs:
                value = getattr(value, attr)
            weights.append(value)
        return self._folded(weights)

    def _folded(self, weights: List[Any]) -> Tuple[torch.Tensor, ...]:
        key = tuple(map(id, weights))
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and entry.valid_for(weights):
                self._cache.move_to_end(key)
                return entry.folded
        with torch.no_grad():
            folded = tuple(self.fold(*weights))
            if self.concatenations:
                folded = _share_concatenations(folded, weights, self.concatenations)
        released: List[torch.Tensor] = []
        with self._lock:
            replaced = self._cache.pop(key, None)
            if replaced is not None:
                released.extend(replaced.folded)
            self._cache[key] = _Entry(weights, folded)
            while len(self._cache) > MAX_WEIGHT_SETS:
                released.extend(self._cache.popitem(last=False)[1].folded)
        _released(released)
        log.debug("folded %d constants for a new weight set (%d cached)", len(folded), len(self._cache))
        return folded

    def bind(self, run_main: Callable[..., Any]) -> Callable[..., Any]:
        """The callable on the original inputs: folded values (cached) plus the inputs main still reads."""
        main_inputs, folded_for = self.main_inputs, self.folded_for
        from .runtime.executor import CppRunner

        if isinstance(run_main, CppRunner):  # the program chooses the inputs itself
            return run_main.bound(main_inputs, folded_for)

        def run(*args: Any) -> Any:
            return run_main(*folded_for(args), *[args[i] for i in main_inputs])

        return run
