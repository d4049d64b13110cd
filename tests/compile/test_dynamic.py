"""Resolution changes: one dynamic graph serves every size, fuses what the static graphs fuse, matches eager.

After the first dynamic graph, ``torch._dynamo.config.patch(error_on_recompile=True)`` proves that the other
sizes reuse it. diffusers' ``RMSNorm`` is included: under ``dynamic=True`` Dynamo makes its float ``eps`` a 0-dim
tensor input, which the rms_norm pass reads on the host at run time.
"""

import warnings

import pytest
import torch

from fusion_utils import FAMILIES, TOLERANCE, count_fused
from mindiesd.compilation import MindieSDBackend, MindieSDFallbackWarning

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow  # whole models: the quick subset is `pytest -m "not slow"`


def _run(model, inputs_per_size, dynamic):
    """Compile once, call at every size (no recompile after the first); per-family counts of the final graphs."""
    backend = MindieSDBackend(keep_graphs=True)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    outputs = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        first, *rest = inputs_per_size
        outputs.append(compiled(**first))
        if dynamic is None:  # automatic dynamic: the second size gives the dynamic graph
            outputs.append(compiled(**rest.pop(0)))
        with torch._dynamo.config.patch(error_on_recompile=True):
            outputs += [compiled(**inputs) for inputs in rest]
    assert backend.report().fallbacks == []
    return outputs, backend


def _assert_matches_eager(model, inputs_per_size, outputs):
    with torch.no_grad():
        for inputs, out in zip(inputs_per_size, outputs):
            expected = model(**inputs)
            expected, out = (expected[0], out[0]) if isinstance(expected, tuple) else (expected, out)
            assert out.shape == expected.shape
            rtol, atol = TOLERANCE[expected.dtype]
            torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------- diffusers RMSNorm
class _Normed(torch.nn.Module):
    def __init__(self, eps):
        super().__init__()
        from diffusers.models.normalization import RMSNorm

        self.norm = RMSNorm(64, eps=eps)
        with torch.no_grad():
            self.norm.weight.normal_()

    def forward(self, hidden_states):
        return self.norm(hidden_states)


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_diffusers_rms_norm_fuses_with_eps_as_a_graph_input(eps):
    model = _Normed(eps)
    sizes = [dict(hidden_states=torch.randn(2, s, 64)) for s in (5, 9, 17)]
    outputs, backend = _run(model, sizes, dynamic=True)
    (graph,) = backend.graphs
    placeholders = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
    assert any(isinstance(v, torch.Tensor) and v.dim() == 0 for v in placeholders), "eps is a tensor input here"
    assert count_fused(backend) == {f: (1 if f == "rms_norm" else 0) for f in FAMILIES}
    _assert_matches_eager(model, sizes, outputs)


def test_a_changed_eps_is_read_at_run_time():
    model = _Normed(1e-6)
    x = torch.randn(2, 7, 64)
    backend = MindieSDBackend(keep_graphs=True)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        compiled(hidden_states=x)
        model.norm.eps = 0.25  # a large eps changes the result visibly
        out = compiled(hidden_states=x)
        torch.testing.assert_close(out, model(hidden_states=x), rtol=1e-5, atol=1e-5)
    assert count_fused(backend)["rms_norm"] >= 1


# ---------------------------------------------------------------------------------------------- Flux and Wan
# Sizes avoid the values of the other input dims at the first call (Flux: 256 text features, 128 pooled, 16
# channels; Wan: 16 channels, 3 frames): Dynamo's duck shaping gives equal sizes one symbol, and a weight's width
# then pins it (docs/debugging.md).
def _flux_sizes(case, tokens=(192, 160, 96)):
    out = []
    for n in tokens:
        inputs = dict(case.inputs)
        inputs["hidden_states"] = case.inputs["hidden_states"][:, :n].clone()
        inputs["img_ids"] = case.inputs["img_ids"][:n].clone()
        out.append(inputs)
    return out


def _wan_sizes(case, grids=((12, 10), (10, 8), (14, 6))):
    out = []
    for h, w in grids:
        inputs = dict(case.inputs)
        inputs["hidden_states"] = case.inputs["hidden_states"][..., :h, :w].clone()
        out.append(inputs)
    return out


def _static_counts(case, inputs):
    backend = MindieSDBackend(keep_graphs=True)
    with torch.no_grad():
        torch.compile(case.model, backend=backend)(**inputs)
    return count_fused(backend)


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic_true", "automatic_dynamic"])
@pytest.mark.parametrize("name,sizes", [("flux", _flux_sizes), ("wan", _wan_sizes)])
def test_three_resolutions_compile_once_and_fuse_as_static(name, sizes, dynamic):
    from mindiesd import zoo

    case = zoo.build(name, "tiny", dtype=torch.float32, device="cpu")
    inputs = sizes(case)
    static = _static_counts(case, inputs[0])
    torch._dynamo.reset()
    outputs, backend = _run(case.model, inputs, dynamic)
    dynamic_graphs = backend.graphs if dynamic else backend.graphs[len(backend.graphs) // 2:]
    counts = {f: 0 for f in FAMILIES}
    for gm in dynamic_graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "namespace", None) == "mindiesd" \
                    and node.target._opname in counts:  # the specification's families (cat_linear apart)
                counts[node.target._opname] += 1
    assert counts == static, "the dynamic graph fuses every site the static one does"
    assert all(static[f] > 0 for f in ("norm_rope", "adalayernorm", "mul_add"))  # Flux's norms are all in norm_rope
    _assert_matches_eager(case.model, inputs, outputs)


def test_taylorseer_step_cache_runs_fused_without_a_fallback():
    """diffusers' TaylorSeer cache passes the step distance as an int that changes between calls: Dynamo makes it a
    symbolic graph input, which the executor takes as a number. Every step equals eager's with the same cache."""
    from diffusers import TaylorSeerCacheConfig
    from mindiesd import zoo

    def steps(compiled):
        case = zoo.build("flux", "tiny")
        model = case.model
        model.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1,
                                                 taylor_factors_dtype=torch.float32))
        backend = MindieSDBackend(keep_graphs=True)
        run = torch.compile(model, backend=backend) if compiled else model
        outputs = []
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", MindieSDFallbackWarning)
            for _ in range(6):
                with model.cache_context("cond"):
                    outputs.append(run(**case.inputs)[0])
        return outputs, backend

    torch._dynamo.reset()
    expected, _ = steps(False)
    actual, backend = steps(True)
    assert backend.report().fallbacks == [] and sum(count_fused(backend).values()) > 0
    for out, want in zip(actual, expected):
        rtol, atol = TOLERANCE[want.dtype]
        torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
