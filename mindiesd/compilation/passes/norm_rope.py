"""A query's or key's RMSNorm and the RoPE after it, through joint attention's concatenation of the streams,
replaced by ``mindiesd.norm_rope``.

It runs after the rms_norm and rope passes and rewrites their ops:

* ``rope(cat([rms_norm(x_1, w_1), ..., rms_norm(x_n, w_n)], dim))``: joint attention (Flux's double blocks,
  HunyuanVideo, Chroma, ...) normalises the text and the image queries (keys) each with its own norm, joins them
  along the sequence and rotates the result. The fused op writes each stream's normalised, rotated rows into its
  slice of the output, so neither the normalised streams nor their concatenation are written;
* ``rope(rms_norm(x, w))``: the same with one stream (Flux's single blocks, Wan 2.2's TI2V and others whose norm
  runs per head).

Fused when every norm is read by the concatenation (or the rope) alone, normalises the last dimension with a
``[D]`` weight or none and one eps shared by all streams, and gives its input's dtype or float32 (Qwen-Image and
Lumina2 upcast before their complex rotation: the op then keeps the normalised values in float32, as the norm
did), and the concatenation is not along the last dimension. A norm over all heads at once (Wan's ``norm_q`` over ``H * D`` before the heads are
split) is not this form: its rows are not the rotated rows.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import is_call, tensor_val
from ..matcher import Alt, Op, Var
from .base import FusionPass, Rule

aten = torch.ops.aten
mindiesd = torch.ops.mindiesd

_ROPE_ARGS = (Var("cos"), Var("sin"), Var("interleaved"))
_ROPE_KWARGS = {"out_dtype": Var("out_dtype")}
_JOINT = Op(mindiesd.rope.default, Op(aten.cat.default, Var("xs"), Var("dim")), *_ROPE_ARGS, kwargs=_ROPE_KWARGS)
_SINGLE = Op(mindiesd.rope.default, Var("norm"), *_ROPE_ARGS, kwargs=_ROPE_KWARGS)


def _norm_parts(node, reader: Node):
    """(x, weight, eps, output dtype) of an rms_norm node that ``reader`` alone reads, whose output has its
    input's dtype or float32 and which normalises with a ``[D]`` weight or none; else the reason it cannot be
    fused."""
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
            return "a norm's weight is not a [D] vector"
    return x, weight, eps, out.dtype


def _check(m, root):
    out = tensor_val(root)
    if out is None or not out.is_contiguous():
        return "the rotated tensor is not contiguous"
    if "xs" in m.bindings:
        xs, cat = m["xs"], root.args[0]
        if not isinstance(xs, (list, tuple)) or not xs:
            return "the concatenation has no inputs"
        rank = out.dim()
        dim = m["dim"]
        if not isinstance(dim, int) or dim % rank == rank - 1:
            return "the concatenation is along the last dimension"
        parts = [_norm_parts(x, cat) for x in xs]
    else:
        parts = [_norm_parts(m["norm"], root)]
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
    norms = list(m["xs"]) if "xs" in m.bindings else [m["norm"]]
    dim = m["dim"] if "xs" in m.bindings else 0
    xs = [n.args[0] for n in norms]
    weights = [n.args[1] for n in norms]
    eps = norms[0].args[2]
    norm_dtype = tensor_val(norms[0]).dtype
    fused = emit(mindiesd.norm_rope.default, xs, dim, weights, eps, norm_dtype, m["cos"], m["sin"], m["interleaved"],
                 out_dtype=m.get("out_dtype"))
    m.interior.extend(norms)  # erased with the concatenation once the rope's readers read the fused op
    return fused


class NormRopePass(FusionPass):
    family = "norm_rope"
    rules = (Rule("joint", _JOINT, _build, _check), Rule("single", _SINGLE, _build, _check))

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
