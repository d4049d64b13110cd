"""The fusion families: one declaration each, from which the config's switches, the pass order, the bench's
columns and the tests' family lists are derived.

A :class:`FusionFamily` names its switch (``enable_<name>`` in ``CompilationConfig.fusion_patterns``) and the
switch's doc, the op it emits (the op's declaration in :mod:`mindiesd.ops.defs`, whose kernels say per device
whether they beat eager) or none for a rewrite into aten ops (which then declares per device whether it gains),
its stage and its group. The pass classes live in :mod:`mindiesd.compilation.passes`.

Adding a family: its op module and kernels under ``mindiesd/ops/``, its pass
(``mindiesd/compilation/passes/<name>.py``, listed in ``passes/__init__.py``), and one :class:`FusionFamily`
below, in the position of its pass in the run order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ..ops import registry
from ..ops.defs import (ADALAYERNORM, CAT_LINEAR, CHANNEL_RMS_NORM, DEQUANT_LINEAR, FAST_GELU, GLU, GROUP_NORM_SILU, INT8_LINEAR,
                        LINEAR_GELU, MUL_ADD, NORM_ROPE, RMS_NORM, ROPE)

__all__ = ["Rewrite", "FusionFamily", "FAMILIES", "family", "forced", "skip_reason", "STAGES", "SPEC_FAMILIES",
           "GEMM_FAMILIES", "QUANTIZED_FAMILIES", "CONV_FAMILIES", "ATTENTION_FAMILIES", "OP_FAMILIES"]

#: When a family's pass runs: ``lower`` first, on the whole aten graph, whatever ``enable_freezing`` says (a
#: call that must not run as traced is replaced); ``freeze`` on the whole aten graph before it is split, so that
#: what the rewrite computes from weights alone (a concatenated weight) is folded with the rest (a ``freeze``
#: family needs ``enable_freezing``); ``fusion`` on the main graph after freezing (an op replaces an op sequence).
STAGES = ("lower", "freeze", "fusion")
GROUPS = ("elementwise", "gemm", "quantized", "convolutional", "attention")


@dataclass(frozen=True)
class Rewrite:
    """Whether a rewrite into aten ops beats the unrewritten graph on a device, and why (measured or not)."""

    fast: bool
    note: str = ""


@dataclass(frozen=True)
class FusionFamily:
    """One fusion family: a switch, the op it emits (or its per-device rewrite declarations), stage and group."""

    name: str
    doc: str
    #: The op the pass emits; None for a rewrite that emits aten ops only.
    op: Optional[registry.OpDef]
    stage: str = "fusion"
    #: ``elementwise`` (the ops that replace elementwise and row sequences: the specification's five families,
    #: norm_rope and glu), ``gemm`` (rewrites around the matrix products) or ``quantized`` (a quantized linear
    #: layer as one op) or ``convolutional`` (the norms and activations of convolutional networks: VAEs) or
    #: ``attention`` (attention calls lowered to a kernel).
    group: str = "elementwise"
    #: For a family without an op: device type -> whether the rewrite gains there.
    rewrites: Mapping[str, Rewrite] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"family {self.name!r}: stage must be one of {STAGES}, got {self.stage!r}")
        if self.group not in GROUPS:
            raise ValueError(f"family {self.name!r}: group must be one of {GROUPS}, got {self.group!r}")
        if self.op is not None and (self.op.name != self.name or self.rewrites):
            raise ValueError(f"family {self.name!r}: emits op {self.op.name!r}; only a rewrite declares rewrites")

    @property
    def switch(self) -> str:
        """Its setting in ``CompilationConfig.fusion_patterns``."""
        return f"enable_{self.name}"

    @property
    def has_op(self) -> bool:
        """Whether the family emits an op of its own (``torch.ops.mindiesd.<name>``)."""
        return self.op is not None

    @property
    def schema(self) -> str:
        """The schema of its op; empty for a rewrite."""
        return self.op.schema if self.op is not None else ""

    @property
    def declared(self) -> Mapping:
        """Device type -> what is declared there: the op's kernels (``registry.DeviceKernel``) or the rewrites."""
        return self.op.kernels if self.op is not None else self.rewrites


#: Family name -> declaration, in the order the passes run. The ``lower`` stage runs first, then the ``freeze`` stage (before the graph
#: is split into fold and main graphs), then the ``fusion`` stage in this order. Order matters where forms
#: overlap: int8_linear and dequant_linear run first, as their rescale ends in a multiply-add that mul_add would
#: otherwise take; RoPE and adaLN contain multiply-adds, so they run before mul_add, which would otherwise take their
#: sums apart; rms_norm runs first since its output feeds RoPE, and norm_rope after both, as it joins their ops
#: (and the concatenation between them) into one; group_norm_silu and channel_rms_norm run before glu, which
#: would otherwise take their SiLU as the gate of a product, and channel_rms_norm before mul_add, which would
#: otherwise take its weight and bias; glu runs before linear_gelu and fast_gelu, which
#: would otherwise take the gate's GELU out of its gated product; linear_gelu runs before fast_gelu, which would
#: otherwise take the GELU away from its matmul; cat_linear runs last, as it replaces a matmul and its input
#: concatenation that no other family reads.
FAMILIES: Dict[str, FusionFamily] = {
    f.name: f
    for f in (
        FusionFamily(
            name="flex_attention",
            doc="Lower torch's flex_attention, which outside Inductor runs an unfused reference that materialises "
                "every score: a call that changes nothing about plain attention (diffusers' flex backend without a "
                "mask) becomes scaled_dot_product_attention; any other call is compiled by Inductor's flex lowering, "
                "the rest of the graph staying mindiesd's.",
            op=None,
            stage="lower",
            group="attention",
            # measured with ``bench model --model flux --attention flex`` (docs/compatibility.md)
            rewrites={
                "cpu": Rewrite(True, "faster than flex's unfused reference on the CPUs measured "
                                     "(2-core AMD EPYC, AVX2, fp32)"),
                "cuda": Rewrite(True, "the attention kernels against flex's unfused reference, which materialises "
                                      "every score (not measured on a GPU yet)"),
                "npu": Rewrite(True, "scaled_dot_product_attention against flex's unfused reference; a call that "
                                     "needs Inductor stays as it is (not measured on an NPU yet)"),
            },
        ),
        FusionFamily(
            name="upsample_nearest",
            doc="Give nearest-neighbour upsampling (F.interpolate mode nearest or nearest-exact: every VAE decoder), "
                "which aot decomposes into a gather and a copy into channels-last, back its aten kernel.",
            op=None,
            stage="lower",
            group="convolutional",
            # measured with ``bench vae --vae kl`` (docs/benchmarks.md "VAE decode")
            rewrites={
                "cpu": Rewrite(True, "faster than the gather and the copy after it on the CPUs measured "
                                     "(2-core AMD EPYC, AVX2, fp32)"),
                "cuda": Rewrite(False, "not measured on a GPU yet"),
                "npu": Rewrite(False, "not measured on an NPU yet"),
            },
        ),
        FusionFamily(
            name="conv_channels_last",
            doc="Run float32 2-D and 3-D CPU convolutions (bfloat16 too where the CPU has native bfloat16: "
                "AVX-512 BF16, AMX) on oneDNN over channels-last operands (the weights' copy "
                "folded at freeze time), where aten picks its reference kernels for small batches and sizes (the "
                "causal 3-D convolutions of Wan's VAE) and reorders NCHW operands on every call; the activations "
                "stay channels-last between convolutions and the graph's outputs keep their traced layout.",
            op=None,
            stage="lower",
            group="convolutional",
            # measured with ``bench vae`` (docs/benchmarks.md "VAE decode")
            rewrites={
                "cpu": Rewrite(True, "faster than aten's choice of kernel and layout on the CPUs measured (2-core "
                                     "AMD EPYC with AVX-512 BF16, and limited to AVX2; fp32 and bf16: "
                                     "AutoencoderKL and AutoencoderKLWan decodes)"),
                "cuda": Rewrite(False, "CPU only: oneDNN's kernels"),
                "npu": Rewrite(False, "CPU only: oneDNN's kernels"),
            },
        ),
        FusionFamily(
            name="merge_projections",
            doc="Merge sibling linear layers that read the same input (Q/K/V, context K/V, Flux single blocks' "
                "MLP input beside Q/K/V) into one matmul over the concatenated weight, folded at freeze time "
                "(needs enable_freezing).",
            op=None,
            stage="freeze",
            group="gemm",
            # Measured with ``bench --model flux --size mid --vs inductor --force F --ablate``, each switch off in
            # turn (docs/fusion-families.md "GEMM rewrites"); off where no gain was measured, and where nothing was measured yet.
            rewrites={
                "cpu": Rewrite(False, "not faster than separate GEMMs on the CPUs measured "
                                      "(2-core AMD EPYC, fp32: within noise)"),
                "cuda": Rewrite(False, "not measured on a GPU yet (bench/gpu_check.sh measures it)"),
                "npu": Rewrite(False, "not measured on an NPU yet"),
            },
        ),
        FusionFamily(
            name="int8_linear",
            doc="Fuse a linear layer of torchao's int8 dynamic quantization (Int8DynamicActivationInt8WeightConfig): "
                "the per-row quantization of its input, the int8 GEMM and the rescale (and bias) after it, "
                "bit-exact with the unfused ops.",
            op=INT8_LINEAR,
            group="quantized",
        ),
        FusionFamily(
            name="dequant_linear",
            doc="Fuse a linear layer of torchao's weight-only quantization (Int8WeightOnlyConfig, "
                "Float8WeightOnlyConfig): the weight's dequantization, the GEMM and the scale and bias after it, "
                "with the unfused ops' roundings and no per-call copy of the weight.",
            op=DEQUANT_LINEAR,
            group="quantized",
        ),
        FusionFamily(
            name="rms_norm",
            doc="Fuse RMSNorm (torch.nn.RMSNorm, F.rms_norm, diffusers RMSNorm).",
            op=RMS_NORM,
        ),
        FusionFamily(
            name="rope",
            doc="Fuse rotary position embeddings (interleaved, half-rotated, Wan's strided, complex, 2x2 matrix).",
            op=ROPE,
        ),
        FusionFamily(
            name="norm_rope",
            doc="Fuse a query/key RMSNorm with the RoPE after it, through joint attention's concatenation of the "
                "text and image streams: one op writes each stream's normalised, rotated rows into its slice of "
                "the tensor attention reads (needs enable_rms_norm and enable_rope, whose ops it joins).",
            op=NORM_ROPE,
        ),
        FusionFamily(
            name="adalayernorm",
            doc="Fuse adaLN modulation: layer_norm(x) * (1 + scale) + shift.",
            op=ADALAYERNORM,
        ),
        FusionFamily(
            name="group_norm_silu",
            doc="Fuse a group norm and the SiLU after it (the ResNet blocks of AutoencoderKL and the other "
                "convolutional VAEs), over a contiguous [N, C, *] input: NCHW, NCDHW.",
            op=GROUP_NORM_SILU,
            group="convolutional",
        ),
        FusionFamily(
            name="channel_rms_norm",
            doc="Fuse the channel-wise RMS norm of Wan's and Qwen-Image's VAEs, F.normalize(x, dim=1) * scale * "
                "gamma + bias, with the SiLU after it where there is one (contiguous or channels-last x).",
            op=CHANNEL_RMS_NORM,
            group="convolutional",
        ),
        FusionFamily(
            name="glu",
            doc="Fuse gated activations act(gate) * value (SiLU, GELU or tanh-GELU): SwiGLU/GEGLU halves of one "
                "projection, or two projections as in LLaMA-style feed-forwards.",
            op=GLU,
        ),
        FusionFamily(
            name="linear_gelu",
            doc="Fuse a linear layer followed by tanh-GELU into one matmul with a GELU epilogue.",
            op=LINEAR_GELU,
            group="gemm",
        ),
        FusionFamily(
            name="fast_gelu",
            doc="Fuse tanh-approximated GELU (aten.gelu or the explicit formula).",
            op=FAST_GELU,
        ),
        FusionFamily(
            name="mul_add",
            doc="Fuse x * y + z (incl. the residual gate x + gate * y).",
            op=MUL_ADD,
        ),
        FusionFamily(
            name="cat_linear",
            doc="Fuse a linear layer over a concatenation along the last dimension (Flux's single blocks' "
                "proj_out(cat([attn, mlp]))) into GEMMs over each input and its block of weight columns, "
                "accumulated into one output without the concatenation.",
            op=CAT_LINEAR,
            group="gemm",
        ),
    )
}


#: The elementwise families (the specification's ``fusion_patterns.enable_*``, norm_rope and glu), in run order.
SPEC_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.group == "elementwise")
#: The rewrites around matrix products, in run order.
GEMM_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.group == "gemm")
#: The quantized linear layers, in run order.
QUANTIZED_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.group == "quantized")
#: The attention calls lowered to a kernel, in run order.
ATTENTION_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.group == "attention")
#: The norms and activations of convolutional networks (VAEs), in run order.
CONV_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.group == "convolutional")
#: The families that emit an op of their own (``torch.ops.mindiesd.<name>``), in run order.
OP_FAMILIES: Tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.has_op)


def family(name: str) -> FusionFamily:
    """The declaration of family ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown fusion family {name!r}; known: {list(FAMILIES)}") from None


def check_known(names: Collection[str]) -> frozenset:
    """``names`` as a set of family names; ValueError naming the unknown ones and the known."""
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown fusion families {unknown}; known: {list(FAMILIES)}")
    return frozenset(names)


def forced(names: Collection[str], device_type: str) -> frozenset:
    """``names`` as the families a run forces on ``device_type`` (``MindieSDBackend(force_fast=...)``);
    ValueError for an unknown family or one that declares no kernel or rewrite there."""
    for name in names:
        declared = family(name).declared
        if device_type not in declared:
            raise ValueError(f"family {name!r} declares no kernel for {device_type!r} (declared: {sorted(declared)})")
    return frozenset(names)


def skip_reason(name: str, device_type: Optional[str], force: Collection[str] = ()) -> Optional[str]:
    """Why family ``name`` is not fused for a graph on ``device_type``, or None when it is.

    A fused op must not make the model slower: it needs a registered kernel on the device that is faster than
    eager's sequence (the declared kernel when declared fast, or any kernel a user registered there). The
    families in ``force`` count as faster than eager wherever they declare a kernel or rewrite (``bench
    --force``, to measure one where it is off by default).
    """
    check_known(force)
    declared_family = family(name)
    if device_type is None or device_type == "meta":
        return None
    is_forced = name in force
    declared = declared_family.declared.get(device_type)
    if declared_family.op is None:
        if declared is None:
            return f"no {name} rewrite declared for {device_type}"
        return None if declared.fast or is_forced else f"on {device_type}, {declared.note or 'not faster than eager'}"
    registered = registry.DEVICE_KERNELS.get(device_type, {}).get(name)
    if registered is None:
        if declared is None:
            return f"no {name} kernel for {device_type} (the reference composition is not faster than eager)"
        return f"the {device_type} kernel ({declared.note or 'declared'}) is not registered: its runtime is missing"
    if declared is not None and not declared.fast and not is_forced and declared.declares(registered):
        return f"the {device_type} kernel is {declared.note or 'not faster than eager'}"
    return None
