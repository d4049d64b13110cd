"""``mindiesd.int8_linear`` and ``mindiesd.dequant_linear``: their references are torchao's quantized linear layers
bit for bit, the C++ kernels are bit-exact with the references in every dtype combination they cover, and bad
arguments get clear errors."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

from mindiesd.ops import reference
from mindiesd.ops.defs.int8_linear import DEFAULT_EPS
from mindiesd.ops.kernels import cpp as _cpp_kernels, cpu as _cpu

OP = torch.ops.mindiesd.int8_linear.default
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ids = lambda d: str(d).removeprefix("torch.")  # noqa: E731


def _case(shape, n=48, dtype=torch.float32, scale_dtype=None, bias_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    # rows of different magnitudes, so that the row scales differ
    x = (torch.randn(shape, generator=g) * (torch.rand(shape[:-1] + (1,), generator=g) * 4 + 0.1)).to(dtype)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    ws = (torch.rand(n, 1, generator=g) * 0.01 + 1e-4).to(scale_dtype or dtype)
    b = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    return x, w, ws, b


@pytest.fixture(scope="module")
def cpp():
    import mindiesd.ops as ops

    if not _cpp_kernels.enabled() or not ops.build_cpu_kernels():
        pytest.skip(f"C++ CPU kernels unavailable: {_cpp_kernels.cpu_kernel_implementation()}")
    return _cpp_kernels.extension()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_reference_is_torchao_eager_bit_for_bit(dtype, bias):
    quantization = pytest.importorskip("torchao.quantization")
    layer = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantization.quantize_(layer, quantization.Int8DynamicActivationInt8WeightConfig())
    x = _case((3, 7, 96), dtype=dtype)[0]
    with torch.no_grad():
        expected = layer(x)
        weight = layer.weight
        actual = reference.int8_linear(x, weight.qdata, weight.scale, layer.bias, None, DEFAULT_EPS, dtype)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual, expected)


COMBINATIONS = [
    # (x dtype, weight-scale dtype, bias dtype or None, out_dtype or None)
    *[(d, d, d, None) for d in DTYPES],
    *[(d, d, None, None) for d in DTYPES],
    (torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16),  # torchao's bf16 model: float32 scales
    (torch.bfloat16, torch.float32, None, torch.bfloat16),
    (torch.float16, torch.float32, torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16, torch.float32, None),  # the sum in float32
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("shape", [(3, 7, 96), (1, 40), (5, 33, 200), (64, 1000)], ids=str)
@pytest.mark.parametrize("combination", COMBINATIONS, ids=lambda c: "-".join(ids(d) if d else "none" for d in c))
def test_cpp_kernel_is_bit_exact_with_the_reference(cpp, combination, shape):
    dtype, scale_dtype, bias_dtype, out_dtype = combination
    x, w, ws, b = _case(shape, dtype=dtype, scale_dtype=scale_dtype, bias_dtype=bias_dtype)
    expected = reference.int8_linear(x, w, ws, b, None, DEFAULT_EPS, out_dtype)
    raw = cpp.int8_linear(x, w, ws, b, None, DEFAULT_EPS, expected.dtype)
    assert raw is not None, "the C++ kernel declined a covered form"
    assert raw.dtype == expected.dtype and raw.shape == expected.shape and raw.is_contiguous()
    assert torch.equal(raw, expected)
    dispatched = OP(x, w, ws, b, None, DEFAULT_EPS, out_dtype)  # through the registered op and its layout adapter
    assert torch.equal(dispatched, expected)


@pytest.fixture
def int8_gemm(cpp):
    """Sets the C++ int8_linear's integer product for one test (each CPU's choice, on any CPU), then auto again."""
    yield cpp.set_int8_gemm
    cpp.set_int8_gemm("auto")


def _large_sums(rows, k, seed=4):
    """Rows whose int8 values are all 127 against weights of 100-127: every sum of products is about 2^25, beyond
    float32's exact integers, unless the float32 product sums blocks of at most 1024 columns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.full((rows, k), 3.0)
    w = torch.randint(100, 128, (40, k), generator=g, dtype=torch.int8)
    return x, w, torch.rand(40, 1, generator=g) * 0.01 + 1e-4, torch.randn(40, generator=g)


def _int_mm_takes_uint8() -> bool:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)


@pytest.mark.parametrize("compensated", [False, True], ids=["signed_graph", "uint8_graph"])
@pytest.mark.parametrize("form", ["signed", "unsigned", "float", "dot"])
def test_every_integer_product_is_bit_exact(cpp, int8_gemm, form, compensated):
    """Each CPU's product (AMX: int8 x int8; VNNI: uint8 x int8 less the compensation; neither: float32 GEMMs, or
    a direct dot product for a few rows) forced on this one: each is torchao's result bit for bit, with and
    without the compensation a uint8 graph hands over, and beyond 1024 columns."""
    if form == "unsigned" and not _int_mm_takes_uint8():
        pytest.skip("torch's _int_mm takes a uint8 operand from 2.12 on")
    int8_gemm(form)
    cases = [_case((3, 7, 96), dtype=torch.bfloat16, scale_dtype=torch.float32, bias_dtype=torch.bfloat16),
             _case((9, 200)), _large_sums(6, 2100), _large_sums(2, 1500)]
    for x, w, ws, b in cases:
        compensation = w.sum(1, dtype=torch.int32) * 128 if compensated else None
        rows = x.numel() // x.shape[-1]
        assert cpp.int8_gemm(rows, compensated) == form
        expected = reference.int8_linear(x, w, ws, b, None, DEFAULT_EPS)
        assert torch.equal(cpp.int8_linear(x, w, ws, b, compensation, DEFAULT_EPS, expected.dtype), expected)
        assert torch.equal(OP(x, w, ws, b, compensation, DEFAULT_EPS), expected)
    x, w, ws, b = _large_sums(6, 2100)
    unblocked = (x * 127 / 3).float() @ w.float().t()  # what one float32 GEMM over all columns makes of it
    assert not torch.equal(unblocked, (torch.full((6, 2100), 127, dtype=torch.int32) @ w.int().t()).float()), \
        "the large case does not exercise the blocks"


def test_the_product_follows_the_cpu(cpp, int8_gemm):
    """auto: int8 x int8 with AMX tiles; with VNNI, uint8 x int8 where the graph has the compensation; neither:
    float32 (a direct dot product up to 4 rows)."""
    amx, vnni = torch.cpu._is_amx_tile_supported(), torch.cpu._is_vnni_supported()
    int8_gemm("auto")
    for rows, compensated in [(1, False), (64, False), (64, True)]:
        expected = ("signed" if amx or (vnni and not (compensated and _int_mm_takes_uint8())) else "unsigned" if vnni
                    else "dot" if rows <= 4 else "float")
        assert cpp.int8_gemm(rows, compensated) == expected
    with pytest.raises(RuntimeError, match="int8 GEMM must be auto, signed"):
        int8_gemm("int4")


def test_strided_input_and_another_eps(cpp):
    x, w, ws, b = _case((6, 80))
    strided = x.t().contiguous().t()[:, :64]  # column-major, and a slice of it
    w = w[:, :64].contiguous()
    for eps in (DEFAULT_EPS, 0.5):  # 0.5 floors most row scales here: the clamp matters
        expected = reference.int8_linear(strided, w, ws, b, None, eps)
        assert torch.equal(cpp.int8_linear(strided, w, ws, b, None, eps, torch.float32), expected)


def test_zero_rows_and_nan_rows(cpp):
    x, w, ws, b = _case((4, 64))
    x[1, 3] = float("nan")
    x[2] = 0.0
    expected = reference.int8_linear(x, w, ws, b)
    actual = cpp.int8_linear(x, w, ws, b, None, DEFAULT_EPS, torch.float32)
    assert torch.equal(actual[[0, 2, 3]], expected[[0, 2, 3]])  # an all-zero row: the eps floor, exact zeros
    assert actual[1].isnan().all() and expected[1].isnan().all()  # a NaN in a row: the whole row is NaN


def test_forms_the_cpp_kernel_leaves_to_the_composition(cpp):
    x, w, ws, b = _case((4, 64), dtype=torch.bfloat16)
    assert cpp.int8_linear(x, w, ws, b, None, DEFAULT_EPS, torch.float16) is None  # an output of a third dtype
    assert cpp.int8_linear(x, w, ws.half(), b, None, DEFAULT_EPS, torch.bfloat16) is None  # a scale of a third dtype
    # the registered op still answers them, through the composition
    expected = reference.int8_linear(x, w, ws, b, None, DEFAULT_EPS, torch.float16)
    assert torch.equal(OP(x, w, ws, b, None, DEFAULT_EPS, torch.float16), expected)
    assert torch.equal(_cpu.KERNELS["int8_linear"](x, w, ws, b, None, DEFAULT_EPS, torch.float16), expected)


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "x": a["x"].double()}, "x must be float32, bfloat16 or float16"),
    (lambda a: {**a, "weight": a["weight"].float()}, "weight must be a 2-D int8 tensor"),
    (lambda a: {**a, "weight": a["weight"][:, :32]}, "does not take x's last dimension 64"),
    (lambda a: {**a, "weight_scale": a["weight_scale"][:5]}, "weight_scale must hold 48 values"),
    (lambda a: {**a, "weight_scale": a["weight_scale"].half()}, "weight_scale must hold 48 values"),
    (lambda a: {**a, "bias": a["bias"][:5]}, r"bias must be \[48\]"),
    (lambda a: {**a, "compensation": a["weight"].sum(1)}, "compensation must be None or 48 int32 values"),
    (lambda a: {**a, "eps": 0.0}, "eps must be positive"),
    (lambda a: {**a, "out_dtype": torch.int32}, "out_dtype must be float32, bfloat16 or float16"),
], ids=["float64-x", "float-weight", "width", "scale-count", "scale-dtype", "bias", "compensation", "eps", "out-dtype"])
def test_bad_arguments_are_named(change, message):
    x, w, ws, b = _case((4, 64), bias_dtype=torch.float32)
    args = change(dict(x=x, weight=w, weight_scale=ws, bias=b, compensation=None, eps=DEFAULT_EPS, out_dtype=None))
    with pytest.raises(ValueError, match=message):
        OP(*args.values())
    with pytest.raises(ValueError, match=message):
        reference.int8_linear(*args.values())


# ------------------------------------------------------------------------------------------------ dequant_linear
DEQUANT = torch.ops.mindiesd.dequant_linear.default
STORAGE = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def _stored(n, k, storage, seed=3):
    g = torch.Generator().manual_seed(seed)
    if storage == torch.int8:
        return torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return (torch.randn(n, k, generator=g) * 4).to(storage)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_dequant_reference_is_torchao_eager_bit_for_bit(dtype, config, bias):
    quantization = pytest.importorskip("torchao.quantization")
    layer = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantization.quantize_(layer, getattr(quantization, config)())
    x = _case((3, 7, 96), dtype=dtype)[0]
    weight = layer.weight
    scale_first = config.startswith("Float8")
    # torchao casts an int8 layer's scale to x's dtype before it multiplies the output
    scale = weight.scale if scale_first else weight.scale.to(dtype)
    with torch.no_grad():
        expected = layer(x)
        actual = reference.dequant_linear(x, weight.qdata, scale, layer.bias, scale_first, expected.dtype)
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)


def _gemm_in_float32(cpp, dtype) -> bool:
    """Whether the C++ dequant_linear multiplies 16-bit x in float32: builds for CPUs without 16-bit GEMM
    instructions (below AVX-512), where ATen's 16-bit GEMM widens in software."""
    return dtype != torch.float32 and "AVX512" not in cpp.capability()


def _dequant_expected(cpp, x, w, ws, b, scale_first, out_dtype):
    """The reference, with its GEMM of x's 16-bit values run in float32 and rounded to x's type where the kernel
    does so (:func:`_gemm_in_float32`): the same products, summed in float32 in another order."""
    if not _gemm_in_float32(cpp, x.dtype):
        return reference.dequant_linear(x, w, ws, b, scale_first, out_dtype)
    mm = torch.mm
    with mock.patch.object(torch, "mm", lambda a, c: mm(a.float(), c.float()).to(a.dtype)):
        return reference.dequant_linear(x, w, ws, b, scale_first, out_dtype)


@pytest.mark.parametrize("scale_first", [True, False], ids=["scale_first", "scale_after"])
@pytest.mark.parametrize("storage", STORAGE, ids=ids)
@pytest.mark.parametrize("combination", COMBINATIONS, ids=lambda c: "-".join(ids(d) if d else "none" for d in c))
def test_dequant_cpp_kernel_is_bit_exact_with_the_reference(cpp, combination, storage, scale_first):
    """Bit-exact with the reference, whose GEMM runs in float32 where the kernel's does (16-bit x below AVX-512);
    that GEMM stays within the 16-bit GEMM's own rounding of torchao's layer."""
    dtype, scale_dtype, bias_dtype, out_dtype = combination
    x, _, ws, b = _case((5, 33, 72), dtype=dtype, scale_dtype=scale_dtype, bias_dtype=bias_dtype)
    w = _stored(48, 72, storage)
    expected = _dequant_expected(cpp, x, w, ws, b, scale_first, out_dtype)
    raw = cpp.dequant_linear(x, w, ws, b, scale_first, expected.dtype)
    assert raw is not None and raw.dtype == expected.dtype and raw.shape == expected.shape and raw.is_contiguous()
    assert torch.equal(raw, expected)
    assert torch.equal(DEQUANT(x, w, ws, b, scale_first, out_dtype), expected)
    unfused = reference.dequant_linear(x, w, ws, b, scale_first, out_dtype)
    torch.testing.assert_close(raw, unfused, **TOLERANCE[dtype])


#: Two float32 sums of the same products in different orders, rounded to a 16-bit type, differ by a unit of its last
#: place at most where they do not cancel; the bounds allow a few, relative to the output's magnitude.
TOLERANCE = {torch.float32: dict(rtol=0, atol=0), torch.bfloat16: dict(rtol=8e-3, atol=2e-2),
             torch.float16: dict(rtol=1e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=ids)
def test_dequant_16_bit_gemm_in_float32_is_as_close_to_the_exact_product_as_atens(cpp, dtype):
    """Where the kernel multiplies 16-bit x in float32, its error against the exact product (float64) is of the
    size of ATen's 16-bit GEMM's, over rows long enough for the sums' rounding to show."""
    if not _gemm_in_float32(cpp, dtype):
        pytest.skip(f"the {cpp.capability()} build runs ATen's 16-bit GEMM")
    x, _, ws, _ = _case((256, 512), n=96, dtype=dtype, scale_dtype=torch.float32)
    w = _stored(96, 512, torch.int8)
    ones = torch.ones_like(ws)
    exact = x.double() @ w.double().t()
    fused = cpp.dequant_linear(x, w, ones, None, False, dtype).double()
    eager = torch.mm(x, w.t().to(dtype)).double()
    fused_error, eager_error = ((result - exact).abs().max() for result in (fused, eager))
    assert fused_error <= 2 * eager_error, (fused_error, eager_error)


def test_dequant_kernel_reuses_its_buffer_across_weights_of_other_sizes(cpp):
    """The dequantized weight's buffer is kept between calls: a smaller weight after a larger one, and a larger one
    after that, each give their own layer's result."""
    for n, k in ((64, 96), (8, 16), (96, 128), (8, 16)):
        x, _, ws, b = _case((4, k), n=n, bias_dtype=torch.float32)
        w = _stored(n, k, torch.float8_e4m3fn, seed=n + k)
        expected = reference.dequant_linear(x, w, ws, b, True, torch.float32)
        assert torch.equal(cpp.dequant_linear(x, w, ws, b, True, torch.float32), expected)
        half = x.bfloat16()  # a 16-bit GEMM (in float32 below AVX-512) through the same buffer
        assert torch.equal(cpp.dequant_linear(half, w, ws, b, True, torch.float32),
                           _dequant_expected(cpp, half, w, ws, b, True, torch.float32))


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "weight": a["weight"].to(torch.uint8)}, "weight must be a 2-D int8 or float8 tensor"),
    (lambda a: {**a, "weight": a["weight"][:, :32]}, "does not take x's last dimension 64"),
    (lambda a: {**a, "weight_scale": a["weight_scale"][:5]}, "weight_scale must hold 48 values"),
    (lambda a: {**a, "x": a["x"].double()}, "x must be float32, bfloat16 or float16"),
    (lambda a: {**a, "out_dtype": torch.int8}, "out_dtype must be float32, bfloat16 or float16"),
], ids=["uint8-weight", "width", "scale-count", "float64-x", "out-dtype"])
def test_dequant_bad_arguments_are_named(change, message):
    x, _, ws, b = _case((4, 64), bias_dtype=torch.float32)
    args = change(dict(x=x, weight=_stored(48, 64, torch.float8_e4m3fn), weight_scale=ws, bias=b, scale_first=True,
                       out_dtype=torch.float32))
    with pytest.raises(ValueError, match=message):
        DEQUANT(*args.values())
