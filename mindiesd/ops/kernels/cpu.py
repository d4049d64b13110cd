"""CPU kernels: aten compositions that touch memory as few times as possible.

On CPU these ops are bound by memory traffic and, above all, by fresh large
allocations (first-touch page faults of a new 32 MiB buffer cost about ten
times one pass of arithmetic over it), so each kernel allocates one output
buffer where it can and finishes its work with in-place or ``out=`` ops.
16-bit inputs are computed in float32 and rounded once, either inside an
aten kernel that accumulates in float32 (layer_norm with float32 affine,
gelu, addcmul) or through one float32 working buffer.
Outputs are contiguous, as the fake kernels promise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import reference, registry
from .._rules import REDUCED_FLOAT_DTYPES, promote
from ..defs import ADALAYERNORM, CHANNEL_RMS_NORM, FAST_GELU, GLU, GROUP_NORM_SILU, MUL_ADD, NORM_ROPE, RMS_NORM, ROPE
from ..defs.adalayernorm import adalayernorm_rules
from ..defs.channel_rms_norm import channel_rms_norm_rules
from ..defs.fast_gelu import fast_gelu_rules
from ..defs.glu import glu_rules, halves
from ..defs.group_norm_silu import group_norm_silu_rules
from ..defs.mul_add import mul_add_rules
from ..defs.norm_rope import norm_rope_rules, rotated_shape
from ..defs.rms_norm import rms_norm_rules
from ..defs.rope import rope_rules

def _without_autograd(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Run ``kernel`` with grad mode off.

    The ops have no autograd formula; a direct call on tensors that require
    grad would otherwise fail inside the ``out=`` ops.  This makes the CPU
    kernel behave like the reference kernel does on other devices.
    """

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return kernel(*args, **kwargs)
        return kernel(*args, **kwargs)

    return run


#: Op name -> CPU kernel, as registered (each op's composition here, linear_gelu's in ``gemm``).
KERNELS: dict[str, Callable[..., torch.Tensor]] = {}


def cpu_kernel(op: registry.OpDef, *, fast: bool = True, note: str = "C++ kernel, or an aten composition"):
    """Decorator: register the function, run without autograd, as ``op``'s CPU kernel (the C++ kernel of
    ``cpp`` replaces it where the extension is enabled)."""

    def decorate(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        registry.kernel(op, "cpu", fast=fast, note=note, into=KERNELS)(_without_autograd(kernel))
        return kernel

    return decorate


# Batch slices up to which 16-bit adalayernorm runs one affine layer_norm per
# slice instead of layer_norm on a float32 copy followed by a modulation.
_MAX_AFFINE_SLICES = 16
_COMPLEX_COMPUTE_DTYPES = (torch.float32, torch.float64)


@functools.lru_cache(maxsize=64)
def _scalar_tensor(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 0-dim tensor, so scalar arithmetic fuses into one addcmul."""
    return torch.tensor(value, dtype=dtype, device=device)


def _working_copy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous copy of ``x`` in ``dtype`` that may be overwritten."""
    return x.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def _finish(result: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return result if result.dtype == out_dtype else result.to(out_dtype)


@cpu_kernel(RMS_NORM)
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One read for the statistics (vector_norm), then in-place scaling."""
    out_dtype, work_dtype = rms_norm_rules(x, weight, out_dtype)
    if x.dtype == work_dtype:
        source = x
        out = torch.empty(x.shape, dtype=work_dtype, device=x.device)
    else:
        source = out = _working_copy(x, work_dtype)
    norm = torch.linalg.vector_norm(source, dim=-1, keepdim=True)
    inv_rms = torch.addcmul(
        _scalar_tensor(eps, work_dtype, x.device), norm, norm, value=1.0 / x.shape[-1]
    ).rsqrt_()
    if out is source:
        out.mul_(inv_rms)
    else:
        torch.mul(source, inv_rms, out=out)
    if weight is not None:
        out.mul_(weight)
    return _finish(out, out_dtype)


def _pair_table(table: torch.Tensor, width: int) -> torch.Tensor | None:
    """cos/sin as one value per interleaved pair, or None when not expressible.

    A full-width table whose even and odd entries are equal (Flux builds them
    with repeat_interleave) is equivalent to its even entries.
    """
    last = table.shape[-1]
    if last == 1 or last == width // 2:
        return table
    even, odd = table[..., 0::2], table[..., 1::2]
    return even if torch.equal(even, odd) else None


def _complex_viewable(values: torch.Tensor) -> bool:
    return (
        values.dtype in _COMPLEX_COMPUTE_DTYPES
        and values.stride(-1) == 1
        and values.storage_offset() % 2 == 0
        and all(stride % 2 == 0 for stride in values.stride()[:-1])
    )


@cpu_kernel(ROPE)
def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotary embedding in one or three passes over one output buffer.

    Interleaved with per-pair tables (or full-width ones whose pair entries
    are equal, as Flux builds them): one complex multiply.  Otherwise one
    multiply by cos and two addcmul_ of the partner halves with sin.
    """
    out_dtype, work_dtype = rope_rules(x, cos, sin, out_dtype)
    width = x.shape[-1]
    pair_shape = (width // 2, 2)
    fresh = x.dtype != work_dtype
    source = _working_copy(x, work_dtype) if fresh else x
    cos = cos.to(work_dtype)
    sin = sin.to(work_dtype)

    if interleaved and _complex_viewable(source):
        cos_pairs, sin_pairs = _pair_table(cos, width), _pair_table(sin, width)
        if cos_pairs is not None and sin_pairs is not None:
            rotation = torch.complex(cos_pairs, sin_pairs)
            source_complex = torch.view_as_complex(source.unflatten(-1, pair_shape))
            if fresh:
                source_complex.mul_(rotation)
                return _finish(source, out_dtype)
            out = torch.empty(x.shape, dtype=work_dtype, device=x.device)
            torch.mul(
                source_complex, rotation, out=torch.view_as_complex(out.unflatten(-1, pair_shape))
            )
            return _finish(out, out_dtype)

    cos = reference.full_width(cos, width, interleaved)
    sin = reference.full_width(sin, width, interleaved)
    if interleaved:
        first, second = slice(0, None, 2), slice(1, None, 2)
    else:
        first, second = slice(0, width // 2), slice(width // 2, None)
    sin_first = sin if sin.shape[-1] == 1 else sin[..., first]
    sin_second = sin if sin.shape[-1] == 1 else sin[..., second]
    out = torch.empty(x.shape, dtype=work_dtype, device=x.device)
    torch.mul(source, cos, out=out)
    out[..., first].addcmul_(source[..., second], sin_first, value=-1)
    out[..., second].addcmul_(source[..., first], sin_second)
    return _finish(out, out_dtype)


@cpu_kernel(NORM_ROPE)
def norm_rope(
    xs: list,
    dim: int,
    weights: list,
    eps: float,
    norm_dtype: torch.dtype | None,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The two kernels above in sequence: each stream's RMSNorm, their concatenation, one rotation (of the heads)."""
    out_dtype, _ = norm_rope_rules(xs, dim, weights, eps, norm_dtype, head_dim, cos, sin, out_dtype)
    normed = [rms_norm(x, w, eps, norm_dtype or x.dtype) for x, w in zip(xs, weights)]
    joined = torch.cat(normed, dim) if len(normed) > 1 else normed[0].contiguous()
    heads = joined.view(rotated_shape(joined.shape, head_dim))
    return rope(heads, cos, sin, interleaved, out_dtype).view(joined.shape)


def _modulated_leading_dims(x_shape: torch.Size, *shapes: torch.Size) -> int:
    """Number of leading dims of x along which any of ``shapes`` varies.

    Beyond them (up to the last dim) every modulation tensor is constant, so
    each slice x[i0, ..., ip-1] sees a single [D] scale and shift.
    """
    rank = len(x_shape)
    leading = 0
    for shape in shapes:
        aligned = (1,) * (rank - len(shape)) + tuple(shape)
        for dim in range(rank - 1):
            if aligned[dim] != 1:
                leading = max(leading, dim + 1)
    return leading


def _rows(table: torch.Tensor, x_shape: torch.Size, leading: int) -> torch.Tensor:
    """``table`` as [slices, D]: one row per slice of the ``leading`` dims of x."""
    rank = len(x_shape)
    aligned = table.reshape((1,) * (rank - table.dim()) + tuple(table.shape))
    per_slice = aligned[(slice(None),) * leading + (0,) * (rank - 1 - leading)]
    return per_slice.expand(*x_shape[:leading], x_shape[-1]).reshape(-1, x_shape[-1])


@cpu_kernel(ADALAYERNORM)
def adalayernorm(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """layer_norm with (1 + scale, shift) as its affine where scale/shift allow it.

    * scale/shift constant over all but the last dim: one affine layer_norm.
    * 16-bit x varying over a few leading (batch) slices: one affine
      layer_norm per slice, which rounds once without a float32 copy of x.
    * otherwise: layer_norm, then one in-place addcmul.
    """
    out_dtype, work_dtype = adalayernorm_rules(x, scale, shift, out_dtype)
    width = x.shape[-1]
    leading = _modulated_leading_dims(x.shape, scale.shape, shift.shape)
    slices = math.prod(x.shape[:leading])
    # layer_norm accumulates 16-bit input in float32 against float32 affine
    # parameters and rounds once, so such x needs no float32 working copy.
    mixed_precision = (
        x.dtype in REDUCED_FLOAT_DTYPES and work_dtype == torch.float32 and out_dtype == x.dtype
    )

    if slices == 1 or (mixed_precision and slices <= _MAX_AFFINE_SLICES):
        source = x if (x.dtype == work_dtype or mixed_precision) else _working_copy(x, work_dtype)
        weights = _rows(scale.to(work_dtype), x.shape, leading).add(1)
        biases = _rows(shift.to(work_dtype), x.shape, leading)
        if slices == 1:
            out = F.layer_norm(source, (width,), weights[0], biases[0], eps)
            return _finish(out.contiguous(), out_dtype)
        source_slices = source.reshape(slices, *x.shape[leading:])
        parts = [
            F.layer_norm(source_slices[index], (width,), weights[index], biases[index], eps)
            for index in range(slices)
        ]
        return _finish(torch.stack(parts).view(x.shape), out_dtype)

    source = x if x.dtype == work_dtype else _working_copy(x, work_dtype)
    out = F.layer_norm(source, (width,), None, None, eps).contiguous()
    torch.addcmul(shift.to(work_dtype), out, scale.to(work_dtype).add(1), out=out)
    return _finish(out, out_dtype)


@cpu_kernel(GROUP_NORM_SILU)
def group_norm_silu(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
    """aten's group norm, then its SiLU in place over the norm's (new) output: eager's two kernels, one
    allocation."""
    group_norm_silu_rules(x, groups, weight, bias)
    out = torch.ops.aten.group_norm.default(x, groups, weight, bias, eps)
    return torch.ops.aten.silu_.default(out)


@cpu_kernel(CHANNEL_RMS_NORM)
def channel_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, scale: float,
                     eps: float, silu: bool) -> torch.Tensor:
    """Eager's ops (``F.normalize``, the scale, weight and bias, the SiLU) in the compute dtype (float32 for 16-bit
    inputs), in place after the division, rounded once."""
    out_dtype, work_dtype = channel_rms_norm_rules(x, weight, bias)
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    out = F.normalize(x.to(work_dtype), dim=1, eps=eps).mul_(scale)
    if weight is not None:
        out.mul_(weight.to(work_dtype).reshape(shape))
    if bias is not None:
        out.add_(bias.to(work_dtype).reshape(shape))
    if silu:
        torch.ops.aten.silu_.default(out)
    return _finish(out, out_dtype)


_ACTIVATIONS_OUT = {
    "silu": lambda values, out: torch.ops.aten.silu.out(values, out=out),
    "gelu": lambda values, out: torch.ops.aten.gelu.out(values, out=out),
    "gelu_tanh": lambda values, out: torch.ops.aten.gelu.out(values, approximate="tanh", out=out),
}


@cpu_kernel(GLU)
def glu(x: torch.Tensor, y: torch.Tensor | None, activation: str, gate_first: bool) -> torch.Tensor:
    """The activation into one output buffer (in float32 for 16-bit inputs), then an in-place product."""
    out_dtype, work_dtype = glu_rules(x, y, activation)
    first, second = halves(x, y)
    gate, value = (first, second) if gate_first else (second, first)
    out = torch.empty(gate.shape, dtype=work_dtype, device=x.device)
    _ACTIVATIONS_OUT[activation](gate if gate.dtype == work_dtype else gate.to(work_dtype), out)
    out.mul_(value)
    return _finish(out, out_dtype)


@cpu_kernel(FAST_GELU)
def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """aten's tanh GELU kernel (computes 16-bit input in float32 internally)."""
    out_dtype, _ = fast_gelu_rules(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return torch.ops.aten.gelu.out(x, approximate="tanh", out=out)


@cpu_kernel(MUL_ADD)
def mul_add(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """One addcmul kernel; 16-bit math runs in float32 inside it.

    addcmul broadcasts by itself, which is much cheaper per call than
    computing the shape in Python; the shared rules only run to explain a
    failure.  Mixed dtypes are cast to the promoted dtype first, because
    addcmul's own promotion lets 0-dim tensors keep a lower dtype.
    """
    if not (x.dtype == y.dtype == z.dtype):
        out_dtype = promote(x.dtype, y.dtype, z.dtype)
        x, y, z = x.to(out_dtype), y.to(out_dtype), z.to(out_dtype)
    if x.dtype == torch.bool:
        return reference.mul_add(x, y, z)
    try:
        out = torch.addcmul(z, x, y)
    except RuntimeError:
        mul_add_rules(x, y, z)
        raise
    return out if out.is_contiguous() else out.contiguous()
