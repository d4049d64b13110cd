"""The device kernels of the fused ops; each module registers its kernels with their op when imported.

``cpu`` (aten compositions), ``cpp`` (+ ``cpp_build``: the C++ kernels, built on first use), ``gemm`` (GEMM
epilogues), ``npu`` (torch_npu mapping, registered where torch_npu exists) and ``triton`` (CUDA, imported only
where CUDA and Triton exist).
"""

from . import cpu, gemm, npu  # noqa: F401  (importing them registers their kernels)
