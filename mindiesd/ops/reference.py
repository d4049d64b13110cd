"""Reference definitions of the mindiesd fused operators.

Each function is a plain composition of aten ops and is the definition of
correct for its operator: every device kernel is tested against it.  The
arithmetic runs in the compute dtype (float32 for float16/bfloat16 inputs,
otherwise the promoted dtype) and is rounded once, at the end, to the output
dtype.  Outputs have the layout of ``mindiesd.ops._layout``'s rule (that of
the op sequence each one replaces), matching the fake kernels.  The
functions are differentiable, so ``mindiesd.ops`` also uses them whenever
autograd needs a gradient.
"""

from __future__ import annotations

import math

import torch

from ._layout import output_layout, restride
from ._rules import (
    linear_gelu_rules,
    adalayernorm_rules,
    fast_gelu_rules,
    mul_add_rules,
    rms_norm_rules,
    rope_rules,
)

__all__ = ["adalayernorm", "fast_gelu", "mul_add", "rms_norm", "rope"]

_GELU_TANH_COEFFICIENT = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715


def _finish(result: torch.Tensor, out_dtype: torch.dtype, op: str, *inputs: torch.Tensor) -> torch.Tensor:
    """Round to the output dtype once, in the layout of the rule for ``op`` on ``inputs``."""
    return restride(result.to(dtype=out_dtype), output_layout(op, inputs)[1])


def rms_norm(
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
    return _finish(result, out_dtype, "rms_norm", x)


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


def rope(
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
    return _finish(result, out_dtype, "rope", x)


def adalayernorm(
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
    return _finish(result, out_dtype, "adalayernorm", x)


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GELU, the function of F.gelu(x, approximate="tanh")."""
    out_dtype, work_dtype = fast_gelu_rules(x)
    values = x.to(work_dtype)
    inner = _GELU_TANH_COEFFICIENT * (values + _GELU_TANH_CUBIC * values.pow(3))
    result = 0.5 * values * (1 + torch.tanh(inner))
    return _finish(result, out_dtype, "fast_gelu", x)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """tanh-GELU of the linear layer ``x @ weight.T + bias``: eager's two ops, the GEMM rounded to x's dtype."""
    out_dtype = linear_gelu_rules(x, weight, bias)
    return _finish(fast_gelu(torch.nn.functional.linear(x, weight, bias)), out_dtype, "linear_gelu", x, weight)


def mul_add(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, addend_first: bool = False) -> torch.Tensor:
    """x * y + z with full broadcasting, in the layout of eager's ``z + x * y`` when ``addend_first``."""
    _, out_dtype, work_dtype = mul_add_rules(x, y, z)
    result = x.to(work_dtype) * y.to(work_dtype) + z.to(work_dtype)
    return _finish(result, out_dtype, "mul_add", x, y, z, addend_first)
