"""``mindiesd::adalayernorm``: adaLN modulation, layer_norm(x) * (1 + scale) + shift."""

from __future__ import annotations

import torch

from .. import registry
from .._rules import check_broadcasts_into, compute_dtype, finish, promote, require_floating, resolve_out_dtype


def adalayernorm_rules(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """Validate adalayernorm inputs; return (output dtype, compute dtype)."""
    require_floating("adalayernorm", x=x, scale=scale, shift=shift)
    if x.dim() < 1:
        raise ValueError("mindiesd.adalayernorm: `x` must have at least one dimension")
    check_broadcasts_into("adalayernorm", "scale", scale.shape, x.shape)
    check_broadcasts_into("adalayernorm", "shift", shift.shape, x.shape)
    promoted = promote(x.dtype, scale.dtype, shift.dtype)
    return resolve_out_dtype(out_dtype, promoted), compute_dtype(promoted)


def reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """layer_norm(x, [D], no affine, eps) * (1 + scale) + shift."""
    out_dtype, work_dtype = adalayernorm_rules(x, scale, shift, out_dtype)
    values = x.to(work_dtype)
    mean = values.mean(dim=-1, keepdim=True)
    centered = values - mean
    variance = centered.pow(2).mean(dim=-1, keepdim=True)
    normalized = centered * torch.rsqrt(variance + eps)
    result = normalized * (1 + scale.to(work_dtype)) + shift.to(work_dtype)
    return finish(result, out_dtype, "adalayernorm", x)


ADALAYERNORM = registry.declare(registry.OpDef(
    schema="adalayernorm(Tensor x, Tensor scale, Tensor shift, float eps, ScalarType? out_dtype=None) -> Tensor",
    layout="contiguous", table_args=(1, 2),
    reference=reference, checks=adalayernorm_rules,
))

public = registry.public_function(ADALAYERNORM, """Adaptive layer norm: layer_norm(x) * (1 + scale) + shift.

    scale/shift broadcast into x (e.g. [B, 1, D] or [D]).  Output dtype:
    ``out_dtype`` or promote(x, scale, shift).
    """)
