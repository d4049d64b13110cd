"""Which dtypes the fused ops compute in, and which dtype casts change no value.

Weights are often stored in formats that aten computes nothing in: float8 (torchao's ``Float8Tensor``, diffusers'
layerwise casting), float4, the e8m0 scales, the sub-byte and quantized integer types. ``torch.promote_types``
raises on them. Every dtype question of the fused ops and of the pattern passes is answered here, so that such a
dtype makes a pattern not match, and a fused op refuse it with a clear error, instead of raising inside a check.
"""

from __future__ import annotations

from functools import reduce
from typing import Optional

import torch

__all__ = ["COMPUTE_FLOAT_DTYPES", "PROMOTING_DTYPES", "is_compute_float", "promoted", "widens"]

#: The floating dtypes aten computes and promotes in (float8, float4 and e8m0 are storage formats only).
COMPUTE_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

#: The dtypes ``torch.promote_types`` accepts with one another.
PROMOTING_DTYPES = COMPUTE_FLOAT_DTYPES | frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.complex32, torch.complex64, torch.complex128,
})


def is_compute_float(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a floating dtype the fused ops compute in: float16, bfloat16, float32 or float64."""
    return dtype in COMPUTE_FLOAT_DTYPES


def promoted(*dtypes: torch.dtype) -> Optional[torch.dtype]:
    """The type-promotion result of ``dtypes``; None when one of them takes no part in type promotion (float8,
    float4, bit and quantized dtypes)."""
    if not dtypes or any(d not in PROMOTING_DTYPES for d in dtypes):
        return None
    return reduce(torch.promote_types, dtypes)


def widens(src: torch.Tensor | torch.dtype, dst: torch.Tensor | torch.dtype) -> bool:
    """Whether a cast from ``src`` to ``dst`` (dtypes, or tensors standing for theirs) is exact between compute
    floats: every value of ``src`` is one of ``dst``."""
    src, dst = (t.dtype if isinstance(t, torch.Tensor) else t for t in (src, dst))
    return is_compute_float(src) and is_compute_float(dst) and promoted(src, dst) == dst
