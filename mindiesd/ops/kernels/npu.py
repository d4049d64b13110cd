"""Ascend NPU kernels (device type "npu", dispatch key PrivateUse1) through torch_npu.

An op runs a torch_npu fused kernel only on the inputs for which that kernel
computes the same function as ``mindiesd.ops.reference``; all other inputs,
and the ops without such a kernel, run the reference composition.

* rms_norm: ``torch_npu.npu_rms_norm(x, gamma, epsilon)[0]``.  The kernel
  normalizes over the last ``gamma.dim()`` dims of x, so only a weight that
  is a [D] vector (after dropping leading size-1 dims) is passed; a missing
  weight becomes ones.  Its output has x's dtype, so it is used when that is
  the output dtype, or when x is float32 (the float32 result is then
  rounded once).  The weight must have x's dtype or promote into it.
* rope: ``torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode)``, which computes
  ``x * r1 + rotate(x) * r2`` with ``rotate_half`` ("half") or the
  interleaved-pair rotation ("interleave") on full-width tables.  Used for
  4-D x whose tables broadcast in one of the documented layouts, with the
  documented size limits, on Atlas A2/A3 (the other chips' older kernel has
  no interleave mode and narrower limits).  Per-pair tables are widened to
  full width first (a copy of the table, not of x).
* glu: ``torch_npu.npu_swiglu(x, dim=-1)``, which computes ``silu(A) * B`` of
  x's first half A and second half B (Atlas A2), so only for the form that
  is the same function: one contiguous x (its documented limit, 1 to 8
  dims, not empty), silu, the first half activated (Flux2's form).  The
  other forms (the second half activated as in diffusers' SwiGLU, two
  projections, GELU) run the reference, so the family is declared not
  faster than eager there (and is unmeasured); forced on, the mapped form
  still runs npu_swiglu.
* fast_gelu: reference.  ``torch_npu.npu_fast_gelu`` computes
  x * sigmoid(1.702 x), a different function from the tanh GELU this op is,
  and some torch_npu versions run ``F.gelu(x, approximate="tanh")`` as
  aclnnGelu without passing the approximation on, so neither is used.
* group_norm_silu: ``torch_npu.npu_group_norm_silu(x, gamma, beta, group, eps)[0]``
  (the norm with the biased variance, then SiLU; x of 2 to 8 dims in float16, bfloat16 or float32, gamma and beta
  [C] of one dtype no narrower than x's: a missing one becomes ones or zeros of x's dtype).  Other forms run the
  reference.  Not measured on an NPU.
* channel_rms_norm, adalayernorm, mul_add: reference; torch_npu has no binding of the same
  functions.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from .. import reference, registry
from .._rules import promote
from ..defs import ADALAYERNORM, CHANNEL_RMS_NORM, FAST_GELU, GLU, GROUP_NORM_SILU, MUL_ADD, RMS_NORM, ROPE
from ..defs.glu import glu_rules
from ..defs.group_norm_silu import group_norm_silu_rules
from ..defs.rms_norm import rms_norm_rules
from ..defs.rope import rope_rules

__all__ = ["KERNELS", "adalayernorm", "channel_rms_norm", "fast_gelu", "glu", "group_norm_silu", "mul_add", "register", "rms_norm", "rope", "swiglu_covers"]

DEVICE_TYPE = "npu"

#: Op name -> NPU kernel (declared at import, registered by :func:`register` where torch_npu exists).
KERNELS: dict = {}


def _npu_kernel(op: registry.OpDef, note: str, fast: bool = True):
    return registry.kernel(op, DEVICE_TYPE, fast=fast, note=note, into=KERNELS, register=False)

# Dtypes the torch_npu fused kernels accept.
NPU_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Ranks of x that npu_rms_norm accepts.
RMS_NORM_RANKS = range(2, 9)
# Ranks of x that npu_swiglu accepts.
SWIGLU_RANKS = range(1, 9)
# npu_rotary_mul limits on Atlas A2/A3: D below this, and B, N (half) or
# B * N (interleave) below ROTARY_BATCH_HEADS_LIMIT.
ROTARY_MAX_WIDTH = 896
ROTARY_BATCH_HEADS_LIMIT = 1000
# SoC version ranges (torch_npu._C._npu_get_soc_version) of Atlas A2 (910B)
# and A3 (910C / 910_93) chips, which run the aclnn RotaryPositionEmbedding kernel.
ROTARY_SOC_RANGES = (range(220, 240), range(250, 260))

# cos/sin table forms npu_rotary_mul documents for each layout of x: which
# of x's first three dims the table keeps (True) or broadcasts (False), and
# the dims of x that are then B and N (whose sizes are limited).  One table
# form can fit several layouts; the limits of all of them must hold.
_HALF_TABLE_FORMS = (
    ((False, False, True), (0, 1)),  # x BNSD, table 11SD
    ((True, False, True), (0, 1)),  # x BNSD, table B1SD
    ((True, True, True), (0, 1)),  # x BNSD, table BNSD
    ((False, True, False), (0, 2)),  # x BSND, table 1S1D
    ((True, True, False), (0, 2)),  # x BSND, table BS1D
    ((True, True, True), (0, 2)),  # x BSND, table BSND
    ((True, False, False), (1, 2)),  # x SBND, table S11D
    ((True, True, False), (1, 2)),  # x SBND, table SB1D
    ((True, True, True), (1, 2)),  # x SBND, table SBND
)
_INTERLEAVE_TABLE_FORMS = (
    ((False, False, True), (0, 1)),  # x BNSD, table 11SD
    ((False, True, False), (0, 2)),  # x BSND, table 1S1D
    ((True, False, False), (1, 2)),  # x SBND, table S11D
)
_TABLE_FORMS = {"half": _HALF_TABLE_FORMS, "interleave": _INTERLEAVE_TABLE_FORMS}


def _torch_npu():
    """The torch_npu module (imported by whoever made the NPU tensors)."""
    import torch_npu

    return torch_npu


def _rounds_once(x_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether a kernel result in x's dtype, cast to ``out_dtype``, is the reference result.

    True when no cast is needed, or when the kernel computed in float32 and
    the cast is the only rounding.
    """
    return out_dtype == x_dtype or (x_dtype == torch.float32 and out_dtype.is_floating_point)


def _finish(result: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if result.dtype != out_dtype:
        result = result.to(out_dtype)
    return result.contiguous()


# ----------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------


def rms_norm_gamma(
    x: torch.Tensor, weight: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor | None:
    """The [D] gamma with which npu_rms_norm computes this rms_norm, or None."""
    if x.dtype not in NPU_FLOAT_DTYPES or x.dim() not in RMS_NORM_RANKS:
        return None
    if not _rounds_once(x.dtype, out_dtype):
        return None
    width = x.shape[-1]
    if weight is None:
        return torch.ones(width, dtype=x.dtype, device=x.device)
    if weight.dim() == 0 or weight.shape[-1] != width or any(s != 1 for s in weight.shape[:-1]):
        return None
    if weight.dtype not in NPU_FLOAT_DTYPES or promote(x.dtype, weight.dtype) != x.dtype:
        return None
    return weight.reshape(width).to(x.dtype)


@_npu_kernel(RMS_NORM, "npu_rms_norm where it computes the same function")
def rms_norm(x, weight, eps, out_dtype=None):
    """npu_rms_norm where it computes this function, else the reference."""
    out_dtype, _ = rms_norm_rules(x, weight, out_dtype)
    gamma = rms_norm_gamma(x, weight, out_dtype)
    if gamma is None:
        return reference.rms_norm(x, weight, eps, out_dtype)
    result, _ = _torch_npu().npu_rms_norm(x, gamma, eps)
    return _finish(result, out_dtype)


# ----------------------------------------------------------------------------
# rope
# ----------------------------------------------------------------------------


def _takes_rotary_mode(function) -> bool:
    """Whether this torch_npu's npu_rotary_mul has the rotary_mode argument."""
    try:
        return "rotary_mode" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        pass
    try:
        schema = torch.ops.npu.npu_rotary_mul.default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(argument.name == "rotary_mode" for argument in schema.arguments)


@functools.cache
def rotary_mul_modes() -> frozenset[str]:
    """The rotary modes of npu_rotary_mul this machine runs with the documented semantics.

    Empty off Atlas A2/A3 chips; "interleave" needs a torch_npu whose
    npu_rotary_mul takes ``rotary_mode``.
    """
    torch_npu = _torch_npu()
    try:
        soc_version = torch_npu._C._npu_get_soc_version()
    except (AttributeError, RuntimeError):
        return frozenset()
    if not any(soc_version in versions for versions in ROTARY_SOC_RANGES):
        return frozenset()
    if _takes_rotary_mode(torch_npu.npu_rotary_mul):
        return frozenset({"half", "interleave"})
    return frozenset({"half"})


def _batch_head_dims(x_shape, table_shape, forms) -> list[tuple[int, ...]]:
    """The (B, N) dims of x for every documented layout whose table form ``table_shape`` fits."""
    return [
        batch_heads
        for keeps, batch_heads in forms
        if all(
            table_size == (x_size if keep else 1)
            for keep, table_size, x_size in zip(keeps, table_shape[:3], x_shape[:3])
        )
    ]


def _four_dims(shape) -> tuple[int, ...]:
    """``shape`` with leading size-1 dims added up to four dims."""
    return (1,) * (4 - len(shape)) + tuple(shape)


def _widen(table: torch.Tensor, width: int, interleaved: bool) -> torch.Tensor:
    """A 4-D full-width view (or, for a per-pair table, copy) of a cos/sin table of last dim D or D/2."""
    return reference.full_width(table.reshape(_four_dims(table.shape)), width, interleaved)


def rotary_mul_args(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """(r1, r2, rotary_mode) with which npu_rotary_mul computes this rope, or None."""
    if x.dim() != 4 or cos.dim() > 4 or sin.dim() > 4:
        return None
    if x.dtype not in NPU_FLOAT_DTYPES or not (x.dtype == cos.dtype == sin.dtype):
        return None
    if not _rounds_once(x.dtype, out_dtype):
        return None
    mode = "interleave" if interleaved else "half"
    if mode not in rotary_mul_modes():
        return None
    width = x.shape[-1]
    if width >= ROTARY_MAX_WIDTH or _four_dims(cos.shape) != _four_dims(sin.shape):
        return None
    if cos.shape[-1] not in (width, width // 2):
        return None
    layouts = _batch_head_dims(x.shape, _four_dims(cos.shape), _TABLE_FORMS[mode])
    if not layouts:
        return None
    for batch_heads in layouts:
        sizes = [x.shape[dim] for dim in batch_heads]
        if mode == "half" and max(sizes) >= ROTARY_BATCH_HEADS_LIMIT:
            return None
        if mode == "interleave" and math.prod(sizes) >= ROTARY_BATCH_HEADS_LIMIT:
            return None
    return _widen(cos, width, interleaved), _widen(sin, width, interleaved), mode


@_npu_kernel(ROPE, "npu_rotary_mul where it computes the same function")
def rope(x, cos, sin, interleaved, out_dtype=None):
    """npu_rotary_mul where it computes this function, else the reference."""
    out_dtype, _ = rope_rules(x, cos, sin, out_dtype)
    args = rotary_mul_args(x, cos, sin, interleaved, out_dtype)
    if args is None:
        return reference.rope(x, cos, sin, interleaved, out_dtype)
    r1, r2, mode = args
    npu_rotary_mul = _torch_npu().npu_rotary_mul
    if mode == "half":
        result = npu_rotary_mul(x, r1, r2)
    else:
        result = npu_rotary_mul(x, r1, r2, rotary_mode=mode)
    return _finish(result, out_dtype)


# ----------------------------------------------------------------------------
# glu
# ----------------------------------------------------------------------------


def swiglu_covers(x: torch.Tensor, y: torch.Tensor | None, activation: str, gate_first: bool) -> bool:
    """Whether ``npu_swiglu(x, dim=-1)`` computes this glu: silu of x's first half times its second half, for a
    contiguous, non-empty x of 1 to 8 dims in a dtype the kernel takes."""
    return (
        y is None and activation == "silu" and gate_first and x.dtype in NPU_FLOAT_DTYPES
        and x.dim() in SWIGLU_RANKS and x.numel() > 0 and x.is_contiguous()
    )


@_npu_kernel(GLU, "npu_swiglu covers only silu of the first half of one contiguous tensor: "
                  "the other forms run the reference composition (not measured)", fast=False)
def glu(x, y, activation, gate_first):
    """npu_swiglu where it computes this function, else the reference."""
    glu_rules(x, y, activation)
    if not swiglu_covers(x, y, activation, gate_first):
        return reference.glu(x, y, activation, gate_first)
    return _finish(_torch_npu().npu_swiglu(x, dim=-1), x.dtype)


# ----------------------------------------------------------------------------
# Ops without an exact torch_npu kernel
# ----------------------------------------------------------------------------


@_npu_kernel(ADALAYERNORM, "no torch_npu kernel: the fp32 reference composition", fast=False)
def adalayernorm(x, scale, shift, eps, out_dtype=None):
    """Reference composition (no torch_npu binding computes this function)."""
    return reference.adalayernorm(x, scale, shift, eps, out_dtype)


@_npu_kernel(FAST_GELU, "npu_fast_gelu is another function: the reference composition", fast=False)
def fast_gelu(x):
    """Reference tanh GELU; never npu_fast_gelu, which is x * sigmoid(1.702 x)."""
    return reference.fast_gelu(x)


# Ranks of x that npu_group_norm_silu accepts.
GROUP_NORM_SILU_RANKS = range(2, 9)


def group_norm_silu_parameters(x, weight, bias):
    """(gamma, beta) with which npu_group_norm_silu computes this op, or None."""
    if x.dtype not in NPU_FLOAT_DTYPES or x.dim() not in GROUP_NORM_SILU_RANKS or x.numel() == 0:
        return None
    given = [t for t in (weight, bias) if t is not None]
    dtype = given[0].dtype if given else x.dtype
    if any(t.dtype != dtype for t in given) or dtype not in NPU_FLOAT_DTYPES or promote(x.dtype, dtype) != dtype:
        return None
    channels = x.shape[1]
    gamma = weight if weight is not None else torch.ones(channels, dtype=dtype, device=x.device)
    beta = bias if bias is not None else torch.zeros(channels, dtype=dtype, device=x.device)
    return gamma, beta


@_npu_kernel(GROUP_NORM_SILU, "npu_group_norm_silu where it computes the same function (not measured)")
def group_norm_silu(x, groups, weight, bias, eps):
    """npu_group_norm_silu where it computes this function, else the reference."""
    group_norm_silu_rules(x, groups, weight, bias)
    parameters = group_norm_silu_parameters(x, weight, bias)
    if parameters is None:
        return reference.group_norm_silu(x, groups, weight, bias, eps)
    return _finish(_torch_npu().npu_group_norm_silu(x, *parameters, groups, eps)[0], x.dtype)


@_npu_kernel(CHANNEL_RMS_NORM, "no torch_npu kernel: the fp32 reference composition", fast=False)
def channel_rms_norm(x, weight, bias, scale, eps, silu):
    """Reference composition (npu_rms_norm normalises the last dims, not the channels)."""
    return reference.channel_rms_norm(x, weight, bias, scale, eps, silu)


@_npu_kernel(MUL_ADD, "no torch_npu kernel: the fp32 reference composition", fast=False)
def mul_add(x, y, z):
    """Reference composition: x * y + z computed in float32 for 16-bit inputs."""
    return reference.mul_add(x, y, z)


def register() -> bool:
    """Register the NPU kernels for device type "npu" when torch_npu is importable.

    Returns False (and registers nothing) without torch_npu.  Kernels that
    are already registered are left alone, so calling it again is a no-op.
    """
    try:
        _torch_npu()
    except ImportError:
        return False
    registry.register_device_kernels(DEVICE_TYPE, KERNELS)
    return True
