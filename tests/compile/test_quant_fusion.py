"""The int8_linear and dequant_linear families: torchao's int8 dynamic-quantization linear layers become one
``mindiesd.int8_linear`` each, and its weight-only int8 and float8 layers one ``mindiesd.dequant_linear``, bit-exact
with the unfused graph (and so with eager), in every dtype, with and without bias, at any rank and under symbolic
sizes; forms with other arithmetic (a zero point, another range) are left alone."""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_utils import run_compiled
from mindiesd.compilation import CompilationConfig
from mindiesd.compilation.families import FAMILIES

quantization = pytest.importorskip("torchao.quantization")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ids = lambda d: str(d).removeprefix("torch.")  # noqa: E731
#: Every family but int8_linear off: the graph's other arithmetic is eager's, so the output must be eager's bit
#: for bit (a fused GELU rounds differently, and int8 quantization turns one ulp into a whole quantization step).
ONLY_INT8 = CompilationConfig(strict=True, fusion_patterns={f"enable_{f}": f == "int8_linear" for f in FAMILIES})


def _quantized(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    model = model.eval().to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantization.quantize_(model, quantization.Int8DynamicActivationInt8WeightConfig())
    return model


def _mlp(dtype, bias=True):
    torch.manual_seed(0)
    return _quantized(nn.Sequential(nn.Linear(64, 96, bias=bias), nn.GELU(approximate="tanh"),
                                    nn.Linear(96, 48, bias=bias)), dtype)


def _x(shape, dtype, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _calls(backend, op=torch.ops.mindiesd.int8_linear.default):
    return sum(node.target is op for gm in backend.graphs for node in gm.graph.nodes)


@pytest.mark.parametrize("shape", [(2, 8, 64), (16, 64)], ids=["3d", "2d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_each_layer_is_one_op_and_the_output_is_eagers_bit_for_bit(dtype, bias, shape):
    actual, expected, counts, backend = run_compiled(_mlp(dtype, bias), _x(shape, dtype), config=ONLY_INT8)
    assert _calls(backend) == 2 and backend.report().matches["int8_linear"] == 2
    for op in (torch.ops.aten._int_mm.default, torch.ops.aten.amax.default, torch.ops.aten.round.default):
        assert _calls(backend, op) == 0, f"{op} left in the graph"
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_with_every_family_on_the_block_fuses_and_stays_within_quantization_error(dtype):
    """The GELU between the layers is fused too; its rounding differs from eager's by an ulp, which quantization
    may turn into a step of the int8 grid: the tolerance is that of one quantization step of the largest output."""
    actual, expected, counts, backend = run_compiled(_mlp(dtype), _x((2, 8, 64), dtype),
                                                     config=CompilationConfig(strict=True))
    assert backend.report().matches["int8_linear"] == 2 and counts["fast_gelu"] == 1
    assert actual.dtype == expected.dtype
    error = ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    assert error < 3e-2


#: torchao's int8 x int8 product by processor (torchao/kernel/intmm.py, _int_scaled_matmul_cpu), as its capability
#: checks report (AMX tiles, VNNI): each traced on this machine whatever its own processor has.
CPUS = {"amx": (True, True), "vnni_no_amx": (False, True), "neither": (False, False)}


@contextlib.contextmanager
def _processor(amx: bool, vnni: bool):
    intmm = pytest.importorskip("torchao.kernel.intmm")
    with mock.patch.object(intmm, "_cpu_is_amx_tile_supported", lambda: amx), \
            mock.patch.object(intmm, "_cpu_is_vnni_supported", lambda: vnni):
        yield


def _unsigned_form_traced() -> bool:
    """Whether torchao shifts to uint8 where VNNI has no AMX beside it (from torch 2.12 on)."""
    from torchao.utils import torch_version_at_least

    return torch_version_at_least("2.12.0.dev")


@pytest.mark.parametrize("freezing", [True, False], ids=["frozen", "unfrozen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("cpu", CPUS)
def test_every_processors_form_is_one_op_and_eagers_bit_for_bit(cpu, dtype, freezing):
    """The signed form (AMX, or no VNNI) and the uint8 form with its column-sum compensation (VNNI without AMX)
    both fuse; the compensation is folded with the weights when frozen (no per-call sum), read as computed when
    not, and the output is eager's under the same processor's form."""
    unsigned = cpu == "vnni_no_amx" and _unsigned_form_traced()
    config = CompilationConfig(strict=True, enable_freezing=freezing,
                               fusion_patterns={f"enable_{f}": f == "int8_linear" for f in FAMILIES})
    with _processor(*CPUS[cpu]):
        actual, expected, counts, backend = run_compiled(_mlp(dtype), _x((2, 8, 64), dtype), config=config)
    assert _calls(backend) == 2 and backend.report().matches["int8_linear"] == 2
    assert _calls(backend, torch.ops.aten._int_mm.default) == 0 and _calls(backend, torch.ops.aten.sub.Tensor) == 0
    compensations = [node.args[4] for gm in backend.graphs for node in gm.graph.nodes
                     if node.target is torch.ops.mindiesd.int8_linear.default]
    if unsigned:
        assert all(c is not None for c in compensations)
        summed = _calls(backend, torch.ops.aten.sum.dim_IntList)
        assert summed == (0 if freezing else 2), "the column sums are folded when frozen, computed when not"
    else:
        assert compensations == [None, None]
    assert torch.equal(actual, expected)


def test_a_uint8_product_less_something_else_is_left_alone():
    """_int_mm(q + 128 as uint8, t(w)) less a value that is not 128 times w's column sums: not torchao's
    arithmetic, left unfused and exact."""
    if not _unsigned_form_traced():
        pytest.skip("torch's _int_mm takes a uint8 operand from 2.12 on")
    w, ws, b = _weights()

    def layer(x, other):
        q, scale = _quantize_rows(x)
        shifted = (q.view(-1, 64).to(torch.int32) + 128).to(torch.uint8)
        acc = torch._int_mm(shifted, w.t()) - other
        return (acc.to(torch.float32) * scale.view(-1, 1)) * ws.view(-1) + b

    other = w.t().sum(0, keepdim=True, dtype=torch.int32) * 127
    actual, expected, counts, backend = run_compiled(layer, _x((16, 64), torch.float32), other, config=ONLY_INT8)
    assert _calls(backend) == 0 and torch.equal(actual, expected)


def test_the_switch_turns_it_off():
    off = CompilationConfig(strict=True, fusion_patterns={"enable_int8_linear": False})
    actual, expected, counts, backend = run_compiled(_mlp(torch.float32), _x((2, 8, 64), torch.float32), config=off)
    assert _calls(backend) == 0 and _calls(backend, torch.ops.aten._int_mm.default) == 2
    assert "int8_linear" not in backend.report().records[0].matches or \
        backend.report().records[0].matches["int8_linear"] == 0
    torch.testing.assert_close(actual, expected, rtol=3e-2, atol=3e-2)


def test_symbolic_sizes_fuse_and_stay_exact():
    model = _mlp(torch.bfloat16)
    for length in (8, 12, 20):
        actual, expected, counts, backend = run_compiled(model, _x((2, length, 64), torch.bfloat16), config=ONLY_INT8,
                                                         dynamic=True)
        assert _calls(backend) == 2
        assert torch.equal(actual, expected)


# --------------------------------------------------------------------- torchao's arithmetic written out by hand
def _quantize_rows(x, zero_point=0, half_range=127.5, eps=torch.finfo(torch.float32).eps):
    """torchao's per-row symmetric int8 quantization, as its aten ops (a zero point or range given here changes
    the arithmetic: such forms are not the fused op's)."""
    low = torch.minimum(x.amin(-1, keepdim=True), torch.zeros_like(x.amin(-1, keepdim=True)))
    high = torch.maximum(x.amax(-1, keepdim=True), torch.zeros_like(x.amax(-1, keepdim=True)))
    scale = (torch.maximum(-low, high) / half_range).clamp(eps)
    zero = torch.full_like(scale, zero_point).to(torch.int8)
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zero, -128, 127).to(torch.int8)
    return q, scale


def _layer(q, scale, w, ws, b):
    acc = torch._int_mm(q.view(-1, q.shape[-1]), w.t())
    y = (acc.to(torch.float32) * scale.view(-1, 1)) * ws.view(-1)
    return y.view(*q.shape[:-1], -1) + b


def _weights(n=32, k=64, seed=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, 1, generator=g) * 0.01,
            torch.randn(n, generator=g))


def test_one_quantization_read_by_two_layers_fuses_both():
    """A graph that quantizes x once for two layers (as a graph with shared subexpressions does): each layer
    becomes an op, and the shared quantization is dropped once nothing reads it."""
    (w1, s1, b1), (w2, s2, b2) = _weights(seed=2), _weights(seed=3)

    def two_layers(x):
        q, scale = _quantize_rows(x)
        return _layer(q, scale, w1, s1, b1), _layer(q, scale, w2, s2, b2)

    actual, expected, counts, backend = run_compiled(two_layers, _x((2, 8, 64), torch.float32), config=ONLY_INT8)
    assert _calls(backend) == 2 and _calls(backend, torch.ops.aten.amin.default) == 0
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


@pytest.mark.parametrize("form", [dict(zero_point=1), dict(half_range=127.0)], ids=["zero_point_1", "range_127"])
def test_other_arithmetic_is_left_alone(form):
    w, ws, b = _weights()

    def layer(x):
        return _layer(*_quantize_rows(x, **form), w, ws, b)

    actual, expected, counts, backend = run_compiled(layer, _x((2, 8, 64), torch.float32), config=ONLY_INT8)
    assert _calls(backend) == 0 and _calls(backend, torch.ops.aten._int_mm.default) == 1
    assert torch.equal(actual, expected)


def test_a_scale_taken_over_another_dimension_is_left_alone():
    w, ws, b = _weights(n=32, k=8)

    def layer(x):  # the scale per column of [8, 8] rows: same ops, another dimension
        low = torch.minimum(x.amin(0, keepdim=True), torch.zeros_like(x.amin(0, keepdim=True)))
        high = torch.maximum(x.amax(0, keepdim=True), torch.zeros_like(x.amax(0, keepdim=True)))
        scale = (torch.maximum(-low, high) / 127.5).clamp(torch.finfo(torch.float32).eps)
        q = torch.clamp(torch.round(x * (1.0 / scale)), -128, 127).to(torch.int8)
        acc = torch._int_mm(q, w.t())
        return (acc.to(torch.float32) * scale.view(-1, 1)) * ws.view(-1) + b

    actual, expected, counts, backend = run_compiled(layer, _x((8, 8), torch.float32), config=ONLY_INT8)
    assert _calls(backend) == 0
    assert torch.equal(actual, expected)


def test_reported_and_documented_as_a_family():
    family = FAMILIES["int8_linear"]
    assert family.has_op and family.switch == "enable_int8_linear" and "torchao" in family.doc
    assert list(FAMILIES).index("int8_linear") < list(FAMILIES).index("mul_add"), \
        "its rescale ends in a multiply-add that mul_add would otherwise take"


# ----------------------------------------------------------------------------------- weight-only: dequant_linear
ONLY_DEQUANT = CompilationConfig(strict=True,
                                 fusion_patterns={f"enable_{f}": f == "dequant_linear" for f in FAMILIES})
WEIGHT_ONLY = ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"]


def _weight_only_mlp(dtype, config, bias=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=bias), nn.GELU(approximate="tanh"), nn.Linear(96, 48, bias=bias))
    model = model.eval().to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantization.quantize_(model, getattr(quantization, config)())
    return model


@pytest.mark.parametrize("shape", [(2, 8, 64), (16, 64)], ids=["3d", "2d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("config", WEIGHT_ONLY)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_weight_only_layers_are_one_op_each_and_the_output_is_eagers(dtype, config, bias, shape):
    actual, expected, counts, backend = run_compiled(_weight_only_mlp(dtype, config, bias), _x(shape, dtype),
                                                     config=ONLY_DEQUANT)
    assert _calls(backend, torch.ops.mindiesd.dequant_linear.default) == 2
    assert backend.report().matches["dequant_linear"] == 2
    assert _calls(backend, torch.ops.aten.mm.default) == 0
    # no copy of a weight is left (a 16-bit int8 layer keeps torchao's cast of its N scales, read by the op)
    copies = [node.meta["val"].shape for gm in backend.graphs for node in gm.graph.nodes
              if node.target is torch.ops.aten._to_copy.default]
    assert all(len(shape) < 2 or min(shape) == 1 for shape in copies), copies
    assert actual.dtype == expected.dtype
    if _gemm_in_float32(dtype):  # the same products summed in float32 in another order than ATen's 16-bit GEMM
        torch.testing.assert_close(actual, expected, rtol=8e-3, atol=2e-2 * expected.abs().max().item())
    else:
        assert torch.equal(actual, expected)


def _gemm_in_float32(dtype) -> bool:
    """Whether the C++ dequant_linear multiplies 16-bit x in float32 (builds below AVX-512: ATen's 16-bit GEMM
    widens in software there)."""
    from mindiesd.ops.kernels import cpp

    module = cpp.extension()
    return dtype != torch.float32 and module is not None and "AVX512" not in module.capability()


@pytest.mark.parametrize("config", WEIGHT_ONLY)
def test_weight_only_with_every_family_on_and_under_symbolic_sizes(config):
    model = _weight_only_mlp(torch.bfloat16, config)
    for length in (8, 12):
        actual, expected, counts, backend = run_compiled(model, _x((2, length, 64), torch.bfloat16),
                                                         config=CompilationConfig(strict=True), dynamic=True)
        assert backend.report().matches["dequant_linear"] == 2 and counts["fast_gelu"] == 1
        torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)


def test_a_weight_read_twice_keeps_its_cast_for_the_other_reader():
    """A float8 weight whose float32 copy is also returned: the copy is read elsewhere, so the layer is left
    unfused (the match's interior must have no other reader) and the output is eager's."""
    g = torch.Generator().manual_seed(4)
    q = (torch.randn(32, 64, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(32, 1, generator=g)

    def layer(x):
        w = q.t().to(torch.float32) * scale.t()
        return x.reshape(-1, 64) @ w, w

    actual, expected, counts, backend = run_compiled(layer, _x((16, 64), torch.float32), config=ONLY_DEQUANT)
    assert _calls(backend, torch.ops.mindiesd.dequant_linear.default) == 0
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


def test_a_uint8_weight_with_a_zero_point_is_left_alone():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 256, (32, 64), generator=g, dtype=torch.uint8)
    scale = torch.rand(32, generator=g)

    def layer(x):
        return (x @ (q.t().to(torch.float32) - 128)) * scale

    actual, expected, counts, backend = run_compiled(layer, _x((16, 64), torch.float32), config=ONLY_DEQUANT)
    assert _calls(backend, torch.ops.mindiesd.dequant_linear.default) == 0
    assert torch.equal(actual, expected)


class _HeadsThenLinear(nn.Module):
    """Attention's output as diffusers hands it to ``to_out``: heads moved next to the rows and flattened into
    the last dimension, then a linear layer (whose input is a view of a tensor with another last dimension)."""

    def __init__(self, dtype, config):
        super().__init__()
        torch.manual_seed(0)
        self.out = nn.Linear(64, 48).to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantization.quantize_(self.out, getattr(quantization, config)())

    def forward(self, heads):  # [batch, heads, rows, head_dim]
        return self.out(heads.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("config,family", [("Int8DynamicActivationInt8WeightConfig", "int8_linear"),
                                           ("Int8WeightOnlyConfig", "dequant_linear"),
                                           ("Float8WeightOnlyConfig", "dequant_linear")])
def test_a_layer_over_flattened_heads_fuses(config, family):
    only = CompilationConfig(strict=True, fusion_patterns={f"enable_{f}": f == family for f in FAMILIES})
    actual, expected, counts, backend = run_compiled(_HeadsThenLinear(torch.float32, config),
                                                     _x((2, 4, 8, 16), torch.float32), config=only)
    assert backend.report().matches[family] == 1
    assert torch.equal(actual, expected)
