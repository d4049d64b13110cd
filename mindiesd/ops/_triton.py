"""Triton kernels for the mindiesd operators on NVIDIA GPUs (device type "cuda").

Every kernel reads its inputs through their own strides, so broadcast
operands (stride-0 views made with ``expand``) and non-contiguous inputs are
used in place, without copies.  Before a launch the dims of all operands are
coalesced (adjacent dims that are contiguous with respect to each other in
every operand are merged), which leaves at most ``MAX_DIMS`` index dims for
all layouts seen in practice; rarer layouts are copied to contiguous memory
first.  16-bit inputs are computed in float32 (float64 inputs in float64) and
rounded once, when the result is stored.  Outputs are new contiguous tensors.

Inputs the kernels do not cover (non-float dtypes, operands on different
devices) run the reference composition, which is correct on any device.

The wrappers below take the op schema arguments positionally; ``register()``
binds them to the "cuda" dispatch key.
"""

import contextlib

import torch
import triton
import triton.language as tl

from ..families import device_kernels
from . import reference
from ._library import register_device_kernels
from ._rules import (
    adalayernorm_rules,
    fast_gelu_rules,
    mul_add_rules,
    rms_norm_rules,
    rope_rules,
)

__all__ = ["KERNELS", "adalayernorm", "fast_gelu", "mul_add", "register", "rms_norm", "rope"]

DEVICE_TYPE = "cuda"

# Index dims a kernel decomposes a flat (row or element) index into.
MAX_DIMS = 4
# Widest row kept in registers in one piece by the normalization kernels;
# wider rows are processed in chunks of this size.
MAX_ROW_BLOCK = 8192
# Elements per program of the elementwise kernels.
ELEMENTWISE_BLOCK = 1024
# Pairs per program of the rope kernel (rows x pairs).
ROPE_TILE = 2048

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_COMPUTE_TYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


# ----------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------


@triton.jit
def _unravel(index, n1, n2, n3):
    """Split a flat index over dims (n0, n1, n2, n3) into its four coordinates."""
    i3 = index % n3
    rest = index // n3
    i2 = rest % n2
    rest = rest // n2
    return rest // n1, rest % n1, i2, i3


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    n1, n2, n3,
    xs0, xs1, xs2, xs3, x_last,
    ws0, ws1, ws2, ws3, w_last,
    width, eps,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """One program per row: x * rsqrt(mean(x**2) + eps) [* weight]."""
    row = tl.program_id(0).to(tl.int64)
    i0, i1, i2, i3 = _unravel(row, n1, n2, n3)
    x_row = x_ptr + i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3
    w_row = w_ptr + i0 * ws0 + i1 * ws1 + i2 * ws2 + i3 * ws3
    out_row = out_ptr + row * width
    out_type = out_ptr.dtype.element_ty
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        values = tl.load(x_row + cols * x_last, mask=mask, other=0.0).to(COMPUTE)
        inv_rms = tl.rsqrt(tl.sum(values * values, axis=0) / width + eps)
        result = values * inv_rms
        if HAS_WEIGHT:
            result = result * tl.load(w_row + cols * w_last, mask=mask, other=0.0).to(COMPUTE)
        tl.store(out_row + cols, result.to(out_type), mask=mask)
    else:
        squares = tl.zeros([BLOCK], dtype=COMPUTE)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            values = tl.load(x_row + cols * x_last, mask=mask, other=0.0).to(COMPUTE)
            squares += values * values
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / width + eps)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            values = tl.load(x_row + cols * x_last, mask=mask, other=0.0).to(COMPUTE)
            result = values * inv_rms
            if HAS_WEIGHT:
                result = result * tl.load(w_row + cols * w_last, mask=mask, other=0.0).to(COMPUTE)
            tl.store(out_row + cols, result.to(out_type), mask=mask)


@triton.jit
def _adalayernorm_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr,
    n1, n2, n3,
    xs0, xs1, xs2, xs3, x_last,
    cs0, cs1, cs2, cs3, c_last,
    hs0, hs1, hs2, hs3, h_last,
    width, eps,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """One program per row: layer_norm(x) * (1 + scale) + shift."""
    row = tl.program_id(0).to(tl.int64)
    i0, i1, i2, i3 = _unravel(row, n1, n2, n3)
    x_row = x_ptr + i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3
    scale_row = scale_ptr + i0 * cs0 + i1 * cs1 + i2 * cs2 + i3 * cs3
    shift_row = shift_ptr + i0 * hs0 + i1 * hs1 + i2 * hs2 + i3 * hs3
    out_row = out_ptr + row * width
    out_type = out_ptr.dtype.element_ty
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        values = tl.load(x_row + cols * x_last, mask=mask, other=0.0).to(COMPUTE)
        mean = tl.sum(values, axis=0) / width
        centered = tl.where(mask, values - mean, 0.0)
        inv_std = tl.rsqrt(tl.sum(centered * centered, axis=0) / width + eps)
        scale = tl.load(scale_row + cols * c_last, mask=mask, other=0.0).to(COMPUTE)
        shift = tl.load(shift_row + cols * h_last, mask=mask, other=0.0).to(COMPUTE)
        result = centered * inv_std * (1.0 + scale) + shift
        tl.store(out_row + cols, result.to(out_type), mask=mask)
    else:
        total = tl.zeros([BLOCK], dtype=COMPUTE)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            total += tl.load(x_row + cols * x_last, mask=mask, other=0.0).to(COMPUTE)
        mean = tl.sum(total, axis=0) / width
        squares = tl.zeros([BLOCK], dtype=COMPUTE)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            values = tl.load(x_row + cols * x_last, mask=mask, other=0.0).to(COMPUTE)
            centered = tl.where(mask, values - mean, 0.0)
            squares += centered * centered
        inv_std = tl.rsqrt(tl.sum(squares, axis=0) / width + eps)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            values = tl.load(x_row + cols * x_last, mask=mask, other=0.0).to(COMPUTE)
            scale = tl.load(scale_row + cols * c_last, mask=mask, other=0.0).to(COMPUTE)
            shift = tl.load(shift_row + cols * h_last, mask=mask, other=0.0).to(COMPUTE)
            result = (values - mean) * inv_std * (1.0 + scale) + shift
            tl.store(out_row + cols, result.to(out_type), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    rows, pairs, width,
    n1, n2, n3,
    xs0, xs1, xs2, xs3, x_last,
    cs0, cs1, cs2, cs3, c_last,
    ss0, ss1, ss2, ss3, s_last,
    x_step, x_partner,
    c_step, c_partner,
    s_step, s_partner,
    COMPUTE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
):
    """A tile of rows x pairs: out = x * cos + rotate(x) * sin.

    Pair ``j`` of a row holds elements ``j * x_step`` and ``j * x_step +
    x_partner`` (interleaved: step 2, partner 1; half-rotated: step 1,
    partner D/2).  Its cos/sin values sit at ``j * step`` and ``j * step +
    partner`` of the table row (full width: as for x; per pair: step 1,
    partner 0; one value: step 0, partner 0).
    """
    rows_index = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair = tl.program_id(1) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    mask = (rows_index < rows)[:, None] & (pair < pairs)[None, :]
    i0, i1, i2, i3 = _unravel(rows_index, n1, n2, n3)
    x_row = (i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3)[:, None]
    cos_row = (i0 * cs0 + i1 * cs1 + i2 * cs2 + i3 * cs3)[:, None]
    sin_row = (i0 * ss0 + i1 * ss1 + i2 * ss2 + i3 * ss3)[:, None]

    first = (pair * x_step)[None, :]
    second = first + x_partner
    x_first = tl.load(x_ptr + x_row + first * x_last, mask=mask, other=0.0).to(COMPUTE)
    x_second = tl.load(x_ptr + x_row + second * x_last, mask=mask, other=0.0).to(COMPUTE)
    cos_first_index = (pair * c_step)[None, :]
    sin_first_index = (pair * s_step)[None, :]
    cos_first = tl.load(cos_ptr + cos_row + cos_first_index * c_last, mask=mask, other=0.0)
    cos_second = tl.load(
        cos_ptr + cos_row + (cos_first_index + c_partner) * c_last, mask=mask, other=0.0
    )
    sin_first = tl.load(sin_ptr + sin_row + sin_first_index * s_last, mask=mask, other=0.0)
    sin_second = tl.load(
        sin_ptr + sin_row + (sin_first_index + s_partner) * s_last, mask=mask, other=0.0
    )
    out_first = x_first * cos_first.to(COMPUTE) - x_second * sin_first.to(COMPUTE)
    out_second = x_second * cos_second.to(COMPUTE) + x_first * sin_second.to(COMPUTE)

    out_type = out_ptr.dtype.element_ty
    out_row = out_ptr + (rows_index * width)[:, None]
    tl.store(out_row + first, out_first.to(out_type), mask=mask)
    tl.store(out_row + second, out_second.to(out_type), mask=mask)


@triton.jit
def _fast_gelu_kernel(
    x_ptr, out_ptr, numel,
    n1, n2, n3,
    xs0, xs1, xs2, xs3,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Tanh GELU, written as x * sigmoid(2u) = 0.5 x (1 + tanh(u)), u = c (x + a x**3)."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < numel
    i0, i1, i2, i3 = _unravel(index, n1, n2, n3)
    values = tl.load(x_ptr + i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3, mask=mask, other=0.0)
    values = values.to(COMPUTE)
    inner = 0.7978845608028654 * (values + 0.044715 * values * values * values)
    result = values / (1.0 + tl.exp(-2.0 * inner))
    tl.store(out_ptr + index, result.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mul_add_kernel(
    x_ptr, y_ptr, z_ptr, out_ptr, numel,
    n1, n2, n3,
    xs0, xs1, xs2, xs3,
    ys0, ys1, ys2, ys3,
    zs0, zs1, zs2, zs3,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """x * y + z over the (broadcast) output shape."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < numel
    i0, i1, i2, i3 = _unravel(index, n1, n2, n3)
    x = tl.load(x_ptr + i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3, mask=mask, other=0.0)
    y = tl.load(y_ptr + i0 * ys0 + i1 * ys1 + i2 * ys2 + i3 * ys3, mask=mask, other=0.0)
    z = tl.load(z_ptr + i0 * zs0 + i1 * zs1 + i2 * zs2 + i3 * zs3, mask=mask, other=0.0)
    result = x.to(COMPUTE) * y.to(COMPUTE) + z.to(COMPUTE)
    tl.store(out_ptr + index, result.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------
# Host side: layouts and launches
# ----------------------------------------------------------------------------


def _coalesce(sizes, strides_per_tensor):
    """Merge dims of several same-shaped tensors into as few dims as possible.

    Size-1 dims are dropped; dims i and i+1 merge when, in every tensor,
    stride[i] == stride[i+1] * size[i+1].  Flat C-order indices over the
    result address the same elements as over the input shape.  Returns
    (sizes, one stride list per tensor).
    """
    merged_sizes: list[int] = []
    merged_strides: list[list[int]] = [[] for _ in strides_per_tensor]
    for dim, size in enumerate(sizes):
        if size == 1:
            continue
        strides = [tensor_strides[dim] for tensor_strides in strides_per_tensor]
        if merged_sizes and all(
            kept[-1] == stride * size for kept, stride in zip(merged_strides, strides)
        ):
            merged_sizes[-1] *= size
            for kept, stride in zip(merged_strides, strides):
                kept[-1] = stride
            continue
        merged_sizes.append(size)
        for kept, stride in zip(merged_strides, strides):
            kept.append(stride)
    return merged_sizes, merged_strides


def _index_layout(sizes, tensors):
    """(n1, n2, n3) and each tensor's four strides over ``sizes``, or None.

    ``tensors`` all have ``sizes`` as (a prefix of) their shape; only those
    dims are used.  None when more than ``MAX_DIMS`` dims remain after
    coalescing.
    """
    rank = len(sizes)
    merged, strides = _coalesce(sizes, [t.stride()[:rank] for t in tensors])
    if len(merged) > MAX_DIMS:
        return None
    padding = MAX_DIMS - len(merged)
    padded_sizes = [1] * padding + merged
    padded_strides = [[0] * padding + kept for kept in strides]
    return padded_sizes[1:], padded_strides


def _row_layout(x, tables):
    """Row layout of x (and of tables expanded to x's shape) over all but the last dim.

    Copies the operands to contiguous memory when their layout needs more
    than ``MAX_DIMS`` row dims.
    """
    operands = [x, *tables]
    layout = _index_layout(x.shape[:-1], operands)
    if layout is None:
        operands = [t.contiguous() for t in operands]
        layout = _index_layout(x.shape[:-1], operands)
    return operands, layout


def _elementwise_layout(shape, operands):
    """Index layout of ``operands`` (already expanded to ``shape``) over all of it."""
    layout = _index_layout(shape, operands)
    if layout is None:
        operands = [t.contiguous() for t in operands]
        layout = _index_layout(shape, operands)
    return operands, layout


def _row_block(width):
    """(BLOCK, ONE_PASS, num_warps) for a normalization over rows of ``width``."""
    block = min(triton.next_power_of_2(width), MAX_ROW_BLOCK)
    num_warps = min(max(block // 256, 1), 16)
    return block, block >= width, num_warps


def _device_guard(device):
    """Make ``device`` current for the launch (kernels launch on the current GPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _same_device(device, *tensors):
    return all(t is None or t.device == device for t in tensors)


def _covered(out_dtype, *tensors):
    """Whether every input and the output have a float dtype the kernels handle."""
    return out_dtype in _FLOAT_DTYPES and all(
        t is None or t.dtype in _FLOAT_DTYPES for t in tensors
    )


def _empty(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


def rms_norm(x, weight, eps, out_dtype=None):
    """RMS norm over the last dim; one program per row."""
    out_dtype, work_dtype = rms_norm_rules(x, weight, out_dtype)
    if not (_covered(out_dtype, x, weight) and _same_device(x.device, weight)):
        return reference.rms_norm(x, weight, eps, out_dtype)
    out = _empty(x.shape, out_dtype, x.device)
    if out.numel() == 0:
        return out
    width = x.shape[-1]
    tables = [] if weight is None else [weight.expand(x.shape)]
    operands, ((n1, n2, n3), strides) = _row_layout(x, tables)
    x = operands[0]
    w = operands[1] if weight is not None else x
    x_strides = strides[0]
    w_strides = strides[1] if weight is not None else [0] * MAX_DIMS
    block, one_pass, num_warps = _row_block(width)
    with _device_guard(x.device):
        _rms_norm_kernel[(out.numel() // width,)](
            x, w, out,
            n1, n2, n3,
            *x_strides, x.stride(-1),
            *w_strides, w.stride(-1) if weight is not None else 0,
            width, eps,
            HAS_WEIGHT=weight is not None,
            COMPUTE=_COMPUTE_TYPES[work_dtype],
            BLOCK=block,
            ONE_PASS=one_pass,
            num_warps=num_warps,
        )
    return out


def adalayernorm(x, scale, shift, eps, out_dtype=None):
    """layer_norm(x) * (1 + scale) + shift over the last dim; one program per row."""
    out_dtype, work_dtype = adalayernorm_rules(x, scale, shift, out_dtype)
    if not (_covered(out_dtype, x, scale, shift) and _same_device(x.device, scale, shift)):
        return reference.adalayernorm(x, scale, shift, eps, out_dtype)
    out = _empty(x.shape, out_dtype, x.device)
    if out.numel() == 0:
        return out
    width = x.shape[-1]
    operands, ((n1, n2, n3), strides) = _row_layout(
        x, [scale.expand(x.shape), shift.expand(x.shape)]
    )
    x, scale, shift = operands
    block, one_pass, num_warps = _row_block(width)
    with _device_guard(x.device):
        _adalayernorm_kernel[(out.numel() // width,)](
            x, scale, shift, out,
            n1, n2, n3,
            *strides[0], x.stride(-1),
            *strides[1], scale.stride(-1),
            *strides[2], shift.stride(-1),
            width, eps,
            COMPUTE=_COMPUTE_TYPES[work_dtype],
            BLOCK=block,
            ONE_PASS=one_pass,
            num_warps=num_warps,
        )
    return out


def _table_indexing(table_width, width, x_step, x_partner):
    """(step, partner) locating a pair's two cos/sin values in a table row."""
    if table_width == width:
        return x_step, x_partner
    if table_width == 1:
        return 0, 0
    return 1, 0


def rope(x, cos, sin, interleaved, out_dtype=None):
    """Rotary embedding; a program rotates a tile of rows x pairs."""
    out_dtype, work_dtype = rope_rules(x, cos, sin, out_dtype)
    if not (_covered(out_dtype, x, cos, sin) and _same_device(x.device, cos, sin)):
        return reference.rope(x, cos, sin, interleaved, out_dtype)
    out = _empty(x.shape, out_dtype, x.device)
    if out.numel() == 0:
        return out
    width = x.shape[-1]
    pairs = width // 2
    rows = out.numel() // width
    leading = x.shape[:-1]
    cos_rows = cos.expand(*leading, cos.shape[-1])
    sin_rows = sin.expand(*leading, sin.shape[-1])
    operands, ((n1, n2, n3), strides) = _row_layout(x, [cos_rows, sin_rows])
    x, cos_rows, sin_rows = operands
    x_step, x_partner = (2, 1) if interleaved else (1, pairs)
    c_step, c_partner = _table_indexing(cos_rows.shape[-1], width, x_step, x_partner)
    s_step, s_partner = _table_indexing(sin_rows.shape[-1], width, x_step, x_partner)
    block_pairs = min(triton.next_power_of_2(pairs), ROPE_TILE)
    block_rows = min(triton.next_power_of_2(rows), max(ROPE_TILE // block_pairs, 1))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(pairs, block_pairs))
    with _device_guard(x.device):
        _rope_kernel[grid](
            x, cos_rows, sin_rows, out,
            rows, pairs, width,
            n1, n2, n3,
            *strides[0], x.stride(-1),
            *strides[1], cos_rows.stride(-1),
            *strides[2], sin_rows.stride(-1),
            x_step, x_partner,
            c_step, c_partner,
            s_step, s_partner,
            COMPUTE=_COMPUTE_TYPES[work_dtype],
            BLOCK_ROWS=block_rows,
            BLOCK_PAIRS=block_pairs,
            num_warps=4,
        )
    return out


def fast_gelu(x):
    """Tanh-approximated GELU, elementwise through x's strides."""
    out_dtype, work_dtype = fast_gelu_rules(x)
    if not _covered(out_dtype, x):
        return reference.fast_gelu(x)
    out = _empty(x.shape, out_dtype, x.device)
    numel = out.numel()
    if numel == 0:
        return out
    (x,), ((n1, n2, n3), strides) = _elementwise_layout(x.shape, [x])
    with _device_guard(x.device):
        _fast_gelu_kernel[(triton.cdiv(numel, ELEMENTWISE_BLOCK),)](
            x, out, numel,
            n1, n2, n3,
            *strides[0],
            COMPUTE=_COMPUTE_TYPES[work_dtype],
            BLOCK=ELEMENTWISE_BLOCK,
            num_warps=4,
        )
    return out


def mul_add(x, y, z):
    """x * y + z; operands broadcast to the output through stride-0 views."""
    shape, out_dtype, work_dtype = mul_add_rules(x, y, z)
    if not (_covered(out_dtype, x, y, z) and _same_device(x.device, y, z)):
        return reference.mul_add(x, y, z)
    out = _empty(shape, out_dtype, x.device)
    numel = out.numel()
    if numel == 0:
        return out
    operands, ((n1, n2, n3), strides) = _elementwise_layout(
        shape, [x.expand(shape), y.expand(shape), z.expand(shape)]
    )
    with _device_guard(out.device):
        _mul_add_kernel[(triton.cdiv(numel, ELEMENTWISE_BLOCK),)](
            *operands, out, numel,
            n1, n2, n3,
            *strides[0],
            *strides[1],
            *strides[2],
            COMPUTE=_COMPUTE_TYPES[work_dtype],
            BLOCK=ELEMENTWISE_BLOCK,
            num_warps=4,
        )
    return out


#: Op name -> Triton kernel, for the families that declare one for "cuda" (mindiesd.families).
KERNELS = device_kernels(DEVICE_TYPE)


def register() -> bool:
    """Register the Triton kernels for device type "cuda".

    Returns False (and registers nothing) without a CUDA device.  Kernels
    that are already registered are left alone, so calling it again is a
    no-op.
    """
    if not torch.cuda.is_available():
        return False
    register_device_kernels(DEVICE_TYPE, KERNELS)
    return True
