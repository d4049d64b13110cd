"""Tests of the single-pass C++ CPU kernels (mindiesd/ops/_cpp), their build (kernels/cpp_build.py) and their fallback.

The kernels are the package build's prebuilt ones where it made them; otherwise the first test that needs them
builds them (a few minutes, once per machine: later runs load the cached build). The prebuilt modules, their
manifest and setup.py have tests of their own in test_cpp_prebuilt.py.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import mindiesd.ops as ops
from mindiesd.ops import registry, reference
from mindiesd.ops.kernels import cpp_build as _cpp_build, cpp as _cpp_kernels, cpu as _cpu
from mindiesd.ops.defs.adalayernorm import adalayernorm_rules
from mindiesd.ops.defs.rms_norm import rms_norm_rules
from mindiesd.ops.defs.rope import rope_rules
from op_checks import DTYPES, assert_matches, randn  # noqa: E402

OPS = torch.ops.mindiesd
WIDTHS = [40, 96, 1000]
OP_NAMES = ["rms_norm", "rope", "adalayernorm", "glu", "fast_gelu", "mul_add", "linear_gelu", "cat_linear",
            "int8_linear", "dequant_linear"]

#: Why this process runs without the C++ kernels by request (``MINDIESD_CPP_KERNELS=0``), or None.
DISABLED_REASON = (
    None
    if _cpp_kernels.enabled()
    else f"C++ kernels are disabled by {_cpp_kernels.ENABLE_ENV}={os.environ.get(_cpp_kernels.ENABLE_ENV)}"
)
requires_enabled = pytest.mark.skipif(DISABLED_REASON is not None, reason=DISABLED_REASON or "")


@pytest.fixture(scope="module")
def cpp():
    """The built C++ kernel module (built here on first use)."""
    if DISABLED_REASON is not None:
        pytest.skip(DISABLED_REASON)
    if not ops.build_cpu_kernels():
        pytest.skip(f"C++ CPU kernels unavailable: {_cpp_kernels.cpu_kernel_implementation()}")
    return _cpp_kernels.extension()


@pytest.fixture
def restore_loader():
    """Forget a simulated loader state afterwards, so later tests load the real build."""
    yield
    _cpp_build._reset()




def direct(cpp, name, *args):
    """Call the C++ entry point as the wrapper does (with the resolved output dtype)."""
    if name == "rms_norm":
        x, weight, eps, *rest = args
        out_dtype, _ = rms_norm_rules(x, weight, rest[0] if rest else None)
        return cpp.rms_norm(x, weight, eps, out_dtype)
    if name == "adalayernorm":
        x, scale, shift, eps, *rest = args
        out_dtype, _ = adalayernorm_rules(x, scale, shift, rest[0] if rest else None)
        return cpp.adalayernorm(x, scale, shift, eps, out_dtype)
    if name == "rope":
        x, cos, sin, interleaved, *rest = args
        out_dtype, _ = rope_rules(x, cos, sin, rest[0] if rest else None)
        return cpp.rope(x, cos, sin, interleaved, out_dtype)
    return getattr(cpp, name)(*args)


def check(cpp, name, args, dtype, *, covered=True):
    """The C++ kernel (direct and dispatched) agrees with the reference."""
    ref = getattr(reference, name)(*args)
    out = getattr(OPS, name).default(*args)
    # the registered op has the layout rule's strides (the reference's); the raw kernel writes contiguous
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.stride() == ref.stride()
    assert_matches(out, ref, dtype)
    raw = direct(cpp, name, *args)
    if not covered:
        assert raw is None
        return out
    assert raw is not None, f"{name}: the C++ kernel did not cover this form"
    assert raw.dtype == ref.dtype and raw.shape == ref.shape and raw.is_contiguous()
    assert_matches(raw, ref, dtype)
    return raw


def leading_shape(rank):
    return {2: (6,), 3: (2, 5), 4: (2, 3, 5)}[rank]


# ----------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------


@requires_enabled
@pytest.mark.parametrize("name", OP_NAMES)
def test_cpp_wrappers_are_the_cpu_kernels(name):
    assert registry.DEVICE_KERNELS["cpu"][name] is _cpp_kernels.KERNELS[name]


@pytest.mark.parametrize("name", OP_NAMES)
def test_cpp_wrappers_keep_the_composition_signature(name):
    wrapper = getattr(_cpp_kernels, name)
    assert inspect.isfunction(wrapper) and wrapper.__name__ == name
    assert inspect.signature(wrapper) == inspect.signature(_cpu.KERNELS[name])


def test_cpp_wrappers_take_keywords_and_defaults():
    x, weight = randn(3, 40), randn(40, seed=1)
    expected = reference.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(_cpp_kernels.rms_norm(x, weight, 1e-6), expected)
    torch.testing.assert_close(_cpp_kernels.rms_norm(x, weight, eps=1e-6, out_dtype=None), expected)
    out = _cpp_kernels.rms_norm(x, weight, 1e-6, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    cos, sin = randn(40, seed=2), randn(40, seed=3)
    torch.testing.assert_close(_cpp_kernels.rope(x, cos, sin, interleaved=True), reference.rope(x, cos, sin, True))
    with pytest.raises(TypeError):
        _cpp_kernels.fast_gelu(x, x)


def test_kernels_report_their_capability(cpp):
    implementation = _cpp_kernels.cpu_kernel_implementation()
    assert implementation.startswith(("C++ prebuilt (", "C++ JIT-built ("))
    assert implementation.startswith(f"C++ {_cpp_build._origin(cpp)} ({cpp.capability()}, {cpp.vector_lanes} float")
    assert cpp.capability().split("+")[0] in ("AVX512", "AVX2", "DEFAULT")


# ----------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_rms_norm(cpp, dtype, width, rank):
    x = randn(*leading_shape(rank), width, dtype=dtype)
    check(cpp, "rms_norm", (x, None, 1e-6), dtype)
    check(cpp, "rms_norm", (x, randn(width, dtype=dtype, seed=1), 1e-6), dtype)
    check(cpp, "rms_norm", (x, randn(width, seed=1), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_inputs(cpp, dtype):
    big = randn(2, 6, 104, dtype=dtype)
    weight = randn(96, dtype=dtype, seed=1)
    check(cpp, "rms_norm", (big[..., :96], weight, 1e-6), dtype)  # strided rows
    check(cpp, "rms_norm", (big[..., :96].transpose(0, 1), weight, 1e-6), dtype)
    check(cpp, "rms_norm", (big[..., ::2][..., :40], weight[:40], 1e-6), dtype)  # strided last dim
    check(cpp, "rms_norm", (big[..., :96], randn(192, dtype=dtype)[::2], 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_weight_broadcasts_and_out_dtype(cpp, dtype):
    x = randn(2, 7, 40, dtype=dtype)
    check(cpp, "rms_norm", (x, randn(1, 1, 40, seed=1), 1e-6), dtype)
    check(cpp, "rms_norm", (x, randn(7, 40, dtype=dtype, seed=1), 1e-6), dtype)
    check(cpp, "rms_norm", (x, torch.tensor(1.5, dtype=dtype), 1e-6), dtype)
    check(cpp, "rms_norm", (x, randn(40, seed=1), 1e-6, torch.bfloat16), torch.bfloat16)
    check(cpp, "rms_norm", (x, None, 1e-6, torch.float32), dtype)


def test_rms_norm_float64_falls_back(cpp):
    x = randn(3, 40, dtype=torch.float64)
    check(cpp, "rms_norm", (x, None, 1e-6), torch.float64, covered=False)


# ----------------------------------------------------------------------------
# adalayernorm
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(
    "x_shape, mod_shape",
    [
        ((2, 7), (2, 1)),  # [B, 1, D]
        ((2, 7), ()),  # [D]
        ((2, 7), (2, 7)),  # [B, S, D]
        ((2, 3, 7), (2, 1, 1)),  # [B, 1, 1, D]
        ((2, 3, 7), (3, 1)),
        ((9,), (9,)),
    ],
)
def test_adalayernorm(cpp, dtype, width, x_shape, mod_shape):
    x = randn(*x_shape, width, dtype=dtype)
    scale = randn(*mod_shape, width, dtype=dtype, seed=1)
    shift = randn(*mod_shape, width, dtype=dtype, seed=2)
    check(cpp, "adalayernorm", (x, scale, shift, 1e-6), dtype)
    check(cpp, "adalayernorm", (x, scale.float(), shift.float(), 1e-5), dtype)
    check(cpp, "adalayernorm", (x, scale.float(), shift.float(), 1e-6, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adalayernorm_strided_modulation_and_input(cpp, dtype):
    # DiT blocks chunk one [B, 1, 6D] embedding into shift/scale/gate views.
    emb = randn(2, 1, 6 * 96, dtype=dtype, seed=3)
    shift, scale = emb.chunk(6, dim=-1)[:2]
    big = randn(2, 7, 100, dtype=dtype)
    check(cpp, "adalayernorm", (big[..., :96], scale, shift, 1e-6), dtype)
    transposed = randn(7, 2, 100, dtype=dtype)[..., :96].transpose(0, 1)
    check(cpp, "adalayernorm", (transposed, scale, shift, 1e-6), dtype)
    strided = big[..., ::2][..., :40]  # strided last dim
    check(cpp, "adalayernorm", (strided, scale[..., :40], shift[..., :40], 1e-6), dtype)
    check(cpp, "adalayernorm", (big[..., :96], emb[..., 0:192:2], shift, 1e-6), dtype)


def test_adalayernorm_large_mean_is_accurate(cpp):
    """Rows far from zero mean: as accurate as the float32 reference."""
    x = (randn(4, 1000, dtype=torch.float64) * 0.1 + 300.0).float()
    scale, shift = randn(1000, seed=1), randn(1000, seed=2)
    exact = reference.adalayernorm(x.double(), scale.double(), shift.double(), 1e-6)
    kernel_error = (direct(cpp, "adalayernorm", x, scale, shift, 1e-6) - exact).abs().max()
    reference_error = (reference.adalayernorm(x, scale, shift, 1e-6) - exact).abs().max()
    assert kernel_error <= 1.5 * reference_error + 1e-6


# ----------------------------------------------------------------------------
# rope
# ----------------------------------------------------------------------------


def flux_rope(x, cos, sin):
    """diffusers' Flux apply_rotary_emb (interleaved, full-width tables)."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_table_forms(cpp, dtype, width, interleaved):
    x = randn(2, 6, 3, width, dtype=dtype)  # [B, S, H, D]
    half = width // 2
    forms = {
        "full [1,S,1,D]": (randn(1, 6, 1, width, seed=1), randn(1, 6, 1, width, seed=2)),
        "pair [1,S,1,D/2]": (randn(1, 6, 1, half, seed=1), randn(1, 6, 1, half, seed=2)),
        "bf16 pair": (randn(6, 1, half, seed=1).bfloat16(), randn(6, 1, half, seed=2).bfloat16()),
        "one value": (randn(6, 3, 1, seed=1), randn(6, 3, 1, seed=2)),
        "full + pair": (randn(6, 1, width, seed=1), randn(6, 1, half, seed=2)),
    }
    for cos, sin in forms.values():
        check(cpp, "rope", (x, cos, sin, interleaved), dtype)
        check(cpp, "rope", (x, cos, sin, interleaved, dtype), dtype)
    # [S, D] tables with x in [B, H, S, D].
    x_bhsd = randn(2, 3, 6, width, dtype=dtype)
    tables = randn(6, width, seed=1), randn(6, width, seed=2)
    check(cpp, "rope", (x_bhsd, *tables, interleaved), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_strided_tables_and_inputs(cpp, dtype, interleaved):
    freqs = randn(1, 6, 1, 96, seed=1)
    cos, sin = freqs[..., 0::2], freqs[..., 1::2]  # per pair, last-dim stride 2
    x = randn(2, 6, 3, 96, dtype=dtype)
    check(cpp, "rope", (x, cos, sin, interleaved), dtype)
    wide = randn(6, 192, seed=2)  # full width with strided rows
    check(cpp, "rope", (x, wide[:, None, :96], wide[:, None, 96:], interleaved), dtype)
    check(cpp, "rope", (x.transpose(1, 2), randn(6, 96), randn(6, 96, seed=3), interleaved), dtype)
    big = randn(2, 6, 3, 200, dtype=dtype)
    check(cpp, "rope", (big[..., :96], cos, sin, interleaved), dtype)  # strided rows
    check(cpp, "rope", (big[..., ::2][..., :96], cos, sin, interleaved), dtype)  # strided last dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_reads_float64_tables_for_a_float32_or_16_bit_output(cpp, dtype):
    """Lumina2's complex128 freqs_cis as real pairs (float64, last-dim stride 2); eager's product is complex128,
    cast back to x's dtype. A float64 output stays with the composition."""
    x = randn(2, 24, 4, 32, dtype=dtype)
    pairs = torch.view_as_real(torch.polar(torch.ones(2, 24, 1, 16, dtype=torch.float64),
                                           randn(2, 24, 1, 16, seed=1).double() * 10))
    cos, sin = pairs[..., 0], pairs[..., 1]
    out = check(cpp, "rope", (x, cos, sin, True, dtype), dtype)
    eager = torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (16, 2))) * torch.complex(cos, sin))
    assert_matches(out, eager.flatten(-2).to(dtype), dtype)
    check(cpp, "rope", (x, cos, sin, True), torch.float64, covered=False)  # promoted: float64 output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_flux_formula(cpp, dtype):
    x = randn(1, 64, 4, 128, dtype=dtype)
    pairs_cos, pairs_sin = randn(1, 64, 1, 64, seed=1), randn(1, 64, 1, 64, seed=2)
    cos, sin = pairs_cos.repeat_interleave(2, -1), pairs_sin.repeat_interleave(2, -1)
    out = OPS.rope.default(x, cos, sin, True, dtype)
    assert_matches(out, flux_rope(x, cos, sin), dtype)
    per_pair = OPS.rope.default(x, pairs_cos, pairs_sin, True, dtype)
    assert_matches(per_pair, flux_rope(x, cos, sin), dtype)


# ----------------------------------------------------------------------------
# glu
# ----------------------------------------------------------------------------

GLU_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("activation", sorted(GLU_ACTIVATIONS))
def test_glu_of_halves(cpp, dtype, width, rank, activation):
    x = randn(*leading_shape(rank), 2 * width, dtype=dtype) * 4
    value, gate = x.float().chunk(2, dim=-1)
    out = check(cpp, "glu", (x, None, activation, False), dtype)
    assert_matches(out, value * GLU_ACTIVATIONS[activation](gate), dtype)
    gate, value = x.float().chunk(2, dim=-1)
    out = check(cpp, "glu", (x, None, activation, True), dtype)
    assert_matches(out, GLU_ACTIVATIONS[activation](gate) * value, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(GLU_ACTIVATIONS))
def test_glu_of_two_tensors(cpp, dtype, activation):
    for shape in [(7, 33), (2, 5, 1000), (3, 1)]:
        a, b = randn(*shape, dtype=dtype) * 4, randn(*shape, dtype=dtype, seed=1)
        out = check(cpp, "glu", (a, b, activation, True), dtype)
        assert_matches(out, GLU_ACTIVATIONS[activation](a.float()) * b.float(), dtype)
        out = check(cpp, "glu", (a, b, activation, False), dtype)
        assert_matches(out, a.float() * GLU_ACTIVATIONS[activation](b.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_strided_inputs_and_extreme_values(cpp, dtype):
    # the halves of a strided view (the MLP part of a fused projection), read in place, and large enough to run
    # on several threads
    projection = randn(4, 300, 3 * 96, dtype=dtype)
    check(cpp, "glu", (projection[..., 96:], None, "silu", True), dtype)
    check(cpp, "glu", (randn(2, 40, 5, dtype=dtype).transpose(1, 2), None, "gelu", False), dtype)
    check(cpp, "glu", (randn(6, 100, dtype=dtype)[:, ::2], None, "gelu_tanh", False), dtype)  # last dim strided
    a = randn(5, 192, dtype=dtype)[:, ::2]
    b = randn(96, 5, dtype=dtype, seed=1).t()
    check(cpp, "glu", (a, b, "silu", True), dtype)
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 12.0, -12.0, 60.0, -60.0, 100.0, -100.0, 1e4, -1e4])
    for activation in GLU_ACTIVATIONS:
        out = check(cpp, "glu", (edges.to(dtype), torch.full_like(edges, 3.0).to(dtype), activation, True), dtype)
        assert torch.isfinite(out).all()


def test_glu_forms_it_does_not_cover(cpp):
    a, b = randn(4, 40, dtype=torch.bfloat16), randn(4, 40, seed=1)
    check(cpp, "glu", (a, b, "silu", True), torch.bfloat16, covered=False)  # mixed dtypes: the composition
    check(cpp, "glu", (randn(3, 40, dtype=torch.float64), None, "silu", False), torch.float64, covered=False)
    assert cpp.glu(randn(3, 40), None, "relu", False) is None
    assert check(cpp, "glu", (randn(3, 0), None, "silu", False), torch.float32).shape == (3, 0)


# ----------------------------------------------------------------------------
# fast_gelu
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_fast_gelu(cpp, dtype, width, rank):
    x = randn(*leading_shape(rank), width, dtype=dtype) * 4
    out = check(cpp, "fast_gelu", (x,), dtype)
    assert_matches(out, F.gelu(x.float(), approximate="tanh"), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_gelu_strided_and_extreme_values(cpp, dtype):
    x = randn(6, 100, dtype=dtype)
    check(cpp, "fast_gelu", (x[:, :96],), dtype)
    check(cpp, "fast_gelu", (x.t(),), dtype)
    check(cpp, "fast_gelu", (x[:, ::3],), dtype)
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 12.0, -12.0, 60.0, -60.0, 1e4, -1e4])
    check(cpp, "fast_gelu", (edges.to(dtype),), dtype)


# ----------------------------------------------------------------------------
# linear_gelu and cat_linear (GEMM ops: ATen's GEMMs, one call from the host)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_shape", [(7, 40), (2, 5, 40), (0, 40)])
def test_linear_gelu(cpp, dtype, bias, x_shape):
    x, w = randn(*x_shape, dtype=dtype), randn(24, 40, dtype=dtype, seed=1) * 0.3
    b = randn(24, dtype=dtype, seed=2) if bias else None
    out = check(cpp, "linear_gelu", (x, w, b), dtype)
    # the GEMM rounded to x's dtype, then the GELU: eager's two ops
    assert_matches(out, F.gelu(F.linear(x, w, b).float(), approximate="tanh"), dtype)


def test_linear_gelu_forms_it_does_not_cover(cpp):
    x, w = randn(3, 8), randn(4, 8, seed=1)
    assert cpp.linear_gelu(x.double(), w.double(), None) is None  # float64: the composition
    assert cpp.linear_gelu(x, w.bfloat16(), None) is None  # mixed dtypes
    assert cpp.linear_gelu(x, randn(4, 9), None) is None  # not a linear layer of x
    with pytest.raises(ValueError, match="do not make a linear layer"):
        OPS.linear_gelu.default(x, randn(4, 9), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("widths", [(40, 24), (8, 16, 24)])
def test_cat_linear(cpp, dtype, bias, widths):
    xs = [randn(2, 5, k, dtype=dtype, seed=i) for i, k in enumerate(widths)]
    w = randn(12, sum(widths), dtype=dtype, seed=7)
    b = randn(12, dtype=dtype, seed=8) if bias else None
    out = check(cpp, "cat_linear", (xs, w, b), dtype)
    assert_matches(out, F.linear(torch.cat(xs, -1), w, b), dtype)


def test_cat_linear_strided_inputs_and_weight(cpp):
    attn = randn(5, 2, 32).transpose(0, 1)  # a permuted attention output
    mlp = randn(2, 5, 48, seed=1)[..., :40]
    w = randn(72, 12, seed=2).t()  # a transposed weight: column blocks of a row-major [72, 12]
    check(cpp, "cat_linear", ([attn, mlp], w, randn(12, seed=3)), torch.float32)


def test_cat_linear_16_bit_forms_are_left_to_the_composition(cpp):
    # one GEMM over the concatenation rounds once, as eager; two accumulated GEMMs would round twice
    xs, w = [randn(3, 8, dtype=torch.bfloat16), randn(3, 4, dtype=torch.bfloat16, seed=1)], randn(5, 12, seed=2)
    check(cpp, "cat_linear", (xs, w.bfloat16(), None), torch.bfloat16, covered=False)
    assert cpp.cat_linear([xs[0].float(), xs[1]], w, None) is None  # mixed dtypes


# ----------------------------------------------------------------------------
# mul_add
# ----------------------------------------------------------------------------


MUL_ADD_SHAPES = [
    ((2, 7, 96), (2, 1, 96), (2, 7, 96)),  # gated residual
    ((2, 3, 7, 40), (2, 1, 1, 40), (40,)),
    ((5, 1), (1000,), (1,)),
    ((), (40,), (2, 40)),
    ((2, 7, 96), (2, 7, 96), (2, 7, 96)),
    ((3, 1, 40), (1, 5, 1), (5, 40)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", MUL_ADD_SHAPES)
def test_mul_add_broadcasts(cpp, dtype, shapes):
    args = tuple(randn(*shape, dtype=dtype, seed=i) for i, shape in enumerate(shapes))
    check(cpp, "mul_add", args, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mul_add_strided_inputs(cpp, dtype):
    x = randn(7, 2, 96, dtype=dtype).transpose(0, 1)
    y = randn(2, 1, 192, dtype=dtype, seed=1)[..., ::2]
    z = randn(2, 7, 100, dtype=dtype, seed=2)[..., :96]
    check(cpp, "mul_add", (x, y, z), dtype)


def test_mul_add_mixed_dtypes_fall_back(cpp):
    x = randn(4, 40, dtype=torch.bfloat16)
    y, z = randn(40, seed=1), randn(4, 40, seed=2, dtype=torch.float16)
    check(cpp, "mul_add", (x, y, z), torch.float32, covered=False)
    with pytest.raises(ValueError, match="do not broadcast"):
        OPS.mul_add.default(randn(3, 4), randn(5, 4), randn(4))


# ----------------------------------------------------------------------------
# Misc forms
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_inputs(cpp, dtype):
    x = torch.empty(0, 40, dtype=dtype)
    check(cpp, "rms_norm", (x, randn(40), 1e-6), dtype)
    check(cpp, "adalayernorm", (x, randn(40), randn(40), 1e-6), dtype)
    check(cpp, "rope", (x, randn(40), randn(40), True), dtype)
    check(cpp, "fast_gelu", (x,), dtype)
    check(cpp, "mul_add", (x, randn(40, dtype=dtype), randn(1, 40, dtype=dtype)), dtype)


def test_inputs_that_require_grad(cpp):
    x = randn(3, 40).requires_grad_()
    weight = randn(40, seed=1).requires_grad_()
    out = OPS.rms_norm.default(x, weight, 1e-6)
    assert_matches(out, reference.rms_norm(x.detach(), weight.detach(), 1e-6), torch.float32)
    # The public API still differentiates through the reference.
    ops.rms_norm(x, weight).sum().backward()
    assert x.grad is not None


def test_inputs_split_across_threads(cpp):
    x = randn(16, 256, 128)  # many more rows than one task's share
    check(cpp, "rms_norm", (x, randn(128, seed=1), 1e-6), torch.float32)
    check(cpp, "adalayernorm", (x, randn(16, 1, 128), randn(128), 1e-6), torch.float32)
    tables = randn(64, 1, 64, seed=2), randn(64, 1, 64, seed=3)
    check(cpp, "rope", (x.unflatten(1, (64, 4)), *tables, True), torch.float32)


@pytest.fixture
def streaming(cpp):
    """Every output written with non-temporal stores (normally only large ones)."""
    previous = cpp.streaming_threshold()
    cpp.set_streaming_threshold(0)
    yield
    cpp.set_streaming_threshold(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 96, 1000, 1024])
def test_streamed_outputs(cpp, streaming, dtype, width):
    x = randn(2, 6, 3, width, dtype=dtype)
    check(cpp, "rms_norm", (x, randn(width, seed=1), 1e-6), dtype)
    check(cpp, "adalayernorm", (x, randn(2, 1, 1, width), randn(width, seed=2), 1e-6), dtype)
    for interleaved in (True, False):
        for last in (width, width // 2):
            tables = randn(6, 1, last, seed=3), randn(6, 1, last, seed=4)
            check(cpp, "rope", (x, *tables, interleaved, dtype), dtype)
    check(cpp, "fast_gelu", (x,), dtype)
    check(cpp, "mul_add", (x, randn(2, 1, 1, width, dtype=dtype), x), dtype)


def test_streaming_threshold_follows_the_cache(cpp):
    cache = _cpp_build._last_level_cache_bytes()
    if cache is None:
        pytest.skip("no cache size in sysfs")
    assert cpp.streaming_threshold() == cache * 3 // 4


# ----------------------------------------------------------------------------
# Loader: fallback, laziness, cache key, thread safety
# ----------------------------------------------------------------------------


def _simulate_missing_build(monkeypatch, tmp_path):
    """No prebuilt kernels (a folder without manifest) and no cached JIT build."""
    monkeypatch.setenv(_cpp_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_cpp_build, "PREBUILT_DIR", tmp_path / "no-prebuilt-kernels")
    monkeypatch.setattr(_cpp_build, "_import_built", lambda name, directory: None)
    _cpp_build._reset()


@requires_enabled
def test_failed_build_warns_once_and_uses_compositions(monkeypatch, tmp_path, restore_loader):
    _simulate_missing_build(monkeypatch, tmp_path)

    def failing_compile(name, flags, directory):
        raise RuntimeError(
            "Error building extension 'mindiesd'\nrms_norm.cpp:12:3: error: simulated failure"
        )

    monkeypatch.setattr(_cpp_build, "_compile", failing_compile)
    x, weight = randn(2, 5, 40), randn(40, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = OPS.rms_norm.default(x, weight, 1e-6)
        second = OPS.rms_norm.default(x, weight, 1e-6)
        gelu = OPS.fast_gelu.default(x)
    messages = [str(w.message) for w in caught if "C++ CPU kernels" in str(w.message)]
    assert len(messages) == 1, messages
    assert "simulated failure" in messages[0]
    torch.testing.assert_close(first, _cpu.rms_norm(x, weight, 1e-6))
    torch.testing.assert_close(second, reference.rms_norm(x, weight, 1e-6))
    torch.testing.assert_close(gelu, reference.fast_gelu(x))
    assert _cpp_kernels.cpu_kernel_implementation().startswith("composition (build failed")
    assert ops.build_cpu_kernels() is False


def _planted_build(monkeypatch, tmp_path, mode):
    """A cached-build folder under a cache root of ``mode`` holding a ready marker and a module file (not a real
    extension); returns the imports attempted and the compile calls made from now on."""
    root = tmp_path / "cpp-cache"
    name, _ = _cpp_build.build_name()
    build = root / name
    build.mkdir(parents=True)
    (build / _cpp_build._READY_MARKER).write_text("planted\n")
    (build / f"{name}.so").write_bytes(b"\x7fELF planted")
    root.chmod(mode)
    monkeypatch.setenv(_cpp_kernels.CACHE_ENV, str(root))
    monkeypatch.setattr(_cpp_build, "PREBUILT_DIR", tmp_path / "no-prebuilt-kernels")
    imports, compiles = [], []

    def record_import(module_name, path):
        imports.append(Path(path))
        raise ImportError("not a real extension")

    def record_compile(module_name, flags, directory):
        compiles.append(directory)
        raise RuntimeError("no build in this test")

    monkeypatch.setattr(_cpp_build, "_import_extension", record_import)
    monkeypatch.setattr(_cpp_build, "_compile", record_compile)
    _cpp_build._reset()
    return imports, compiles


@requires_enabled
def test_a_build_folder_others_can_write_is_never_imported_or_built_into(monkeypatch, tmp_path, restore_loader):
    imports, compiles = _planted_build(monkeypatch, tmp_path, 0o777)
    x = randn(2, 5, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = OPS.fast_gelu.default(x)
    assert imports == [] and compiles == [], "a module others could have written was imported or built over"
    messages = [str(w.message) for w in caught if "C++ CPU kernels" in str(w.message)]
    assert len(messages) == 1 and "not trusted" in messages[0] and "writable by" in messages[0], messages
    torch.testing.assert_close(out, reference.fast_gelu(x))  # the composition kernel
    assert _cpp_kernels.cpu_kernel_implementation().startswith("composition")


@requires_enabled
def test_an_own_build_folder_is_imported(monkeypatch, tmp_path, restore_loader):
    imports, compiles = _planted_build(monkeypatch, tmp_path, 0o700)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        OPS.fast_gelu.default(randn(2, 5, 40))
    name, _ = _cpp_build.build_name()
    assert imports[:1] == [tmp_path / "cpp-cache" / name / f"{name}.so"]


@requires_enabled
def test_report_without_build_compiles_nothing(monkeypatch, tmp_path, restore_loader):
    _simulate_missing_build(monkeypatch, tmp_path)

    def no_compile(name, flags, directory):
        raise AssertionError("cpu_kernel_implementation(build=False) compiled the kernels")

    monkeypatch.setattr(_cpp_build, "_compile", no_compile)
    tag = _cpp_build.build_name()[0].split("_")[3]
    assert _cpp_kernels.cpu_kernel_implementation(build=False) == (
        f"not built yet (the C++ kernels for {tag} build on the first CPU kernel call)"
    )
    assert _cpp_kernels.extension(build=False) is None
    assert not _cpp_build._resolved and list(tmp_path.iterdir()) == []


def test_report_without_build_loads_a_cached_build(cpp, restore_loader):
    expected = _cpp_kernels.cpu_kernel_implementation()
    _cpp_build._reset()
    assert _cpp_kernels.cpu_kernel_implementation(build=False) == expected
    assert _cpp_build._resolved and _cpp_kernels.extension(build=False) is cpp


@requires_enabled
def test_missing_compiler_names_the_cause(monkeypatch, tmp_path, restore_loader):
    _simulate_missing_build(monkeypatch, tmp_path)
    monkeypatch.setenv("CXX", "mindiesd-no-such-compiler")
    x = randn(3, 40)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
        out = OPS.fast_gelu.default(x)
    torch.testing.assert_close(out, reference.fast_gelu(x))


def test_lazy_init_is_thread_safe(monkeypatch, cpp, restore_loader):
    calls = []
    real_module = cpp

    def slow_load(build=True):
        calls.append(threading.get_ident())
        time.sleep(0.2)
        return real_module

    monkeypatch.setattr(_cpp_build, "_load", slow_load)
    _cpp_build._reset()
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(_cpp_kernels.extension())) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(results) == 8 and all(module is real_module for module in results)


def test_cache_key_names_the_capability(monkeypatch):
    names = {}
    for capability in ("AVX512", "AVX2", "DEFAULT"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(_cpp_build, "_has_avx512_bf16", lambda: False)
        name, flags = _cpp_kernels.build_name()
        names[capability] = name
        assert f"_{capability.lower()}_" in name
        assert "-O3" in flags
        if capability == "AVX2":
            assert "-mavx2" in flags and not any("avx512" in flag for flag in flags)
        if capability == "DEFAULT":
            assert not any(flag.startswith("-m") for flag in flags)
    assert len(set(names.values())) == 3


def test_build_lists_every_source():
    files = {path.name for path in _cpp_build.SOURCE_DIR.iterdir() if path.suffix in (".cpp", ".h")}
    assert set(_cpp_build.SOURCES) | set(_cpp_build.HEADERS) == files
    assert set(_cpp_build.SOURCES) == {name for name in files if name.endswith(".cpp")}
    assert [path.name for path in _cpp_build.source_files()] == sorted(files)
    # the package data ships them
    pyproject = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"_cpp/*.cpp", "_cpp/*.h"' in pyproject


def test_cache_key_follows_every_source_and_header(monkeypatch, tmp_path):
    sources = tmp_path / "_cpp"
    shutil.copytree(_cpp_build.SOURCE_DIR, sources)
    monkeypatch.setattr(_cpp_build, "SOURCE_DIR", sources)
    names = {_cpp_build.build_name()[0]}
    for file in _cpp_build.SOURCES + _cpp_build.HEADERS:
        path = sources / file
        original = path.read_bytes()
        path.write_bytes(original + b"\n// edited\n")
        names.add(_cpp_build.build_name()[0])
        path.write_bytes(original)
    assert len(names) == 1 + len(_cpp_build.SOURCES + _cpp_build.HEADERS)
    assert _cpp_build.build_name()[0] in names  # unchanged sources: the same key again
    (sources / "extra.h").write_text("// a header not listed yet\n")
    assert _cpp_build.build_name()[0] not in names


def test_cache_folder_is_configurable(monkeypatch, tmp_path):
    monkeypatch.setenv(_cpp_kernels.CACHE_ENV, str(tmp_path))
    assert _cpp_kernels.cache_root() == tmp_path
    monkeypatch.delenv(_cpp_kernels.CACHE_ENV)
    assert _cpp_kernels.cache_root() == pathlib.Path.home() / ".cache" / "mindiesd" / "cpp"


def _run_python(script, **env):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    return result


def test_import_does_not_build():
    result = _run_python(
        """
        import sys
        import mindiesd.ops
        from mindiesd.ops import registry
        from mindiesd.ops.kernels import cpp_build as _cpp_build, cpp as _cpp_kernels
        assert registry.DEVICE_KERNELS["cpu"]["rms_norm"] is _cpp_kernels.KERNELS["rms_norm"]  # installed
        assert not _cpp_build._resolved  # but not built or loaded
        assert "torch.utils.cpp_extension" not in sys.modules
        print("ok")
        """,
        MINDIESD_CPP_KERNELS="1",  # enabled, whatever this process was started with
    )
    assert result.stdout.strip() == "ok"
    assert "building" not in result.stderr


def test_later_process_reuses_the_build(cpp):
    result = _run_python(
        """
        import time
        import torch
        import mindiesd.ops
        start = time.perf_counter()
        assert mindiesd.ops.build_cpu_kernels()
        x = torch.randn(4, 40)
        torch.testing.assert_close(
            torch.ops.mindiesd.rms_norm.default(x, None, 1e-6), mindiesd.ops.reference.rms_norm(x)
        )
        print(f"{time.perf_counter() - start:.2f}")
        """
    )
    assert "building" not in result.stderr
    assert float(result.stdout.strip()) < 10.0


def test_disabled_by_environment():
    result = _run_python(
        """
        import torch
        import mindiesd.ops
        from mindiesd.ops import registry
        from mindiesd.ops.kernels import cpu as _cpu
        assert registry.DEVICE_KERNELS["cpu"]["rms_norm"] is _cpu.KERNELS["rms_norm"]
        assert not mindiesd.ops.build_cpu_kernels()
        x = torch.randn(3, 8)
        torch.testing.assert_close(torch.ops.mindiesd.fast_gelu.default(x),
                                   mindiesd.ops.reference.fast_gelu(x))
        print("ok")
        """,
        MINDIESD_CPP_KERNELS="0",
    )
    assert result.stdout.strip() == "ok"
    assert "C++ CPU kernels" not in result.stderr


def test_disabled_by_environment_loads_no_prebuilt_module():
    result = _run_python(
        """
        import sys
        import torch
        import mindiesd.ops
        from mindiesd.ops.kernels import cpp_build
        x = torch.randn(3, 8)
        torch.ops.mindiesd.fast_gelu.default(x)
        assert cpp_build.cpu_kernel_implementation() == "composition (disabled by MINDIESD_CPP_KERNELS=0)"
        print(sorted(name for name in sys.modules if cpp_build.PREBUILT_PREFIX in name))
        """,
        MINDIESD_CPP_KERNELS="0",
    )
    assert result.stdout.strip() == "[]"


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, capsys):
    stale, live = tmp_path / "stale", tmp_path / "live"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "lock").touch()
        (folder / "rope.o").touch()
    old = time.time() - _cpp_build.STALE_LOCK_SECONDS - 60
    for path in stale.iterdir():
        os.utime(path, (old, old))
    _cpp_build._clear_stale_lock(stale)
    _cpp_build._clear_stale_lock(live)
    assert not (stale / "lock").exists() and (live / "lock").exists()
    assert "left by a build that did not finish" in capsys.readouterr().err
