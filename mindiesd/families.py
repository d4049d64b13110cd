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

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Tuple

__all__ = ["Kernel", "FusionFamily", "FAMILIES", "family", "resolve", "device_kernels", "native_kernels", "fast_on",
           "LAYOUTS", "STAGES", "SPEC_FAMILIES", "GEMM_FAMILIES", "OP_FAMILIES", "set_fast", "declared_fast"]

#: The output layout rules (``mindiesd.ops._layout``): ``like_x`` follows ``torch.empty_like(x)``; ``contiguous``
#: is dense row-major; ``broadcast`` is the layout eager's ``x * y + z`` gives over the broadcast operands (or
#: ``z + x * y``'s when the op's argument 3, ``addend_first``, is set); ``gemm`` is the dense row-major
#: ``x.shape[:-1] + (weight.shape[0],)`` of a linear layer (argument 1 is the weight).
LAYOUTS = ("like_x", "contiguous", "broadcast", "gemm")
#: When a family's pass runs: ``fusion`` on the main graph after freezing (an op replaces an op sequence);
#: ``freeze`` on the whole aten graph before it is split, so that what the rewrite computes from weights alone
#: (a concatenated weight) is folded with the rest. A ``freeze`` family needs ``enable_freezing``.
STAGES = ("freeze", "fusion")


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
    #: The op's schema; empty for a rewrite that emits aten ops only (its kernels name the aten op it emits).
    schema: str
    fusion_pass: str
    layout: str = ""
    stage: str = "fusion"
    #: ``elementwise`` (the specification's five families) or ``gemm`` (rewrites around the matrix products).
    group: str = "elementwise"
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
        if self.schema and self.layout not in LAYOUTS:
            raise ValueError(f"family {self.name!r}: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.stage not in STAGES:
            raise ValueError(f"family {self.name!r}: stage must be one of {STAGES}, got {self.stage!r}")

    @property
    def switch(self) -> str:
        """Its setting in ``CompilationConfig.fusion_patterns``."""
        return f"enable_{self.name}"

    @property
    def op_name(self) -> str:
        return self.name

    @property
    def has_op(self) -> bool:
        """Whether the family emits an op of its own (``torch.ops.mindiesd.<name>``)."""
        return bool(self.schema)


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

#: The GEMM rewrites, per device: whether they beat the unrewritten graph there (measured with ``bench --model
#: flux --size mid --vs inductor --force F --ablate``, each switch off in turn; README "GEMM rewrites"). Off
#: where no gain was measured, and where nothing was measured yet: ``set_fast`` turns one on for a process.
_MERGE_KERNELS = {
    "cpu": Kernel("torch:addmm", fast=False,
                  note="not faster than separate GEMMs on the CPUs measured (2-core AMD EPYC, fp32: within noise)"),
    "cuda": Kernel("torch:addmm", fast=False, note="not measured on a GPU yet (bench/gpu_check.sh measures it)"),
    "npu": Kernel("torch:addmm", fast=False, note="not measured on an NPU yet"),
}
_LINEAR_GELU_KERNELS = {
    "cpu": Kernel("mindiesd.ops._gemm:linear_gelu_cpu", fast=False,
                  note="oneDNN's tanh-GELU post-op, slower than the GEMM + the fast_gelu kernel here (measured)"),
    "cuda": Kernel("mindiesd.ops._gemm:linear_gelu_cuda", fast=False,
                   note="cuBLASLt's GELU epilogue (torch._addmm_activation), not measured on a GPU yet "
                        "(bench/gpu_check.sh measures it)"),
}

#: Family name -> declaration, in the order the passes run. The ``freeze`` stage runs first (before the graph
#: is split into fold and main graphs), then the ``fusion`` stage in this order. Order matters where forms
#: overlap: RoPE and adaLN contain multiply-adds, so they run before mul_add, which would otherwise take their
#: sums apart; rms_norm runs first since its output feeds RoPE; linear_gelu runs before fast_gelu, which
#: would otherwise take the GELU away from its matmul.
FAMILIES: Dict[str, FusionFamily] = {
    f.name: f
    for f in (
        FusionFamily(
            name="merge_projections",
            doc="Merge sibling linear layers that read the same input (Q/K/V, context K/V, Flux single blocks' "
                "MLP input beside Q/K/V) into one matmul over the concatenated weight, folded at freeze time "
                "(needs enable_freezing).",
            schema="",
            fusion_pass=f"{_P}.merge_projections:MergeProjectionsPass",
            stage="freeze",
            group="gemm",
            kernels=_MERGE_KERNELS,
        ),
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
            name="linear_gelu",
            doc="Fuse a linear layer followed by tanh-GELU into one matmul with a GELU epilogue.",
            schema="linear_gelu(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
            fusion_pass=f"{_P}.linear_gelu:LinearGeluPass",
            layout="gemm",
            group="gemm",
            rows=False,
            kernels=_LINEAR_GELU_KERNELS,
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


#: The specification's families (``fusion_patterns.enable_*`` of the spec), in run order.
SPEC_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.group == "elementwise")
#: The rewrites around matrix products, in run order.
GEMM_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.group == "gemm")
#: The families that emit an op of their own (``torch.ops.mindiesd.<name>``), in run order.
OP_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.has_op)


def family(name: str) -> FusionFamily:
    """The declaration of family ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown fusion family {name!r}; known: {list(FAMILIES)}") from None


def device_kernels(device_type: str) -> Dict[str, Any]:
    """Op name -> the declared kernel callable of every family that has one on ``device_type``."""
    return {name: resolve(f.kernels[device_type].target) for name, f in FAMILIES.items()
            if f.has_op and device_type in f.kernels}


def native_kernels(device_type: str) -> Dict[str, Any]:
    """Op name -> the compiled kernel of every family that declares one on ``device_type``."""
    return {name: resolve(f.kernels[device_type].native) for name, f in FAMILIES.items()
            if f.has_op and device_type in f.kernels and f.kernels[device_type].native}


def fast_on(name: str, device_type: str) -> bool:
    """Whether family ``name`` declares a kernel on ``device_type`` that beats eager's op sequence there."""
    kernel = family(name).kernels.get(device_type)
    return kernel is not None and kernel.fast


def set_fast(name: str, device_type: str, fast: bool = True) -> bool:
    """Declare whether family ``name`` beats eager on ``device_type`` (overriding the measured declaration, e.g. to
    measure a rewrite where it is off by default: ``bench --force``); returns the previous declaration. Backends
    created afterwards follow it. A family with no kernel declared on the device gets none: ValueError."""
    declared = family(name)
    kernel = declared.kernels.get(device_type)
    if kernel is None:
        raise ValueError(f"family {name!r} declares no kernel for {device_type!r} (declared: {sorted(declared.kernels)})")
    FAMILIES[name] = dataclasses.replace(
        declared, kernels={**declared.kernels, device_type: dataclasses.replace(kernel, fast=fast)})
    return kernel.fast


@contextlib.contextmanager
def declared_fast(name: str, device_type: str, fast: bool = True):
    """:func:`set_fast` for the duration of a ``with`` block."""
    previous = set_fast(name, device_type, fast)
    try:
        yield
    finally:
        set_fast(name, device_type, previous)
