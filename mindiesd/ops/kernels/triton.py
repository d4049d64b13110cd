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
from functools import partial

import torch
import triton
import triton.language as tl

from .. import reference, registry
from . import gemm
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

__all__ = ["KERNELS", "adalayernorm", "channel_rms_norm", "fast_gelu", "glu", "group_norm_silu", "mul_add", "norm_rope", "register", "rms_norm", "rope"]

DEVICE_TYPE = "cuda"

#: Op name -> CUDA kernel: the Triton kernels and the GEMM epilogue of ``gemm`` (registered by :func:`register`).
KERNELS: dict = dict(gemm.CUDA_KERNELS)


def _triton_kernel(op: registry.OpDef, slower: str = ""):
    """Declare a Triton kernel; ``slower`` says where it was measured slower than eager's op sequence (then the
    family is skipped on CUDA unless forced)."""
    note = f"Triton; {slower}" if slower else "Triton"
    return registry.kernel(op, DEVICE_TYPE, fast=not slower, note=note, into=KERNELS, register=False)


# Measured with `python -m mindiesd bench ops --device cuda` on one H200 (torch 2.11.0+cu130, Triton 3.6, the op
# bench's shapes, uncaptured): each launch from Python costs tens of microseconds, more than these ops' work at
# diffusion-transformer sizes, where eager's aten kernels launch in a few.
_H200 = "slower than eager on an H200 uncaptured"

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
#
# Conventions shared by the kernels: ``dims`` is (n1, n2, n3), the sizes of
# the last three of the four index dims a flat index is split into (n0 is
# implied by the index range).  Each operand comes as its pointer, its four
# strides over those dims (``*_strides``) and, in the row kernels, the stride
# of its last dim (``*_col``), which is the dim a row runs along.
# ----------------------------------------------------------------------------


@triton.jit
def _unravel(index, dims):
    """Coordinates (i0, i1, i2, i3) of a flat C-order ``index`` over (n0, *dims)."""
    i3 = index % dims[2]
    rest = index // dims[2]
    i2 = rest % dims[1]
    rest = rest // dims[1]
    return rest // dims[0], rest % dims[0], i2, i3


@triton.jit
def _offset(coords, strides):
    """Element offset of ``coords`` (from ``_unravel``) through four ``strides``."""
    i0, i1, i2, i3 = coords
    return i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3]


@triton.jit
def _program_block(count, BLOCK: tl.constexpr):
    """This program's BLOCK flat indices along grid axis 0 (as int64), and index < count."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return index, index < count


@triton.jit
def _columns(start, width, BLOCK: tl.constexpr):
    """Columns start .. start + BLOCK - 1 of a row, and which of them lie inside ``width``."""
    cols = start + tl.arange(0, BLOCK)
    return cols, cols < width


@triton.jit
def _load(pointers, mask, COMPUTE: tl.constexpr):
    """The values at ``pointers`` (0 where ``mask`` is false), upcast to COMPUTE."""
    return tl.load(pointers, mask=mask, other=0.0).to(COMPUTE)


@triton.jit
def _store(out_ptr, offsets, values, mask):
    """Store ``values``, rounded to the output dtype, at ``out_ptr + offsets`` where ``mask``."""
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_sum(
    row_ptr, col_stride, width, center,
    SQUARE: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Sum over a row of ``width`` values x of (x - center), or of (x - center)**2 with SQUARE.

    The row is read BLOCK columns at a time; the result has dtype COMPUTE.
    """
    total = tl.zeros([BLOCK], dtype=COMPUTE)
    for start in range(0, width, BLOCK):
        cols, mask = _columns(start, width, BLOCK)
        terms = tl.where(mask, _load(row_ptr + cols * col_stride, mask, COMPUTE) - center, 0.0)
        if SQUARE:
            terms = terms * terms
        total += terms
    return tl.sum(total, axis=0)


@triton.jit
def _pair_columns(pair, pairing):
    """Columns of the two elements of each ``pair`` in a row, as [1, pairs] blocks.

    ``pairing`` is (step, partner): pair j holds columns j * step and
    j * step + partner.
    """
    first = (pair * pairing[0])[None, :]
    return first, first + pairing[1]


@triton.jit
def _load_pair(row_ptrs, col_stride, pair, pairing, mask, COMPUTE: tl.constexpr):
    """The two values of each ``pair`` (see ``_pair_columns``) in rows ``row_ptrs``, upcast."""
    first, second = _pair_columns(pair, pairing)
    first_values = _load(row_ptrs + first * col_stride, mask, COMPUTE)
    return first_values, _load(row_ptrs + second * col_stride, mask, COMPUTE)


@triton.jit
def _rms_norm_kernel(
    dims, x_ptr, x_strides, x_col, w_ptr, w_strides, w_col, out_ptr, width, eps,
    HAS_WEIGHT: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """One program per row: x * rsqrt(mean(x**2) + eps) [* weight]."""
    row = tl.program_id(0).to(tl.int64)
    coords = _unravel(row, dims)
    x_row = x_ptr + _offset(coords, x_strides)
    w_row = w_ptr + _offset(coords, w_strides)
    if ONE_PASS:
        cols, mask = _columns(0, width, BLOCK)
        values = _load(x_row + cols * x_col, mask, COMPUTE)
        inv_rms = tl.rsqrt(tl.sum(values * values, axis=0) / width + eps)
        result = values * inv_rms
        if HAS_WEIGHT:
            result = result * _load(w_row + cols * w_col, mask, COMPUTE)
        _store(out_ptr, row * width + cols, result, mask)
    else:
        inv_rms = tl.rsqrt(_row_sum(x_row, x_col, width, 0.0, True, COMPUTE, BLOCK) / width + eps)
        for start in range(0, width, BLOCK):
            cols, mask = _columns(start, width, BLOCK)
            result = _load(x_row + cols * x_col, mask, COMPUTE) * inv_rms
            if HAS_WEIGHT:
                result = result * _load(w_row + cols * w_col, mask, COMPUTE)
            _store(out_ptr, row * width + cols, result, mask)


@triton.jit
def _adalayernorm_kernel(
    dims,
    x_ptr, x_strides, x_col,
    scale_ptr, scale_strides, scale_col,
    shift_ptr, shift_strides, shift_col,
    out_ptr, width, eps,
    COMPUTE: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """One program per row: layer_norm(x) * (1 + scale) + shift."""
    row = tl.program_id(0).to(tl.int64)
    coords = _unravel(row, dims)
    x_row = x_ptr + _offset(coords, x_strides)
    scale_row = scale_ptr + _offset(coords, scale_strides)
    shift_row = shift_ptr + _offset(coords, shift_strides)
    if ONE_PASS:
        cols, mask = _columns(0, width, BLOCK)
        values = _load(x_row + cols * x_col, mask, COMPUTE)
        mean = tl.sum(values, axis=0) / width
        centered = tl.where(mask, values - mean, 0.0)
        inv_std = tl.rsqrt(tl.sum(centered * centered, axis=0) / width + eps)
        scale = _load(scale_row + cols * scale_col, mask, COMPUTE)
        shift = _load(shift_row + cols * shift_col, mask, COMPUTE)
        _store(out_ptr, row * width + cols, centered * inv_std * (1.0 + scale) + shift, mask)
    else:
        mean = _row_sum(x_row, x_col, width, 0.0, False, COMPUTE, BLOCK) / width
        variance = _row_sum(x_row, x_col, width, mean, True, COMPUTE, BLOCK) / width
        inv_std = tl.rsqrt(variance + eps)
        for start in range(0, width, BLOCK):
            cols, mask = _columns(start, width, BLOCK)
            centered = _load(x_row + cols * x_col, mask, COMPUTE) - mean
            scale = _load(scale_row + cols * scale_col, mask, COMPUTE)
            shift = _load(shift_row + cols * shift_col, mask, COMPUTE)
            _store(out_ptr, row * width + cols, centered * inv_std * (1.0 + scale) + shift, mask)


@triton.jit
def _rope_kernel(
    dims,
    x_ptr, x_strides, x_col,
    cos_ptr, cos_strides, cos_col,
    sin_ptr, sin_strides, sin_col,
    out_ptr, rows, pairs, width,
    x_pairing, cos_pairing, sin_pairing,
    COMPUTE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
):
    """A tile of rows x pairs: out = x * cos + rotate(x) * sin.

    Pair ``j`` of a row holds elements ``j * step`` and ``j * step +
    partner``, with ``x_pairing`` = (step, partner) (interleaved: (2, 1);
    half-rotated: (1, D/2)).  Its cos/sin values sit at the same places of
    the table row, through ``cos_pairing`` and ``sin_pairing`` (full width:
    as for x; per pair: (1, 0); one value: (0, 0)).
    """
    rows_index, row_mask = _program_block(rows, BLOCK_ROWS)
    pair = tl.program_id(1) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    mask = row_mask[:, None] & (pair < pairs)[None, :]
    coords = _unravel(rows_index, dims)
    x_row = x_ptr + _offset(coords, x_strides)[:, None]
    cos_row = cos_ptr + _offset(coords, cos_strides)[:, None]
    sin_row = sin_ptr + _offset(coords, sin_strides)[:, None]

    x_first, x_second = _load_pair(x_row, x_col, pair, x_pairing, mask, COMPUTE)
    cos_first, cos_second = _load_pair(cos_row, cos_col, pair, cos_pairing, mask, COMPUTE)
    sin_first, sin_second = _load_pair(sin_row, sin_col, pair, sin_pairing, mask, COMPUTE)
    out_first = x_first * cos_first - x_second * sin_first
    out_second = x_second * cos_second + x_first * sin_second

    first, second = _pair_columns(pair, x_pairing)
    out_row = (rows_index * width)[:, None]
    _store(out_ptr, out_row + first, out_first, mask)
    _store(out_ptr, out_row + second, out_second, mask)


@triton.jit
def _norm_rope_kernel(
    dims,
    x_ptr, x_strides, x_col,
    w_ptr, w_strides, w_col,
    cos_ptr, cos_strides, cos_col,
    sin_ptr, sin_strides, sin_col,
    out_ptr, out_strides, out_col,
    pairs, head_pairs, head_dim, table_head_step, width, eps,
    x_pairing, cos_pairing, sin_pairing,
    HAS_WEIGHT: tl.constexpr, NORMED: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
):
    """One program per row of one stream: the row's RMSNorm (rounded to NORMED), each head of ``head_dim`` values
    rotated as ``_rope_kernel`` does (``head_pairs`` pairs a head; a head's tables ``table_head_step`` elements
    after the previous one's), stored through out's strides (the stream's slice of the concatenation)."""
    row = tl.program_id(0).to(tl.int64)
    coords = _unravel(row, dims)
    index = tl.arange(0, BLOCK_PAIRS)
    mask = index < pairs
    head = index // head_pairs
    pair = index % head_pairs
    first = head * head_dim + pair * x_pairing[0]
    second = first + x_pairing[1]
    x_row = x_ptr + _offset(coords, x_strides)
    x_first = _load(x_row + first * x_col, mask, COMPUTE)
    x_second = _load(x_row + second * x_col, mask, COMPUTE)
    inv_rms = tl.rsqrt((tl.sum(x_first * x_first, axis=0) + tl.sum(x_second * x_second, axis=0)) / width + eps)
    n_first = x_first * inv_rms
    n_second = x_second * inv_rms
    if HAS_WEIGHT:
        w_row = w_ptr + _offset(coords, w_strides)
        n_first = n_first * _load(w_row + first * w_col, mask, COMPUTE)
        n_second = n_second * _load(w_row + second * w_col, mask, COMPUTE)
    n_first = n_first.to(NORMED).to(COMPUTE)
    n_second = n_second.to(NORMED).to(COMPUTE)
    cos_row = cos_ptr + _offset(coords, cos_strides) + head * table_head_step
    sin_row = sin_ptr + _offset(coords, sin_strides) + head * table_head_step
    cos_first = _load(cos_row + pair * cos_pairing[0] * cos_col, mask, COMPUTE)
    cos_second = _load(cos_row + (pair * cos_pairing[0] + cos_pairing[1]) * cos_col, mask, COMPUTE)
    sin_first = _load(sin_row + pair * sin_pairing[0] * sin_col, mask, COMPUTE)
    sin_second = _load(sin_row + (pair * sin_pairing[0] + sin_pairing[1]) * sin_col, mask, COMPUTE)
    out_row = _offset(coords, out_strides)
    _store(out_ptr, out_row + first * out_col, n_first * cos_first - n_second * sin_first, mask)
    _store(out_ptr, out_row + second * out_col, n_second * cos_second + n_first * sin_second, mask)


@triton.jit
def _group_norm_silu_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, groups, per_group, spatial, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per (sample, group) of a contiguous [N, C, *] x: the group's mean and biased variance over its
    ``per_group * spatial`` contiguous values (two reads), then silu(x_hat * weight[c] + bias[c])."""
    task = tl.program_id(0).to(tl.int64)
    size = per_group * spatial
    base = task * size
    mean = _row_sum(x_ptr + base, 1, size, 0.0, False, COMPUTE, BLOCK) / size
    inv_std = tl.rsqrt(_row_sum(x_ptr + base, 1, size, mean, True, COMPUTE, BLOCK) / size + eps)
    first_channel = (task % groups) * per_group
    for start in range(0, size, BLOCK):
        cols, mask = _columns(start, size, BLOCK)
        y = (_load(x_ptr + base + cols, mask, COMPUTE) - mean) * inv_std
        channel = first_channel + cols // spatial
        if HAS_WEIGHT:
            y = y * _load(w_ptr + channel, mask, COMPUTE)
        if HAS_BIAS:
            y = y + _load(b_ptr + channel, mask, COMPUTE)
        _store(out_ptr, base + cols, y / (1.0 + tl.exp(-y)), mask)


@triton.jit
def _channel_rms_norm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, channels, spatial, blocks, scale, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (sample, BLOCK positions) of a contiguous [N, C, S] x: the sums of squares down the channels,
    then each channel's values times scale / max(norm, eps) * weight[c] + bias[c] (and SiLU)."""
    task = tl.program_id(0).to(tl.int64)
    base = (task // blocks) * channels * spatial
    cols, mask = _columns((task % blocks) * BLOCK, spatial, BLOCK)
    total = tl.zeros([BLOCK], dtype=COMPUTE)
    for c in range(0, channels):
        values = _load(x_ptr + base + c * spatial + cols, mask, COMPUTE)
        total += values * values
    factor = scale / tl.maximum(tl.sqrt(total), eps)
    for c in range(0, channels):
        y = _load(x_ptr + base + c * spatial + cols, mask, COMPUTE) * factor
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + c).to(COMPUTE)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + c).to(COMPUTE)
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        _store(out_ptr, base + c * spatial + cols, y, mask)


@triton.jit
def _fast_gelu_kernel(
    dims, x_ptr, x_strides, out_ptr, numel, COMPUTE: tl.constexpr, BLOCK: tl.constexpr
):
    """Tanh GELU, written as x * sigmoid(2u) = 0.5 x (1 + tanh(u)), u = c (x + a x**3)."""
    index, mask = _program_block(numel, BLOCK)
    x = _load(x_ptr + _offset(_unravel(index, dims), x_strides), mask, COMPUTE)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    _store(out_ptr, index, x / (1.0 + tl.exp(-2.0 * inner)), mask)


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr):
    """silu (0), the exact GELU (1) or the tanh GELU (2) of x."""
    if ACTIVATION == 0:
        return x / (1.0 + tl.exp(-x))
    elif ACTIVATION == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x / (1.0 + tl.exp(-2.0 * inner))


@triton.jit
def _glu_kernel(
    dims, gate_ptr, gate_strides, value_ptr, value_strides, out_ptr, numel,
    ACTIVATION: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):
    """act(gate) * value; gate and value are read through their strides (halves of one tensor, in place)."""
    index, mask = _program_block(numel, BLOCK)
    coords = _unravel(index, dims)
    gate = _load(gate_ptr + _offset(coords, gate_strides), mask, COMPUTE)
    value = _load(value_ptr + _offset(coords, value_strides), mask, COMPUTE)
    _store(out_ptr, index, _activate(gate, ACTIVATION) * value, mask)


@triton.jit
def _mul_add_kernel(
    dims, x_ptr, x_strides, y_ptr, y_strides, z_ptr, z_strides, out_ptr, numel,
    COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):
    """x * y + z over the (broadcast) output shape."""
    index, mask = _program_block(numel, BLOCK)
    coords = _unravel(index, dims)
    x = _load(x_ptr + _offset(coords, x_strides), mask, COMPUTE)
    y = _load(y_ptr + _offset(coords, y_strides), mask, COMPUTE)
    z = _load(z_ptr + _offset(coords, z_strides), mask, COMPUTE)
    _store(out_ptr, index, x * y + z, mask)


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
    """(n1, n2, n3) and each tensor's four strides over ``sizes``, as tuples, or None.

    ``tensors`` all have ``sizes`` as (a prefix of) their shape; only those
    dims are used.  None when more than ``MAX_DIMS`` dims remain after
    coalescing.
    """
    rank = len(sizes)
    merged, strides = _coalesce(sizes, [t.stride()[:rank] for t in tensors])
    if len(merged) > MAX_DIMS:
        return None
    padding = [0] * (MAX_DIMS - len(merged))
    dims = tuple([1] * len(padding) + merged)[1:]
    return dims, [tuple(padding + kept) for kept in strides]


def _strided_args(sizes, operands, columns=False):
    """Kernel arguments that read ``operands`` through their strides over ``sizes``.

    ``operands`` all have ``sizes`` as (a prefix of) their shape.  Returns
    ``dims`` (n1, n2, n3), then per operand: the tensor, its four strides
    and, with ``columns``, the stride of its last dim.  Operands whose
    layout needs more than ``MAX_DIMS`` dims are copied to contiguous memory
    first.
    """
    layout = _index_layout(sizes, operands)
    if layout is None:
        operands = [t.contiguous() for t in operands]
        layout = _index_layout(sizes, operands)
    dims, strides = layout
    args = [dims]
    for tensor, tensor_strides in zip(operands, strides):
        args += [tensor, tensor_strides] + ([tensor.stride(-1)] if columns else [])
    return args


def _row_args(x, tables):
    """``_strided_args`` of x and ``tables`` row by row: over all but x's last dim."""
    return _strided_args(x.shape[:-1], [x, *tables], columns=True)


def _row_block(width):
    """Launch options (BLOCK, ONE_PASS, num_warps) of a normalization over rows of ``width``."""
    block = min(triton.next_power_of_2(width), MAX_ROW_BLOCK)
    num_warps = min(max(block // 256, 1), 16)
    return {"BLOCK": block, "ONE_PASS": block >= width, "num_warps": num_warps}


def _device_guard(device):
    """Make ``device`` current for the launch (kernels launch on the current GPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _run(shape, out_dtype, work_dtype, fallback, launch, *args):
    """A new output filled by ``launch(out, COMPUTE, *args)``, or ``fallback()``.

    The fallback (the reference composition) runs unless ``out_dtype`` and
    every tensor in ``args`` have a float dtype the kernels handle and those
    tensors share one device.  Otherwise the output is a new contiguous
    tensor of ``shape`` on that device, and ``launch`` fills it, with that
    device current and COMPUTE the Triton type of ``work_dtype``; an empty
    output is returned without a launch.
    """
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    device = tensors[0].device
    covered = out_dtype in _FLOAT_DTYPES and all(
        t.dtype in _FLOAT_DTYPES and t.device == device for t in tensors
    )
    if not covered:
        return fallback()
    out = torch.empty(shape, dtype=out_dtype, device=device)
    if out.numel() > 0:
        with _device_guard(device):
            launch(out, _COMPUTE_TYPES[work_dtype], *args)
    return out


def _launch_rms_norm(out, compute, x, weight, eps):
    """Launch the rms_norm kernel into ``out``: one program per row of x."""
    width = x.shape[-1]
    # Without a weight, x stands in for it (HAS_WEIGHT=False: never read).
    w = x if weight is None else weight.expand(x.shape)
    _rms_norm_kernel[(out.numel() // width,)](
        *_row_args(x, [w]), out, width, eps,
        HAS_WEIGHT=weight is not None, COMPUTE=compute, **_row_block(width),
    )


@_triton_kernel(RMS_NORM, slower=f"{_H200}: bf16 0.88x (fp32 1.32x)")
def rms_norm(x, weight, eps, out_dtype=None):
    """RMS norm over the last dim; one program per row."""
    out_dtype, work_dtype = rms_norm_rules(x, weight, out_dtype)
    fallback = partial(reference.rms_norm, x, weight, eps, out_dtype)
    return _run(x.shape, out_dtype, work_dtype, fallback, _launch_rms_norm, x, weight, eps)


def _launch_adalayernorm(out, compute, x, scale, shift, eps):
    """Launch the adalayernorm kernel into ``out``: one program per row of x."""
    width = x.shape[-1]
    _adalayernorm_kernel[(out.numel() // width,)](
        *_row_args(x, [scale.expand(x.shape), shift.expand(x.shape)]), out, width, eps,
        COMPUTE=compute, **_row_block(width),
    )


@_triton_kernel(ADALAYERNORM, slower=f"{_H200}: bf16 0.88x (fp32 1.21x)")
def adalayernorm(x, scale, shift, eps, out_dtype=None):
    """layer_norm(x) * (1 + scale) + shift over the last dim; one program per row."""
    out_dtype, work_dtype = adalayernorm_rules(x, scale, shift, out_dtype)
    fallback = partial(reference.adalayernorm, x, scale, shift, eps, out_dtype)
    return _run(
        x.shape, out_dtype, work_dtype, fallback, _launch_adalayernorm, x, scale, shift, eps
    )


def _table_pairing(table_width, width, x_pairing):
    """(step, partner) locating a pair's two cos/sin values in a table row."""
    if table_width == width:
        return x_pairing
    if table_width == 1:
        return 0, 0
    return 1, 0


def _launch_rope(out, compute, x, cos, sin, interleaved):
    """Launch the rope kernel into ``out``: a program per tile of rows x pairs."""
    width = x.shape[-1]
    pairs = width // 2
    rows = out.numel() // width
    tables = [table.expand(*x.shape[:-1], table.shape[-1]) for table in (cos, sin)]
    x_pairing = (2, 1) if interleaved else (1, pairs)
    table_pairings = [_table_pairing(t.shape[-1], width, x_pairing) for t in tables]
    block_pairs = min(triton.next_power_of_2(pairs), ROPE_TILE)
    block_rows = min(triton.next_power_of_2(rows), max(ROPE_TILE // block_pairs, 1))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(pairs, block_pairs))
    _rope_kernel[grid](
        *_row_args(x, tables), out, rows, pairs, width, x_pairing, *table_pairings,
        COMPUTE=compute, BLOCK_ROWS=block_rows, BLOCK_PAIRS=block_pairs, num_warps=4,
    )


@_triton_kernel(ROPE)
def rope(x, cos, sin, interleaved, out_dtype=None):
    """Rotary embedding; a program rotates a tile of rows x pairs."""
    out_dtype, work_dtype = rope_rules(x, cos, sin, out_dtype)
    fallback = partial(reference.rope, x, cos, sin, interleaved, out_dtype)
    return _run(x.shape, out_dtype, work_dtype, fallback, _launch_rope, x, cos, sin, interleaved)


_TRITON_TYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                 torch.float64: tl.float64}


def _launch_norm_rope(out, compute, xs, dim, weights, eps, norm_dtype, head_dim, cos, sin, interleaved):
    """Launch the norm_rope kernel once per stream, into the stream's slice of ``out``: a program per row."""
    width = out.shape[-1]
    pairs, head_pairs = width // 2, head_dim // 2
    x_pairing = (2, 1) if interleaved else (1, head_pairs)
    rotated = rotated_shape(out.shape, head_dim)
    tables = [table.expand(*rotated[:-1], table.shape[-1]) for table in (cos, sin)]
    table_head_step = 0
    if len(rotated) > out.dim():  # the first head's values; the next head's one step further (0: the same)
        if tables[0].stride(-2) != tables[1].stride(-2) or any(t.stride(-1) != 1 for t in tables):
            tables = [t.contiguous() for t in tables]
        table_head_step = tables[0].stride(-2)
        tables = [t.select(-2, 0) for t in tables]
    table_pairings = [_table_pairing(t.shape[-1], head_dim, x_pairing) for t in tables]
    start = 0
    for x, weight in zip(xs, weights):
        length = x.shape[dim]
        if x.numel() == 0:
            continue
        piece = [t.narrow(dim, start, length) for t in (*tables, out)]
        start += length
        w = x if weight is None else weight.expand(x.shape)  # HAS_WEIGHT=False: never read
        normed = _TRITON_TYPES[norm_dtype or x.dtype]
        _norm_rope_kernel[(x.numel() // width,)](
            *_strided_args(x.shape[:-1], [x, w, *piece], columns=True), pairs, head_pairs, head_dim,
            table_head_step, width, eps,
            x_pairing, *table_pairings,
            HAS_WEIGHT=weight is not None, NORMED=normed, COMPUTE=compute,
            BLOCK_PAIRS=triton.next_power_of_2(pairs), num_warps=min(max(pairs // 256, 1), 8),
        )


@_triton_kernel(NORM_ROPE, slower="not measured on a GPU yet (bench/gpu_check.sh measures it)")
def norm_rope(xs, dim, weights, eps, norm_dtype, head_dim, cos, sin, interleaved, out_dtype=None):
    """Each stream's RMSNorm and rotation in one program per row, written into its slice of the output."""
    out_dtype, work_dtype = norm_rope_rules(xs, dim, weights, eps, norm_dtype, head_dim, cos, sin, out_dtype)
    fallback = partial(reference.norm_rope, xs, dim, weights, eps, norm_dtype, head_dim, cos, sin, interleaved,
                       out_dtype)
    width = xs[0].shape[-1]
    if width // 2 > MAX_ROW_BLOCK or (norm_dtype is not None and norm_dtype not in _TRITON_TYPES):
        return fallback()
    dim = dim % xs[0].dim()
    shape = (*xs[0].shape[:dim], sum(x.shape[dim] for x in xs), *xs[0].shape[dim + 1:])
    tensors = [*xs, *(w for w in weights if w is not None), cos, sin]
    covered = all(t.dtype in _FLOAT_DTYPES for t in tensors) and len({t.device for t in tensors}) == 1
    if not covered:
        return fallback()
    return _run(shape, out_dtype, work_dtype, fallback, _launch_norm_rope, xs, dim, weights, eps, norm_dtype,
                head_dim, cos, sin, interleaved)


def _launch_group_norm_silu(out, compute, x, groups, weight, bias, eps):
    """Launch the group_norm_silu kernel into ``out``: one program per (sample, group)."""
    x = x.contiguous()
    per_group = x.shape[1] // groups
    spatial = x.numel() // (x.shape[0] * x.shape[1])
    # A missing weight or bias: x stands in for its pointer (never read).
    _group_norm_silu_kernel[(x.shape[0] * groups,)](
        x, x if weight is None else weight.contiguous(), x if bias is None else bias.contiguous(), out, groups,
        per_group, spatial, eps, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, COMPUTE=compute,
        BLOCK=min(triton.next_power_of_2(per_group * spatial), MAX_ROW_BLOCK), num_warps=8,
    )


@_triton_kernel(GROUP_NORM_SILU, slower="not measured on a GPU yet (bench/gpu_check.sh measures it)")
def group_norm_silu(x, groups, weight, bias, eps):
    """Group norm and SiLU; one program per (sample, group)."""
    out_dtype, work_dtype = group_norm_silu_rules(x, groups, weight, bias)
    fallback = partial(reference.group_norm_silu, x, groups, weight, bias, eps)
    return _run(x.shape, out_dtype, work_dtype, fallback, _launch_group_norm_silu, x, groups, weight, bias, eps)


def _launch_channel_rms_norm(out, compute, x, weight, bias, scale, eps, silu):
    """Launch the channel_rms_norm kernel into ``out``: one program per (sample, 256 positions)."""
    x = x.contiguous()
    channels = x.shape[1]
    spatial = x.numel() // (x.shape[0] * channels)
    block = min(triton.next_power_of_2(max(spatial, 1)), 256)
    blocks = triton.cdiv(spatial, block)
    # A missing weight or bias: x stands in for its pointer (never read).
    _channel_rms_norm_kernel[(x.shape[0] * blocks,)](
        x, x if weight is None else weight.reshape(-1).contiguous(),
        x if bias is None else bias.reshape(-1).contiguous(), out, channels, spatial, blocks, scale, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, SILU=bool(silu), COMPUTE=compute, BLOCK=block,
    )


@_triton_kernel(CHANNEL_RMS_NORM, slower="not measured on a GPU yet (bench/gpu_check.sh measures it)")
def channel_rms_norm(x, weight, bias, scale, eps, silu):
    """The channel-wise RMS norm (and SiLU); one program per (sample, block of positions)."""
    out_dtype, work_dtype = channel_rms_norm_rules(x, weight, bias)
    fallback = partial(reference.channel_rms_norm, x, weight, bias, scale, eps, silu)
    return _run(x.shape, out_dtype, work_dtype, fallback, _launch_channel_rms_norm, x, weight, bias, scale, eps,
                silu)


def _launch_elementwise(kernel, out, compute, *operands):
    """Launch an elementwise ``kernel`` over ``out``, ELEMENTWISE_BLOCK elements a program.

    The operands are broadcast to out's shape (stride-0 views) and read
    through their strides.
    """
    numel = out.numel()
    operands = [t.expand(out.shape) for t in operands]
    kernel[(triton.cdiv(numel, ELEMENTWISE_BLOCK),)](
        *_strided_args(out.shape, operands), out, numel,
        COMPUTE=compute, BLOCK=ELEMENTWISE_BLOCK, num_warps=4,
    )


#: glu's activation argument -> the ACTIVATION of ``_activate``.
_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def _launch_glu(out, compute, gate, value, activation):
    """Launch the glu kernel over ``out``, ELEMENTWISE_BLOCK elements a program."""
    numel = out.numel()
    _glu_kernel[(triton.cdiv(numel, ELEMENTWISE_BLOCK),)](
        *_strided_args(out.shape, [gate, value]), out, numel,
        ACTIVATION=_ACTIVATION_CODES[activation], COMPUTE=compute, BLOCK=ELEMENTWISE_BLOCK, num_warps=4,
    )


@_triton_kernel(GLU, slower=f"{_H200}: bf16 0.75x, fp32 0.95x")
def glu(x, y, activation, gate_first):
    """act(gate) * value, the halves of x read in place through their strides (or x and y)."""
    out_dtype, work_dtype = glu_rules(x, y, activation)
    first, second = halves(x, y)
    gate, value = (first, second) if gate_first else (second, first)
    fallback = partial(reference.glu, x, y, activation, gate_first)
    return _run(first.shape, out_dtype, work_dtype, fallback, _launch_glu, gate, value, activation)


@_triton_kernel(FAST_GELU, slower=f"{_H200}: bf16 0.21x, fp32 0.36x")
def fast_gelu(x):
    """Tanh-approximated GELU, elementwise through x's strides."""
    out_dtype, work_dtype = fast_gelu_rules(x)
    launch = partial(_launch_elementwise, _fast_gelu_kernel)
    return _run(x.shape, out_dtype, work_dtype, partial(reference.fast_gelu, x), launch, x)


@_triton_kernel(MUL_ADD, slower=f"{_H200}: bf16 0.42x, fp32 0.56x")
def mul_add(x, y, z):
    """x * y + z; operands broadcast to the output through stride-0 views."""
    shape, out_dtype, work_dtype = mul_add_rules(x, y, z)
    launch = partial(_launch_elementwise, _mul_add_kernel)
    return _run(shape, out_dtype, work_dtype, partial(reference.mul_add, x, y, z), launch, x, y, z)


def register() -> bool:
    """Register the Triton kernels for device type "cuda".

    Returns False (and registers nothing) without a CUDA device.  Kernels
    that are already registered are left alone, so calling it again is a
    no-op.
    """
    if not torch.cuda.is_available():
        return False
    registry.register_device_kernels(DEVICE_TYPE, KERNELS)
    return True
