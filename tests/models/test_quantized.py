"""Quantized weights through the backend: torchao's int8 weight-only, int8 dynamic activation + int8 weight and
float8 weight-only configs, and diffusers' layerwise casting (float8 storage), on tiny registry models.

A quantized model that eager runs must compile without a fallback, and the fused families around its linear layers
(RMSNorm, adaLN, RoPE, GELU, mul+add: ordinary float tensors) must fuse every site the unquantized model fuses
(the registry's ``expected`` counts, checked unquantized by test_models_e2e and test_more_dits), counted at run time
with the profiler. The reference is eager's output of the same quantized model:

* weight-only: the dequantized weight and the GEMM are the same aten ops compiled and eager, so the error is the
  fused ops' own, bounded as unquantized;
* int8 dynamic: each activation is rounded to int8 per row, so a fused op that rounds one unit differently can
  move a code by one step, and the output by far more than a unit. The bound is eager's own sensitivity: twice
  the largest change of eager's output when the input moves by the dtype's unit roundoff.

Freezing keeps folding what it folds unquantized (rotary and timestep tables) and never a quantized weight's inner
tensors (that would keep a dequantized full-precision copy).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List

import pytest
import torch

pytest.importorskip("torchao")
pytest.importorskip("diffusers")

from torchao.quantization import (  # noqa: E402
    Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_,
)

from fusion_utils import FAMILIES  # noqa: E402
from mindiesd import zoo  # noqa: E402
from mindiesd.compilation import MindieSDBackend, MindieSDFallbackWarning  # noqa: E402

pytestmark = pytest.mark.slow  # whole models; tests/compile/test_quantized_weights.py is the quick subset's check

CONFIGS = {
    "int8_weight_only": Int8WeightOnlyConfig,
    "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
    "float8_weight_only": Float8WeightOnlyConfig,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: max |compiled - eager| / max |eager| where only the weights are quantized (as unquantized, test_more_dits).
WEIGHT_ONLY_ERROR = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: What tiny Flux folds: the rotary frequencies of each position axis and the timestep frequencies, none of them
#: read from a linear layer's weight.
FLUX_FOLDED = len(zoo.config_for("flux")["axes_dims_rope"]) + 1


@dataclass
class Run:
    reference: torch.Tensor
    actual: torch.Tensor
    fused: Dict[str, int]  # the mindiesd ops one compiled forward ran, per family
    folded: List[int] = field(default_factory=list)  # folded constants per compiled graph
    graphs: int = 0
    quantized: Dict[str, int] = field(default_factory=dict)  # calls of the quantized-linear ops per forward

    @property
    def error(self) -> float:
        return _relative(self.actual, self.reference)


def _relative(actual: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.float()
    return ((actual.float() - reference).abs().max() / reference.abs().max()).item()


def _compiled_run(case: zoo.Case) -> Run:
    """Eager's and the compiled model's outputs, with a fallback an error, and the fused ops of a second call."""
    backend = MindieSDBackend()
    compiled = torch.compile(case.model, backend=backend)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        reference = case.model(**case.inputs)[0]
        actual = compiled(**case.inputs)[0]  # compiles, then runs
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            second = compiled(**case.inputs)[0]
    torch.testing.assert_close(second, actual, rtol=0, atol=0)
    calls = Counter(e.name.split("::", 1)[1] for e in prof.events() if e.name.startswith("mindiesd::"))
    records = backend.report().records
    assert [r.fallback for r in records if r.fallback] == []
    return Run(reference, actual, {f: calls.get(f, 0) for f in FAMILIES},
               [r.folded_constants for r in records], backend.report().graphs,
               {op: calls.get(op, 0) for op in ("int8_linear", "dequant_linear")})


def _quantized(name: str, config: str, dtype: torch.dtype) -> zoo.Case:
    case = zoo.build(name, "tiny", dtype=dtype)
    quantize_(case.model, CONFIGS[config]())
    return case


def _eager_spread(case: zoo.Case, seeds: int = 2) -> float:
    """The largest relative change of eager's output when every element of the latent input moves by the dtype's
    unit roundoff (random signs)."""
    inputs = case.inputs
    latent = inputs["hidden_states"]
    roundoff = torch.finfo(latent.dtype).eps / 2
    spread = 0.0
    with torch.no_grad():
        reference = case.model(**inputs)[0]
        for seed in range(seeds):
            signs = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed)).sign()
            moved = (latent.float() * (1 + roundoff * signs)).to(latent.dtype)
            spread = max(spread, _relative(case.model(**{**inputs, "hidden_states": moved})[0], reference))
    return spread


def _assert_close_to_eager(run: Run, case: zoo.Case, config: str, dtype: torch.dtype) -> None:
    assert run.actual.shape == run.reference.shape and run.actual.dtype == run.reference.dtype
    if config == "int8_dynamic":
        spread = _eager_spread(case)
        assert spread > 0, "eager does not react to its own rounding: the bound below would be no bound"
        assert run.error <= 2 * spread, (run.error, spread)
    else:
        assert run.error <= WEIGHT_ONLY_ERROR[dtype], run.error


def _assert_weights_stay_quantized(case: zoo.Case, config: str) -> None:
    stored = {type(m.weight).__name__ for m in case.model.modules() if isinstance(m, torch.nn.Linear)}
    assert stored == {"Float8Tensor" if config.startswith("float8") else "Int8Tensor"}, stored


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("config", CONFIGS)
def test_quantized_tiny_flux_fuses_every_site_and_matches_eager(config, dtype):
    case = _quantized("flux", config, dtype)
    run = _compiled_run(case)
    assert run.graphs == 1
    assert run.fused == case.expected(), "the families fused without quantization"
    assert {f for f, n in run.fused.items() if n} == {"norm_rope", "adalayernorm", "fast_gelu", "mul_add"}
    layers = sum(isinstance(m, torch.nn.Linear) for m in case.model.modules())
    # the frequency tables are folded, and at most one small value per layer (its scales in x's dtype, its column
    # sums); a dequantized weight is not (each layer's op reads its packed weight)
    (folded,) = run.folded
    assert FLUX_FOLDED <= folded <= FLUX_FOLDED + layers, run.folded
    op = "int8_linear" if config == "int8_dynamic" else "dequant_linear"
    assert run.quantized == {"int8_linear": 0, "dequant_linear": 0, op: layers}, "every linear layer is one op"
    _assert_weights_stay_quantized(case, config)
    _assert_close_to_eager(run, case, config, dtype)


@pytest.mark.parametrize("name", zoo.names(size="tiny"))
def test_every_tiny_model_with_float8_weights_fuses_and_matches_eager(name):
    if not zoo.available(name):
        pytest.skip(f"the installed diffusers has no {zoo.entry(name).cls}")
    case = _quantized(name, "float8_weight_only", torch.float32)
    run = _compiled_run(case)
    # the registry's counts where the model has no known gap; where it has one, what the unquantized model fuses
    expected, gaps = case.expected(), zoo.gaps(name)
    if gaps:
        unquantized = _compiled_run(zoo.build(name, "tiny", dtype=torch.float32)).fused
        expected = {f: unquantized[f] if f in gaps else n for f, n in expected.items()}
    assert run.fused == expected
    _assert_weights_stay_quantized(case, "float8_weight_only")
    _assert_close_to_eager(run, case, "float8_weight_only", torch.float32)


def test_layerwise_float8_storage_compiles_without_fallback_and_matches_eager():
    case = zoo.build("flux", "tiny", dtype=torch.bfloat16)
    case.model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    stored = {p.dtype for p in case.model.parameters()}
    assert torch.float8_e4m3fn in stored
    with torch._dynamo.config.patch(recompile_limit=64):  # diffusers' casting hook compiles once per layer shape
        run = _compiled_run(case)
    assert {p.dtype for p in case.model.parameters()} == stored, "the weights are kept in their storage dtype"
    fused = {f for f, n in run.fused.items() if n}
    assert fused == {"norm_rope", "adalayernorm", "fast_gelu", "mul_add"}, run.fused
    assert run.error <= WEIGHT_ONLY_ERROR[torch.bfloat16], run.error
