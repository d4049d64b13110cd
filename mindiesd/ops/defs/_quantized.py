"""The input checks that the quantized linear layers (``int8_linear``, ``dequant_linear``) share."""

from __future__ import annotations

from typing import Collection, Optional

import torch

from .._rules import shape_str

#: The dtypes of x (and of the output) the quantized linear layers compute in.
X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_layer(op: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype], storage: Collection[torch.dtype],
                storage_name: str) -> None:
    """ValueError naming the first argument of ``op`` that is not x ``[..., K]`` (float32, bfloat16 or float16), a
    2-D ``weight`` ``[N, K]`` of one of the ``storage`` dtypes, N scales and a bias ``[N]`` (each of x's dtype or
    float32), an output dtype x may have, all on one device."""
    op = f"mindiesd.{op}"
    if x.dtype not in X_DTYPES:
        raise ValueError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dimension")
    if weight.dtype not in storage or weight.dim() != 2:
        raise ValueError(f"{op}: weight must be a 2-D {storage_name} tensor [out_features, in_features], got "
                         f"{weight.dtype} {shape_str(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight {shape_str(weight.shape)} does not take x's last dimension {x.shape[-1]}")
    n = weight.shape[0]
    if weight_scale.dtype not in (x.dtype, torch.float32) or weight_scale.numel() != n:
        raise ValueError(f"{op}: weight_scale must hold {n} values of x's dtype {x.dtype} or float32, got "
                         f"{weight_scale.dtype} {shape_str(weight_scale.shape)}")
    if bias is not None and (bias.dtype not in (x.dtype, torch.float32) or bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op}: bias must be [{n}] of x's dtype {x.dtype} or float32, got {bias.dtype} "
                         f"{shape_str(bias.shape)}")
    if out_dtype is not None and out_dtype not in X_DTYPES:
        raise ValueError(f"{op}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    devices = {t.device for t in (x, weight, weight_scale, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{op}: the tensors must be on one device, got {sorted(map(str, devices))}")
