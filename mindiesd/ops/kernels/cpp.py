"""Single-pass C++ CPU kernels for the mindiesd operators, prebuilt by the package build or built on first use.

Each op here calls its entry point of the C++ extension (``_cpp/``; the
package build's prebuilt module, else built, cached and loaded by
``cpp_build.py`` on the first call of a CPU kernel, or by
``mindiesd.ops.build_cpu_kernels()``, never at import) and falls back to
the aten composition kernel of ``cpu.py`` for the forms the extension does
not cover (e.g. float64, mixed-dtype mul_add) or when it is unavailable (no
compiler or ninja, a failed build: one warning names the cause) or disabled:

* ``MINDIESD_CPP_CACHE``: cache folder (default ``~/.cache/mindiesd/cpp``).
* ``MINDIESD_CPP_KERNELS=0``: keep the aten composition kernels of ``cpu.py``.

An op gets a C++ kernel with one :func:`native` line here, its ``.cpp`` file in ``_cpp/`` (the build
compiles every ``.cpp`` there; after the kernel, the file registers the C++ executor's entry for the op,
``entries.h``) and its entry point declared in ``kernels.h`` and bound in ``bindings.cpp``.
:func:`install` (run at import) registers the wrappers as the CPU kernels of the ops; nothing is built until
one of them runs.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch

from .. import registry
from . import cpp_build, cpu, gemm  # noqa: F401  (gemm registers linear_gelu's composition kernel first)
from .cpp_build import (  # noqa: F401  (the build's public names, as before the split)
    CACHE_ENV,
    ENABLE_ENV,
    HEADERS,
    SOURCE_DIR,
    SOURCES,
    build_cpu_kernels,
    build_name,
    cache_root,
    cpu_kernel_implementation,
    enabled,
    extension,
)
from ..defs import (ADALAYERNORM, CAT_LINEAR, CHANNEL_RMS_NORM, DEQUANT_LINEAR, FAST_GELU, GLU, GROUP_NORM_SILU,
                    INT8_LINEAR, LINEAR_GELU, MUL_ADD, NORM_ROPE, RMS_NORM, ROPE)

__all__ = ["build_cpu_kernels", "cpu_kernel_implementation", "install", "native"]

#: Op name -> C++ kernel wrapper.
KERNELS: dict[str, Callable[..., torch.Tensor]] = {}


def native(
    op: registry.OpDef,
    sample: Callable[..., tuple],
    fallible: tuple[type[BaseException], ...] = (),
) -> Callable[..., torch.Tensor]:
    """The CPU kernel of ``op``: the C++ entry point of that name, else the composition kernel of ``cpu``.

    The wrapper has the composition kernel's signature.  When the op takes an ``out_dtype`` (last), the
    op's checks (called with all arguments but the scalar before ``out_dtype``) resolve it first, as the
    entry point takes it resolved.  The entry point returns None for forms it does not cover, and raises
    one of ``fallible`` where the composition kernel explains the failure better; both run the composition
    kernel instead.  ``sample`` gives the reference arguments of the build's self-check from its sample
    tensors (``cpp_build.self_check_tensors``).
    """
    fallback = cpu.KERNELS[op.name]
    signature = inspect.signature(fallback)
    arity = len(signature.parameters)
    rules = op.checks if "out_dtype" in signature.parameters else None

    def kernel(*args, **kwargs):
        if kwargs or len(args) != arity:  # keywords, defaults or a wrong call: bind (or raise TypeError)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        if rules is not None:
            out_dtype, _ = rules(*args[:-2], args[-1])
            args = (*args[:-1], out_dtype)
        module = cpp_build._extension if cpp_build._resolved else extension()
        if module is not None:
            try:
                result = getattr(module, op.name)(*args)
            except fallible:
                result = None
            if result is not None:
                return result
        return fallback(*args)

    kernel.__name__ = kernel.__qualname__ = op.name
    kernel.__doc__ = f"C++ {op.name}, or the composition kernel for forms it does not cover."
    kernel.__signature__ = signature
    KERNELS[op.name] = kernel
    cpp_build.SELF_CHECKS[op.name] = (op, sample, rules is not None)
    declared = op.kernels.get("cpu")  # a composition kernel declared off (not faster) stays off, with its reason
    if declared is not None and not declared.fast:
        registry.declare_kernel(op, "cpu", kernel, fast=False, note=declared.note)
    else:
        registry.declare_kernel(op, "cpu", kernel, note="C++ kernel, or an aten composition")
    return kernel


rms_norm = native(RMS_NORM, lambda t: (t.x, t.w, 1e-6))
rope = native(ROPE, lambda t: (t.x, t.cos, t.sin, True))
# x [3, 2, 40] and its first row as a second stream, joined along dim 0, rotated as two heads of 20.
norm_rope = native(NORM_ROPE, lambda t: ([t.x, t.x[:1]], 0, [t.w, None], 1e-6, None, 20, t.cos[:1], t.sin[:1], False))
adalayernorm = native(ADALAYERNORM, lambda t: (t.x, t.scale, t.shift, 1e-6))
glu = native(GLU, lambda t: (t.x, None, "gelu", True))
fast_gelu = native(FAST_GELU, lambda t: (t.x,))
# x [3, 2, 40] as 3 samples of 2 channels (two groups of one), 40 positions, with per-channel weight and bias
group_norm_silu = native(GROUP_NORM_SILU, lambda t: (t.x, 2, t.w[:2], t.shift[:2], 1e-6))
# the same x normalised over its 2 channels at each of its 40 positions, weighted, shifted and activated
channel_rms_norm = native(CHANNEL_RMS_NORM, lambda t: (t.x, t.w[:2], t.shift[:2], 1.5, 1e-12, True))
linear_gelu = native(LINEAR_GELU, lambda t: (t.x, t.scale.reshape(3, 40), t.w[:3]))
# x [3, 2, 40] beside its first 10 columns, through a [3, 50] weight
cat_linear = native(CAT_LINEAR, lambda t: ([t.x, t.x[..., :10]], t.scale.reshape(3, 40).repeat(1, 2)[:, :50], t.w[:3]))
# The composition kernel explains shapes that do not broadcast.
mul_add = native(MUL_ADD, lambda t: (t.x, t.scale, t.w), fallible=(RuntimeError,))
# x [3, 2, 40] through 3 int8 output rows, with their scales and a bias
int8_linear = native(INT8_LINEAR, lambda t: (t.x, (t.scale.reshape(3, 40) * 40).round().clamp(-128, 127).to(torch.int8),
                                             t.w[:3].abs() + 0.01, t.shift[:3], None, 1.1920928955078125e-07))
# the same weight stored as float8 and dequantized before the GEMM
dequant_linear = native(DEQUANT_LINEAR, lambda t: (t.x, t.scale.reshape(3, 40).to(torch.float8_e4m3fn),
                                                   t.w[:3].abs() + 0.01, t.shift[:3], True))


def install() -> None:
    """Make the C++ kernels (lazily built) the CPU kernels of the mindiesd ops.

    Only ops whose CPU kernel is still the composition kernel are replaced,
    so a kernel registered by the user stays.  Nothing is built here.
    """
    if not enabled():
        return
    registered = registry.DEVICE_KERNELS.get("cpu", {})
    for name, kernel in KERNELS.items():
        if registered.get(name) is not cpu.KERNELS[name]:
            continue
        with warnings.catch_warnings():
            # Replacing the composition kernel is intended: no override warning.
            warnings.simplefilter("ignore", UserWarning)
            registry.register_device_kernel(name, "cpu", kernel)


try:
    install()
except Exception as _install_error:  # noqa: BLE001  (import must never fail)
    warnings.warn(
        f"mindiesd: could not register the C++ CPU kernels ({_install_error}); "
        "using the aten composition kernels",
        RuntimeWarning,
        stacklevel=2,
    )
