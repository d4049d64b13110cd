"""flex_attention lowered, so that it does not run on its unfused math path.

Outside Inductor a ``torch.ops.higher_order.flex_attention`` call runs flex's reference implementation, which
materialises the whole score matrix and applies the score and mask functions to it element by element: many times
slower than an attention kernel. This pass, on the whole aten graph before freezing, lowers each call one of two
ways (rules ``sdpa`` and ``inductor`` in the report):

* ``sdpa``: the call changes nothing about plain attention (diffusers' ``flex`` backend without a mask, or any
  call whose score function returns the score and whose mask function is true everywhere, over block tables that
  list every block) becomes ``aten.scaled_dot_product_attention`` with the call's scale (and ``enable_gqa`` where
  query and key differ in heads). Its block tables must be computable at compile time (they are built in the
  graph from nothing but sizes: diffusers' and flex's default mask); tables that arrive as inputs go the other way.
* ``inductor``: any other call (a user's mask or score function, tables given as inputs) becomes one region that
  Inductor compiles with its flex lowering, on the first call for each input layout: the rest of the graph stays
  mindiesd's. Such a graph is not stored in the persistent cache (the region is Inductor's code, cached by Inductor
  itself). On devices other than the CPU and CUDA, and for training graphs, such a call is left as it is.

Only the output is read from a call rewritten to ``sdpa``; a call whose log-sum-exp or maximum is read goes to
Inductor.
"""

from __future__ import annotations

import itertools
import logging
import operator
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.fx import Graph, GraphModule, Node

from ..fx_utils import Emitter, literal_value, replace_readers, same_layout, tensor_val
from ..report import MindieSDFallbackWarning
from .base import LoweringPass

log = logging.getLogger("mindiesd.compilation")
aten = torch.ops.aten

__all__ = ["FlexAttentionPass", "FlexRegion", "FLEX_ATTENTION", "has_flex_region"]

try:
    from torch._higher_order_ops.flex_attention import flex_attention as FLEX_ATTENTION
except ImportError:  # pragma: no cover - a torch without flex attention
    FLEX_ATTENTION = None

#: Block sizes from which one block covers any sequence (flex's default mask: ``_LARGE_SPARSE_BLOCK_SIZE``).
_ONE_BLOCK = 1 << 30

#: Where the block mask tuple keeps its tables and sizes (``BlockMask.as_tuple()``): sequence lengths (q, kv),
#: kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, ... , Q and KV block sizes, mask_mod.
_KV_NUM, _KV_IDX, _FULL_KV_NUM, _FULL_KV_IDX = 2, 3, 4, 5


class FlexRegion:
    """One flex_attention call compiled by Inductor (``compile_fx_inner``) on its first call for each layout of
    its tensor inputs; called with those tensors, it returns the call's outputs as a tuple."""

    def __init__(self, gm: GraphModule, label: str):
        self.gm, self.label = gm, label
        self._compiled: Dict[Tuple[Any, ...], Any] = {}
        self.__name__ = f"flex_region_{label}"

    def __repr__(self) -> str:
        return f"FlexRegion({self.label})"

    def __call__(self, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        key = tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled, outputs = self._compile(list(tensors))
            self._compiled[key] = compiled
            return outputs
        return tuple(compiled(list(tensors)))

    def _reference(self, args: List[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        return tuple(self.gm(*args))

    def _compile(self, tensors: List[torch.Tensor]) -> Tuple[Any, Tuple[torch.Tensor, ...]]:
        """Inductor's code for these layouts and its outputs on ``tensors``; flex's reference instead (with one
        warning) where Inductor fails to lower the call or its first outputs differ from the reference's."""
        from torch._inductor.compile_fx import compile_fx_inner

        log.info("flex_attention %s: compiling its region with Inductor's flex lowering", self.label)
        expected = self._reference(tensors)
        try:
            with torch.no_grad():
                compiled = compile_fx_inner(self.gm, tensors)
                outputs = tuple(compiled(list(tensors)))
            why = _mismatch(outputs, expected)
        except Exception as exc:  # Inductor lowers no such call
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if why is None:
            return compiled, outputs
        warnings.warn(f"mindiesd: Inductor cannot lower flex_attention {self.label} ({why}); it runs flex's "
                      "unfused reference", MindieSDFallbackWarning, stacklevel=3)
        return self._reference, expected


def _mismatch(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> Optional[str]:
    """Why Inductor's outputs are not the reference's within the dtype's tolerance, or None."""
    for a, e in zip(actual, expected):
        tolerance = 1e-4 if e.dtype == torch.float32 else 2e-2
        scale = e.abs().max().item() if e.numel() else 0.0
        if a.shape != e.shape:
            return "its output's shape differs from the reference's"
        if e.numel() and (a.float() - e.float()).abs().max().item() > tolerance * max(scale, 1.0):
            return "its output differs from the reference's"
    return None


def has_flex_region(gm: GraphModule) -> bool:
    """Whether ``gm`` runs a flex_attention region that Inductor compiles (a graph the cache does not store)."""
    return any(isinstance(n.target, FlexRegion) for n in gm.graph.nodes)


def _submodule(gm: GraphModule, node: Any) -> Optional[GraphModule]:
    if isinstance(node, Node) and node.op == "get_attr":
        sub = getattr(gm, node.target, None)
        return sub if isinstance(sub, GraphModule) else None
    return None


def _output_of(sub: GraphModule) -> Any:
    out = next(n for n in reversed(sub.graph.nodes) if n.op == "output").args[0]
    return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


def _identity_score(sub: Optional[GraphModule]) -> bool:
    """The score function returns the score (its first argument) unchanged."""
    if sub is None:
        return False
    first = next((n for n in sub.graph.nodes if n.op == "placeholder"), None)
    return first is not None and _output_of(sub) is first


_TRUE_FACTORIES = (aten.new_ones.default, aten.ones.default, aten.full.default, aten.new_full.default,
                   aten.scalar_tensor.default)


def _always_true(sub: Optional[GraphModule]) -> bool:
    """The mask function is true everywhere: it returns a constant true (flex's ``noop_mask``)."""
    if sub is None:
        return False
    out = _output_of(sub)
    if out is True:
        return True
    if not isinstance(out, Node) or out.op != "call_function" or out.target not in _TRUE_FACTORIES:
        return False
    if out.target in (aten.new_ones.default, aten.ones.default):
        return True
    fill = out.args[-1] if out.target in (aten.full.default, aten.new_full.default) else out.args[0]
    return isinstance(fill, (bool, int, float)) and bool(fill)


def _covers_all_blocks(mask: Sequence[Any], q_len: int, kv_len: int, cache: Dict[Node, Any]) -> bool:
    """The block tables list every KV block for every query block (partial or full), so that the kernels, which
    skip unlisted blocks, attend to everything."""
    q_block, kv_block = mask[-3], mask[-2]
    if not all(isinstance(b, int) and b > 0 for b in (q_block, kv_block)):
        return False
    num, idx = literal_value(mask[_KV_NUM], cache), literal_value(mask[_KV_IDX], cache)
    if not isinstance(num, torch.Tensor) or not isinstance(idx, torch.Tensor):
        return False
    full_num = literal_value(mask[_FULL_KV_NUM], cache) if mask[_FULL_KV_NUM] is not None else None
    full_idx = literal_value(mask[_FULL_KV_IDX], cache) if mask[_FULL_KV_IDX] is not None else None
    if (mask[_FULL_KV_NUM] is not None) != isinstance(full_num, torch.Tensor) \
            or (mask[_FULL_KV_IDX] is not None) != isinstance(full_idx, torch.Tensor):
        return False
    n_q, n_kv = -(-q_len // q_block), -(-kv_len // kv_block)
    if num.dim() < 1 or num.shape[-1] < n_q or idx.shape[:-1] != num.shape \
            or (full_num is not None and (full_num.shape != num.shape or full_idx.shape[:-1] != num.shape)):
        return False
    wanted, batch = set(range(n_kv)), tuple(num.shape[:-1])
    num, idx = num.tolist(), idx.tolist()
    full_num, full_idx = (None, None) if full_num is None else (full_num.tolist(), full_idx.tolist())
    for where in itertools.product(*(range(s) for s in batch)):
        for row in range(n_q):
            listed = set(_at(idx, where)[row][: _at(num, where)[row]])
            if full_num is not None:
                listed |= set(_at(full_idx, where)[row][: _at(full_num, where)[row]])
            if not wanted <= listed:
                return False
    return True


def _at(nested: Any, where: Tuple[int, ...]) -> Any:
    for i in where:
        nested = nested[i]
    return nested


class FlexAttentionPass(LoweringPass):
    """Lowers each flex_attention call (the module docstring says how); returns how many it lowered."""

    family = "flex_attention"
    targets = (FLEX_ATTENTION,) if FLEX_ATTENTION is not None else ()

    def __init__(self) -> None:
        super().__init__()
        #: Whether calls that need Inductor may be compiled by it (the CPU and CUDA, inference graphs), and the
        #: graph's device type (set by the pass manager before each graph).
        self.inductor, self.device_type = True, "cpu"
        #: Why the last graph kept a flex_attention call on its unfused path, or None.
        self.why_not: Optional[str] = None

    def begin(self, gm: GraphModule) -> None:
        self.why_not = None if self.inductor else "no Inductor for this graph (a training graph, or not the CPU or CUDA)"

    def lower(self, gm: GraphModule, node: Node, cache: Dict[Node, Any], index: int) -> Optional[str]:
        if self._to_sdpa(gm, node, cache):
            return "sdpa"
        if self.inductor and self._to_region(gm, node, index):
            return "inductor"
        log.info("flex_attention %s left on its unfused path: %s", node.name, self.why_not)
        return None

    def finish(self, gm: GraphModule) -> None:
        for node in list(gm.graph.nodes):  # the score and mask functions nothing calls any more
            if node.op == "get_attr" and not node.users and isinstance(getattr(gm, node.target, None), GraphModule):
                name = node.target
                gm.graph.erase_node(node)
                gm.delete_submodule(name)

    @staticmethod
    def _parts(node: Node) -> Optional[Tuple[Node, Node, Node, Any, Sequence[Any], Any, Dict[str, Any], Sequence, Sequence]]:
        args = list(node.args) + [None] * (9 - len(node.args))
        q, k, v, score_mod, mask, scale, options, score_buffers, mask_buffers = args[:9]
        if node.kwargs or not isinstance(mask, (tuple, list)) or not all(isinstance(t, Node) for t in (q, k, v)):
            return None
        return q, k, v, score_mod, mask, scale, dict(options or {}), tuple(score_buffers or ()), tuple(mask_buffers or ())

    def _to_sdpa(self, gm: GraphModule, node: Node, cache: Dict[Node, Any]) -> bool:
        parts = self._parts(node)
        if parts is None:
            return False
        q, k, v, score_mod, mask, scale, _, score_buffers, mask_buffers = parts
        users = list(node.users)
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
            return False  # the log-sum-exp or the maximum is read
        if score_buffers or mask_buffers or not _identity_score(_submodule(gm, score_mod)) \
                or not _always_true(_submodule(gm, mask[-1])):
            return False
        qv, kv, vv = (tensor_val(t) for t in (q, k, v))
        if qv is None or kv is None or vv is None or qv.dim() != 4 or not isinstance(scale, (int, float)):
            return False
        q_len, kv_len, hq, hkv = qv.shape[-2], kv.shape[-2], qv.shape[1], kv.shape[1]
        if type(hq) is not int or type(hkv) is not int:
            return False
        if type(q_len) is not int or type(kv_len) is not int:  # symbolic lengths (read without adding a guard):
            blocks = (mask[-3], mask[-2])  # only a single block, flex's default, covers any of them
            if not all(type(b) is int for b in blocks) or min(blocks) < _ONE_BLOCK:
                return False
            q_len = kv_len = 1
        if hq % hkv or not _covers_all_blocks(mask, q_len, kv_len, cache):
            return False
        extra = {"enable_gqa": True} if hq != hkv else {}
        emit = Emitter(node.graph, node)
        out = emit(aten.scaled_dot_product_attention.default, q, k, v, scale=float(scale), **extra)
        want = node.meta.get("val")
        want = want[0] if isinstance(want, (tuple, list)) else want
        if not same_layout(out.meta["val"], want):
            strided = emit(aten.empty_strided.default, list(want.shape), list(want.stride()), dtype=want.dtype,
                           device=want.device)
            out = emit(aten.copy.default, strided, out)
            if not same_layout(out.meta["val"], want):
                emit.discard()
                return False
        replace_readers(node, out)  # each reader takes the output, which the call returned first
        return True

    def _to_region(self, gm: GraphModule, node: Node, index: int) -> bool:
        parts = self._parts(node)
        if parts is None:
            return False
        sub = Graph()
        owner = torch.nn.Module()
        env: Dict[Node, Node] = {}
        inputs: List[Node] = []

        def move(a: Any) -> Any:
            if not isinstance(a, Node):
                return a
            if a not in env:
                if a.op == "get_attr":
                    setattr(owner, a.target, getattr(gm, a.target))
                    env[a] = sub.get_attr(a.target)
                else:
                    env[a] = sub.placeholder(a.name)
                    env[a].meta = dict(a.meta)
                    inputs.append(a)
            return env[a]

        users = list(node.users)
        if not all(u.target is operator.getitem and isinstance(u.args[1], int) for u in users):
            return False
        if self.device_type == "cpu" and any(u.args[1] for u in users):
            self.why_not = "the log-sum-exp is read, which Inductor's CPU flex lowering does not give"
            return False
        read = sorted({u.args[1] for u in users})  # the outputs read (Inductor's lowering makes no unread maximum)
        call = sub.call_function(node.target, torch.fx.node.map_aggregate(node.args, move), {})
        call.meta = dict(node.meta)
        sub.output(tuple(sub.call_function(operator.getitem, (call, i)) for i in read))
        region = FlexRegion(GraphModule(owner, sub), f"{node.name}#{index}")
        with node.graph.inserting_before(node):
            new = node.graph.call_function(region, tuple(inputs), {})
        outs = node.meta.get("val")
        new.meta = {**node.meta, "val": tuple(outs[i] for i in read)}
        for user in users:
            user.args = (new, read.index(user.args[1]))
        node.graph.erase_node(node)
        return True
