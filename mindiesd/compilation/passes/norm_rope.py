"""A query's or key's RMSNorm and the RoPE after it, through joint attention's concatenation of the streams,
replaced by ``mindiesd.norm_rope``.

It runs after the rms_norm and rope passes and rewrites their ops:

* ``rope(cat([rms_norm(x_1, w_1), ..., rms_norm(x_n, w_n)], dim))``: joint attention (Flux's double blocks,
  HunyuanVideo, Chroma, ...) normalises the text and the image queries (keys) each with its own norm, joins them
  along the sequence and rotates the result. The fused op writes each stream's normalised, rotated rows into its
  slice of the output, so neither the normalised streams nor their concatenation are written;
* ``rope(rms_norm(x, w))``: the same with one stream (Flux's single blocks, Qwen-Image, LTX-Video, Lumina2);
* either of them with ``view``s that split the last dim into heads between norm and rotation, after the
  concatenation or before it: the norm runs over all heads' ``H * D`` values (Wan, SkyReels-V2, HiDream), each
  head's ``D`` values are rotated. The op then rotates heads of ``D`` within each normalised row, and a view to
  the heads follows it.

Fused when every norm is read by the concatenation (or the rope, or the view) alone, normalises the last dimension
with a weight of that width or none and one eps shared by all streams, and gives its input's dtype or float32
(Qwen-Image and Lumina2 upcast before their complex rotation: the op then keeps the normalised values in float32,
as the norm did), and the concatenation is not along the last dimension.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from ..fx_utils import is_call, tensor_val
from .matcher import Alt, Op, Var
from .base import FusionPass, Rule
from .patterns import VIEW_RESHAPES

aten = torch.ops.aten
mindiesd = torch.ops.mindiesd

_ROPE_ARGS = (Var("cos"), Var("sin"), Var("interleaved"))
_ROPE_KWARGS = {"out_dtype": Var("out_dtype")}
_JOINT = Op(mindiesd.rope.default, Op(aten.cat.default, Var("xs"), Var("dim")), *_ROPE_ARGS, kwargs=_ROPE_KWARGS)
_SINGLE = Op(mindiesd.rope.default, Var("norm"), *_ROPE_ARGS, kwargs=_ROPE_KWARGS)
_HEADS = Op(mindiesd.rope.default,
            Op((aten.view.default, aten._unsafe_view.default, aten.reshape.default),
               Alt(Op(aten.cat.default, Var("xs"), Var("dim")), Var("norm")), Var("heads_shape")),
            *_ROPE_ARGS, kwargs=_ROPE_KWARGS)


def _norm_parts(node, reader: Node):
    """(x, weight, eps, output dtype) of an rms_norm node that ``reader`` alone reads, whose output has its
    input's dtype or float32 and which normalises with a weight of the normalised width or none; else the reason
    it cannot be fused."""
    if not is_call(node, mindiesd.rms_norm.default):
        return "an input is not a fused rms_norm"
    if set(node.users) != {reader}:
        return "a normalised stream is read elsewhere too"
    x, weight, eps = node.args[:3]
    x_val, out = tensor_val(x), tensor_val(node)
    if x_val is None or out is None or x_val.dim() < 2:
        return "a norm's input is not a tensor of rank >= 2"
    if out.dtype not in (x_val.dtype, torch.float32):
        return f"a norm's output ({out.dtype}) has neither its input's dtype ({x_val.dtype}) nor float32"
    if x_val.stride()[-1:] != (1,) and x_val.shape[-1] != 1:
        return "a norm's input has a strided last dimension"
    if weight is not None:
        w = tensor_val(weight)
        if w is None or w.dim() != 1 or w.shape[0] != x_val.shape[-1]:
            return "a norm's weight is not a vector of the normalised width"
    return x, weight, eps, out.dtype




def _heads_of(view) -> Optional[int]:
    """D when ``view`` only splits its input's last dim into [H, D] (static sizes), else None."""
    if not is_call(view, *VIEW_RESHAPES):
        return None
    source, out = tensor_val(view.args[0]), tensor_val(view)
    if source is None or out is None or out.dim() != source.dim() + 1:
        return None
    width, heads, head_dim = source.shape[-1], out.shape[-2], out.shape[-1]
    if not all(isinstance(v, int) for v in (width, heads, head_dim)) or heads * head_dim != width:
        return None
    return head_dim if list(out.shape[:-2]) == list(source.shape[:-1]) else None


def _streams(m, root):
    """How the rotated tensor is made of normalised streams: (norm nodes, concatenation dim of their inputs,
    head_dim, the views and concatenation between them and the rotation, whether a view follows the fused op);
    or the reason it is not this form.

    Forms: rope(norm), rope(cat(norms)), rope(view(norm)), rope(view(cat(norms))), and rope(cat(views(norms)))
    (HiDream: each stream split into heads, then joined), each view splitting the last dim into heads of D."""
    out = tensor_val(root)
    if out is None or not out.is_contiguous():
        return "the rotated tensor is not contiguous"
    between, view_after = [], False
    head_dim = out.shape[-1]
    joined = root.args[0]
    if "heads_shape" in m.bindings:
        head_dim = _heads_of(joined)
        if head_dim is None:
            return "the view between norm and rotation does more than split the last dim into heads"
        between.append(joined)
        joined, view_after = joined.args[0], True
    if not isinstance(head_dim, int):
        return "the rotated heads' width is symbolic"
    if "xs" not in m.bindings:
        return [m["norm"]], 0, head_dim, between, view_after
    xs, dim = m["xs"], m["dim"]
    if not isinstance(xs, (list, tuple)) or not xs:
        return "the concatenation has no inputs"
    rank = tensor_val(joined).dim()
    if not isinstance(dim, int) or dim % rank == rank - 1:
        return "the concatenation is along the last dimension"
    between.append(joined)
    split = {_heads_of(x) for x in xs}
    if split != {None}:  # each stream split into heads before the concatenation
        if len(split) != 1 or view_after or dim % rank >= rank - 2:
            return "the streams are split into heads differently, or joined along a head dim"
        head_dim = split.pop()
        for x in xs:
            if set(x.users) != {joined}:
                return "a stream's heads are read elsewhere too"
        between.extend(xs)
        return [x.args[0] for x in xs], dim % rank, head_dim, between, True
    return list(xs), dim, head_dim, between, view_after


def _check(m, root):
    streams = _streams(m, root)
    if isinstance(streams, str):
        return streams
    norms, _, _, between, _ = streams
    parts = []
    for norm in norms:
        readers = [b for b in between if norm in b.args[:1] or (isinstance(b.args[0], (list, tuple))
                                                                and norm in b.args[0])]
        parts.append(_norm_parts(norm, readers[0] if readers else root))
    for part in parts:
        if isinstance(part, str):
            return part
    eps = {p[2] if isinstance(p[2], Node) else float(p[2]) for p in parts}
    if len(eps) != 1:
        return "the streams' norms have different eps"
    if len({(tensor_val(p[0]).dtype, p[3]) for p in parts}) != 1:
        return "the streams or their norms' outputs have different dtypes"
    return None


def _build(m, root, emit):
    norms, dim, head_dim, between, view_after = _streams(m, root)
    xs = [n.args[0] for n in norms]
    weights = [n.args[1] for n in norms]
    eps = norms[0].args[2]
    norm_dtype = tensor_val(norms[0]).dtype
    fused = emit(mindiesd.norm_rope.default, xs, dim, weights, eps, norm_dtype, head_dim, m["cos"], m["sin"],
                 m["interleaved"], out_dtype=m.get("out_dtype"))
    # erased with the rest of the match once the rope's readers read the fused op
    m.interior.extend([*between, *norms])
    if view_after:  # the heads' view, by its static head sizes (the leading sizes may be symbolic)
        out = tensor_val(root)
        return emit(aten.unflatten.int, fused, -1, [out.shape[-2], out.shape[-1]])
    return fused


class NormRopePass(FusionPass):
    family = "norm_rope"
    rules = (Rule("joint", _JOINT, _build, _check), Rule("single", _SINGLE, _build, _check),
             Rule("heads", _HEADS, _build, _check))

    def __call__(self, gm) -> int:
        before = _op_counts(gm)
        replaced = super().__call__(gm)
        after = _op_counts(gm)
        #: The rms_norm and rope ops the last call joined into its ops, per family (the pass manager takes them
        #: off those families' counts, which count the ops in the final graph).
        self.consumed = {family: before[family] - after[family] for family in before}
        return replaced


def _op_counts(gm) -> dict:
    targets = {mindiesd.rms_norm.default: "rms_norm", mindiesd.rope.default: "rope"}
    counts = dict.fromkeys(targets.values(), 0)
    for node in gm.graph.nodes:
        family = targets.get(node.target) if node.op == "call_function" else None
        if family is not None:
            counts[family] += 1
    return counts
