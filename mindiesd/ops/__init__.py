"""Fused operators for diffusion transformers, registered as ``torch.ops.mindiesd.*``.

Importing this package registers the operators (once per process): each op's module under ``defs/``
declares it, and the kernel modules register their kernels with it.  The
functions below call the registered ops, whose device kernels are fast but
not differentiable; when autograd needs a gradient they run the reference
composition from ``mindiesd.ops.reference`` instead, so backward works.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

import torch

from . import kernels, reference, registry  # noqa: F401  (kernels registers the CPU, GEMM and NPU kernels)
from .defs import ADALAYERNORM, CHANNEL_RMS_NORM, FAST_GELU, GLU, GROUP_NORM_SILU, MUL_ADD, NORM_ROPE, RMS_NORM, ROPE
from .defs.adalayernorm import public as adalayernorm
from .defs.channel_rms_norm import public as channel_rms_norm
from .defs.fast_gelu import public as fast_gelu
from .defs.glu import public as glu
from .defs.group_norm_silu import public as group_norm_silu
from .defs.mul_add import public as mul_add
from .defs.norm_rope import public as norm_rope
from .defs.rms_norm import public as rms_norm
from .defs.rope import public as rope
from .registry import register_device_kernel

__all__ = [
    "adalayernorm",
    "build_cpu_kernels",
    "channel_rms_norm",
    "fast_gelu",
    "glu",
    "group_norm_silu",
    "mul_add",
    "norm_rope",
    "reference",
    "register_device_kernel",
    "rms_norm",
    "rope",
]

#: The Triton kernels' ops: declared here, as the module is only imported where CUDA and Triton exist.
for _op in (RMS_NORM, ROPE, NORM_ROPE, ADALAYERNORM, GROUP_NORM_SILU, CHANNEL_RMS_NORM, GLU, FAST_GELU, MUL_ADD):
    registry.declare_kernel(_op, "cuda", note="Triton")


def _register_optional_kernels() -> None:
    """Register the Triton (CUDA) and torch_npu (Ascend) kernels where their runtimes exist.

    Triton is imported only when a CUDA device is present.  A runtime that is
    installed but fails to load costs a warning; the reference kernels run.
    """
    backends = []
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        backends.append("triton")
    if importlib.util.find_spec("torch_npu") is not None:
        backends.append("npu")
    for backend in backends:
        try:
            importlib.import_module(f"{__name__}.kernels.{backend}").register()
        except Exception as error:  # a broken optional runtime must not break this import
            warnings.warn(
                f"mindiesd.ops: {backend} kernels not registered ({error!r}); "
                "the reference kernels run instead",
                RuntimeWarning,
                stacklevel=2,
            )


_register_optional_kernels()

from .kernels.cpp import build_cpu_kernels  # noqa: E402  (registers the lazily built C++ CPU kernels)
