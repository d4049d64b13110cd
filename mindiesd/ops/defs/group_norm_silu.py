"""``mindiesd::group_norm_silu``: group normalization over the channels (dim 1) and the spatial dims, an optional
per-channel affine, then SiLU: the norm and activation of the ResNet blocks of a convolutional VAE."""

from __future__ import annotations

import torch

from .. import registry
from .._rules import compute_dtype, finish, promote, require_floating, shape_str


def group_norm_silu_rules(
    x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.dtype, torch.dtype]:
    """Validate group_norm_silu inputs; return (output dtype, compute dtype). The output has x's dtype, as
    ``group_norm``'s has."""
    require_floating("group_norm_silu", x=x, weight=weight, bias=bias)
    if x.dim() < 2:
        raise ValueError(f"mindiesd.group_norm_silu: `x` must have a batch and a channel dim, got {shape_str(x.shape)}")
    channels = x.shape[1]
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0 or channels % groups:
        raise ValueError(f"mindiesd.group_norm_silu: `groups` must be a positive divisor of the {channels} channels "
                         f"of x, got {groups!r}")
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and tuple(value.shape) != (channels,):
            raise ValueError(f"mindiesd.group_norm_silu: `{name}` must have shape [{channels}] (x's channels), "
                             f"got {shape_str(value.shape)}")
    params = [t.dtype for t in (weight, bias) if t is not None]
    return x.dtype, compute_dtype(promote(x.dtype, *params))


def reference(
    x: torch.Tensor,
    groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """silu(group_norm(x, groups, weight, bias, eps)): each of the ``groups`` groups of channels normalised over
    its channels and the spatial dims (biased variance), scaled and shifted per channel."""
    out_dtype, work_dtype = group_norm_silu_rules(x, groups, weight, bias)
    values = x.to(work_dtype)
    grouped = values.reshape(x.shape[0], groups, -1)
    mean = grouped.mean(dim=-1, keepdim=True)
    variance = (grouped - mean).pow(2).mean(dim=-1, keepdim=True)
    normed = ((grouped - mean) * torch.rsqrt(variance + eps)).reshape(x.shape)
    per_channel = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    if weight is not None:
        normed = normed * weight.to(work_dtype).reshape(per_channel)
    if bias is not None:
        normed = normed + bias.to(work_dtype).reshape(per_channel)
    return finish(torch.nn.functional.silu(normed), out_dtype, "group_norm_silu", x)


GROUP_NORM_SILU = registry.declare(registry.OpDef(
    schema="group_norm_silu(Tensor x, int groups, Tensor? weight, Tensor? bias, float eps) -> Tensor",
    # group_norm's output has x's layout (contiguous, channels-last): the kernels give it themselves
    layout="like_x", rows=False, own_layout=True,
    reference=reference, checks=group_norm_silu_rules,
))

public = registry.public_function(GROUP_NORM_SILU, """Group normalization (over dim 1's groups and the spatial
    dims, optionally scaled by ``weight`` and shifted by ``bias`` per channel), then SiLU.

    Same function as ``F.silu(F.group_norm(x, groups, weight, bias, eps))``; output dtype: x's.
    """)
