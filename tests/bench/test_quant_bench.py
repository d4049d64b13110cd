"""``bench model --quant``: a registry model quantized with torchao's configs, eager and mindiesd running the same
quantized model."""

from __future__ import annotations

import pytest

from mindiesd.benchmarks.quant import QUANT_CONFIGS, quantize

pytest.importorskip("torchao")


def test_an_int8_dynamic_flux_row_is_fused_without_a_fallback_and_matches_eager(run_bench):
    data, out = run_bench("model", "--model", "flux", "--quant", "int8-dynamic", "--iters", "1",
                       "--warmup", "0", "--cache-dir", "off")
    [row] = data["rows"]
    assert row["quant"] == "int8-dynamic" and "int8-dynamic" in out and "quant" in out.splitlines()[0]
    assert row["fallbacks"] == 0
    assert row["norm_rope"] > 0 and row["adalayernorm"] > 0 and row["mul_add"] > 0
    # int8 activations: a one-ulp difference upstream moves a row's rounding, so the error is int8's, not fp32's
    assert row["max_rel_err"] < 5e-2


def test_quantize_names_the_known_configs():
    import torch

    with pytest.raises(ValueError, match="known: int8-weight"):
        quantize(torch.nn.Linear(4, 4), "int4")
    assert set(QUANT_CONFIGS) == {"int8-weight", "int8-dynamic", "float8-weight"}
