"""The GEMM rewrites: merged projections (``merge_projections``), the GELU epilogue (``linear_gelu``) and the
linear layer over a concatenation (``cat_linear``).

All are off on CPU by default (measured: no gain on the CPUs tried, docs/fusion-families.md "GEMM rewrites"); the tests declare
them fast on CPU (``MindieSDBackend(force_fast=...)``) to check the rewrites themselves: what is rewritten (counted in
the final graph), what is left alone, the numerics against eager per dtype, and weights changed after compiling.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import TOLERANCE, assert_close, count_fused
from mindiesd.compilation import families
from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDFallbackWarning
from mindiesd.ops.kernels import gemm as _gemm
from mindiesd.zoo._base import modules_named

aten = torch.ops.aten


#: The rewrites the enclosing ``forced`` block has the backends count as fast (``force_fast``).
FORCED: tuple = ()


@contextlib.contextmanager
def forced(*names):
    global FORCED
    previous, FORCED = FORCED, names
    try:
        yield
    finally:
        FORCED = previous


def compile_run(fn, *args, config=None, dynamic=False):
    backend = MindieSDBackend(config or CompilationConfig(cache_dir=None, strict=True), keep_graphs=True,
                              force_fast=FORCED)
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        return compiled(*args), compiled, backend


def calls(backend, *targets):
    return sum(1 for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def gemm_widths(backend):
    """The output widths of the matmuls in the final graphs (sorted): addmm, mm, and the linear calls that tidy makes
    of addmm with a transposed weight."""
    widths = []
    for gm in backend.graphs:
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in (aten.addmm.default, aten.mm.default, aten.linear.default):
                widths.append(int(n.meta["val"].shape[-1]))
    return sorted(widths)


class Attention(torch.nn.Module):
    """q, k, v projections of one input (and optionally a second input's k, v), then attention."""

    def __init__(self, d=32, heads=2, bias=True, context=False, out_q=False, flat_q=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.out_q, self.flat_q = heads, out_q, flat_q
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(d, d, bias=bias) for _ in range(3))
        self.context = context
        if context:
            self.add_k, self.add_v = torch.nn.Linear(d, d, bias=bias), torch.nn.Linear(d, d, bias=bias)
        self.to_out = torch.nn.Linear(d, d)

    def split(self, t):
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x, c=None):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        if self.context:
            k = torch.cat([self.add_k(c), k], dim=1)
            v = torch.cat([self.add_v(c), v], dim=1)
        o = F.scaled_dot_product_attention(self.split(q), self.split(k), self.split(v))
        o = self.to_out(o.transpose(1, 2).reshape(x.shape))
        if self.flat_q:
            o = o + q.view(-1)[: o.numel()].view(o.shape)
        return (o, q) if self.out_q else o


# ------------------------------------------------------------------------------------------ merge_projections
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_qkv_projections_become_one_matmul_and_match_eager(dtype, bias):
    model = Attention(bias=bias).to(dtype).eval()
    x = torch.randn(2, 24, 32, dtype=dtype)
    with forced("merge_projections"):
        out, _, backend = compile_run(model, x)
    (record,) = backend.report().records
    assert record.matches["merge_projections"] == 1
    assert record.rules == {f"merge_projections:3_{'addmm' if bias else 'mm'}": 1}
    assert gemm_widths(backend) == [32, 96], "q/k/v: one matmul of width 3*32; to_out alone"
    with torch.no_grad():
        assert_close(out, model(x), dtype)


def test_context_kv_merge_and_a_group_never_spans_an_attention():
    class TwoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Attention(context=True, seed=1), Attention(context=True, seed=2)

        def forward(self, x, c):
            return self.b(self.a(x, c), c)  # both blocks read the same context c

    model = TwoBlocks().eval()
    x, c = torch.randn(1, 16, 32), torch.randn(1, 8, 32)
    with forced("merge_projections"):
        out, _, backend = compile_run(model, x, c)
    (record,) = backend.report().records
    # per block: q/k/v of x, and add_k/add_v of c; the two blocks' context projections are not merged together
    assert record.rules == {"merge_projections:3_addmm": 2, "merge_projections:2_addmm": 2}
    assert gemm_widths(backend) == [32, 32, 64, 64, 96, 96]
    with torch.no_grad():
        assert_close(out, model(x, c))


def test_no_merge_where_a_projection_layout_would_reach_the_output_or_a_dense_view():
    x = torch.randn(2, 24, 32)
    for model in (Attention(out_q=True).eval(), Attention(flat_q=True).eval()):
        with forced("merge_projections"):
            out, _, backend = compile_run(model, x)
        (record,) = backend.report().records
        assert record.matches["merge_projections"] == 0, "q's slice would change the output's / a view's layout"
        assert gemm_widths(backend) == [32, 32, 32, 32]
        with torch.no_grad():
            assert_close(out, model(x))


def test_different_inputs_or_widths_are_not_merged():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(32, 16), torch.nn.Linear(32, 8), torch.nn.Linear(16, 8)

        def forward(self, x, y):
            return self.a(x).sum() + self.c(y).sum() + self.b(y[..., :32].repeat(1, 2)[..., :32]).sum()

    model = Mixed().eval()
    x, y = torch.randn(4, 32), torch.randn(4, 16)
    with forced("merge_projections"):
        out, _, backend = compile_run(model, x, y)
    assert backend.report().records[0].matches["merge_projections"] == 0
    with torch.no_grad():
        torch.testing.assert_close(out, model(x, y))


def test_merged_weight_is_refolded_when_a_weight_changes_in_place():
    model = Attention().eval()
    x = torch.randn(2, 24, 32)
    with forced("merge_projections"):
        _, compiled, backend = compile_run(model, x)
    with torch.no_grad():
        model.to_k.weight.mul_(1.5)  # in place: the version counter moves, the concatenation is folded again
        model.to_v.bias.add_(0.25)
        expected = model(x)
        with torch._dynamo.config.patch(error_on_recompile=True):
            actual = compiled(x)
    assert backend.report().records[0].matches["merge_projections"] == 1
    assert_close(actual, expected)


def test_merged_weights_live_in_the_concatenation_so_data_writes_are_seen():
    """The concatenated weight is not a copy: q/k/v become views of it, so even a write through ``.data`` (which
    moves no version counter: PEFT's merge(), diffusers' fuse_lora) reaches the merged matmul."""
    model = Attention().eval()
    x = torch.randn(2, 24, 32)
    with forced("merge_projections"):
        _, compiled, backend = compile_run(model, x)
    q, k, v = model.to_q.weight, model.to_k.weight, model.to_v.weight
    assert isinstance(q, torch.nn.Parameter) and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert (k.storage_offset(), v.storage_offset()) == (q.storage_offset() + q.numel(), q.storage_offset() + 2 * q.numel())
    with torch.no_grad():
        model.to_k.weight.data += 0.5  # invisible to version counters
        model.to_v.bias.data.mul_(-1.0)
        expected = model(x)
        with torch._dynamo.config.patch(error_on_recompile=True):
            actual = compiled(x)
    assert_close(actual, expected)
    assert model.to_q.weight.requires_grad and model.to_q.weight.grad is None


def test_a_second_graph_over_the_same_weights_reads_them_in_place():
    """A recompile for another shape folds the same weights: they already lie side by side, so its merged
    weight is a view of them (no copy, and the two graphs do not take the weights from each other)."""
    model = Attention().eval()
    with forced("merge_projections"):
        _, compiled, backend = compile_run(model, torch.randn(2, 24, 32))
        storage = model.to_q.weight.untyped_storage().data_ptr()
        with torch.no_grad():
            for n in (40, 24, 40):
                x = torch.randn(2, n, 32)
                assert_close(compiled(x), model(x))
    assert backend.report().graphs == 2
    assert model.to_q.weight.untyped_storage().data_ptr() == storage
    assert model.to_v.weight.untyped_storage().data_ptr() == storage


def test_merge_needs_freezing_and_follows_its_switch_and_the_device_declaration():
    model, x = Attention().eval(), torch.randn(2, 24, 32)
    _, _, backend = compile_run(model, x)  # CPU default: declared not faster
    record = backend.report().records[0]
    assert record.matches.get("merge_projections", 0) == 0
    assert "not faster" in record.skipped["merge_projections"]
    with forced("merge_projections"):
        _, _, backend = compile_run(model, x, config=CompilationConfig(cache_dir=None, enable_freezing=False))
        assert backend.report().records[0].skipped["merge_projections"] == "needs enable_freezing"
        assert gemm_widths(backend) == [32, 32, 32, 32]
        off = CompilationConfig(cache_dir=None, fusion_patterns={"enable_merge_projections": False})
        _, _, backend = compile_run(model, x, config=off)
        assert "merge_projections" not in backend.report().records[0].matches
        assert gemm_widths(backend) == [32, 32, 32, 32]


def test_merge_with_dynamic_shapes():
    model = Attention().eval()
    with forced("merge_projections"):
        for n in (24, 40):
            x = torch.randn(2, n, 32)
            out, compiled, backend = compile_run(model, x, dynamic=True)
            with torch.no_grad():
                assert_close(out, model(x))
    assert backend.report().records[0].matches["merge_projections"] == 1


# ------------------------------------------------------------------------------------------------ linear_gelu
class Mlp(torch.nn.Module):
    def __init__(self, d=32, hidden=64, bias=True, explicit=False, approximate="tanh", reuse=False):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(d, hidden, bias=bias), torch.nn.Linear(hidden, d)
        self.explicit, self.approximate, self.reuse = explicit, approximate, reuse

    def forward(self, x):
        h = self.up(x)
        if self.explicit:
            g = 0.5 * h * (1 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3))))
        else:
            g = F.gelu(h, approximate=self.approximate)
        out = self.down(g)
        return out + h[..., : out.shape[-1]] if self.reuse else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["aten", "explicit", "no_bias", "2d"])
def test_linear_then_tanh_gelu_becomes_linear_gelu(dtype, form):
    model = Mlp(bias=form != "no_bias", explicit=form == "explicit").to(dtype).eval()
    x = torch.randn(*((48,) if form == "2d" else (2, 24)), 32, dtype=dtype)
    with forced("linear_gelu"):
        out, _, backend = compile_run(model, x)
    counts = count_fused(backend)
    assert calls(backend, torch.ops.mindiesd.linear_gelu.default) == 1 and counts["fast_gelu"] == 0
    with torch.no_grad():
        assert_close(out, model(x), dtype)


def test_linear_gelu_leaves_exact_gelu_and_shared_outputs_to_the_other_families():
    x = torch.randn(2, 24, 32)
    with forced("linear_gelu"):
        for model, gelus in ((Mlp(approximate="none").eval(), 0), (Mlp(reuse=True).eval(), 1)):
            out, _, backend = compile_run(model, x)
            assert calls(backend, torch.ops.mindiesd.linear_gelu.default) == 0
            assert count_fused(backend)["fast_gelu"] == gelus
            with torch.no_grad():
                assert_close(out, model(x))


def test_linear_gelu_is_off_on_cpu_by_default_and_fast_gelu_fuses_the_gelu():
    model, x = Mlp().eval(), torch.randn(2, 24, 32)
    _, _, backend = compile_run(model, x)
    record = backend.report().records[0]
    assert "linear_gelu" in record.skipped and record.matches["fast_gelu"] == 1


def test_linear_gelu_kernels_match_the_reference():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 32, generator=g), torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    reference = F.gelu(F.linear(x, w, b), approximate="tanh")
    for kernel in (_gemm.linear_gelu_cpu, _gemm.linear_gelu_cuda):
        for bias in (b, None):
            expected = reference if bias is not None else F.gelu(F.linear(x, w), approximate="tanh")
            torch.testing.assert_close(kernel(x, w, bias), expected, rtol=1e-5, atol=1e-5)
    # on CPU torch._addmm_activation's GELU is the exact one: the CUDA kernel's check sees it and uses two ops
    assert _gemm.epilogue_is_tanh_gelu(torch.device("cpu"), torch.float32) is False
    torch.testing.assert_close(torch.ops.mindiesd.linear_gelu(x, w, b), reference, rtol=1e-5, atol=1e-5)


def test_linear_gelu_rejects_inputs_that_are_not_a_linear_layer():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="do not make a linear layer"):
        torch.ops.mindiesd.linear_gelu(x, torch.randn(6, 7), None)
    with pytest.raises(ValueError, match="bias"):
        torch.ops.mindiesd.linear_gelu(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="share a dtype"):
        torch.ops.mindiesd.linear_gelu(x, w.double(), None)


def test_force_refuses_a_device_without_a_kernel():
    with pytest.raises(ValueError, match="declares no kernel"):
        families.forced(["linear_gelu"], "npu")
    with pytest.raises(ValueError, match="unknown fusion families"):
        MindieSDBackend(force_fast=["no_such_family"])
    assert families.skip_reason("merge_projections", "cpu", force={"merge_projections"}) is None
    assert families.skip_reason("merge_projections", "cpu") is not None


def test_force_fast_makes_the_rewrites_for_one_backend_and_leaves_the_declarations_alone():
    model, mlp = Attention().eval(), Mlp().eval()
    x = torch.randn(2, 24, 32)
    strict = CompilationConfig(cache_dir=None, strict=True)
    forced_backend = MindieSDBackend(strict, keep_graphs=True, force_fast=("merge_projections", "linear_gelu"))
    for module in (model, mlp):
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(module, backend=forced_backend, fullgraph=True)(x)
            assert_close(out, module(x), torch.float32)
    attention, gelu = forced_backend.report().records
    assert attention.matches["merge_projections"] == 1 and 96 in gemm_widths(forced_backend), "q/k/v in one matmul"
    assert gelu.matches["linear_gelu"] == 1 and calls(forced_backend, torch.ops.mindiesd.linear_gelu.default) == 1
    assert "merge_projections" not in attention.skipped and "linear_gelu" not in gelu.skipped
    assert families.skip_reason("merge_projections", "cpu") is not None  # the declarations are unchanged
    assert families.skip_reason("linear_gelu", "cpu") is not None
    torch._dynamo.reset()
    _, _, plain = compile_run(model, x)  # a backend without force_fast: the CPU declarations hold
    assert plain.report().records[0].matches.get("merge_projections", 0) == 0
    assert "merge_projections" in plain.report().records[0].skipped


def test_force_fast_names_known_families_and_does_not_invent_a_kernel():
    with pytest.raises(ValueError,
                       match="unknown fusion families \\['gelu'\\]; known: \\['flex_attention', 'upsample_nearest', "
                             "'conv_channels_last', 'merge_projections'"):
        MindieSDBackend(force_fast=["gelu"])
    from mindiesd.compilation.pass_manager import skip_reason

    assert skip_reason("linear_gelu", "cpu", force={"linear_gelu"}) is None
    assert "no linear_gelu kernel for npu" in skip_reason("linear_gelu", "npu", force={"linear_gelu"})
    with pytest.raises(ValueError, match="unknown fusion families"):
        skip_reason("rope", "cpu", force={"nope"})


# ----------------------------------------------------------------------------------------------- cat_linear
class CatProjection(torch.nn.Module):
    """Flux's single-block tail: ``proj_out(cat([attn, gelu(proj_mlp(x))], -1))``, optionally with a third input,
    2-D inputs, the concatenation along another dimension, or the concatenation also returned."""

    def __init__(self, d=32, mlp=96, out=48, bias=True, third=False, dim=-1, leak=False):
        super().__init__()
        torch.manual_seed(0)
        self.attn, self.mlp = torch.nn.Linear(d, d), torch.nn.Linear(d, mlp)
        width = (d + mlp + (d if third else 0)) if dim == -1 else d
        self.proj = torch.nn.Linear(width, out, bias=bias)
        self.third, self.dim, self.leak = third, dim, leak

    def forward(self, x):
        parts = [self.attn(x), F.gelu(self.mlp(x), approximate="tanh")]
        if self.dim != -1:
            parts = [parts[0], parts[1][..., : parts[0].shape[-1]]]
        if self.third:
            parts.append(x * 2)
        joined = torch.cat(parts, self.dim)
        out = self.proj(joined)
        return (out, joined) if self.leak else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["bias", "no_bias", "three_inputs", "2d"])
def test_linear_over_a_concatenation_becomes_cat_linear(dtype, form):
    model = CatProjection(bias=form != "no_bias", third=form == "three_inputs").to(dtype).eval()
    x = torch.randn(*((40,) if form == "2d" else (2, 24)), 32, dtype=dtype)
    with forced("cat_linear"):
        out, _, backend = compile_run(model, x)
    assert calls(backend, torch.ops.mindiesd.cat_linear.default) == 1
    assert calls(backend, aten.cat.default) == 0, "the concatenation is not written"
    assert backend.report().records[0].matches["cat_linear"] == 1
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cat_linear_leaves_16_bit_graphs_to_eager_rounding(dtype):
    """In 16-bit the output would hold a rounded partial sum: one rounding more than eager's single GEMM."""
    model = CatProjection().to(dtype).eval()
    x = torch.randn(2, 24, 32, dtype=dtype)
    with forced("cat_linear"):
        out, _, backend = compile_run(model, x)
    assert calls(backend, torch.ops.mindiesd.cat_linear.default) == 0 and calls(backend, aten.cat.default) == 1
    with torch.no_grad():
        assert_close(out, model(x), dtype)


@pytest.mark.parametrize("case", ["other_dim", "concatenation_returned", "few_rows"])
def test_cat_linear_leaves_what_it_cannot_replace(case):
    model = CatProjection(dim=0 if case == "other_dim" else -1, leak=case == "concatenation_returned").eval()
    x = torch.randn(*((1, 4) if case == "few_rows" else (2, 24)), 32)
    with forced("cat_linear"):
        out, _, backend = compile_run(model, x)
    assert calls(backend, torch.ops.mindiesd.cat_linear.default) == 0 and calls(backend, aten.cat.default) == 1
    with torch.no_grad():
        assert_close(out, model(x), torch.float32)


class RegroupedCat(torch.nn.Module):
    """A linear layer over a concatenation viewed as rows of another width: not a split along the weight."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 16))

    def forward(self, a, b):
        return F.linear(torch.cat([a, b], -1).reshape(-1, 16), self.weight)


def test_cat_linear_leaves_a_concatenation_regrouped_into_other_rows():
    model, a, b = RegroupedCat().eval(), torch.randn(2, 24, 16), torch.randn(2, 24, 16)
    with forced("cat_linear"):
        out, _, backend = compile_run(model, a, b)  # strict: a failed rewrite would raise
    assert calls(backend, torch.ops.mindiesd.cat_linear.default) == 0
    with torch.no_grad():
        torch.testing.assert_close(out, model(a, b), rtol=1e-5, atol=1e-5)


def test_cat_linear_reads_the_weight_as_it_is_after_an_in_place_change():
    """The weight's column blocks are views taken by the kernel: nothing derived from the weight is folded."""
    model, x = CatProjection().eval(), torch.randn(2, 24, 32)
    with forced("cat_linear"):
        _, compiled, backend = compile_run(model, x)
    with torch.no_grad():
        model.proj.weight.mul_(-0.5)
        model.proj.bias.add_(1.0)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert calls(backend, torch.ops.mindiesd.cat_linear.default) >= 1


def test_cat_linear_with_dynamic_rows():
    model = CatProjection().eval()
    with forced("cat_linear"):
        out, compiled, backend = compile_run(model, torch.randn(2, 24, 32), dynamic=True)
        with torch.no_grad():
            for rows in (24, 37):
                x = torch.randn(2, rows, 32)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert calls(backend, torch.ops.mindiesd.cat_linear.default) >= 1 and backend.report().graphs == 1


def test_cat_linear_kernels_and_checks():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 24, generator=g)]
    w, b = torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
    for kernel in (_gemm.cat_linear_cpu, _gemm.cat_linear_cuda):
        for bias in (b, None):
            expected = F.linear(torch.cat(xs, -1), w, bias)
            torch.testing.assert_close(kernel(xs, w, bias), expected, rtol=1e-5, atol=1e-5)
    bf16 = [x.bfloat16() for x in xs]
    # 16-bit: the concatenation and one GEMM, bit for bit eager's
    torch.testing.assert_close(_gemm.cat_linear_cpu(bf16, w.bfloat16(), b.bfloat16()),
                               F.linear(torch.cat(bf16, -1), w.bfloat16(), b.bfloat16()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="two or more"):
        torch.ops.mindiesd.cat_linear([xs[0]], w[:, :8], None)
    with pytest.raises(ValueError, match=r"must be \[out_features, 32\]"):
        torch.ops.mindiesd.cat_linear(xs, w[:, :30], None)
    with pytest.raises(ValueError, match="agree in every dimension but the last"):
        torch.ops.mindiesd.cat_linear([xs[0], xs[1][:2]], w, None)
    with pytest.raises(ValueError, match="share a dtype"):
        torch.ops.mindiesd.cat_linear(xs, w.double(), None)
    with pytest.raises(ValueError, match="bias"):
        torch.ops.mindiesd.cat_linear(xs, w, torch.randn(15))


# ------------------------------------------------------------------------------------------------- the models
#: merged matmuls in the tiny core models: Flux (2 double blocks: image q/k/v, context q/k/v; 4 single blocks:
#: q/k/v + proj_mlp), SD3 (2 joint blocks: image and context q/k/v), Wan (2 blocks: self q/k/v, cross k/v)
MERGED = {"flux": 8, "sd3": 4, "wan": 4}


#: linear layers over a concatenation with enough rows: the single blocks' proj_out(cat([attn, mlp])) (Flux,
#: Chroma, Flux2, HunyuanVideo) and Chroma's approximator, whose in_proj reads the concatenated timestep, guidance
#: and modulation-index embeddings (one row per modulation index). The timestep embeddings' linear_1(cat([sin,
#: cos])) has one row per sample and is left alone.
CAT_LINEARS = {
    "flux": lambda m: len(modules_named(m, "FluxSingleTransformerBlock")),
    "sd3": lambda m: 0,
    "wan": lambda m: 0,
    "chroma": lambda m: len(modules_named(m, "ChromaSingleTransformerBlock", "ChromaApproximator")),
    "flux2": lambda m: len(modules_named(m, "Flux2SingleTransformerBlock")),
    "hunyuan_video": lambda m: len(modules_named(m, "HunyuanVideoSingleTransformerBlock")),
}


def _compiled(case):
    backend = MindieSDBackend(CompilationConfig(cache_dir=None, strict=True), keep_graphs=True, force_fast=FORCED)
    torch._dynamo.reset()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", MindieSDFallbackWarning)
            return torch.compile(case.model, backend=backend)(**case.inputs)[0], backend
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MERGED))
def test_gemm_rewrites_on_the_core_models(name):
    from mindiesd import zoo

    case = zoo.build(name, "tiny")
    with torch.no_grad():
        expected = case.model(**case.inputs)[0]
    default = count_fused(_compiled(case)[1])
    with forced("merge_projections", "linear_gelu", "cat_linear"):
        actual, backend = _compiled(case)
    record = backend.report().records[0]
    counts = count_fused(backend)
    assert record.matches["merge_projections"] == MERGED[name] and backend.report().graphs == 1
    assert record.matches["cat_linear"] == CAT_LINEARS[name](case.model)
    # the other families fuse as before; a GELU after an unmerged linear moves to linear_gelu
    assert {f: counts[f] for f in counts if f != "fast_gelu"} == {f: default[f] for f in default if f != "fast_gelu"}
    assert record.matches["linear_gelu"] + counts["fast_gelu"] == default["fast_gelu"]
    assert calls(backend, torch.ops.mindiesd.linear_gelu.default) == record.matches["linear_gelu"]
    assert ((actual - expected).abs().max() / expected.abs().max()).item() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chroma", "flux2", "hunyuan_video"])
def test_cat_linear_on_the_models_with_single_blocks(name):
    from mindiesd import zoo

    case = zoo.build(name, "tiny")
    with torch.no_grad():
        expected = case.model(**case.inputs)[0]
    with forced("cat_linear"):
        actual, backend = _compiled(case)
    sites = CAT_LINEARS[name](case.model)
    assert sites > 0 and backend.report().graphs == 1
    assert backend.report().records[0].matches["cat_linear"] == sites
    assert calls(backend, torch.ops.mindiesd.cat_linear.default) == sites
    assert ((actual - expected).abs().max() / expected.abs().max()).item() <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_gelu_cuda_kernel_and_rewrites_on_the_gpu(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).to("cuda", dtype)
    w = (torch.randn(256, 128, generator=g) * 0.1).to("cuda", dtype)
    b = torch.randn(256, generator=g).to("cuda", dtype)
    expected = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    rtol, atol = TOLERANCE[dtype]
    for bias, want in ((b, expected), (None, F.gelu(F.linear(x.double(), w.double()), approximate="tanh"))):
        out = _gemm.linear_gelu_cuda(x, w, bias)
        assert out.dtype == dtype and out.is_contiguous()
        torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol * max(1.0, want.abs().max().item()))
    model = Attention().to("cuda", dtype).eval()
    mlp = Mlp().to("cuda", dtype).eval()
    xs = torch.randn(2, 24, 32, device="cuda", dtype=dtype)
    with forced_on("cuda", "merge_projections", "linear_gelu"):
        for module in (model, mlp):
            out, _, backend = compile_run(module, xs)
            with torch.no_grad():
                assert_close(out, module(xs), dtype)
    assert backend.report().records[0].matches["linear_gelu"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cat_linear_cuda_kernel_and_rewrite_on_the_gpu():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 48, generator=g).cuda(), torch.randn(64, 80, generator=g).cuda()]
    w, b = (torch.randn(96, 128, generator=g) * 0.1).cuda(), torch.randn(96, generator=g).cuda()
    torch.testing.assert_close(_gemm.cat_linear_cuda(xs, w, b), F.linear(torch.cat(xs, -1), w, b),
                               rtol=1e-4, atol=1e-4)
    model, x = CatProjection().cuda().eval(), torch.randn(2, 24, 32, device="cuda")
    with forced_on("cuda", "cat_linear"):
        out, _, backend = compile_run(model, x)
    assert calls(backend, torch.ops.mindiesd.cat_linear.default) == 1
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)


def forced_on(device_type, *names):
    """``forced``: force_fast holds on every device where the families declare a kernel or rewrite."""
    return forced(*names)


@pytest.mark.slow
def test_peft_fuse_lora_after_compiling_with_merged_projections_and_save_pretrained(tmp_path):
    """diffusers' fuse_lora / unfuse_lora (PEFT's merge(): ``base_layer.weight.data += delta``) after compiling
    with merged projections give eager's results (PEFT's state changes the forward, so Dynamo recompiles; the
    write through ``.data`` without a recompile is test_merged_weights_live_in_the_concatenation_so_data_writes_
    are_seen); the model, whose q/k/v now share one storage, still saves and loads."""
    pytest.importorskip("peft")
    from mindiesd import zoo

    case = zoo.build("flux", "tiny")
    model, inputs = case.model, case.inputs
    gen = torch.Generator().manual_seed(3)
    lora = {}
    for name, module in model.named_modules():
        if name.endswith((".to_q", ".to_k", ".to_v")) and isinstance(module, torch.nn.Linear):
            lora[f"{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=gen) * 0.05
            lora[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=gen) * 0.05
    model.load_lora_adapter(lora, adapter_name="style", prefix=None)
    with forced("merge_projections"):
        first, backend = _compiled_keep(case)
        assert backend.report().records[0].matches["merge_projections"] == 8
        with torch.no_grad():
            unfused = model(**inputs)[0]
            model.fuse_lora(lora_scale=2.0)  # base weights changed in place through .data; adapters skipped from now
            fused_eager = model(**inputs)[0]
            fused = backend.compiled(**inputs)[0]  # a second graph (PEFT's `merged` flag changes the forward)
            model.unfuse_lora()  # in place through .data again
            unfused_eager = model(**inputs)[0]
            unfused_again = backend.compiled(**inputs)[0]
            model.fuse_lora()
    torch._dynamo.reset()
    error = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert error(first, unfused) <= 1e-5
    assert error(fused_eager, unfused) > 1e-3, "fusing the adapters changes nothing: the test would prove nothing"
    assert error(fused, fused_eager) <= 1e-5
    assert error(unfused_again, unfused_eager) <= 1e-5
    model.unload_lora()
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        again = reloaded(**inputs)[0]
    torch.testing.assert_close(again, fused_eager, rtol=1e-5, atol=1e-5)


def _compiled_keep(case):
    backend = MindieSDBackend(CompilationConfig(cache_dir=None, strict=True), keep_graphs=True, force_fast=FORCED)
    torch._dynamo.reset()
    backend.compiled = torch.compile(case.model, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        return backend.compiled(**case.inputs)[0], backend
