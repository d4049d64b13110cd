"""``mindiesd::int8_linear``: a linear layer over int8 weights with dynamic per-row int8 quantization of its input,
as torchao's ``Int8DynamicActivationInt8WeightConfig`` computes it, in one op.

For x ``[..., K]`` of dtype T (float32, bfloat16 or float16), weight ``[N, K]`` int8, weight_scale of N values and
bias ``[N]`` or None (each of dtype T or float32: torchao keeps a bfloat16 model's scales in float32), each row of x
is quantized symmetrically to int8 and the int32 product is rescaled, with every intermediate rounding of torchao's
unfused sequence (so the op is bit-exact with it). ``compensation`` is None or the weight's column sums times 128
(int32, N values), which torchao computes on CPUs with VNNI but no AMX, where it shifts the quantized x to uint8 for
a uint8 x int8 GEMM and subtracts them; a kernel may use them for that GEMM. The integer product is exact whichever
way it is computed, so the result does not depend on it:

1. ``amax_abs = maximum(-minimum(amin(x), 0), maximum(amax(x), 0))`` per row, in T;
2. ``scale = clamp(amax_abs / 127.5, min=eps)`` in T (127.5 is half the width of [-128, 127]), then float32;
3. ``q = clamp(round(float32(x) * reciprocal(scale)), -128, 127)`` as int8 (round half to even);
4. ``acc = q @ weight.T`` in int32 (``torch._int_mm``, or ``_int_mm(q + 128 as uint8, weight.T) - compensation``);
5. ``out = T(float32(acc) * scale) * weight_scale + bias``, the product and the sum in the promoted dtype of
   their operands (as eager's type promotion rounds them), then cast to ``out_dtype`` (by default that of the sum).

The output is contiguous, ``x.shape[:-1] + (N,)``. A row that holds a NaN has a NaN scale, so its output row is
NaN, as in the unfused sequence.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import registry
from ._quantized import check_layer

#: The quantized range and the divisor of the symmetric scale: (127 - (-128)) / 2.
QMIN, QMAX, HALF_RANGE = -128, 127, 127.5
#: The scale's floor in torchao's int8 dynamic quantization: float32's machine epsilon.
DEFAULT_EPS = torch.finfo(torch.float32).eps


def int8_linear_rules(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: Optional[torch.Tensor], compensation: Optional[torch.Tensor],
                      out_dtype: Optional[torch.dtype]) -> tuple[torch.dtype, torch.dtype]:
    """Validate int8_linear inputs; return (output dtype, compute dtype: float32)."""
    check_layer("int8_linear", x, weight, weight_scale, bias, out_dtype, (torch.int8,), "int8")
    n = weight.shape[0]
    if compensation is not None and (compensation.dtype != torch.int32 or compensation.numel() != n
                                     or compensation.device != weight.device):
        raise ValueError(f"mindiesd.int8_linear: compensation must be None or {n} int32 values (the weight's column "
                         f"sums times 128) on the weight's device, got {compensation.dtype} "
                         f"{list(compensation.shape)} on {compensation.device}")
    summed = torch.promote_types(x.dtype, weight_scale.dtype)
    if bias is not None:
        summed = torch.promote_types(summed, bias.dtype)
    return (summed if out_dtype is None else out_dtype), torch.float32


def check_eps(eps: float) -> None:
    if not eps > 0:
        raise ValueError(f"mindiesd.int8_linear: eps must be positive, got {eps}")


def quantize_rows(x: torch.Tensor, eps: float = DEFAULT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows of x, float32 scale per row [..., 1]): steps 1-3, in torchao's order of roundings."""
    low = torch.minimum(x.amin(-1, keepdim=True), torch.zeros((), dtype=x.dtype, device=x.device))
    high = torch.maximum(x.amax(-1, keepdim=True), torch.zeros((), dtype=x.dtype, device=x.device))
    scale = torch.maximum(-low, high).div(HALF_RANGE).clamp(min=eps).float()
    q = (x * scale.reciprocal()).round().clamp(QMIN, QMAX).to(torch.int8)
    return q, scale


def rescale(acc: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
            dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Step 5 on the int32 product ``acc`` [M, N] with the per-row ``scale`` [M, 1], x's dtype ``dtype``."""
    out = (acc.float() * scale).to(dtype) * weight_scale.reshape(-1)
    return (out if bias is None else out + bias).to(out_dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: Optional[torch.Tensor] = None, compensation: Optional[torch.Tensor] = None,
              eps: float = DEFAULT_EPS, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torchao's unfused sequence: quantize the rows, ``torch._int_mm``, rescale (see the module doc). The signed
    product is the uint8 one less the compensation, so ``compensation`` is checked and not needed."""
    out_dtype, _ = int8_linear_rules(x, weight, weight_scale, bias, compensation, out_dtype)
    check_eps(eps)
    k, n = x.shape[-1], weight.shape[0]
    q, scale = quantize_rows(x.detach(), eps)
    acc = torch._int_mm(q.reshape(-1, k), weight.t())
    out = rescale(acc, scale.reshape(-1, 1), weight_scale, bias, x.dtype, out_dtype)
    return out.reshape(*x.shape[:-1], n).contiguous()


INT8_LINEAR = registry.declare(registry.OpDef(
    schema="int8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, Tensor? compensation, "
           "float eps, ScalarType? out_dtype=None) -> Tensor",
    layout="gemm", rows=False,
    reference=reference, checks=int8_linear_rules, layout_args=2,
))

public = registry.public_function(
    INT8_LINEAR, """Linear layer over int8 weights with dynamic per-row int8 quantization of x (torchao's
    Int8DynamicActivationInt8WeightConfig arithmetic, bit-exact); not differentiable through the quantization.""")
