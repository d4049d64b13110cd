"""Elementwise results and linear layers written where the graph reads them (``compilation/cleanup/write_into.py``): a cast after
an op becomes the op's out variant, a concatenation of results the parts written into one buffer. The values are
exactly eager's; what cannot be written as it was computed stays as it was."""

from collections import Counter

import pytest
import torch

from fusion_utils import compile_zoo_model, run_compiled
from mindiesd.compilation import CompilationConfig, MindieSDBackend
from mindiesd.compilation.cleanup.write_into import cast_into, cat_into

aten = torch.ops.aten


def _calls(gm):
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _compiled(fn, *args):
    actual, expected, _, backend = run_compiled(fn, *args, config=CompilationConfig(cache_dir=None))
    torch._dynamo.reset()
    return actual, expected, _calls(backend.graphs[0])


def _exactly(actual, expected):
    for a, e in zip(actual if isinstance(actual, tuple) else (actual,),
                    expected if isinstance(expected, tuple) else (expected,)):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def timestep_embedding(t, freqs):
    emb = t[:, None].float() * freqs[None, :]
    return torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1) * 2.0


def test_a_sinusoidal_embedding_writes_cos_and_sin_into_one_buffer():
    actual, expected, calls = _compiled(timestep_embedding, _randn(1) * 1000, _randn(64))
    _exactly(actual, expected)
    assert calls[aten.cat.default] == 0
    assert calls[aten.cos.out] == calls[aten.sin.out] == 1
    assert calls[aten.cos.default] == calls[aten.sin.default] == 0


def rotary_tables(ids, f0, f1, f2):
    angles = torch.cat([ids[:, 0:1] * f0, ids[:, 1:2] * f1, ids[:, 2:3] * f2], dim=-1)
    return torch.cos(angles).float(), torch.sin(angles).float()


def test_rotary_tables_write_each_axis_into_the_angles_and_round_as_they_store():
    ids = (_randn(40, 3, dtype=torch.float64) * 50).round()
    freqs = [_randn(n, seed=n, dtype=torch.float64).abs() for n in (8, 12, 12)]
    actual, expected, calls = _compiled(rotary_tables, ids, *freqs)
    _exactly(actual, expected)
    # the products write their columns of the angles (strided slices: products round once however they loop);
    # cos and sin are computed in float64 and rounded to float32 as they store
    assert calls[aten.cat.default] == 0 and calls[aten.mul.out] == 3 and calls[aten.mul.Tensor] == 0
    assert calls[aten._to_copy.default] == 0 and calls[aten.cos.out] == calls[aten.sin.out] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_to_16_bits_after_an_op_in_float32_is_the_ops_out_variant(dtype):
    def fn(x):
        return torch.exp(x).to(dtype), torch.sigmoid(x * 3).to(dtype)

    actual, expected, calls = _compiled(fn, _randn(5, 33))
    _exactly(actual, expected)
    assert calls[aten._to_copy.default] == 0 and calls[aten.exp.out] == calls[aten.sigmoid.out] == 1


def test_a_widening_cast_stays():
    def fn(x):
        return torch.cos(x).double() + 1

    actual, expected, calls = _compiled(fn, _randn(5, 33))
    _exactly(actual, expected)
    assert calls[aten._to_copy.default] == 1 and calls[aten.cos.out] == 0


def test_a_transcendental_op_does_not_write_a_strided_slice():
    """cos into every other column block would loop otherwise than cos of its own contiguous result: the
    concatenation stays (products in the same graph still write theirs)."""

    def fn(x, y):
        return torch.cat([torch.cos(x), torch.sin(x)], dim=-1) * 1.5, torch.cat([x * 2, y * 3], dim=-1) * 1.5

    actual, expected, calls = _compiled(fn, _randn(6, 17), _randn(6, 17, seed=1))
    _exactly(actual[0], expected[0])
    _exactly(actual[1], expected[1])
    assert calls[aten.cos.default] == calls[aten.sin.default] == 1 and calls[aten.cos.out] == 0
    assert calls[aten.cat.default] == 1 and calls[aten.mul.out] == 2


def test_a_part_something_else_reads_keeps_the_concatenation():
    def fn(x, y):
        a = x * 2
        return torch.cat([a, y * 3], dim=1) + 1, a.sum()

    actual, expected, calls = _compiled(fn, _randn(1, 4, 8), _randn(1, 5, 8, seed=1))
    _exactly(actual, expected)
    assert calls[aten.cat.default] == 1 and calls[aten.mul.out] == 0


class JointValue(torch.nn.Module):
    """Joint attention's value: the text and image streams' projections, in heads, concatenated along tokens."""

    def __init__(self, dim=32, heads=2, bias=True):
        super().__init__()
        self.heads = heads
        self.to_v = torch.nn.Linear(dim, dim, bias=bias)
        self.add_v_proj = torch.nn.Linear(dim, dim, bias=bias)

    def forward(self, image, text):
        b = image.shape[0]
        v = self.to_v(image).view(b, -1, self.heads, image.shape[-1] // self.heads)
        v_text = self.add_v_proj(text).view(b, -1, self.heads, text.shape[-1] // self.heads)
        return torch.cat([v_text, v], dim=1).transpose(1, 2) * 0.5


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_attentions_value_projections_write_into_the_concatenation(bias, dtype):
    model = JointValue(bias=bias).to(dtype).eval()
    image, text = _randn(1, 12, 32, seed=1, dtype=dtype), _randn(1, 5, 32, seed=2, dtype=dtype)
    actual, expected, calls = _compiled(model, image, text)
    _exactly(actual, expected)  # the same addmm (mm without a bias) on the same rows as eager's linear
    # with a bias the graph holds linear layers; without, the mm of aot's decomposition
    gemm = aten.linear if bias else aten.mm
    assert calls[aten.cat.default] == 0 and calls[gemm.out] == 2 and calls[gemm.default] == 0


def test_a_batch_larger_than_one_keeps_the_concatenation_of_linear_layers():
    """With two samples a stream's token slice is not contiguous: its rows cannot be the GEMM's output."""
    model = JointValue().eval()
    actual, expected, calls = _compiled(model, _randn(2, 12, 32, seed=1), _randn(2, 5, 32, seed=2))
    _exactly(actual, expected)
    assert calls[aten.cat.default] == 1 and calls[aten.linear.out] == 0 and calls[aten.linear.default] == 2


def test_dynamic_shapes_leave_the_graph_as_it_was():
    backend = MindieSDBackend(CompilationConfig(cache_dir=None), keep_graphs=True)
    compiled = torch.compile(timestep_embedding, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for n in (32, 48):
            freqs = _randn(n)
            _exactly(compiled(_randn(1) * 1000, freqs), timestep_embedding(_randn(1) * 1000, freqs))
    torch._dynamo.reset()
    assert all(_calls(gm)[aten.cat.default] == 1 for gm in backend.graphs)


def test_a_graph_that_writes_in_place_is_left_alone():
    from torch.fx import symbolic_trace

    def fn(x, y):
        x.add_(1)
        return torch.cat([x * 2, y * 3])

    gm = symbolic_trace(fn)
    assert cast_into(gm.graph) == 0 and cat_into(gm.graph) == 0


def test_flux_writes_its_embeddings_and_joint_values_in_place_of_the_copies():
    actual, expected, gm = compile_zoo_model("flux", "host")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    calls = _calls(gm)
    # left: the text and image ids' join (graph inputs) and the streams' join before the single blocks (mul_add)
    assert calls[aten.cat.default] == 2
    assert calls[aten._to_copy.default] == 0
    assert calls[aten.cos.out] == calls[aten.sin.out] == 2  # the timestep embedding's and the rotary tables'
    assert calls[aten.linear.out] == 2 * 2  # each double block's value projections
