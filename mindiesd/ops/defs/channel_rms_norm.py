"""``mindiesd::channel_rms_norm``: the channel-wise RMS norm of convolutional VAEs (Wan's and Qwen-Image's
``F.normalize(x, dim=1) * scale * gamma + bias``), optionally followed by SiLU."""

from __future__ import annotations

import torch

from .. import registry
from .._rules import compute_dtype, finish, promote, require_floating, shape_str


def per_channel(value: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``value`` holds one number per channel of x (dim 1): shape [C], or [C, 1, ..., 1] with x's rank less
    one (what broadcasts against x per channel)."""
    channels = x.shape[1]
    if value.dim() == 1:
        return value.shape[0] == channels
    return value.dim() == x.dim() - 1 and value.shape[0] == channels and all(s == 1 for s in value.shape[1:])


def channel_rms_norm_rules(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.dtype, torch.dtype]:
    """Validate channel_rms_norm inputs; return (output dtype, compute dtype): the promotion of x, weight and bias,
    as eager's products and sum give."""
    require_floating("channel_rms_norm", x=x, weight=weight, bias=bias)
    if x.dim() < 2:
        raise ValueError(f"mindiesd.channel_rms_norm: `x` must have a batch and a channel dim, got {shape_str(x.shape)}")
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and not per_channel(value, x):
            raise ValueError(f"mindiesd.channel_rms_norm: `{name}` must hold one value per channel of x ([{x.shape[1]}] "
                             f"or [{x.shape[1]}, 1, ...] of rank {x.dim() - 1}), got {shape_str(value.shape)}")
    promoted = promote(x.dtype, *(t.dtype for t in (weight, bias) if t is not None))
    return promoted, compute_dtype(promoted)


def reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    eps: float = 1e-12,
    silu: bool = False,
) -> torch.Tensor:
    """x / max(||x||_2 over the channels, eps) * scale * weight + bias (weight and bias per channel), then SiLU when
    ``silu``: ``F.normalize(x, dim=1, eps=eps) * scale * weight + bias``."""
    out_dtype, work_dtype = channel_rms_norm_rules(x, weight, bias)
    values = x.to(work_dtype)
    norm = values.pow(2).sum(dim=1, keepdim=True).sqrt().clamp_min(eps)
    result = values / norm * scale
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    if weight is not None:
        result = result * weight.to(work_dtype).reshape(shape)
    if bias is not None:
        result = result + bias.to(work_dtype).reshape(shape)
    if silu:
        result = torch.nn.functional.silu(result)
    return finish(result, out_dtype, "channel_rms_norm", x)


CHANNEL_RMS_NORM = registry.declare(registry.OpDef(
    schema="channel_rms_norm(Tensor x, Tensor? weight, Tensor? bias, float scale, float eps, bool silu) -> Tensor",
    # x's layout (contiguous, channels-last), as eager's elementwise ops over x give: the kernels give it themselves
    layout="like_x", rows=False, own_layout=True,
    reference=reference, checks=channel_rms_norm_rules,
))

public = registry.public_function(CHANNEL_RMS_NORM, """The channel-wise RMS norm of Wan's and Qwen-Image's VAEs:
    ``F.normalize(x, dim=1, eps=eps) * scale * weight + bias`` (weight and bias: one value per channel), then SiLU
    when ``silu``. Output dtype: promote(x, weight, bias).
    """)
