"""PEFT LoRA on a compiled transformer: adapters loaded through diffusers' ``load_lora_adapter`` and hot-swapped.

A hot-swap writes the new LoRA weights into the tensors the compiled graph already reads, so it must take effect
without a recompilation: with freezing (folded constants are recomputed when a weight they depend on changes),
with regional compilation, with device-graph capture (a replay reads the weights where they are) and with a
graph loaded from the persistent cache (weights are inputs, not part of the entry).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from fusion_utils import FAMILIES  # noqa: E402
from lora_utils import lora_state_dict as _lora_state_dict  # noqa: E402
from mindiesd import zoo  # noqa: E402
from mindiesd.compilation import (  # noqa: E402
    CompilationConfig,
    MindieSDBackend,
    MindieSDFallbackWarning,
    SimulatedGraphAdapter,
    register_adapter,
)

pytestmark = pytest.mark.slow  # whole models: the quick subset is `pytest -m "not slow"`



def _error(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _run(fn):
    with torch.no_grad():
        return fn()[0]


@pytest.mark.parametrize("merged", [False, True], ids=["", "merged_projections"])
@pytest.mark.parametrize("variant", ["whole", "regional", "captured", "cached"])
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_lora_hotswap_takes_effect_in_the_compiled_model_without_recompiling(name, variant, merged, tmp_path):
    """With ``merged``, q/k/v (and their LoRA A matrices) run as one matmul over a folded concatenation, which
    the hot-swap's in-place writes must refold."""
    _hotswap(name, variant, merged, tmp_path)


def _hotswap(name, variant, merged, tmp_path):
    case = zoo.build(name, "tiny")
    model, inputs = case.model, case.inputs
    style, other_style = _lora_state_dict(model, 1), _lora_state_dict(model, 2)
    model.load_lora_adapter(style, adapter_name="style", prefix=None)
    first_eager = _run(lambda: model(**inputs))

    settings = {}
    force = ("merge_projections",) if merged else ()
    if variant == "captured":
        simulator = SimulatedGraphAdapter()
        register_adapter("cpu", lambda device: simulator)
        settings["aclgraph_with_compile"] = True
    if variant == "cached":
        settings["cache_dir"] = str(tmp_path)
        torch._dynamo.reset()
        warm = torch.compile(model, backend=MindieSDBackend(CompilationConfig(**settings), force_fast=force))
        _run(lambda: warm(**inputs))  # stores the entry the compile below loads
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(**settings), force_fast=force)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if variant == "regional":
                model.compile_repeated_blocks(backend=backend)
                compiled = model
            else:
                compiled = torch.compile(model, backend=backend)
            first = _run(lambda: compiled(**inputs))
            graphs = backend.report().graphs
            model.load_lora_adapter(other_style, adapter_name="style", prefix=None, hotswap=True)
            with torch._dynamo.config.patch(error_on_recompile=True):
                swapped = _run(lambda: compiled(**inputs))
    finally:
        if variant == "captured":
            register_adapter("cpu", None)
        torch._dynamo.reset()
    if variant == "regional":  # eager again: the blocks' compiled forward set aside
        for module in model.modules():
            module._compiled_call_impl = None
    swapped_eager = _run(lambda: model(**inputs))

    assert [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)] == []
    assert backend.report().graphs == graphs, "the hot-swap recompiled"
    if variant == "cached":
        assert {r.cache for r in backend.report().records} == {"hit"}
    if variant == "captured":
        assert simulator.captures > 0 and simulator.replays > simulator.captures
    fused = backend.report().matches
    assert sum(fused[f] for f in FAMILIES) > 0
    assert (fused["merge_projections"] > 0) == merged
    assert _error(swapped_eager, first_eager) > 1e-3, "the second adapter should change the output"
    assert _error(first, first_eager) <= 1e-5
    assert _error(swapped, swapped_eager) <= 1e-5
