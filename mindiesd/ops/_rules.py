"""Shape, dtype and validation rules shared by every implementation of an op.

The reference composition, the device kernels and the fake (shape-only)
kernels all call the same rule function, so they agree on the output
shape/dtype and reject the same bad inputs with the same message.  The rules
only compare sizes, so they work unchanged on symbolic (SymInt) shapes, where
each comparison becomes a guard.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import torch

REDUCED_FLOAT_DTYPES = (torch.float16, torch.bfloat16)


def promote(*dtypes: torch.dtype) -> torch.dtype:
    """Type-promotion result of all ``dtypes`` (torch.promote_types, folded)."""
    return reduce(torch.promote_types, dtypes)


def compute_dtype(promoted: torch.dtype) -> torch.dtype:
    """Dtype the arithmetic runs in: float32 for 16-bit floats, else ``promoted``."""
    return torch.float32 if promoted in REDUCED_FLOAT_DTYPES else promoted


def _resolve(out_dtype: torch.dtype | None, promoted: torch.dtype) -> torch.dtype:
    return promoted if out_dtype is None else out_dtype


def _shape_str(shape: Sequence) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _require_floating(op: str, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.dtype.is_floating_point:
            raise ValueError(
                f"mindiesd.{op}: `{name}` must be a floating-point tensor, got {tensor.dtype}"
            )


def check_broadcasts_into(
    op: str, name: str, shape: Sequence, target: Sequence, *, skip_last: bool = False
) -> None:
    """Raise ValueError unless ``shape`` broadcasts to ``target`` without enlarging it.

    With ``skip_last`` the last dimension is not compared (the caller checks it).
    """
    if len(shape) > len(target):
        raise ValueError(
            f"mindiesd.{op}: `{name}` of shape {_shape_str(shape)} has more dimensions than "
            f"x {_shape_str(target)}; it must broadcast to x's shape"
        )
    offset = 1 if skip_last else 0
    pairs = list(zip(reversed(shape), reversed(target)))[offset:]
    for position, (size, target_size) in enumerate(pairs, start=1 + offset):
        if size != 1 and size != target_size:
            raise ValueError(
                f"mindiesd.{op}: `{name}` of shape {_shape_str(shape)} does not broadcast to "
                f"x's shape {_shape_str(target)} (dim -{position}: {size} vs {target_size}); "
                f"the output must keep x's shape"
            )


def rms_norm_rules(
    x: torch.Tensor, weight: torch.Tensor | None, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """Validate rms_norm inputs; return (output dtype, compute dtype)."""
    _require_floating("rms_norm", x=x, weight=weight)
    if x.dim() < 1:
        raise ValueError("mindiesd.rms_norm: `x` must have at least one dimension")
    if weight is None:
        promoted = x.dtype
    else:
        check_broadcasts_into("rms_norm", "weight", weight.shape, x.shape)
        promoted = promote(x.dtype, weight.dtype)
    return _resolve(out_dtype, promoted), compute_dtype(promoted)


def rope_rules(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """Validate rope inputs; return (output dtype, compute dtype).

    The last dim D of x must be even; cos/sin carry D values ("full width"),
    D/2 values ("per pair") or 1 value in their last dim, and broadcast into
    x's other dims without enlarging x.
    """
    _require_floating("rope", x=x, cos=cos, sin=sin)
    if x.dim() < 1:
        raise ValueError("mindiesd.rope: `x` must have at least one dimension")
    width = x.shape[-1]
    if width % 2 != 0:
        raise ValueError(
            f"mindiesd.rope: the last dim of `x` must be even, got x of shape {_shape_str(x.shape)}"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() < 1:
            raise ValueError(f"mindiesd.rope: `{name}` must have at least one dimension")
        last = table.shape[-1]
        if last != width and last != width // 2 and last != 1:
            raise ValueError(
                f"mindiesd.rope: the last dim of `{name}` (shape {_shape_str(table.shape)}) "
                f"must be {width} (full width), {width // 2} (per pair) or 1, for x of shape "
                f"{_shape_str(x.shape)}"
            )
        check_broadcasts_into("rope", name, table.shape, x.shape, skip_last=True)
    promoted = promote(x.dtype, cos.dtype, sin.dtype)
    return _resolve(out_dtype, promoted), compute_dtype(promoted)


def adalayernorm_rules(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """Validate adalayernorm inputs; return (output dtype, compute dtype)."""
    _require_floating("adalayernorm", x=x, scale=scale, shift=shift)
    if x.dim() < 1:
        raise ValueError("mindiesd.adalayernorm: `x` must have at least one dimension")
    check_broadcasts_into("adalayernorm", "scale", scale.shape, x.shape)
    check_broadcasts_into("adalayernorm", "shift", shift.shape, x.shape)
    promoted = promote(x.dtype, scale.dtype, shift.dtype)
    return _resolve(out_dtype, promoted), compute_dtype(promoted)


def fast_gelu_rules(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """Validate fast_gelu input; return (output dtype, compute dtype)."""
    _require_floating("fast_gelu", x=x)
    return x.dtype, compute_dtype(x.dtype)


def linear_gelu_rules(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """Validate linear_gelu inputs (x [..., K], weight [M, K], bias [M] or None, one dtype); return the output
    dtype."""
    _require_floating("linear_gelu", x=x, weight=weight, bias=bias)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"mindiesd.linear_gelu: x {_shape_str(x.shape)} and weight {_shape_str(weight.shape)} do not make a "
            "linear layer (weight must be [out_features, x.shape[-1]])"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"mindiesd.linear_gelu: bias {_shape_str(bias.shape)} must be [{weight.shape[0]}]")
    dtypes = {x.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1:
        raise ValueError(f"mindiesd.linear_gelu: x, weight and bias must share a dtype, got {sorted(map(str, dtypes))}")
    return x.dtype


def mul_add_rules(
    x: torch.Tensor, y: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Size, torch.dtype, torch.dtype]:
    """Validate mul_add inputs; return (output shape, output dtype, compute dtype)."""
    try:
        shape = torch.broadcast_shapes(x.shape, y.shape, z.shape)
    except RuntimeError as error:
        raise ValueError(
            f"mindiesd.mul_add: shapes x {_shape_str(x.shape)}, y {_shape_str(y.shape)} and "
            f"z {_shape_str(z.shape)} do not broadcast together"
        ) from error
    promoted = promote(x.dtype, y.dtype, z.dtype)
    return shape, promoted, compute_dtype(promoted)
