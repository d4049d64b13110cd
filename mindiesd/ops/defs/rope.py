"""``mindiesd::rope``: rotary position embedding on the last dimension (interleaved or half-rotated pairs)."""

from __future__ import annotations

import torch

from .. import registry
from .._rules import (
    check_broadcasts_into, compute_dtype, finish, promote, require_floating, resolve_out_dtype, shape_str,
)


def rope_rules(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """Validate rope inputs; return (output dtype, compute dtype).

    The last dim D of x must be even; cos/sin carry D values ("full width"),
    D/2 values ("per pair") or 1 value in their last dim, and broadcast into
    x's other dims without enlarging x.
    """
    require_floating("rope", x=x, cos=cos, sin=sin)
    if x.dim() < 1:
        raise ValueError("mindiesd.rope: `x` must have at least one dimension")
    return table_rules("rope", tuple(x.shape), x.dtype, cos, sin, out_dtype)


def table_rules(
    op: str, shape: tuple, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """The checks of rope's tables for a rotated tensor of ``shape`` and ``dtype`` (``op`` names the caller in
    the errors); return (output dtype, compute dtype)."""
    require_floating(op, cos=cos, sin=sin)
    width = shape[-1]
    if width % 2 != 0:
        raise ValueError(
            f"mindiesd.{op}: the last dim of `x` must be even, got x of shape {shape_str(shape)}"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() < 1:
            raise ValueError(f"mindiesd.{op}: `{name}` must have at least one dimension")
        last = table.shape[-1]
        if last != width and last != width // 2 and last != 1:
            raise ValueError(
                f"mindiesd.{op}: the last dim of `{name}` (shape {shape_str(table.shape)}) "
                f"must be {width} (full width), {width // 2} (per pair) or 1, for x of shape "
                f"{shape_str(shape)}"
            )
        check_broadcasts_into(op, name, table.shape, shape, skip_last=True)
    promoted = promote(dtype, cos.dtype, sin.dtype)
    return resolve_out_dtype(out_dtype, promoted), compute_dtype(promoted)


def _rotate_pairs(values: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of every element with the sign of the rotation applied.

    interleaved: (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]);
    half-rotated: (x[:D/2], x[D/2:]) -> (-x[D/2:], x[:D/2]).
    """
    if interleaved:
        even, odd = values.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = values.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def full_width(table: torch.Tensor, width: int, interleaved: bool) -> torch.Tensor:
    """Expand a per-pair cos/sin table (D/2 values) to one value per element."""
    last = table.shape[-1]
    if last == width or last == 1:
        return table
    if interleaved:
        return table.repeat_interleave(2, dim=-1)
    return torch.cat((table, table), dim=-1)


def reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotary embedding on the last dim: x * cos + rotate(x) * sin.

    ``interleaved`` rotates pairs (x[2i], x[2i+1]); otherwise pairs are
    (x[i], x[i + D/2]) ("rotate_half").  cos/sin hold D values, D/2 values
    (one per pair) or 1 value in their last dim.
    """
    out_dtype, work_dtype = rope_rules(x, cos, sin, out_dtype)
    width = x.shape[-1]
    values = x.to(work_dtype)
    cos_full = full_width(cos.to(work_dtype), width, interleaved)
    sin_full = full_width(sin.to(work_dtype), width, interleaved)
    result = values * cos_full + _rotate_pairs(values, interleaved) * sin_full
    return finish(result, out_dtype, "rope", x)


ROPE = registry.declare(registry.OpDef(
    schema="rope(Tensor x, Tensor cos, Tensor sin, bool interleaved, ScalarType? out_dtype=None) -> Tensor",
    layout="like_x", table_args=(1, 2),
    reference=reference, checks=rope_rules,
))

public = registry.public_function(ROPE, """Rotary position embedding on the last dim of ``x``.

    ``interleaved`` rotates pairs (x[2i], x[2i+1]) (Flux); otherwise pairs
    (x[i], x[i + D/2]) ("rotate_half").  cos/sin hold D, D/2 or 1 values in
    their last dim and broadcast into x.  Output dtype: ``out_dtype`` or
    promote(x, cos, sin).
    """)
