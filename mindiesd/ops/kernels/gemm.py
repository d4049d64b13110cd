"""Kernels of the GEMM ops: ``mindiesd.linear_gelu`` (a matmul whose epilogue applies tanh-GELU) and
``mindiesd.cat_linear`` (a linear layer over a concatenation, without the concatenation).

linear_gelu:

Each takes ``(x, weight, bias)`` with x ``[..., K]``, weight ``[M, K]`` (a linear layer's, untransposed) and
bias ``[M]`` or None, and returns a contiguous ``[..., M]``.

* CUDA: ``torch._addmm_activation(..., use_gelu=True)``, cuBLASLt's GELU epilogue. Which GELU an epilogue
  computes is the library's choice, so the kernel checks it once per device and dtype against the tanh-GELU of
  the reference and, where they differ, computes the GEMM and the GELU as two ops (still correct, not faster).
* CPU: the C++ kernel (``cpp.py``): ATen's linear, then the fast_gelu loop in place over its output, in one call
  from the host (oneDNN's tanh-GELU post-op was measured slower than the GEMM + that loop); without the C++
  kernels, the two ops.

cat_linear takes ``(xs, weight, bias)``: the first input's product with its block of weight columns (plus the
bias) makes the output, and each further input's product is accumulated into it in place (``addmm_``, the GEMM's
own ``beta = 1``), so neither the concatenated input nor a partial sum is ever written apart. The weight's column
blocks are views: a transposed column block is a column-major matrix with the full weight's leading dimension,
which BLAS reads as it is. In bfloat16 and float16 the output would hold the partial sum between the GEMMs,
rounded once per input where eager rounds once, so there the kernels concatenate and run one GEMM, as eager does
(the pass fuses float32 and float64 only).

int8_linear takes ``(x, weight, weight_scale, bias, compensation, eps, out_dtype)``: torchao's dynamic per-row int8 quantization
of x, ``torch._int_mm`` and the rescale (``defs/int8_linear.py``). On CPU the C++ kernel (``cpp.py``) quantizes each
row in one visit and rescales the int32 product in one pass; the composition here is torchao's own sequence. On
CUDA the composition runs (the same ops as eager: declared not faster).

dequant_linear takes ``(x, weight, weight_scale, bias, scale_first, out_dtype)``: torchao's weight-only int8 and
float8 layers (``defs/dequant_linear.py``). On CPU the C++ kernel dequantizes into a buffer it keeps, runs ATen's
GEMM and finishes in one pass; the composition here is torchao's sequence. On CUDA the composition runs (declared
not faster).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from .. import registry
from .cpu import cpu_kernel
from ..defs import CAT_LINEAR, DEQUANT_LINEAR, INT8_LINEAR, LINEAR_GELU
from ..defs.cat_linear import cat_linear_rules, column_blocks
from ..defs.dequant_linear import reference as dequant_linear_reference
from ..defs.int8_linear import reference as int8_linear_reference
from ..defs.linear_gelu import linear_gelu_rules

__all__ = ["linear_gelu_cpu", "linear_gelu_cuda", "cat_linear_cpu", "cat_linear_cuda", "int8_linear_cpu",
           "int8_linear_cuda", "dequant_linear_cpu", "dequant_linear_cuda", "epilogue_is_tanh_gelu",
           "CUDA_KERNELS"]

#: Op name -> CUDA kernel; registered with the Triton kernels where CUDA and Triton exist (``triton.register``).
CUDA_KERNELS: dict = {}

#: (device, dtype) -> whether torch._addmm_activation's GELU epilogue is tanh-GELU there.
_EPILOGUE_OK: Dict[Tuple[str, torch.dtype], bool] = {}


def _two_ops(x2d: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    out = torch.mm(x2d, weight.t()) if bias is None else torch.addmm(bias, x2d, weight.t())
    return F.gelu(out, approximate="tanh")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def epilogue_is_tanh_gelu(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._addmm_activation``'s GELU is the tanh approximation on ``device`` for ``dtype``."""
    key = (str(device), dtype)
    known = _EPILOGUE_OK.get(key)
    if known is None:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(16, 32, generator=g) * 2).to(device=device, dtype=dtype)
        w = torch.randn(24, 32, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(24, generator=g).to(device=device, dtype=dtype)
        fused = torch._addmm_activation(b, x, w.t(), use_gelu=True).float()
        exact = F.gelu(torch.addmm(b, x, w.t()).float(), approximate="none")
        tanh = F.gelu(torch.addmm(b, x, w.t()).float(), approximate="tanh")
        # exact and tanh GELU differ by up to ~5e-4 here; the epilogue must be much nearer the tanh one
        known = bool((fused - tanh).abs().max() < 0.25 * (exact - tanh).abs().max())
        _EPILOGUE_OK[key] = known
    return known


@registry.kernel(LINEAR_GELU, "cuda", fast=False, into=CUDA_KERNELS, register=False,
                 note="cuBLASLt's GELU epilogue (torch._addmm_activation), not measured on a GPU yet "
                      "(bench/gpu_check.sh measures it)")
def linear_gelu_cuda(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    linear_gelu_rules(x, weight, bias)
    x2d = _rows(x)
    if bias is None or not epilogue_is_tanh_gelu(x.device, x.dtype):
        out = _two_ops(x2d, weight, bias)
    else:
        out = torch._addmm_activation(bias, x2d, weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])


@cpu_kernel(LINEAR_GELU, fast=False,
            note="the GEMM and the fast_gelu loop in place over its output in one call (C++, cpp.py), the same work "
                 "as the GEMM + the fast_gelu kernel; off unless forced, so that every GELU after a linear layer "
                 "stays with the specification's fast_gelu family")
def linear_gelu_cpu(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    linear_gelu_rules(x, weight, bias)
    out = _two_ops(_rows(x), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _accumulated(xs, weight: torch.Tensor, bias) -> torch.Tensor:
    if weight.dtype in (torch.float16, torch.bfloat16):  # one rounding, as eager's single GEMM
        rows = _rows(torch.cat(list(xs), -1))
        out = torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())
        return out.view(*xs[0].shape[:-1], weight.shape[0])
    out = None
    for x, block in column_blocks(xs, weight):
        rows = _rows(x)
        if out is None:
            out = torch.mm(rows, block.t()) if bias is None else torch.addmm(bias, rows, block.t())
        else:
            out.addmm_(rows, block.t())
    return out.view(*xs[0].shape[:-1], weight.shape[0])


@registry.kernel(CAT_LINEAR, "cuda", fast=False, into=CUDA_KERNELS, register=False,
                 note="cuBLAS GEMMs accumulated in place, not measured on a GPU yet (bench/gpu_check.sh measures it)")
def cat_linear_cuda(xs, weight: torch.Tensor, bias=None) -> torch.Tensor:
    cat_linear_rules(xs, weight, bias)
    return _accumulated(xs, weight, bias)


@cpu_kernel(CAT_LINEAR, note="GEMMs accumulated in place (the C++ kernel of cpp.py, one call from the host): "
                              "1.02-1.05x the concatenation and one GEMM in fp32 at 1024-4608 rows (measured)")
def cat_linear_cpu(xs, weight: torch.Tensor, bias=None) -> torch.Tensor:
    cat_linear_rules(xs, weight, bias)
    return _accumulated(xs, weight, bias)


@cpu_kernel(INT8_LINEAR)
def int8_linear_cpu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias=None,
                    compensation=None, eps: float = 1.1920928955078125e-07, out_dtype=None) -> torch.Tensor:
    """torchao's sequence (the C++ kernel of cpp.py runs in its place)."""
    return int8_linear_reference(x, weight, weight_scale, bias, compensation, eps, out_dtype)


@registry.kernel(INT8_LINEAR, "cuda", fast=False, into=CUDA_KERNELS, register=False,
                 note="torchao's own sequence (no fused CUDA kernel yet): not faster than eager")
def int8_linear_cuda(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias=None,
                     compensation=None, eps: float = 1.1920928955078125e-07, out_dtype=None) -> torch.Tensor:
    return int8_linear_reference(x, weight, weight_scale, bias, compensation, eps, out_dtype)


@cpu_kernel(DEQUANT_LINEAR)
def dequant_linear_cpu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias=None,
                       scale_first: bool = False, out_dtype=None) -> torch.Tensor:
    """torchao's sequence (the C++ kernel of cpp.py runs in its place)."""
    return dequant_linear_reference(x, weight, weight_scale, bias, scale_first, out_dtype)


@registry.kernel(DEQUANT_LINEAR, "cuda", fast=False, into=CUDA_KERNELS, register=False,
                 note="torchao's own sequence (no fused CUDA kernel yet): not faster than eager")
def dequant_linear_cuda(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias=None,
                        scale_first: bool = False, out_dtype=None) -> torch.Tensor:
    return dequant_linear_reference(x, weight, weight_scale, bias, scale_first, out_dtype)
