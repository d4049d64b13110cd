"""Weights stored quantized (float8, int8, uint8; torchao's tensor subclasses) around the fused sites of a DiT block:
the graph compiles without a fallback (``strict`` raises on any internal failure), every site around the quantized
linear layers fuses as it does unquantized, the output is eager's, and freezing never folds a dequantized copy of a
quantized weight."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_utils import FAMILIES, aten_graph, run_compiled
from mindiesd.compilation import CompilationConfig, MindieSDBackend
from mindiesd.compilation.passes.matcher import Cast, Var, match
from mindiesd.ops.dtypes import is_compute_float, promoted, widens

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: The block's fused sites: its adaLN, the GELU between the linear layers, the gated residual, the final RMSNorm.
SITES = {"adalayernorm": 1, "fast_gelu": 1, "mul_add": 1, "rms_norm": 1}
#: max |compiled - eager| / max |eager|: the fused ops round as unquantized (test_fusion_patterns's bounds).
MAX_ERROR = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
D = 64


class Block(nn.Module):
    """adaLN-modulated layer norm, linear, tanh-GELU, linear, gated residual and RMSNorm: the sites that surround
    a DiT's linear layers; and a table computed from a buffer alone, which freezing folds."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj_in, self.proj_out, self.norm = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.RMSNorm(D)
        self.register_buffer("freqs", torch.randn(D, generator=g))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p is self.norm.weight else 0.0))

    def forward(self, x, scale, shift, gate):
        h = F.layer_norm(x, [D], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        h = self.proj_out(F.gelu(self.proj_in(h), approximate="tanh"))
        return self.norm(x + gate[:, None] * h) * (torch.cos(self.freqs) + 1)


class Packed(nn.Module):
    """A linear layer whose weight is stored in ``storage`` with a scale per output row (and a zero point of 128
    for uint8), dequantized in the forward as a checkpoint quantized by hand is."""

    def __init__(self, linear: nn.Linear, storage: torch.dtype):
        super().__init__()
        w = linear.weight.detach().float()
        top = torch.finfo(storage).max if storage.is_floating_point else 127.0
        scale = w.abs().amax(1, keepdim=True) / top
        q = w / scale
        if not storage.is_floating_point:
            q = q.round() + (128 if storage == torch.uint8 else 0)
        self.zero = 128 if storage == torch.uint8 else 0
        self.register_buffer("weight_packed", q.to(storage))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        w = self.weight_packed.to(x.dtype)
        if self.zero:
            w = w - self.zero
        return F.linear(x, w * self.scale, self.bias)


def _inputs(dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g).to(dtype) * (0.3 if len(shape) == 2 else 1.0)
            for shape in ((2, 16, D), (2, D), (2, D), (2, D))]


def _relative_error(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _check(block, dtype):
    """Compiled with ``strict``: every site fused, the buffer's table folded and nothing else, eager's output;
    returns the backend."""
    actual, expected, counts, backend = run_compiled(block, *_inputs(dtype), config=CompilationConfig(strict=True))
    assert counts == {f: SITES.get(f, 0) for f in FAMILIES}
    (record,) = backend.report().records
    assert record.fallback is None
    _only_small_values_folded(backend, record)
    assert _relative_error(actual, expected) <= MAX_ERROR[dtype]
    return backend


def _only_small_values_folded(backend, record):
    """The buffer's table is folded, and besides it only values of one number per output channel (a quantized
    weight's scales in x's dtype, its column sums): never a dequantized [N, K] weight."""
    folded = [n.meta["val"] for gm in backend.graphs for n in gm.graph.nodes
              if n.op == "placeholder" and n.name.startswith("folded_")]
    assert record.folded_constants == len(folded) >= 1 and any(v.shape == (D,) for v in folded)
    assert all(v.numel() <= 4 * D for v in folded), [tuple(v.shape) for v in folded]


def test_the_dtype_rules_leave_storage_formats_out():
    for storage in (*FLOAT8, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
        assert not is_compute_float(storage) and promoted(storage, torch.float32) is None
        assert not widens(storage, torch.float32) and not widens(torch.float32, storage)
    assert promoted(torch.int8, torch.bfloat16) == torch.bfloat16 and promoted(torch.uint8) == torch.uint8
    assert widens(torch.bfloat16, torch.float32) and not widens(torch.float32, torch.bfloat16)
    assert not widens(torch.int8, torch.float32), "an integer is no float operand of a fused op"


def test_a_cast_from_a_storage_format_is_no_cast_to_look_through():
    gm = aten_graph(lambda w, x: w.to(torch.float32) * x, torch.randn(4).to(torch.float8_e4m3fn), torch.randn(4))
    (cast,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten._to_copy.default]
    assert match(Cast(Var("w")), cast)["w"] is cast, "the float8 input is not bound through its cast"
    assert match(Cast(Var("w"), lossy=True), cast)["w"] is cast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("storage", [*FLOAT8, torch.int8, torch.uint8], ids=lambda d: str(d).replace("torch.", ""))
def test_hand_packed_weights_fuse_every_site_and_are_never_folded_dequantized(storage, dtype):
    block = Block().to(dtype).eval()
    block.proj_in, block.proj_out = Packed(block.proj_in, storage), Packed(block.proj_out, storage)
    backend = _check(block, dtype)
    # the graph reads the packed weights themselves, never a folded full-precision copy of them
    (graph,) = backend.graphs
    packed = [n for n in graph.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == storage]
    assert len(packed) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig",
                                    "Float8WeightOnlyConfig"])
def test_torchao_quantized_linear_layers_leave_every_site_fused_and_the_tables_folded(config, dtype):
    quantization = pytest.importorskip("torchao.quantization")
    block = Block().to(dtype).eval()
    quantization.quantize_(block, getattr(quantization, config)())
    assert type(block.proj_in.weight).__name__ in ("Int8Tensor", "Float8Tensor")
    if not config.startswith("Int8Dynamic"):
        _check(block, dtype)
        return
    # the activations are rounded to int8 per row: a fused op that rounds one unit differently moves a code by a
    # step, so the bound is eager's own reaction to a move of the input by the dtype's unit roundoff
    inputs = _inputs(dtype)
    actual, expected, counts, backend = run_compiled(block, *inputs, config=CompilationConfig(strict=True))
    assert counts == {f: SITES.get(f, 0) for f in FAMILIES}
    (record,) = backend.report().records
    assert record.fallback is None
    _only_small_values_folded(backend, record)
    signs = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(2)).sign()
    with torch.no_grad():
        moved = block((inputs[0].float() * (1 + torch.finfo(dtype).eps / 2 * signs)).to(dtype), *inputs[1:])
    spread = _relative_error(moved, expected)
    assert 0 < spread and _relative_error(actual, expected) <= 2 * spread


class Attention(nn.Module):
    """Q, K and V projections of one input: the siblings merge_projections merges."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (2, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)


def _merging(module, x):
    """(compiled output, eager output, the graph's record) with merge_projections forced on."""
    backend = MindieSDBackend(CompilationConfig(strict=True), force_fast="merge_projections")
    with torch.no_grad():
        expected = module(x)
        actual = torch.compile(module, backend=backend, fullgraph=True)(x)
    (record,) = backend.report().records
    return actual, expected, record


@pytest.mark.parametrize("storage", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig", torch.int8],
                         ids=lambda s: str(s).replace("torch.", ""))
def test_quantized_projections_are_not_merged_and_the_log_says_why(storage, caplog):
    x = torch.randn(2, 16, D)
    assert _merging(Attention().eval(), x)[2].matches["merge_projections"] == 1, "merged where not quantized"

    quantized = Attention().eval()
    if isinstance(storage, torch.dtype):
        quantized.q, quantized.k, quantized.v = (Packed(p, storage) for p in (quantized.q, quantized.k, quantized.v))
    else:
        quantization = pytest.importorskip("torchao.quantization")
        quantization.quantize_(quantized, getattr(quantization, storage)())
    with caplog.at_level("INFO", logger="mindiesd.compilation"):
        actual, expected, record = _merging(quantized, x)
    assert record.matches["merge_projections"] == 0
    assert "3 linear layers read quantized weights" in record.skipped["merge_projections"]  # the report says why
    assert "3 linear layers read quantized weights" in caplog.text
    assert _relative_error(actual, expected) <= MAX_ERROR[torch.float32]
