"""``mindiesd::cat_linear``: a linear layer over the concatenation of its inputs along the last dimension,
without the concatenation.

``linear(cat([x_1, ..., x_n], -1), W, b)`` equals ``sum_i x_i @ W[:, k_i : k_i + K_i]^T + b``, ``W``'s column
blocks being views of the one weight (nothing is copied or folded, so a weight replaced in place is read as it
is). The kernels accumulate the products into one output, so the concatenated input is never written.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import registry
from .._rules import shape_str
from ..dtypes import is_compute_float


def cat_linear_rules(xs: Sequence[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.dtype:
    """Validate cat_linear inputs (two or more xs [..., K_i] of one leading shape, weight [M, sum K_i], bias [M]
    or None, one floating dtype); return the output dtype."""
    if not isinstance(xs, (list, tuple)) or len(xs) < 2:
        raise ValueError("mindiesd.cat_linear: xs must be a list of two or more tensors")
    first = xs[0]
    if not is_compute_float(first.dtype):
        raise ValueError(f"mindiesd.cat_linear: the inputs must be floating-point tensors, got {first.dtype}")
    dtypes = {x.dtype for x in xs} | {weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1:
        raise ValueError(f"mindiesd.cat_linear: xs, weight and bias must share a dtype, got {sorted(map(str, dtypes))}")
    lead = first.shape[:-1]
    if first.dim() < 1 or any(x.dim() != first.dim() or x.shape[:-1] != lead for x in xs):
        raise ValueError("mindiesd.cat_linear: the inputs must agree in every dimension but the last, got "
                         + ", ".join(shape_str(x.shape) for x in xs))
    width = sum(x.shape[-1] for x in xs)
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ValueError(f"mindiesd.cat_linear: weight {shape_str(weight.shape)} must be [out_features, {width}] "
                         "(the inputs' last dimensions summed)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"mindiesd.cat_linear: bias {shape_str(bias.shape)} must be [{weight.shape[0]}]")
    return first.dtype


def column_blocks(xs: Sequence[torch.Tensor], weight: torch.Tensor):
    """``(x_i, W_i)`` pairs: each input with the view of weight's columns it multiplies."""
    start = 0
    for x in xs:
        width = x.shape[-1]
        yield x, weight[:, start:start + width]
        start += width


def reference(xs: Sequence[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linear(cat(xs, -1), weight, bias)``: eager's two ops."""
    cat_linear_rules(xs, weight, bias)
    return torch.nn.functional.linear(torch.cat(list(xs), -1), weight, bias).contiguous()


CAT_LINEAR = registry.declare(registry.OpDef(
    schema="cat_linear(Tensor[] xs, Tensor weight, Tensor? bias) -> Tensor",
    layout="gemm", rows=False,
    reference=reference, checks=cat_linear_rules, output_dtype=cat_linear_rules, layout_args=2,
))
