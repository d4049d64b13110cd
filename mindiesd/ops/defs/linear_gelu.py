"""``mindiesd::linear_gelu``: a linear layer followed by tanh-GELU, one matmul with a GELU epilogue."""

from __future__ import annotations

import torch

from .. import registry
from .._rules import compute_dtype, finish, require_floating, shape_str, tanh_gelu


def linear_gelu_rules(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """Validate linear_gelu inputs (x [..., K], weight [M, K], bias [M] or None, one dtype); return the output
    dtype."""
    require_floating("linear_gelu", x=x, weight=weight, bias=bias)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"mindiesd.linear_gelu: x {shape_str(x.shape)} and weight {shape_str(weight.shape)} do not make a "
            "linear layer (weight must be [out_features, x.shape[-1]])"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"mindiesd.linear_gelu: bias {shape_str(bias.shape)} must be [{weight.shape[0]}]")
    dtypes = {x.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1:
        raise ValueError(f"mindiesd.linear_gelu: x, weight and bias must share a dtype, got {sorted(map(str, dtypes))}")
    return x.dtype


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """tanh-GELU of the linear layer ``x @ weight.T + bias``: eager's two ops, the GEMM rounded to x's dtype."""
    out_dtype = linear_gelu_rules(x, weight, bias)
    gemm = torch.nn.functional.linear(x, weight, bias)
    return finish(tanh_gelu(gemm.to(compute_dtype(gemm.dtype))), out_dtype, "linear_gelu", x, weight)


LINEAR_GELU = registry.declare(registry.OpDef(
    schema="linear_gelu(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    layout="gemm", rows=False,
    reference=reference, checks=linear_gelu_rules, output_dtype=linear_gelu_rules, layout_args=2,
))
