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


# ------------------------------------------------------------ regional against whole-model compilation

from mindiesd.compilation import CompilationConfig, MindieSDBackend, SimulatedGraphAdapter, freezing  # noqa: E402
from mindiesd.compilation import register_adapter  # noqa: E402

CORE = ["flux", "sd3", "wan"]  # SD3 declares no _repeated_blocks in diffusers 0.42: zoo.repeated_blocks finds them


def _blocks(model):
    classes = set(zoo.repeated_blocks(model))
    model._repeated_blocks = sorted(classes)
    return [m for m in model.modules() if type(m).__name__ in classes]


def _no_fallback(caught):
    return [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)] == []


def _outside_blocks(model, blocks):
    """Fused sites of a core model outside its repeated blocks, from its modules: the final ``norm_out``
    modulation (Flux and SD3: AdaLayerNormContinuous; Wan: inline) and the RMSNorm / tanh-GELU modules of the
    embedders. RoPE (with the q/k norms norm_rope joins to it) and the gated residuals live only in blocks; the
    core models have no gated activation."""
    from mindiesd.zoo._base import rms_norms, tanh_gelus

    return {"rms_norm": rms_norms(model) - sum(rms_norms(b) for b in blocks), "rope": 0, "norm_rope": 0,
            "adalayernorm": 1,
            "glu": 0, "fast_gelu": tanh_gelus(model) - sum(tanh_gelus(b) for b in blocks), "mul_add": 0}


@pytest.mark.parametrize("name", CORE)
def test_regional_fuses_inside_the_blocks_what_the_whole_model_compile_fuses(name):
    """Fused ops run per forward: the repeated blocks compiled = the whole model compiled, less the sites outside
    the blocks (which regional compilation leaves to eager). No fusion is lost at a block boundary."""
    counts = {}
    for variant in ("whole", "regional"):
        case = zoo.build(name, "tiny")
        model, inputs = case.model, case.inputs
        blocks = _blocks(model)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            reference = _first(model(**inputs))
            if variant == "whole":
                run = torch.compile(model, backend=MindieSDBackend())
            else:
                model.compile_repeated_blocks(backend=MindieSDBackend())
                run = model
            out = _first(run(**inputs))
            _, counts[variant] = _profiled(lambda: run(**inputs))
        assert _no_fallback(caught), variant
        error = ((out - reference).abs().max() / reference.abs().max()).item()
        assert error <= MAX_ERROR[torch.float32], (variant, error)
    torch._dynamo.reset()
    assert counts["whole"] == case.expected()
    outside = _outside_blocks(model, blocks)
    assert {f: counts["whole"][f] - outside[f] for f in FAMILIES} == counts["regional"], (counts, outside)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_regional_each_block_instance_runs_with_its_own_weights(name):
    """One compiled graph per block class serves every instance with that instance's weights (freezing on): a
    weight changed in place in one block only changes the output as it does in eager."""
    import copy

    case = zoo.build(name, "tiny")
    model, inputs = case.model, case.inputs
    eager = copy.deepcopy(model)
    blocks, eager_blocks = _blocks(model), _blocks(eager)
    torch._dynamo.reset()
    with torch.no_grad():
        model.compile_repeated_blocks(backend=MindieSDBackend(CompilationConfig(enable_freezing=True)))
        first = _first(model(**inputs))
        for block in (blocks[1], eager_blocks[1]):
            next(p for n, p in block.named_parameters() if n.endswith("weight") and p.dim() == 2).mul_(1.5)
        changed, expected = _first(model(**inputs)), _first(eager(**inputs))
    torch._dynamo.reset()
    assert not torch.allclose(changed, first)
    error = ((changed - expected).abs().max() / expected.abs().max()).item()
    assert error <= MAX_ERROR[torch.float32], error


def test_regional_freezing_folds_each_block_instance_once():
    """Where a block computes something from its weights alone, freezing folds it once per block instance (the
    graph is shared, the folded values are not), the later forwards reuse it, and a weight changed in place
    refolds that instance only."""
    from diffusers import ModelMixin

    class ScaledBlock(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.proj = torch.nn.Linear(width, width)
            self.log_gain = torch.nn.Parameter(torch.randn(width) * 0.1)

        def forward(self, x):
            return x + torch.nn.functional.gelu(self.proj(x), approximate="tanh") * self.log_gain.exp()

    class Stack(ModelMixin):
        _repeated_blocks = ["ScaledBlock"]

        def __init__(self, width=32, depth=3):
            super().__init__()
            self.blocks = torch.nn.ModuleList(ScaledBlock(width) for _ in range(depth))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    import copy

    torch.manual_seed(0)
    model, x = Stack().eval(), torch.randn(2, 8, 32)
    eager = copy.deepcopy(model)
    before = set(freezing._live_graphs)
    torch._dynamo.reset()
    with torch.no_grad():
        reference = eager(x)
        model.compile_repeated_blocks(backend=MindieSDBackend(CompilationConfig(enable_freezing=True)))
        first = model(x)
        (graph,) = [g for g in freezing._live_graphs if g not in before]
        folded = {id(t) for e in graph._cache.values() for t in e.folded}
        second = model(x)
        kept = {id(t) for e in graph._cache.values() for t in e.folded}
        for m in (model, eager):
            m.blocks[1].log_gain.add_(0.5)
        changed, expected = model(x), eager(x)
        after = {id(t) for e in graph._cache.values() for t in e.folded}
    torch._dynamo.reset()
    assert len(folded) == len(model.blocks) and len(graph._cache) == len(model.blocks), \
        "one folded weight set per block instance"
    assert kept == folded, "a later forward refolded"
    assert len(after - folded) == 1 and len(after) == len(folded), "only the changed instance is refolded"
    torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(changed, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, first)


@pytest.mark.parametrize("safe_output_mode", [True, False], ids=["safe", "static-outputs"])
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_regional_with_capture_captures_each_block_instance_once(name, safe_output_mode):
    """aclgraph_with_compile per block (simulated device graphs): a capture per block instance, replays after;
    even with static outputs no capture's output is overwritten while a later block still reads it."""
    simulator = SimulatedGraphAdapter()
    register_adapter("cpu", lambda device: simulator)
    try:
        case = zoo.build(name, "tiny")
        model, inputs = case.model, case.inputs
        blocks = _blocks(model)
        torch._dynamo.reset()
        backend = MindieSDBackend(CompilationConfig(aclgraph_with_compile=True, safe_output_mode=safe_output_mode))
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            reference = _first(model(**inputs))
            model.compile_repeated_blocks(backend=backend)
            outs, captures, replays = [], [], []
            for _ in range(3):
                outs.append(_first(model(**inputs)).clone())
                captures.append(simulator.captures)
                replays.append(simulator.replays)
        torch._dynamo.reset()
    finally:
        register_adapter("cpu", None)
    assert _no_fallback(caught)
    # the first forward captures each instance once; the steady state only replays. (Flux: Dynamo tries its
    # newest graph first, so from the second forward the first single block runs in the graph compiled for the
    # later ones, which captures it once more.)
    assert captures[0] == len(blocks), (captures, len(blocks))
    assert captures[2] == captures[1] and replays[2] - replays[1] == len(blocks), (captures, replays)
    assert sum(r.stats.recaptures for r in backend.runners) == 0
    for out in outs:
        error = ((out - reference).abs().max() / reference.abs().max()).item()
        assert error <= MAX_ERROR[torch.float32], error


def test_regional_blocks_serve_new_resolutions_from_cpp_without_a_fallback(monkeypatch):
    """Three resolutions through compile_repeated_blocks: automatic dynamic recompiles the blocks with symbolic
    sizes after the second, and every block graph, static or symbolic, runs in the C++ executor and equals eager."""
    from mindiesd.compilation import CompilationConfig, MindieSDBackend
    from mindiesd.compilation.runtime import executor

    built = []
    real = executor.CppRunner._build

    def recording(self, args=()):
        program = real(self, args)
        built.append(program is not False)
        return program

    monkeypatch.setattr(executor.CppRunner, "_build", recording)
    torch._dynamo.reset()
    model = zoo.build("flux", "host").model
    model._repeated_blocks = zoo.repeated_blocks(model)
    backend = MindieSDBackend(CompilationConfig(cache_dir=None))
    model.compile_repeated_blocks(backend=backend)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        for step in (0, 1, 2, 0):
            case = zoo.build("flux", "host", shapes=zoo.other_resolution("flux", "host", step))
            torch.testing.assert_close(model(**case.inputs)[0], case.model(**case.inputs)[0], rtol=1e-5, atol=1e-5)
    assert backend.report().fallbacks == [] and backend.report().graphs >= 4
    assert built and all(built)
