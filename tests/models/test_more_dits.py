"""End to end on tiny diffusers DiTs beyond Flux, SD3 and Wan: compiled output equals eager, no fallback, and every
fusible site of each family is fused.

The models, their expected counts and their known gaps come from the registry (``mindiesd.zoo``, group ``dits``):
each is a real diffusers class built from a shrunken config with seeded random weights, run at batch 2 so that
per-sample modulation tensors really broadcast. The expected counts are derived from the model's modules and the
forward code of its blocks (documented per model in ``mindiesd/zoo/_dits.py``), not copied from a run.

"No fallback" is checked by the shared runner for every case: no ``MindieSDFallbackWarning`` while compiling or
running, and no record of ``backend.report()`` with a ``fallback``; either makes every test of the model fail.

The fused ops are counted at run time (the ``mindiesd::*`` calls of one compiled forward, read with the profiler),
since a graph that Dynamo compiles once can serve several identical blocks after a graph break; where the model
compiles to one graph the ops in ``backend.graphs`` must give the same counts.

Where a family falls short of the sites the model contains, its case is ``xfail(strict=True)`` with the unfused
form named (the entry's ``gaps``), so the day the gap is closed the test says so.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from fusion_utils import FAMILIES, count_fused  # noqa: E402
from mindiesd import zoo  # noqa: E402
from mindiesd.compilation import MindieSDBackend, MindieSDFallbackWarning  # noqa: E402

pytestmark = pytest.mark.slow  # whole models: the quick subset is `pytest -m "not slow"`

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: max |compiled - eager| / max |eager| per dtype.
MAX_ERROR = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: The models of this suite: the registry's group ``dits``.
MODELS = {name: zoo.entry(name) for name in zoo.names(group="dits")}


# -- one compiled run per (model, dtype), shared by the tests ----------------------------------------------------


@dataclass
class Run:
    error: float = 0.0
    expected: Dict[str, int] = field(default_factory=dict)
    at_run_time: Dict[str, int] = field(default_factory=dict)
    in_graphs: Dict[str, int] = field(default_factory=dict)
    graphs: int = 0
    fallbacks: List[str] = field(default_factory=list)  # the report's records that ran the unfused graph
    fallback_warnings: List[str] = field(default_factory=list)  # MindieSDFallbackWarnings at compile or run time
    failure: Optional[BaseException] = None


_RUNS: Dict[tuple, Run] = {}


def _fused_calls(fn: Callable[[], Any]) -> tuple:
    """fn's result, and the mindiesd ops that the call executed, per family."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    calls = Counter(e.name.split("::", 1)[1] for e in prof.events() if e.name.startswith("mindiesd::"))
    return result, {family: calls.get(family, 0) for family in FAMILIES}


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output.sample


def _run(name: str, dtype: torch.dtype) -> Run:
    if not zoo.available(name):
        pytest.skip(f"diffusers {diffusers.__version__} has no {MODELS[name].cls}")
    key = (name, dtype)
    if key not in _RUNS:
        run = Run()
        try:
            case = zoo.build(name, "tiny", dtype=dtype)  # seeded weights and inputs, eval mode, return_dict=False
            model, inputs = case.model, case.inputs
            run.expected = case.expected()
            backend = MindieSDBackend(keep_graphs=True)
            compiled = torch.compile(model, backend=backend)
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                reference = _first(model(**inputs))
                actual = _first(compiled(**inputs))  # compiles, then runs
                second, run.at_run_time = _fused_calls(lambda: _first(compiled(**inputs)))
            run.fallback_warnings = [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)]
            run.fallbacks = [record.fallback for record in backend.report().records if record.fallback]
            # a fallback runs the unfused graph: every count and comparison below would describe that graph
            assert run.fallback_warnings == [], run.fallback_warnings
            assert run.fallbacks == [], run.fallbacks
            assert actual.shape == reference.shape and actual.dtype == reference.dtype
            torch.testing.assert_close(second, actual, rtol=0, atol=0)  # the second call reruns the same graphs
            run.error = ((actual.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
            run.in_graphs = count_fused(backend)
            run.graphs = backend.report().graphs
        except Exception as exc:  # reported by every test of this model and dtype
            run.failure = RuntimeError(f"{name} {dtype}: {type(exc).__name__}: {exc}")
            run.failure.__cause__ = exc
        _RUNS[key] = run
    run = _RUNS[key]
    if run.failure is not None:
        raise run.failure
    return run


def _cases(with_families: bool):
    for name, entry in MODELS.items():
        for dtype_id in entry.checked_dtypes:
            if not with_families:
                yield pytest.param(name, DTYPES[dtype_id], id=f"{name}-{dtype_id}")
                continue
            for family in FAMILIES:
                marks = []
                if family in entry.gaps:
                    marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=entry.gaps[family]))
                yield pytest.param(name, DTYPES[dtype_id], family, marks=marks, id=f"{name}-{dtype_id}-{family}")


def test_the_suite_covers_the_registry_group():
    assert list(MODELS) == [
        "qwen_image", "hunyuan_video", "cogvideox", "ltx_video", "sana", "lumina2", "pixart", "hidream",
        "hidream_moe", "cogview4", "auraflow", "chroma", "skyreels_v2", "flux2", "omnigen", "prx", "anyflow",
    ]
    # the known gaps: CogVideoX's affine LayerNorm modulation (and the mul_adds it leaves), Lumina2's scale-only one
    assert {(n, f) for n, e in MODELS.items() for f in e.gaps} == {
        ("cogvideox", "adalayernorm"), ("cogvideox", "mul_add"), ("lumina2", "adalayernorm"),
    }


@pytest.mark.parametrize("name,dtype", list(_cases(with_families=False)))
def test_compiled_matches_eager_without_fallback(name, dtype):
    run = _run(name, dtype)
    assert run.fallbacks == [] and run.fallback_warnings == []
    assert run.error <= MAX_ERROR[dtype], run.error


@pytest.mark.parametrize("name,dtype,family", list(_cases(with_families=True)))
def test_every_site_is_fused(name, dtype, family):
    run = _run(name, dtype)
    assert run.at_run_time[family] == run.expected[family], (run.at_run_time, run.expected)
    if run.graphs == 1:
        assert run.in_graphs[family] == run.expected[family], (run.in_graphs, run.expected)
