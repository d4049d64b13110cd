"""Regional compilation: diffusers' ``compile_repeated_blocks`` with the backend passed once, by name.

As diffusers' own ``test_torch_compile_repeated_blocks`` does: ``fullgraph=True`` under ``recompile_limit=1``,
two calls, no recompilation. That holds only if every compiled block returns the strides eager's block returns
(the next block's guards check them). Beyond that: no fallback, output equal to eager's, and the fused ops
that run are those the block graphs contain, once per block instance.

The models are those of the registry (``mindiesd.zoo``) whose diffusers class declares ``_repeated_blocks`` and
whose graph Dynamo traces whole (``fullgraph=True`` rules out the entries with ``graph_breaks``).
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from fusion_utils import FAMILIES  # noqa: E402
from mindiesd import zoo  # noqa: E402
from mindiesd.compilation import MindieSDFallbackWarning, fusion_report, reset_fusion_report  # noqa: E402

pytestmark = pytest.mark.slow  # whole models: the quick subset is `pytest -m "not slow"`

MAX_ERROR = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _regional(name: str) -> bool:
    entry = zoo.entry(name)
    return bool(getattr(getattr(diffusers, entry.cls, None), "_repeated_blocks", None)) and not entry.graph_breaks


NAMES = [name for name in zoo.MODELS if _regional(name)]


def _build(name, dtype):
    case = zoo.build(name, "tiny", dtype=dtype)
    if name == "flux":
        # A single block returns slices of its joint sequence, so the second single block's input has other
        # strides than the first's in eager too: every backend (Dynamo's "eager" included) recompiles there.
        # One single block, as in diffusers' own Flux compile test.
        case.model.single_transformer_blocks = case.model.single_transformer_blocks[:1]
    return case.model, case.inputs


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output.sample


def _profiled(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    calls = Counter(e.name.split("::", 1)[1] for e in prof.events() if e.name.startswith("mindiesd::"))
    return result, {family: calls.get(family, 0) for family in FAMILIES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(NAMES))
def test_compile_repeated_blocks_by_name_never_recompiles(name, dtype):
    model, inputs = _build(name, dtype)  # seeded weights and inputs in dtype, eval mode, return_dict=False
    block_classes = set(model._repeated_blocks)
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    assert blocks, f"{name} has none of its _repeated_blocks {block_classes}"
    first_call_order = []
    hooks = [b.register_forward_pre_hook(lambda m, a: first_call_order.append(type(m).__name__)
                                          if type(m).__name__ not in first_call_order else None) for b in blocks]
    with torch.no_grad():
        reference = _first(model(**inputs))
    for hook in hooks:
        hook.remove()

    reset_fusion_report()
    model.compile_repeated_blocks(fullgraph=True, backend="mindiesd")
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(recompile_limit=1), \
            torch.no_grad():
        warnings.simplefilter("always")
        first = _first(model(**inputs))
        second, ran = _profiled(lambda: _first(model(**inputs)))

    fallbacks = [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)]
    assert fallbacks == []
    report = fusion_report()
    assert report.fallbacks == []
    # one graph per block class that runs; a recompilation would add graphs (or raise past the limit)
    assert report.graphs == len(first_call_order), (report.graphs, first_call_order)
    instances = Counter(type(b).__name__ for b in blocks)
    expected = {f: sum(instances[cls] * record.matches.get(f, 0)
                       for cls, record in zip(first_call_order, report.records)) for f in FAMILIES}
    assert ran == expected
    assert sum(ran.values()) > 0
    error = ((first.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
    assert error <= MAX_ERROR[dtype], error
    torch.testing.assert_close(second, first, rtol=0, atol=0)
