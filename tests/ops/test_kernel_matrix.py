"""One matrix: every implementation of every op, on the same cases, against the reference.

Implementations: the reference itself (the definition of correct), the aten compositions (``_cpu``), the C++
kernels, the Triton kernels (in Triton's interpreter, in a subprocess: Triton fixes that mode when first
imported) and the Ascend mapping over a stand-in ``torch_npu`` (``test_npu_mapping.StandInTorchNpu``). Each is
called as the dispatcher calls it, behind the layout adapter, so a case checks values, dtype, shape and the
strides of the layout rule (``mindiesd.ops.layout``). The cases come from the family registry's op names:
a family without cases here fails ``test_every_op_has_cases``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindiesd.compilation import families
from mindiesd.ops import reference
from mindiesd.ops.kernels import cpu as _cpu
from mindiesd.ops.layout import conform, output_layout

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (rtol, atol) against the reference, which also computes in fp32 and rounds once: one step of the dtype
#: (Triton's interpreter truncates to bf16 where GPUs round to nearest).
TOLERANCE = {torch.float32: (2e-6, 2e-6), torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (2e-3, 1e-4)}


#: Ops that round an intermediate to the input's dtype, as the op sequence they replace does -> the absolute
#: tolerance (times the result's scale) of the Triton interpreter's bf16 results, which truncate it.
INTERMEDIATE_ROUNDING = {"norm_rope": 8e-3}


def randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _int8(n, k, seed=1):
    return torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


#: Ops whose every kernel does the unfused sequence's arithmetic with its roundings: they must equal the reference
#: at the input's dtype bit for bit (a float64 run is no reference for them: they take int8 and float8 operands).
BIT_EXACT = {"int8_linear", "dequant_linear"}


def _tables(s, d, dtype, per_pair=False):
    angles = randn(s, d // 2, dtype=torch.float32, seed=7)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if not per_pair:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return cos.to(dtype), sin.to(dtype)


def _heads_first(b, s, h, d, dtype):
    """[B, H, S, D] as attention makes it: a transposed view of [B, S, H, D]."""
    return randn(b, s, h, d, dtype=dtype).transpose(1, 2)


#: op -> case name -> args(dtype). Small shapes: the interpreter runs these too.
CASES = {
    "rms_norm": {
        "weighted": lambda dt: (randn(2, 5, 64, dtype=dt), randn(64, dtype=dt, seed=1), 1e-6),
        "unweighted_eps_1e-5": lambda dt: (randn(3, 40, dtype=dt), None, 1e-5),
        "heads_first_view": lambda dt: (_heads_first(2, 6, 3, 32, dt), randn(32, dtype=dt, seed=1), 1e-6),
        "fp32_out": lambda dt: (randn(4, 48, dtype=dt), randn(48, dtype=dt, seed=1), 1e-6, torch.float32),
    },
    "rope": {
        "interleaved_full": lambda dt: (randn(2, 3, 8, 32, dtype=dt), *_tables(8, 32, dt), True),
        "interleaved_per_pair": lambda dt: (randn(2, 3, 8, 32, dtype=dt), *_tables(8, 32, dt, per_pair=True), True),
        "half": lambda dt: (randn(2, 3, 8, 32, dtype=dt), *_tables(8, 32, dt), False),
        "heads_first_view": lambda dt: (_heads_first(2, 8, 3, 32, dt), *_tables(8, 32, dt), True),
        "fp32_tables": lambda dt: (randn(2, 3, 8, 32, dtype=dt), *_tables(8, 32, torch.float32), True),
    },
    "norm_rope": {
        # the text and image streams of joint attention, [B, H, S_i, D], joined along S; the normalised values are
        # rounded to the streams' dtype (named, so that the float64 reference rounds them too)
        "joint_interleaved": lambda dt: ([randn(2, 3, 3, 32, dtype=dt), randn(2, 3, 5, 32, dtype=dt, seed=1)], 2,
                                         [randn(32, dtype=dt, seed=2), randn(32, dtype=dt, seed=3)], 1e-6, dt, 32,
                                         *_tables(8, 32, dt), True),
        "single_half_unweighted": lambda dt: ([randn(2, 3, 8, 32, dtype=dt)], 0, [None], 1e-5, dt, 32,
                                              *_tables(8, 32, dt), False),
        # normalised values kept in float32 (an upcast before a complex rotation), per-pair fp32 tables, a strided x
        "float32_norm_per_pair": lambda dt: ([randn(2, 3, 4, 32, dtype=dt), _heads_first(2, 4, 3, 32, dt)], 2,
                                             [None, randn(32, dtype=dt, seed=4)], 1e-6, torch.float32, 32,
                                             *_tables(8, 32, torch.float32, per_pair=True), True, dt),
        # Wan's form: rows of all 3 heads' values [B, S, 3 * 32] normalised, each head rotated (tables [S, 1, 32])
        "heads_joint_half": lambda dt: ([randn(2, 2, 96, dtype=dt), randn(2, 6, 96, dtype=dt, seed=1)], 1,
                                        [randn(96, dtype=dt, seed=2), None], 1e-6, dt, 32,
                                        *(t[:, None] for t in _tables(8, 32, dt)), False),
    },
    "adalayernorm": {
        "per_sample": lambda dt: (randn(2, 7, 48, dtype=dt), randn(2, 1, 48, dtype=dt, seed=1),
                                  randn(2, 1, 48, dtype=dt, seed=2), 1e-6),
        "per_channel": lambda dt: (randn(3, 48, dtype=dt), randn(48, dtype=dt, seed=1), randn(48, dtype=dt, seed=2),
                                   1e-5),
    },
    "glu": {
        # a projection's output split in halves, the second gated (diffusers' SwiGLU / GEGLU)
        "halves_silu": lambda dt: (randn(2, 5, 64, dtype=dt), None, "silu", False),
        "halves_gelu": lambda dt: (randn(2, 5, 64, dtype=dt), None, "gelu", False),
        # the MLP part of a wider projection (Flux2's single blocks): x itself a strided view, the first half gated
        "strided_halves_first": lambda dt: (randn(2, 5, 160, dtype=dt)[..., 48:144], None, "silu", True),
        "heads_first_halves": lambda dt: (_heads_first(2, 6, 3, 34, dt), None, "gelu_tanh", False),
        "two_tensors": lambda dt: (randn(3, 7, 33, dtype=dt), randn(3, 7, 33, dtype=dt, seed=1), "silu", True),
        "two_tensors_tanh": lambda dt: (randn(3, 40, dtype=dt), randn(3, 40, dtype=dt, seed=1), "gelu_tanh", False),
    },
    "group_norm_silu": {
        # AutoencoderKL's ResNet blocks: NCHW, per-channel affine
        "nchw_affine": lambda dt: (randn(2, 8, 5, 6, dtype=dt), 4, randn(8, dtype=dt, seed=1),
                                   randn(8, dtype=dt, seed=2), 1e-6),
        # a video VAE's NCDHW, no affine, a group per 3 channels
        "ncdhw_no_affine": lambda dt: (randn(1, 6, 3, 4, 5, dtype=dt) * 3 + 2, 2, None, None, 1e-5),
        # float32 parameters beside a 16-bit x; positions not a multiple of the vector width
        "float32_parameters": lambda dt: (randn(2, 4, 33, dtype=dt), 2,
                                          randn(4, dtype=torch.float32, seed=1).abs() + 0.5,
                                          randn(4, dtype=torch.float32, seed=2), 1e-5),
        # channels-last x (what CPU convolutions return), the output channels-last too: 24 channels, a vector
        # block and a tail per position; channels-last-3d with fewer channels than a vector
        "channels_last": lambda dt: (randn(2, 24, 3, 4, dtype=dt).contiguous(memory_format=torch.channels_last), 8,
                                     randn(24, dtype=dt, seed=1), None, 1e-6),
        "channels_last_3d": lambda dt: (
            (randn(1, 6, 2, 3, 4, dtype=dt) - 4).contiguous(memory_format=torch.channels_last_3d), 3, None,
            randn(6, dtype=dt, seed=2), 1e-5),
    },
    "channel_rms_norm": {
        # Wan's residual blocks: NCDHW, [C, 1, 1, 1] gamma, no bias (the module adds 0.0), SiLU after
        "ncdhw_silu": lambda dt: (randn(1, 24, 2, 3, 5, dtype=dt), randn(24, 1, 1, 1, dtype=dt, seed=1), None,
                                  24 ** 0.5, 1e-12, True),
        # an image's [C, 1, 1] gamma and bias, no activation (the attention block's norm)
        "nchw_bias": lambda dt: (randn(2, 6, 3, 4, dtype=dt) + 2, randn(6, 1, 1, dtype=dt, seed=1),
                                 randn(6, 1, 1, dtype=dt, seed=2), 6 ** 0.5, 1e-12, False),
        # channels-last, 40 channels: a vector block and a tail per position; float32 parameters
        "channels_last": lambda dt: (randn(2, 40, 3, 2, dtype=dt).contiguous(memory_format=torch.channels_last),
                                     randn(40, dtype=torch.float32, seed=1), None, 40 ** 0.5, 1e-12, True),
    },
    "fast_gelu": {
        "dense": lambda dt: (randn(3, 5, 40, dtype=dt),),
        "transposed": lambda dt: (randn(4, 6, 40, dtype=dt).transpose(0, 1),),
    },
    "linear_gelu": {
        "bias": lambda dt: (randn(2, 5, 32, dtype=dt), (randn(24, 32, seed=1, dtype=torch.float32) * 0.2).to(dt),
                            randn(24, dtype=dt, seed=2)),
        "no_bias_2d": lambda dt: (randn(7, 32, dtype=dt), (randn(24, 32, seed=1, dtype=torch.float32) * 0.2).to(dt),
                                  None),
    },
    "cat_linear": {
        "bias": lambda dt: ([randn(2, 5, 16, dtype=dt), randn(2, 5, 24, dtype=dt, seed=1)],
                            (randn(24, 40, seed=2, dtype=torch.float32) * 0.2).to(dt), randn(24, dtype=dt, seed=3)),
        "three_2d_no_bias": lambda dt: ([randn(7, 8, dtype=dt), randn(7, 16, dtype=dt, seed=1),
                                         randn(7, 8, dtype=dt, seed=2)],
                                        (randn(12, 32, seed=3, dtype=torch.float32) * 0.2).to(dt), None),
    },
    "int8_linear": {
        "bias": lambda dt: (randn(2, 5, 32, dtype=dt), _int8(24, 32),
                            (randn(24, 1, seed=2, dtype=torch.float32).abs() * 0.01).to(dt),
                            randn(24, dtype=dt, seed=3), None, 1.1920928955078125e-07),
        # with the compensation of torchao's uint8 form (VNNI without AMX): 128 times the weight's column sums
        "float32_scales_no_bias_2d_compensated": lambda dt: (
            randn(7, 40, dtype=dt), _int8(16, 40), randn(16, seed=2, dtype=torch.float32).abs() * 0.01 + 1e-3, None,
            _int8(16, 40).sum(1, dtype=torch.int32).mul(128).view(1, 16), 1e-3),
    },
    "dequant_linear": {
        "float8_scale_first": lambda dt: (randn(2, 5, 32, dtype=dt),
                                          (randn(24, 32, seed=1, dtype=torch.float32) * 4).to(torch.float8_e4m3fn),
                                          randn(24, 1, seed=2, dtype=torch.float32).abs() * 0.1,
                                          randn(24, dtype=dt, seed=3), True, dt),
        "int8_scale_after_2d": lambda dt: (randn(7, 40, dtype=dt), _int8(16, 40),
                                           (randn(16, seed=2, dtype=torch.float32).abs() * 0.01).to(dt), None, False,
                                           dt),
    },
    "mul_add": {
        "gate": lambda dt: (randn(2, 1, 32, dtype=dt), randn(2, 9, 32, dtype=dt, seed=1),
                            randn(2, 9, 32, dtype=dt, seed=2), False),
        "residual_first": lambda dt: (randn(2, 9, 32, dtype=dt), randn(2, 1, 32, dtype=dt, seed=1),
                                      randn(2, 9, 32, dtype=dt, seed=2), True),
        "transposed_addend": lambda dt: (randn(9, 32, dtype=dt), randn(9, 32, dtype=dt, seed=1),
                                         randn(32, 9, dtype=dt, seed=2).t(), False),
    },
}


# ---------------------------------------------------------------------------------------------- implementations
def _cpp(op):
    from mindiesd.ops.kernels import cpp_build as _cpp_build, cpp as _cpp_kernels

    if not _cpp_build.enabled():
        pytest.skip(f"C++ kernels are disabled by {_cpp_build.ENABLE_ENV}={os.environ.get(_cpp_build.ENABLE_ENV)}")
    if _cpp_build.extension() is None:
        pytest.skip("the C++ kernels could not be built here (see the build warning)")
    return _cpp_kernels.KERNELS[op]


def _triton(op):
    if not IN_INTERPRETER:
        pytest.skip("runs in the TRITON_INTERPRET=1 subprocess of test_triton_column_in_the_interpreter")
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from mindiesd.ops.kernels import triton as _triton

    return _triton.KERNELS[op]


@pytest.fixture
def stand_in_npu(monkeypatch):
    from test_npu_mapping import StandInTorchNpu

    from mindiesd.ops.kernels import npu as _npu

    module = StandInTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    _npu.rotary_mul_modes.cache_clear()
    yield module
    _npu.rotary_mul_modes.cache_clear()


IMPLEMENTATIONS = ["reference", "composition", "cpp", "triton", "npu"]


def _kernel(implementation, op, request):
    if implementation == "reference":
        return getattr(reference, op)  # already follows the layout rule: no adapter
    if not _declared(implementation, op):
        pytest.skip(f"no {implementation} kernel declared for {op}")
    if implementation == "composition":
        kernel = _cpu.KERNELS[op]
    elif implementation == "cpp":
        kernel = _cpp(op)
    elif implementation == "triton":
        kernel = _triton(op)
    else:
        request.getfixturevalue("stand_in_npu")
        from mindiesd.ops.kernels import npu as _npu

        kernel = _npu.KERNELS[op]
    return conform(op, kernel)


def _declared(implementation, op):
    kernels = families.FAMILIES[op].declared
    if implementation == "cpp":
        from mindiesd.ops.kernels import cpp as _cpp_kernels

        return "cpu" in kernels and op in _cpp_kernels.KERNELS
    device = {"composition": "cpu", "triton": "cuda", "npu": "npu"}[implementation]
    return device in kernels


def _double(arg):
    if isinstance(arg, (list, tuple)):
        return [_double(a) for a in arg]
    return arg.double() if isinstance(arg, torch.Tensor) else arg


def _matrix():
    for op, cases in CASES.items():
        for case in cases:
            yield op, case


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op,case", list(_matrix()), ids=[f"{o}-{c}" for o, c in _matrix()])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_matrix(implementation, op, case, dtype, request):
    args = CASES[op][case](dtype)
    run = _kernel(implementation, op, request)
    out = run(*args)
    if op in BIT_EXACT:
        expected = getattr(reference, op)(*args)
        assert out.dtype == expected.dtype and out.stride() == output_layout(op, args)[1]
        assert torch.equal(out, expected)
        return
    expected = getattr(reference, op)(*[_double(a) for a in args])
    expected_dtype = getattr(reference, op)(*args).dtype
    assert out.dtype == expected_dtype and out.shape == expected.shape
    assert out.stride() == output_layout(op, args)[1], "the layout rule's strides"
    rtol, atol = TOLERANCE[expected_dtype]
    if implementation == "triton" and op in INTERMEDIATE_ROUNDING and expected_dtype == torch.bfloat16:
        # the interpreter truncates the intermediate to bf16 where GPUs round it: a whole step of it, not half,
        # which a later difference (rotation) does not shrink
        atol = INTERMEDIATE_ROUNDING[op]
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(out.double(), expected.to(torch.float64), rtol=rtol, atol=atol * scale)


def test_every_op_has_cases():
    assert sorted(CASES) == sorted(families.OP_FAMILIES)


def test_every_declared_kernel_is_in_the_matrix():
    declared = {device for family in families.FAMILIES.values() for device in family.declared}
    assert declared == {"cpu", "cuda", "npu"}, "a new device needs its column in IMPLEMENTATIONS"


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the interpreter run")
def test_triton_column_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k", "triton and matrix"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    n_cases = sum(len(c) for c in CASES.values()) * len(DTYPES)
    assert f"{n_cases} passed" in summary, summary
