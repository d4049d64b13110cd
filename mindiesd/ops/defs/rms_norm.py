"""``mindiesd::rms_norm``: RMS normalization over the last dimension, optionally scaled by a weight."""

from __future__ import annotations

import torch

from .. import registry
from .._rules import check_broadcasts_into, compute_dtype, finish, promote, require_floating, resolve_out_dtype


def rms_norm_rules(
    x: torch.Tensor, weight: torch.Tensor | None, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """Validate rms_norm inputs; return (output dtype, compute dtype)."""
    require_floating("rms_norm", x=x, weight=weight)
    if x.dim() < 1:
        raise ValueError("mindiesd.rms_norm: `x` must have at least one dimension")
    if weight is None:
        promoted = x.dtype
    else:
        check_broadcasts_into("rms_norm", "weight", weight.shape, x.shape)
        promoted = promote(x.dtype, weight.dtype)
    return resolve_out_dtype(out_dtype, promoted), compute_dtype(promoted)


def reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x * rsqrt(mean(x**2, -1) + eps), times ``weight`` when given."""
    out_dtype, work_dtype = rms_norm_rules(x, weight, out_dtype)
    values = x.to(work_dtype)
    mean_square = values.pow(2).mean(dim=-1, keepdim=True)
    result = values * torch.rsqrt(mean_square + eps)
    if weight is not None:
        result = result * weight.to(work_dtype)
    return finish(result, out_dtype, "rms_norm", x)


RMS_NORM = registry.declare(registry.OpDef(
    schema="rms_norm(Tensor x, Tensor? weight, float eps, ScalarType? out_dtype=None) -> Tensor",
    layout="like_x", table_args=(1,),
    reference=reference, checks=rms_norm_rules,
))

public = registry.public_function(RMS_NORM, """RMS normalization over the last dim, optionally scaled by ``weight``.

    Output dtype: ``out_dtype``, else promote(x, weight), else x's dtype.
    """)
