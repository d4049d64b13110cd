"""The pipeline around the passes: switches, freezing, fallback, dynamic shapes, logging, training."""

import json
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError

from fusion_utils import FAMILIES, WeightedBlock, assert_close, count_fused, only, run_compiled, spec_counts
from mindiesd.compilation import (
    CompilationConfig,
    DeviceGraphUnavailableWarning,
    MindieSDBackend,
    MindieSDFallbackWarning,
    SettingTypeError,
    fusion_report,
)
from mindiesd.compilation.passes import PASSES
from mindiesd.compilation.cleanup import AFTER_FUSION


class AllFamilies(torch.nn.Module):
    """One site of each family."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-6)
        self.q_norm = torch.nn.RMSNorm(d, eps=1e-6)
        self.ln = torch.nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.up = torch.nn.Linear(d, 2 * d)
        self.proj = torch.nn.Linear(d, d)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.q_norm.weight.normal_()

    @staticmethod
    def rotate(h, cos, sin):
        x_even, x_odd = h.unflatten(-1, (-1, 2)).unbind(-1)
        return h * cos + torch.stack([-x_odd, x_even], -1).flatten(-2) * sin

    def forward(self, x, cos, sin, scale, shift, gate):
        # rms_norm (read by an add, not a rotation), rope (of that sum) and norm_rope (a norm rotated right after)
        h = self.rotate(self.norm(x) + x, cos, sin) + self.rotate(self.q_norm(x), cos, sin)
        h = self.ln(h) * (1 + scale) + shift
        value, gate_half = self.up(h).chunk(2, dim=-1)
        h = value * F.silu(gate_half)
        h = F.gelu(self.proj(h), approximate="tanh")
        return x + gate * h


def all_families_inputs(d=32, s=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)
    angles = r(s, d // 2)
    cos = torch.cos(angles).repeat_interleave(2, -1)
    sin = torch.sin(angles).repeat_interleave(2, -1)
    return r(2, s, d), cos, sin, r(2, 1, d), r(2, 1, d), r(2, 1, d)


def test_every_family_fires_once():
    model = AllFamilies()
    out, ref, counts, backend = run_compiled(model, *all_families_inputs())
    assert counts == {f: 1 for f in FAMILIES}
    assert spec_counts(backend.report().matches) == counts
    assert_close(out, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_switch_removes_exactly_its_family(family):
    setattr(CompilationConfig.fusion_patterns, f"enable_{family}", False)
    out, ref, counts, _ = run_compiled(AllFamilies(), *all_families_inputs())
    expected = {f: (0 if f == family else 1) for f in FAMILIES}
    # norm_rope joins the ops of rms_norm and rope: without either there is nothing to join, and without norm_rope
    # the norm and the rotation it would join are fused on their own
    if family == "rms_norm":
        # and the unfused norm's `normed * weight + x` is a multiply-add
        expected.update(norm_rope=0, rope=2, mul_add=2)
    if family == "rope":
        expected.update(norm_rope=0, rms_norm=2)
    if family == "norm_rope":
        expected.update(rms_norm=2, rope=2)
    # the sums `a * b + c` of an unfused rotation or modulation are plain multiply-adds, which the mul_add pass then
    # takes (correctly): one more mul_add per such sum besides the residual gate
    if family == "rope":
        expected["mul_add"] = 3
    if family == "adalayernorm":
        expected["mul_add"] = 2
    assert counts == expected
    assert_close(out, ref)


def test_all_switches_off_gives_no_fused_op():
    for family in FAMILIES:
        setattr(CompilationConfig.fusion_patterns, f"enable_{family}", False)
    out, ref, counts, backend = run_compiled(AllFamilies(), *all_families_inputs())
    assert counts == {f: 0 for f in FAMILIES}
    assert_close(out, ref)


def test_aclgraph_only_skips_fusion_and_with_compile_wins():
    from mindiesd.compilation.runtime import device_graph

    device_graph._warned_unavailable.clear()
    with pytest.warns(DeviceGraphUnavailableWarning, match="capture .* is unavailable on cpu"):
        _, _, counts, _ = run_compiled(AllFamilies(), *all_families_inputs(), config=CompilationConfig(aclgraph_only=True))
    assert counts == {f: 0 for f in FAMILIES}
    both = CompilationConfig(aclgraph_only=True, aclgraph_with_compile=True)
    out, ref, counts, _ = run_compiled(AllFamilies(), *all_families_inputs(), config=both)
    assert counts == {f: 1 for f in FAMILIES}
    assert_close(out, ref)


# ---------------------------------------------------------------------------------------------- freezing
def make_block_class(backend):
    """A module class decorated as in the specification: one compiled graph for all instances."""
    return torch.compile(backend=backend)(type("Block", (WeightedBlock,), {}))


def eager_block(block, x):
    return block.eager(x)


def test_class_decorator_one_graph_serves_instances_with_their_own_weights():
    backend = MindieSDBackend(keep_graphs=True)
    Block = make_block_class(backend)
    blocks = [Block(seed=i) for i in range(3)]
    x = torch.randn(4, 16)
    with torch.no_grad():
        for block in blocks:
            torch.testing.assert_close(block(x), eager_block(block, x), rtol=1e-5, atol=1e-5)
    assert backend.report().graphs == 1
    assert backend.report().records[0].folded_constants >= 1
    assert count_fused(backend)["rms_norm"] == 1


@pytest.mark.parametrize("change", ["inplace_no_grad", "load_state_dict", "assign_data", "buffer_inplace"])
def test_frozen_values_follow_weight_changes(change):
    backend = MindieSDBackend()
    block = make_block_class(backend)(seed=1)
    donor = make_block_class(MindieSDBackend())(seed=7)
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = block(x)
        if change == "inplace_no_grad":
            block.lin.weight.mul_(-2.0)
        elif change == "load_state_dict":
            block.load_state_dict(donor.state_dict())
        elif change == "assign_data":
            block.norm.weight.data = torch.randn(16)
        else:
            block.freqs.add_(1.0)
        after = block(x)
    torch.testing.assert_close(after, eager_block(block, x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


class _WeightOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        w2 = self.w * 2
        return x * w2, w2, w2.view(3, 1)


@pytest.mark.parametrize("use_executor", [True, False])
def test_an_output_computed_from_weights_alone_is_a_fresh_tensor_each_call(use_executor, monkeypatch):
    """A folded value returned as an output (or through a view) is a copy per call, as eager computes it anew: a
    caller's write into one result reaches neither the cache of folded values nor a later result."""
    monkeypatch.setenv("MINDIESD_EXECUTOR", "1" if use_executor else "0")
    torch._dynamo.reset()
    module = _WeightOutput()
    backend = MindieSDBackend(CompilationConfig(cache_dir=None))
    compiled = torch.compile(module, backend=backend)
    with torch.no_grad():
        first = compiled(torch.ones(3))
        second = compiled(torch.ones(3))
        assert backend.report().records[0].folded_constants >= 1
        assert first[1].data_ptr() != second[1].data_ptr()
        assert second[2]._base is second[1]  # the view of the output is still the output's view
        second[1].mul_(10)
        third = compiled(torch.ones(3))
    expected = module(torch.ones(3))
    for got, want in zip(third, expected):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    torch.testing.assert_close(second[2], torch.full((3, 1), 20.0))


def test_freezing_off_still_correct_and_folds_nothing():
    CompilationConfig.enable_freezing = False
    backend = MindieSDBackend()
    block = make_block_class(backend)(seed=2)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(block(x), eager_block(block, x), rtol=1e-5, atol=1e-5)
    assert backend.report().records[0].folded_constants == 0


def test_forward_decorator_form():
    backend = MindieSDBackend(keep_graphs=True)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(8)

        @torch.compile(backend=backend)
        def forward(self, x):
            return F.gelu(self.norm(x), approximate="tanh")

    block, x = Block(), torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(block(x), F.gelu(F.rms_norm(x, [8], block.norm.weight), approximate="tanh"))
    assert count_fused(backend) == {**only("rms_norm", 1), "fast_gelu": 1}


# ---------------------------------------------------------------------------------------------- robustness
def test_failing_pass_warns_once_and_runs_unfused(monkeypatch):
    def broken(self, gm):
        raise RuntimeError("boom in a pass")

    monkeypatch.setattr(PASSES["rope"], "__call__", broken)
    model, inputs = AllFamilies(), all_families_inputs()
    with pytest.warns(MindieSDFallbackWarning, match="boom in a pass") as record:
        out, ref, counts, backend = run_compiled(model, *inputs)
    assert len([w for w in record if issubclass(w.category, MindieSDFallbackWarning)]) == 1
    assert counts == {f: 0 for f in FAMILIES}
    assert "boom in a pass" in backend.report().fallbacks[0]
    assert_close(out, ref)


def test_strict_raises_instead(monkeypatch):
    def broken(self, gm):
        raise RuntimeError("boom in a pass")

    monkeypatch.setattr(PASSES["rms_norm"], "__call__", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)  # no fallback: the pass's error itself
        with pytest.raises(BackendCompilerFailed, match="RuntimeError: boom in a pass") as info:
            run_compiled(AllFamilies(), *all_families_inputs(), config=CompilationConfig(strict=True))
    # Dynamo wraps whatever a backend raises; the error inside is the pass's own, unchanged
    assert type(info.value.inner_exception) is RuntimeError
    assert str(info.value.inner_exception) == "boom in a pass"


def test_run_time_failure_falls_back_once(monkeypatch):
    from mindiesd.compilation import freezing

    def broken(self, args):
        raise RuntimeError("boom at run time")

    monkeypatch.setattr(freezing.FrozenGraph, "folded_for", broken)
    backend = MindieSDBackend()
    block = make_block_class(backend)(seed=3)
    x = torch.randn(2, 16)
    with torch.no_grad(), pytest.warns(MindieSDFallbackWarning, match="boom at run time"):
        first = block(x)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        second = block(x)
    torch.testing.assert_close(first, eager_block(block, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, first)


def test_user_error_still_raises_like_eager():
    model = AllFamilies()
    compiled = torch.compile(model, backend=MindieSDBackend())
    bad = list(all_families_inputs())
    bad[1] = torch.randn(5, 7)  # cos that does not broadcast
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"size of tensor b \(7\)"):
        model(*bad)
    # Dynamo meets the error while tracing, before the backend: the same RuntimeError family as eager's (an
    # `except RuntimeError` written for eager still catches it), naming the shape at fault; no fallback hides it
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        with pytest.raises(TorchRuntimeError, match=r"broadcast a dimension of length 7"):
            compiled(*bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_shapes_compile_and_match(dtype):
    model = AllFamilies().to(dtype)
    backend = MindieSDBackend(keep_graphs=True)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for s in (6, 10, 13):
            inputs = [t.to(dtype) for t in all_families_inputs(s=s, seed=s)]
            assert_close(compiled(*inputs), model(*inputs))
    assert backend.report().graphs == 1
    assert not backend.report().fallbacks
    assert count_fused(backend) == {f: 1 for f in FAMILIES}, "every family fuses with symbolic shapes too"


@pytest.mark.parametrize("input_grad", [False, True], ids=["weights_only", "input_too"])
def test_training_mode_fuses_the_forward_and_keeps_gradients_right(input_grad):
    """docs/specification.md: with gradients on, the forward is fused where every value the backward needs is kept; no freezing.

    The backward always needs the mean and rstd of adaLN's `native_layer_norm`, which the adalayernorm op would
    remove: that site stays unfused and its `norm * (1 + scale) + shift` goes to mul_add (beside the gate). The
    backward of the gated activation needs `silu(gate)`, so glu stays unfused too. When the input needs a gradient
    too, RMSNorm's `rsqrt` is saved for it, so those sites stay unfused as well. The weights' gradients need the
    normalised values, so the norms fuse without their weight, whose multiply stays between norm and rotation:
    nothing for norm_rope to join, and the first norm's `normed * weight + x` is a multiply-add.
    """
    model = AllFamilies()
    x, *rest = all_families_inputs()
    x_compiled, x_eager = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    backend = MindieSDBackend(keep_graphs=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        out = compiled(x_compiled, *rest)
        out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    ref = model(x_eager, *rest)
    ref.square().sum().backward()

    expected = {"rms_norm": 0 if input_grad else 2, "rope": 2, "norm_rope": 0, "adalayernorm": 0, "glu": 0,
                "fast_gelu": 1, "mul_add": 3}
    assert count_fused(backend) == expected
    assert spec_counts(backend.report().matches) == expected
    assert backend.report().graphs == 1
    assert backend.report().fallbacks == []
    assert backend.report().records[0].folded_constants == 0, "freezing is off with gradients enabled"
    assert out.requires_grad
    assert_close(out.detach(), ref.detach())
    assert set(grads) == {"norm.weight", "q_norm.weight", "up.weight", "up.bias", "proj.weight", "proj.bias"}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=_grad_atol(p.grad),
                                   msg=lambda m, name=name: f"{name}: {m}")
    if input_grad:
        torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-4, atol=_grad_atol(x_eager.grad))


def _grad_atol(grad: torch.Tensor) -> float:
    """1e-5 of the gradient's largest entry (at least 1e-5): an fp32 gradient summed over rows is off by rounding
    in proportion to its scale (with the model's unseeded weights, up to 7.6e-5 where the largest entry is 76)."""
    return 1e-5 * max(1.0, grad.abs().max().item())


# ---------------------------------------------------------------------------------------------- observability
def test_info_log_has_one_line_per_graph_and_debug_shows_graphs(caplog):
    with caplog.at_level(logging.DEBUG, logger="mindiesd.compilation"):
        run_compiled(AllFamilies(), *all_families_inputs())
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 1
    assert "rms_norm=1" in info[0].getMessage() and "nodes" in info[0].getMessage()
    debug = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert "pass rms_norm" in debug and "--- before ---" in debug and "mindiesd.rms_norm" in debug


@pytest.mark.parametrize("as_url", [False, True])
def test_graph_log_url_writes_each_pass(tmp_path, as_url):
    folder = tmp_path / "log"
    url = folder.as_uri() if as_url else str(folder)
    run_compiled(AllFamilies(), *all_families_inputs(), config=CompilationConfig(graph_log_url=url))
    graphs = sorted(folder.glob("graph_*"))
    assert len(graphs) == 1
    files = sorted(p.name for p in graphs[0].iterdir())
    for family in FAMILIES:
        assert any(name.endswith(f"{family}.before.txt") for name in files)
        assert any(name.endswith(f"{family}.after.txt") for name in files)
    # the clean-up steps after the passes are logged as the passes are, in their order, after every pass
    steps = [name.split("_", 1)[1][:-len(".after.txt")] for name in files if name.endswith(".after.txt")]
    cleanup = [step.name for step in AFTER_FUSION]
    assert steps[-len(cleanup):] == cleanup and set(FAMILIES) <= set(steps[:-len(cleanup)])
    after = next(graphs[0].glob("*_mul_add.after.txt")).read_text()
    assert "mindiesd.rms_norm" in after
    summary = json.loads((graphs[0] / "summary.json").read_text())
    # cat_linear: the one GEMM rewrite on on CPU (no match here); int8_linear and dequant_linear need quantized weights
    assert summary["matches"] == {**{f: 1 for f in FAMILIES}, "cat_linear": 0, "int8_linear": 0, "dequant_linear": 0,
                                  "group_norm_silu": 0, "channel_rms_norm": 0, "flex_attention": 0,
                                  "upsample_nearest": 0, "conv_channels_last": 0}
    assert (folder / "summary.txt").read_text().count("\n") == 1


def test_graph_log_url_rejects_other_schemes():
    with pytest.raises(SettingTypeError, match="file://"):
        CompilationConfig.graph_log_url = "http://example.invalid/x"


def test_global_fusion_report_accumulates():
    graphs, matches = fusion_report().graphs, fusion_report().matches
    run_compiled(AllFamilies(), *all_families_inputs())
    assert fusion_report().graphs == graphs + 1
    assert spec_counts(fusion_report().matches) == {f: matches[f] + 1 for f in FAMILIES}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_low_precision_is_no_further_from_fp64_than_eager(dtype):
    torch.manual_seed(0)
    base = AllFamilies()
    low, exact = AllFamilies().to(dtype), AllFamilies().double()
    low.load_state_dict({k: v.to(dtype) for k, v in base.state_dict().items()})
    exact.load_state_dict({k: v.to(dtype).double() for k, v in base.state_dict().items()})
    compiled = torch.compile(low, backend=MindieSDBackend())
    eager_error = fused_error = 0.0
    with torch.no_grad():
        for seed in range(8):  # summed over inputs: one sample's maximum error is noisy
            inputs = [t.to(dtype) for t in all_families_inputs(seed=seed)]
            truth = exact(*[t.double() for t in inputs])
            eager_error += (low(*inputs).double() - truth).abs().mean().item()
            fused_error += (compiled(*inputs).double() - truth).abs().mean().item()
    assert fused_error <= eager_error, (fused_error, eager_error)


def test_graph_context_holds_the_per_graph_facts_once_and_cannot_change(tmp_path):
    import dataclasses

    from mindiesd.compilation.context import GraphContext

    gm = torch.fx.symbolic_trace(lambda x, w, lora_A: x @ w + lora_A)
    inputs = [torch.randn(2, 4), torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    config = CompilationConfig(cache_dir=str(tmp_path))
    with torch.no_grad():
        context = GraphContext.build(gm, inputs, config)
        forced = GraphContext.build(gm, inputs, config, frozenset({"linear_gelu"}))
    assert context.weights == (1, 2) and context.adapters == {2} and context.rewritable_weights == (1,)
    assert context.device_type == "cpu" and not context.training and context.why_not_frozen(3) is None
    assert set(context.skipped) == {"merge_projections", "linear_gelu"}
    assert not set(context.families) & set(context.skipped)
    assert context.key is not None and context.cache is not None and context.cache.root == tmp_path
    assert "linear_gelu" in forced.families and forced.key != context.key, "the forced family is in the key"
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.key = "another"
    training = GraphContext.build(gm, inputs, config)
    assert training.training and training.key is None and training.uncached == "not cached: training graph"
    assert training.why_not_frozen(3) == "no freezing for this graph (training or input mutation)"
    off = GraphContext.build(gm, inputs, CompilationConfig(cache_dir=None, enable_freezing=False))
    assert off.cache is None and off.uncached == "off" and off.why_not_frozen(3) == "needs enable_freezing"
