"""The fusion families: one declaration each, from which the rest of mindiesd is derived.

A :class:`FusionFamily` names everything a family is made of: its switch (``enable_<name>`` in
``CompilationConfig.fusion_patterns``) and the switch's doc, the op schema, the reference implementation (the
definition of correct), the fake kernel (shape, dtype, layout), the layout rule of its output, the fusion pass,
and per device type the kernel with a flag saying whether it beats eager's op sequence there. From
:data:`FAMILIES` come the config's switches, the pass order, the ``torch.library`` registration, the per-device
kernels, the bench's columns and the tests' family lists.

Callables are named as ``"module:attribute"`` and imported on first use, so this module imports nothing heavy
and a device runtime (Triton, torch_npu) is only imported where it exists.

Adding a family: write its pass (``mindiesd/compilation/passes/<name>.py``), its reference and fake (and
kernels, optional: without a fast kernel on a device the family is skipped there), and add one
:class:`FusionFamily` below, in the position of its pass in the run order.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Tuple

__all__ = ["Kernel", "FusionFamily", "FAMILIES", "family", "resolve", "device_kernels", "native_kernels", "fast_on", "LAYOUTS"]

#: The output layout rules (``mindiesd.ops._layout``): ``like_x`` follows ``torch.empty_like(x)``; ``contiguous``
#: is dense row-major; ``broadcast`` is the layout eager's ``x * y + z`` gives over the broadcast operands (or
#: ``z + x * y``'s when the op's argument 3, ``addend_first``, is set).
LAYOUTS = ("like_x", "contiguous", "broadcast")


def resolve(target: str) -> Any:
    """The object a ``"module:attribute"`` string names (imported on first use)."""
    module, _, attribute = target.partition(":")
    value: Any = importlib.import_module(module)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


@dataclass(frozen=True)
class Kernel:
    """A device kernel of a family's op.

    ``target`` names a callable taking the op's schema arguments (without layout flags) and returning a
    contiguous tensor; the registered op gives it the family's layout. ``fast`` says whether it runs faster than
    eager's op sequence on that device; a family whose kernel is not fast (or not registered) on the compiled
    graph's device is left unfused there, and the compile report says why.
    """

    target: str
    fast: bool = True
    note: str = ""
    #: A compiled kernel (C++ on CPU) registered in place of ``target`` when it is enabled; it falls back to
    #: ``target`` itself for the inputs it does not cover.
    native: str = ""


@dataclass(frozen=True)
class FusionFamily:
    """One fusion family: a switch, an op, its implementations, and the pass that emits it."""

    name: str
    doc: str
    schema: str
    fusion_pass: str
    layout: str
    #: The reference (definition of correct) and the fake (tracing); by default ``reference.<name>`` and
    #: ``_library._fake_<name>`` in mindiesd.ops.
    reference: str = ""
    fake: str = ""
    #: Positional arguments that broadcast against x and move with it when the layout adapter permutes x.
    table_args: Tuple[int, ...] = ()
    #: Positional arguments the device kernels do not take (layout flags the adapter applies itself).
    kernel_arity: int = -1
    #: True when the op normalises or rotates along the last dimension (which must stay innermost).
    rows: bool = True
    kernels: Mapping[str, Kernel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.reference:
            object.__setattr__(self, "reference", f"mindiesd.ops.reference:{self.name}")
        if not self.fake:
            object.__setattr__(self, "fake", f"mindiesd.ops._library:_fake_{self.name}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"family {self.name!r}: layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def switch(self) -> str:
        """Its setting in ``CompilationConfig.fusion_patterns``."""
        return f"enable_{self.name}"

    @property
    def op_name(self) -> str:
        return self.name


def _cpu(name: str) -> Kernel:
    # The C++ kernel of the same name in mindiesd.ops._cpp_kernels replaces it when C++ kernels are enabled.
    return Kernel(f"mindiesd.ops._cpu:{name}", native=f"mindiesd.ops._cpp_kernels:{name}",
                  note="C++ kernel, or an aten composition")


def _cuda(name: str) -> Kernel:
    return Kernel(f"mindiesd.ops._triton:{name}", note="Triton")


def _kernels(name: str, npu_note: str, npu_fast: bool = True) -> Dict[str, Kernel]:
    """The kernels of op ``name`` on CPU (C++ or compositions), CUDA (Triton) and Ascend (torch_npu mapping)."""
    return {"cpu": _cpu(name), "cuda": _cuda(name),
            "npu": Kernel(f"mindiesd.ops._npu:{name}", fast=npu_fast, note=npu_note)}


_P = "mindiesd.compilation.passes"

#: Family name -> declaration, in the order the passes run. Order matters where forms overlap: RoPE and adaLN
#: contain multiply-adds, so they run before mul_add, which would otherwise take their sums apart; rms_norm
#: runs first since its output feeds RoPE.
FAMILIES: Dict[str, FusionFamily] = {
    f.name: f
    for f in (
        FusionFamily(
            name="rms_norm",
            doc="Fuse RMSNorm (torch.nn.RMSNorm, F.rms_norm, diffusers RMSNorm).",
            schema="rms_norm(Tensor x, Tensor? weight, float eps, ScalarType? out_dtype=None) -> Tensor",
            fusion_pass=f"{_P}.rms_norm:RMSNormPass",
            layout="like_x",
            table_args=(1,),
            kernels=_kernels("rms_norm", npu_note="npu_rms_norm where it computes the same function"),
        ),
        FusionFamily(
            name="rope",
            doc="Fuse rotary position embeddings (interleaved, half-rotated, Wan's strided, complex, 2x2 matrix).",
            schema="rope(Tensor x, Tensor cos, Tensor sin, bool interleaved, ScalarType? out_dtype=None) -> Tensor",
            fusion_pass=f"{_P}.rope:RoPEPass",
            layout="like_x",
            table_args=(1, 2),
            kernels=_kernels("rope", npu_note="npu_rotary_mul where it computes the same function"),
        ),
        FusionFamily(
            name="adalayernorm",
            doc="Fuse adaLN modulation: layer_norm(x) * (1 + scale) + shift.",
            schema="adalayernorm(Tensor x, Tensor scale, Tensor shift, float eps, ScalarType? out_dtype=None) -> Tensor",
            fusion_pass=f"{_P}.adalayernorm:AdaLayerNormPass",
            layout="contiguous",
            table_args=(1, 2),
            kernels=_kernels("adalayernorm", npu_note="no torch_npu kernel: the fp32 reference composition", npu_fast=False),
        ),
        FusionFamily(
            name="fast_gelu",
            doc="Fuse tanh-approximated GELU (aten.gelu or the explicit formula).",
            schema="fast_gelu(Tensor x) -> Tensor",
            fusion_pass=f"{_P}.fast_gelu:FastGeluPass",
            layout="like_x",
            kernels=_kernels("fast_gelu", npu_note="npu_fast_gelu is another function: the reference composition", npu_fast=False),
        ),
        FusionFamily(
            name="mul_add",
            doc="Fuse x * y + z (incl. the residual gate x + gate * y).",
            schema="mul_add(Tensor x, Tensor y, Tensor z, bool addend_first=False) -> Tensor",
            fusion_pass=f"{_P}.mul_add:MulAddPass",
            layout="broadcast",
            table_args=(0, 1, 2),
            kernel_arity=3,
            rows=False,
            kernels=_kernels("mul_add", npu_note="no torch_npu kernel: the fp32 reference composition", npu_fast=False),
        ),
    )
}


def family(name: str) -> FusionFamily:
    """The declaration of family ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown fusion family {name!r}; known: {list(FAMILIES)}") from None


def device_kernels(device_type: str) -> Dict[str, Any]:
    """Op name -> the declared kernel callable of every family that has one on ``device_type``."""
    return {name: resolve(f.kernels[device_type].target) for name, f in FAMILIES.items() if device_type in f.kernels}


def native_kernels(device_type: str) -> Dict[str, Any]:
    """Op name -> the compiled kernel of every family that declares one on ``device_type``."""
    return {name: resolve(f.kernels[device_type].native) for name, f in FAMILIES.items()
            if device_type in f.kernels and f.kernels[device_type].native}


def fast_on(name: str, device_type: str) -> bool:
    """Whether family ``name`` declares a kernel on ``device_type`` that beats eager's op sequence there."""
    kernel = family(name).kernels.get(device_type)
    return kernel is not None and kernel.fast
