"""End to end on tiny Flux, SD3 and Wan: every fusible site in the model is fused, the output stays eager's.

The models and their expected counts come from the registry (``mindiesd.zoo``, group ``core``): the counts are
derived from the model's own modules and the forward of its blocks (documented per model in
``mindiesd/zoo/_core.py``), not copied from a run.
"""

import warnings

import pytest
import torch

from fusion_utils import FAMILIES, TOLERANCE, count_fused, spec_counts
from mindiesd.compilation.families import GEMM_FAMILIES
from mindiesd import zoo
from mindiesd.compilation import MindieSDBackend, MindieSDFallbackWarning

pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow  # whole models: the quick subset is `pytest -m "not slow"`

CORE = zoo.names(group="core")


def test_the_core_group_is_flux_sd3_wan_without_gaps():
    assert CORE == ("flux", "sd3", "wan")
    assert all(zoo.gaps(name) == {} for name in CORE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CORE)
def test_tiny_model_fuses_every_site_and_matches_eager(name, dtype):
    case = zoo.build(name, "tiny", dtype=dtype)
    expected = case.expected()
    # every family has sites but these: the core models' feed-forwards are tanh-GELU, not gated (glu is checked on
    # the gated models of the dits group); SD3 has no RoPE; norm_rope joins every RMSNorm and RoPE of Flux and
    # every RoPE of Wan (their own fusion there is checked with norm_rope off in test_norm_rope.py)
    no_sites = {"flux": {"glu", "rms_norm", "rope"}, "sd3": {"glu", "rope", "norm_rope"}, "wan": {"glu", "rope"}}
    assert {f for f in FAMILIES if expected[f] == 0} == no_sites[name]

    backend = MindieSDBackend(keep_graphs=True)
    compiled = torch.compile(case.model, backend=backend)
    with torch.no_grad():
        reference = case.model(**case.inputs)[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = compiled(**case.inputs)[0]  # compile time and run time
            second = compiled(**case.inputs)[0]
    assert [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)] == []

    assert count_fused(backend) == expected
    assert spec_counts(backend.report().matches) == expected
    # of the GEMM rewrites only cat_linear is on on CPU by default (float32: Flux's single blocks' proj_out)
    single_blocks = len(getattr(case.model, "single_transformer_blocks", ())) if dtype == torch.float32 else 0
    assert backend.report().matches["cat_linear"] == (single_blocks if name == "flux" else 0)
    assert all(backend.report().matches[f] == 0 for f in GEMM_FAMILIES if f != "cat_linear"), "off on CPU"
    assert backend.report().graphs == 1, "a second call with the same shapes must not recompile"
    assert not backend.report().fallbacks
    # the copies of the inference-mode dropouts (after every attention output and feed-forward) are gone
    kept = [n.kwargs for gm in backend.graphs for n in gm.graph.nodes if n.target == torch.ops.aten.clone.default]
    assert all(k.get("memory_format") == torch.contiguous_format for k in kept), kept

    rtol, atol = TOLERANCE[dtype]
    scale = reference.float().abs().max()
    error = ((first.float() - reference.float()).abs().max() / scale).item()
    assert error < (1e-5 if dtype == torch.float32 else 2e-2), error
    torch.testing.assert_close(second, first, rtol=0, atol=0)
