"""Registration of the ``mindiesd`` operators with the PyTorch dispatcher.

The ops are defined with ``torch.library.Library`` (lower per-call overhead
than ``torch.library.custom_op``).  Every op gets

* the reference composition under ``CompositeExplicitAutograd`` (any device),
* a fake kernel (shape/dtype only, symbolic-shape safe) for tracing,
* a device kernel for each device type listed in ``DEVICE_KERNELS``.

Which ops exist, their schemas, references and fakes, and which module holds each device's kernel are declared
once per family in :mod:`mindiesd.families`.

Device kernels for other backends are added by putting them in
``DEVICE_KERNELS`` before registration, or at run time with
``register_device_kernel``.  The ops have no autograd kernel: the Python API
in ``mindiesd.ops`` runs the reference composition when a gradient is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..families import FAMILIES as _ALL, resolve
from . import _cpu
from ._layout import conform, empty_output
from ._rules import (
    adalayernorm_rules,
    fast_gelu_rules,
    linear_gelu_rules,
    mul_add_rules,
    rms_norm_rules,
    rope_rules,
)

NAMESPACE = "mindiesd"

#: The families that emit an op of their own (a GEMM rewrite such as merge_projections emits aten ops only).
FAMILIES = {name: family for name, family in _ALL.items() if family.has_op}

#: Op name -> schema, one op per fusion family (mindiesd.families).
SCHEMAS: dict[str, str] = {name: family.schema for name, family in FAMILIES.items()}

# Device type -> {op name -> kernel}.  Kernels take the op's schema arguments
# positionally and return a contiguous tensor; they are registered behind
# ``_layout.conform``, which gives the output the layout the fakes promise.
# "cuda" (Triton) and "npu" (torch_npu) kernels belong here.
DEVICE_KERNELS: dict[str, dict[str, Callable[..., torch.Tensor]]] = globals().get(
    "DEVICE_KERNELS", {"cpu": dict(_cpu.KERNELS)}
)

# Device type -> dispatch key its kernels are registered under.
DISPATCH_KEYS: dict[str, str] = {
    "cpu": "CPU",
    "cuda": "CUDA",
    "npu": "PrivateUse1",
}


def _fake_rms_norm(x, weight, eps, out_dtype=None):
    out_dtype, _ = rms_norm_rules(x, weight, out_dtype)
    return empty_output("rms_norm", (x,), out_dtype)


def _fake_rope(x, cos, sin, interleaved, out_dtype=None):
    out_dtype, _ = rope_rules(x, cos, sin, out_dtype)
    return empty_output("rope", (x,), out_dtype)


def _fake_adalayernorm(x, scale, shift, eps, out_dtype=None):
    out_dtype, _ = adalayernorm_rules(x, scale, shift, out_dtype)
    return empty_output("adalayernorm", (x,), out_dtype)


def _fake_fast_gelu(x):
    out_dtype, _ = fast_gelu_rules(x)
    return empty_output("fast_gelu", (x,), out_dtype)


def _fake_mul_add(x, y, z, addend_first=False):
    _, out_dtype, _ = mul_add_rules(x, y, z)
    return empty_output("mul_add", (x, y, z, addend_first), out_dtype)


def _fake_linear_gelu(x, weight, bias=None):
    out_dtype = linear_gelu_rules(x, weight, bias)
    return empty_output("linear_gelu", (x, weight), out_dtype)


def _implementations(attribute: str) -> dict[str, Callable[..., torch.Tensor]]:
    return {name: resolve(getattr(family, attribute)) for name, family in FAMILIES.items()}


REFERENCE_KERNELS: dict[str, Callable[..., torch.Tensor]] = _implementations("reference")
FAKE_KERNELS: dict[str, Callable[..., torch.Tensor]] = _implementations("fake")


def _dispatch_key(device_type: str) -> str:
    try:
        return DISPATCH_KEYS[device_type]
    except KeyError:
        raise ValueError(
            f"mindiesd.ops: no dispatch key known for device type {device_type!r}; "
            f"known: {sorted(DISPATCH_KEYS)}"
        ) from None


def _ops_defined() -> bool:
    namespace = getattr(torch.ops, NAMESPACE)
    return all(hasattr(namespace, name) for name in SCHEMAS)


def _define_all() -> torch.library.Library:
    library = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        library.define(schema)
        library.impl(name, REFERENCE_KERNELS[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", FAKE_KERNELS[name], lib=library)
    for device_type, kernels in DEVICE_KERNELS.items():
        for name, kernel in kernels.items():
            library.impl(name, conform(name, kernel), _dispatch_key(device_type))
    return library


def register_device_kernel(
    name: str, device_type: str, kernel: Callable[..., torch.Tensor]
) -> None:
    """Register ``kernel`` as the implementation of op ``name`` on ``device_type``.

    For backends whose kernels are only importable at run time (Triton,
    torch_npu).  The kernel takes the schema arguments positionally and
    returns a contiguous tensor; the registered op gives it the rule's layout
    (``mindiesd.ops._layout``).
    """
    if name not in SCHEMAS:
        raise ValueError(f"mindiesd.ops: unknown operator {name!r}; known: {sorted(SCHEMAS)}")
    LIBRARY.impl(name, conform(name, kernel), _dispatch_key(device_type))
    DEVICE_KERNELS.setdefault(device_type, {})[name] = kernel


def register_device_kernels(device_type: str, kernels: dict[str, Callable[..., torch.Tensor]]) -> None:
    """Register every kernel of ``kernels`` for ``device_type``; ones already registered are left alone."""
    registered = DEVICE_KERNELS.get(device_type, {})
    for name, kernel in kernels.items():
        if registered.get(name) is not kernel:
            register_device_kernel(name, device_type, kernel)


# Registration runs once per process.  importlib.reload keeps the module
# globals, so the existing handle is reused.  If a second copy of this module
# is imported (sys.modules entry removed), the ops stay registered: the
# dispatcher keeps the first copy's fake kernels, hence its globals and its
# Library handle, alive; the copy then only gets a fragment for new kernels.
if "LIBRARY" not in globals():
    if _ops_defined():
        LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
    else:
        LIBRARY = _define_all()
