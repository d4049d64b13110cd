"""``mindiesd::dequant_linear``: a linear layer over weights stored as int8 or float8 with one scale per output
channel (weight-only quantization: torchao's ``Int8WeightOnlyConfig`` and ``Float8WeightOnlyConfig``), dequantized
inside the op.

For x ``[..., K]`` of dtype T (float32, bfloat16 or float16), weight ``[N, K]`` (int8 or a float8 type),
weight_scale of N values and bias ``[N]`` or None, with the roundings of torchao's unfused sequences:

* ``scale_first`` (float8): ``w = T(float32(weight) * weight_scale)``, then ``x @ w.T`` in T;
* otherwise (int8): ``w = T(weight)``, then ``(x @ w.T) * weight_scale`` in the promoted dtype of T and the
  scale's (torchao casts a 16-bit model's scale to T first);

then ``+ bias`` in the promoted dtype, cast to ``out_dtype`` (by default x's dtype promoted with the bias's;
the pass always gives the dtype of the output it replaces). The output is
contiguous, ``x.shape[:-1] + (N,)``. The kernels write the dequantized weight into a buffer they keep for the next
call (eager's sequence allocates one or two full-size copies per layer and call, and frees them). For 16-bit x, a
kernel may sum the GEMM's products in float32 in another order than ATen's 16-bit GEMM (the CPU kernel does where
the CPU has no 16-bit GEMM instructions), which moves an output by the rounding of those sums.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import registry
from ._quantized import check_layer

__all__ = ["DEQUANT_LINEAR", "STORAGE_DTYPES", "dequant_linear_rules", "dequantized_weight", "reference"]

#: The weight storage dtypes the op dequantizes: int8 and every float8 type.
STORAGE_DTYPES = frozenset({torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                            torch.float8_e5m2fnuz})


def dequant_linear_rules(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]) -> tuple:
    """Validate dequant_linear inputs; return (output dtype, x's dtype)."""
    check_layer("dequant_linear", x, weight, weight_scale, bias, out_dtype, STORAGE_DTYPES, "int8 or float8")
    if out_dtype is None:
        out_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    return out_dtype, x.dtype


def dequantized_weight(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
                       scale_first: bool) -> torch.Tensor:
    """The [N, K] weight the GEMM reads: ``T(float32(weight) * scale)`` (scale_first) or ``T(weight)``."""
    if scale_first:
        return (weight.to(torch.float32) * weight_scale.reshape(-1, 1)).to(dtype)
    return weight.to(dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
              scale_first: bool = False, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torchao's unfused sequence (see the module doc)."""
    out_dtype, _ = dequant_linear_rules(x, weight, weight_scale, bias, out_dtype)
    k, n = x.shape[-1], weight.shape[0]
    out = torch.mm(x.reshape(-1, k), dequantized_weight(weight, weight_scale, x.dtype, scale_first).t())
    if not scale_first:
        out = out * weight_scale.reshape(-1)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype).reshape(*x.shape[:-1], n).contiguous()


DEQUANT_LINEAR = registry.declare(registry.OpDef(
    schema="dequant_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, bool scale_first, "
           "ScalarType? out_dtype=None) -> Tensor",
    layout="gemm", rows=False,
    reference=reference, checks=dequant_linear_rules, layout_args=2,
))
