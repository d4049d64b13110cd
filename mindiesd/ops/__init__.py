"""Fused operators for diffusion transformers, registered as ``torch.ops.mindiesd.*``.

Importing this package registers the operators (once per process).  The
functions below call the registered ops, whose device kernels are fast but
not differentiable; when autograd needs a gradient they run the reference
composition from ``mindiesd.ops.reference`` instead, so backward works.
"""

from __future__ import annotations

import torch

from . import _library, reference
from ._library import register_device_kernel

__all__ = [
    "adalayernorm",
    "fast_gelu",
    "mul_add",
    "reference",
    "register_device_kernel",
    "rms_norm",
    "rope",
]

_RMS_NORM = torch.ops.mindiesd.rms_norm.default
_ROPE = torch.ops.mindiesd.rope.default
_ADALAYERNORM = torch.ops.mindiesd.adalayernorm.default
_FAST_GELU = torch.ops.mindiesd.fast_gelu.default
_MUL_ADD = torch.ops.mindiesd.mul_add.default


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(
        tensor is not None and tensor.requires_grad for tensor in tensors
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RMS normalization over the last dim, optionally scaled by ``weight``.

    Output dtype: ``out_dtype``, else promote(x, weight), else x's dtype.
    """
    if _needs_grad(x, weight):
        return reference.rms_norm(x, weight, eps, out_dtype)
    return _RMS_NORM(x, weight, eps, out_dtype)


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotary position embedding on the last dim of ``x``.

    ``interleaved`` rotates pairs (x[2i], x[2i+1]) (Flux); otherwise pairs
    (x[i], x[i + D/2]) ("rotate_half").  cos/sin hold D, D/2 or 1 values in
    their last dim and broadcast into x.  Output dtype: ``out_dtype`` or
    promote(x, cos, sin).
    """
    if _needs_grad(x, cos, sin):
        return reference.rope(x, cos, sin, interleaved, out_dtype)
    return _ROPE(x, cos, sin, interleaved, out_dtype)


def adalayernorm(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Adaptive layer norm: layer_norm(x) * (1 + scale) + shift.

    scale/shift broadcast into x (e.g. [B, 1, D] or [D]).  Output dtype:
    ``out_dtype`` or promote(x, scale, shift).
    """
    if _needs_grad(x, scale, shift):
        return reference.adalayernorm(x, scale, shift, eps, out_dtype)
    return _ADALAYERNORM(x, scale, shift, eps, out_dtype)


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GELU (same function as F.gelu(approximate="tanh"))."""
    if _needs_grad(x):
        return reference.fast_gelu(x)
    return _FAST_GELU(x)


def mul_add(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, addend_first: bool = False) -> torch.Tensor:
    """x * y + z with full broadcasting, rounded once.

    The output has the memory layout eager's ``x * y + z`` gives, or ``z + x * y``'s with ``addend_first``
    (they differ when the operands' layouts do).
    """
    if _needs_grad(x, y, z):
        return reference.mul_add(x, y, z, addend_first)
    return _MUL_ADD(x, y, z, addend_first)


def _register_optional_kernels() -> None:
    """Register the Triton (CUDA) and torch_npu (Ascend) kernels where their runtimes exist.

    Triton is imported only when a CUDA device is present.  A runtime that is
    installed but fails to load costs a warning; the reference kernels run.
    """
    import importlib.util
    import warnings

    backends = []
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        backends.append("_triton")
    if importlib.util.find_spec("torch_npu") is not None:
        backends.append("_npu")
    for backend in backends:
        try:
            importlib.import_module(f"{__name__}.{backend}").register()
        except Exception as error:  # a broken optional runtime must not break this import
            warnings.warn(
                f"mindiesd.ops: {backend.lstrip('_')} kernels not registered ({error!r}); "
                "the reference kernels run instead",
                RuntimeWarning,
                stacklevel=2,
            )


_register_optional_kernels()

from ._cpp_kernels import build_cpu_kernels  # noqa: E402  (registers the lazily built C++ CPU kernels)
