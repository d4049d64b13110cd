"""Helpers of the ops' input checks (each op's own checks live in its module under ``defs/``).

The reference composition, the device kernels and the fake (shape-only)
kernels all call the op's same check function, so they agree on the output
shape/dtype and reject the same bad inputs with the same message.  The checks
only compare sizes, so they work unchanged on symbolic (SymInt) shapes, where
each comparison becomes a guard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
import torch

from .layout import output_layout, restride
from .dtypes import is_compute_float, promoted

REDUCED_FLOAT_DTYPES = (torch.float16, torch.bfloat16)
_GELU_TANH_COEFFICIENT = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715


def promote(*dtypes: torch.dtype) -> torch.dtype:
    """Type-promotion result of all ``dtypes`` (torch.promote_types, folded); ValueError naming them where one
    takes no part in type promotion (float8 and the other storage-only formats)."""
    result = promoted(*dtypes)
    if result is None:
        raise ValueError(f"mindiesd: no type promotion of {', '.join(map(str, dtypes))}: the fused ops compute in "
                         "float16, bfloat16, float32 or float64 (cast storage formats such as float8 first)")
    return result


def compute_dtype(promoted: torch.dtype) -> torch.dtype:
    """Dtype the arithmetic runs in: float32 for 16-bit floats, else ``promoted``."""
    return torch.float32 if promoted in REDUCED_FLOAT_DTYPES else promoted


def resolve_out_dtype(out_dtype: torch.dtype | None, promoted: torch.dtype) -> torch.dtype:
    return promoted if out_dtype is None else out_dtype


def shape_str(shape: Sequence) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def require_floating(op: str, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and not is_compute_float(tensor.dtype):
            raise ValueError(
                f"mindiesd.{op}: `{name}` must be a floating-point tensor the ops compute in (float16, bfloat16, "
                f"float32 or float64), got {tensor.dtype}"
            )


def check_broadcasts_into(
    op: str, name: str, shape: Sequence, target: Sequence, *, skip_last: bool = False
) -> None:
    """Raise ValueError unless ``shape`` broadcasts to ``target`` without enlarging it.

    With ``skip_last`` the last dimension is not compared (the caller checks it).
    """
    if len(shape) > len(target):
        raise ValueError(
            f"mindiesd.{op}: `{name}` of shape {shape_str(shape)} has more dimensions than "
            f"x {shape_str(target)}; it must broadcast to x's shape"
        )
    offset = 1 if skip_last else 0
    pairs = list(zip(reversed(shape), reversed(target)))[offset:]
    for position, (size, target_size) in enumerate(pairs, start=1 + offset):
        if size != 1 and size != target_size:
            raise ValueError(
                f"mindiesd.{op}: `{name}` of shape {shape_str(shape)} does not broadcast to "
                f"x's shape {shape_str(target)} (dim -{position}: {size} vs {target_size}); "
                f"the output must keep x's shape"
            )


def finish(result: torch.Tensor, out_dtype: torch.dtype, op: str, *inputs: torch.Tensor) -> torch.Tensor:
    """Round a reference result to the output dtype once, in the layout of the rule for ``op`` on ``inputs``."""
    return restride(result.to(dtype=out_dtype), output_layout(op, inputs)[1])


def tanh_gelu(values: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU, composed of aten ops in ``values``' dtype (fast_gelu and linear_gelu)."""
    inner = _GELU_TANH_COEFFICIENT * (values + _GELU_TANH_CUBIC * values.pow(3))
    return 0.5 * values * (1 + torch.tanh(inner))
