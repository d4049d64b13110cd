"""End to end on tiny Flux, SD3 and Wan: every fusible site in the model is fused, the output stays eager's.

The expected counts are derived from the model's own modules and the forward of its blocks (documented per
model below), not copied from a run.
"""

import warnings

import pytest
import torch

from fusion_utils import FAMILIES, TOLERANCE, count_fused
from mindiesd import zoo
from mindiesd.compilation import MindieSDBackend, MindieSDFallbackWarning

pytest.importorskip("diffusers")


def _modules(model, *names):
    return [m for m in model.modules() if type(m).__name__ in names]


def _rms_norms(model):
    from diffusers.models.normalization import RMSNorm

    return sum(isinstance(m, (torch.nn.RMSNorm, RMSNorm)) for m in model.modules())


def _tanh_gelus(model):
    from diffusers.models.activations import GELU

    torch_gelus = sum(isinstance(m, torch.nn.GELU) and m.approximate == "tanh" for m in model.modules())
    diffusers_gelus = sum(isinstance(m, GELU) and m.approximate == "tanh" for m in model.modules())
    return torch_gelus + diffusers_gelus


def expected_flux(model):
    double = model.transformer_blocks
    single = model.single_transformer_blocks
    return {
        "rms_norm": _rms_norms(model),
        # q and k are rotated in every attention (joint in double blocks, self in single blocks)
        "rope": 2 * (len(double) + len(single)),
        # AdaLayerNormZero (image and text), the two inline `norm2 * (1 + scale) + shift` per double block,
        # AdaLayerNormZeroSingle per single block, AdaLayerNormContinuous norm_out
        "adalayernorm": len(_modules(model, "AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous"))
        + 2 * len(double),
        "fast_gelu": _tanh_gelus(model),
        # double block: gated residuals of attention and MLP for image and text; single block: one gated residual
        "mul_add": 4 * len(double) + len(single),
    }


def expected_sd3(model):
    blocks = model.transformer_blocks
    full = [b for b in blocks if not b.context_pre_only]
    return {
        "rms_norm": _rms_norms(model),
        "rope": 0,
        # norm1 / norm1_context modules (AdaLayerNormZero or, in the last block, AdaLayerNormContinuous), the
        # inline MLP modulation of the image stream in every block and of the text stream where it continues
        "adalayernorm": len(_modules(model, "AdaLayerNormZero", "AdaLayerNormContinuous")) + len(blocks) + len(full),
        "fast_gelu": _tanh_gelus(model),
        # gated residuals: attention and MLP of the image stream, and of the text stream where it continues
        "mul_add": 2 * len(blocks) + 2 * len(full),
    }


def expected_wan(model):
    blocks = model.blocks
    return {
        "rms_norm": _rms_norms(model),
        "rope": 2 * len(blocks),  # q and k of the self-attention (attn1)
        # norm1 and norm3 are modulated in every block, plus the final norm_out modulation
        "adalayernorm": 2 * len(blocks) + 1,
        "fast_gelu": _tanh_gelus(model),
        "mul_add": 2 * len(blocks),  # gated residuals of self-attention and FFN
    }


EXPECTED = {"flux": expected_flux, "sd3": expected_sd3, "wan": expected_wan}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", zoo.MODELS)
def test_tiny_model_fuses_every_site_and_matches_eager(name, dtype):
    case = zoo.build(name, "tiny", dtype=dtype)
    expected = EXPECTED[name](case.model)
    assert all(expected[f] > 0 for f in FAMILIES if not (name == "sd3" and f == "rope"))

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
    assert backend.report().matches == expected
    assert backend.report().graphs == 1, "a second call with the same shapes must not recompile"
    assert not backend.report().fallbacks

    rtol, atol = TOLERANCE[dtype]
    scale = reference.float().abs().max()
    error = ((first.float() - reference.float()).abs().max() / scale).item()
    assert error < (1e-5 if dtype == torch.float32 else 2e-2), error
    torch.testing.assert_close(second, first, rtol=0, atol=0)
