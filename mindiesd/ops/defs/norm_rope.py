"""``mindiesd::norm_rope``: the query/key RMSNorm and the rotary embedding that follows it, through the
concatenation of the attention's streams, in one op.

Joint attention (Flux, HunyuanVideo, Chroma, ...) normalises the text and the image stream's queries and keys
each with its own RMSNorm, concatenates the streams along the sequence and rotates the result:
``rope(cat([rms_norm(x_1, w_1), ..., rms_norm(x_n, w_n)], dim), cos, sin)``. This op reads each stream once and
writes the normalised, rotated rows into their slice of one output, the tensor attention reads; the normalised
values and the concatenation are never written. With one stream it is the plain norm + RoPE. With ``head_dim``
below the normalised width, each row is the ``H * head_dim`` values of all heads (Wan, HiDream: the norm runs
before the heads are split) and each head's ``head_dim`` values are rotated, the tables broadcasting into the
heads' view ``[..., H, head_dim]``; the output keeps the rows' shape (the caller views it as the heads).

Each normalised value is rounded to ``norm_dtype`` (the replaced norms' output dtype: the streams' own, or float32
where the model upcasts before a complex rotation) before it is rotated, as the ops it replaces do.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import registry
from ..layout import concat_shape
from .._rules import require_floating, shape_str
from ..dtypes import is_compute_float
from .rms_norm import reference as rms_norm_reference
from .rope import reference as rope_reference
from .rope import table_rules


def norm_rope_rules(
    xs: Sequence[torch.Tensor], dim: int, weights: Sequence[Optional[torch.Tensor]], eps: float,
    norm_dtype: Optional[torch.dtype], head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
    out_dtype: Optional[torch.dtype],
) -> tuple[torch.dtype, torch.dtype]:
    """Validate norm_rope inputs (one or more xs of one dtype and rank that agree in every dimension but
    ``dim``, which is not the last; one weight per x, None or [W]; eps >= 0; a floating norm_dtype or None;
    head_dim dividing W; cos/sin as rope takes them for the concatenation, seen as heads of head_dim values);
    return (output dtype, compute dtype)."""
    if not isinstance(xs, (list, tuple)) or not xs:
        raise ValueError("mindiesd.norm_rope: xs must be a list of one or more tensors")
    if not isinstance(weights, (list, tuple)) or len(weights) != len(xs):
        raise ValueError(f"mindiesd.norm_rope: weights must hold one weight (or None) per x: {len(xs)} xs, "
                         f"got {len(weights) if isinstance(weights, (list, tuple)) else weights!r}")
    require_floating("norm_rope", **{f"xs[{i}]": x for i, x in enumerate(xs)},
                     **{f"weights[{i}]": w for i, w in enumerate(weights)})
    first = xs[0]
    rank = first.dim()
    if rank < 2:
        raise ValueError(f"mindiesd.norm_rope: xs need at least two dimensions, got {shape_str(first.shape)}")
    if not -rank <= dim < rank or dim % rank == rank - 1:
        raise ValueError(f"mindiesd.norm_rope: dim {dim} must name a dimension of xs (rank {rank}) but the last")
    d = dim % rank
    for x in xs:
        if x.dtype != first.dtype or x.dim() != rank or any(
                x.shape[i] != first.shape[i] for i in range(rank) if i != d):
            raise ValueError("mindiesd.norm_rope: xs must share a dtype and every dimension but dim "
                             f"{dim}, got " + ", ".join(f"{x.dtype} {shape_str(x.shape)}" for x in xs))
    if not eps >= 0:
        raise ValueError(f"mindiesd.norm_rope: eps must be a number >= 0, got {eps!r}")
    if norm_dtype is not None and not is_compute_float(norm_dtype):
        raise ValueError(f"mindiesd.norm_rope: norm_dtype must be a floating-point dtype or None, got {norm_dtype}")
    width = first.shape[-1]
    for i, w in enumerate(weights):
        if w is not None and (w.dim() != 1 or w.shape[0] != width):
            raise ValueError(f"mindiesd.norm_rope: weights[{i}] {shape_str(w.shape)} must be None or [{width}]")
    if not isinstance(head_dim, int) or head_dim < 1 or width % head_dim != 0:
        raise ValueError(f"mindiesd.norm_rope: head_dim {head_dim!r} must divide the normalised width {width}")
    return table_rules("norm_rope", rotated_shape(concat_shape(xs, dim), head_dim), norm_dtype or first.dtype, cos,
                       sin, out_dtype)


def rotated_shape(shape: Sequence, head_dim: int) -> tuple:
    """The shape the rotation (and its tables) sees: ``shape``, or its last dim split into heads of head_dim."""
    if shape[-1] == head_dim:
        return tuple(shape)
    return (*shape[:-1], shape[-1] // head_dim, head_dim)


def reference(
    xs: Sequence[torch.Tensor],
    dim: int,
    weights: Sequence[Optional[torch.Tensor]],
    eps: float,
    norm_dtype: Optional[torch.dtype],
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = True,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``rope(cat([rms_norm(x_i, w_i, eps, norm_dtype or x_i.dtype)], dim) as heads of head_dim, cos, sin,
    interleaved, out_dtype)`` in the concatenation's shape."""
    out_dtype, _ = norm_rope_rules(xs, dim, weights, eps, norm_dtype, head_dim, cos, sin, out_dtype)
    normed = [rms_norm_reference(x, w, eps, norm_dtype or x.dtype) for x, w in zip(xs, weights)]
    joined = torch.cat(normed, dim) if len(normed) > 1 else normed[0].contiguous()
    heads = joined.reshape(rotated_shape(joined.shape, head_dim))
    return rope_reference(heads, cos, sin, interleaved, out_dtype).reshape(joined.shape).contiguous()


NORM_ROPE = registry.declare(registry.OpDef(
    schema="norm_rope(Tensor[] xs, int dim, Tensor?[] weights, float eps, ScalarType? norm_dtype, int head_dim, "
           "Tensor cos, Tensor sin, bool interleaved, ScalarType? out_dtype=None) -> Tensor",
    layout="concat", rows=False, layout_args=2,
    reference=reference, checks=norm_rope_rules,
))

public = registry.public_function(NORM_ROPE, """RMSNorm of each of ``xs`` (its own weight, one eps), concatenated
    along ``dim`` and rotated on the last dim (as :func:`rope`), in one pass.

    Equals ``rope(cat([rms_norm(x, w, eps, norm_dtype or x.dtype) for x, w in zip(xs, weights)], dim), cos, sin,
    interleaved, out_dtype)``, the concatenation seen as heads of ``head_dim`` values for the rotation (``head_dim``
    = the last dim: no split); the output is contiguous, of the concatenation's shape. Output dtype:
    ``out_dtype`` or promote(norm_dtype or xs' dtype, cos, sin).
    """)
