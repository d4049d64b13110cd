"""Each fused op site runs what measured fastest on the device (``compilation/runtime/kernel_choice.py``): the op where it wins, an
ATen composition or the reference's aten ops where they do. The mechanism runs on the CPU with the CPU's
candidates; a timer double decides the winners where a test needs a given outcome."""

import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import assert_close
from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDFallbackWarning
from mindiesd.compilation.runtime import kernel_choice as choice_module
from mindiesd.compilation.config import SettingTypeError

aten = torch.ops.aten
mindiesd = torch.ops.mindiesd


class Block(torch.nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, gate):
        h = F.gelu(self.proj(self.norm(x)), approximate="tanh")
        return x + gate * h


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 6, 32, generator=g).to(dtype), torch.randn(1, 1, 32, generator=g).to(dtype)


def _calls(gm):
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


class FakeTimer:
    """Times each candidate as the table says (names missing from it: 1 ms); records what it was asked."""

    def __init__(self, table=None):
        self.table = table or {}
        self.asked = []

    def __call__(self, candidates, device):
        self.asked.append(sorted(candidates))
        return {name: self.table.get(name, 1.0) for name in candidates}


def _compile(monkeypatch, timer, kernel_choice="measure", cache_dir=None, dtype=torch.float32):
    if timer is not None:
        monkeypatch.setattr(choice_module, "time_candidates", timer)
    model = Block().to(dtype).eval()
    backend = MindieSDBackend(CompilationConfig(cache_dir=cache_dir, kernel_choice=kernel_choice), keep_graphs=True)
    args = _inputs(dtype)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        actual = torch.compile(model, backend=backend, fullgraph=True)(*args)
        expected = model(*args)
    torch._dynamo.reset()
    return actual, expected, backend


def test_where_the_kernel_is_fastest_every_site_keeps_its_op(monkeypatch):
    timer = FakeTimer({"kernel": 0.1})
    actual, expected, backend = _compile(monkeypatch, timer)
    assert_close(actual, expected)
    calls = _calls(backend.graphs[0])
    assert calls[mindiesd.rms_norm.default] == calls[mindiesd.fast_gelu.default] == calls[mindiesd.mul_add.default] == 1
    record = backend.report().records[0]
    assert len(record.kernel_choices) == 3 and all(": kernel (" in line for line in record.kernel_choices)
    # every candidate of each site was timed: the op, the composition where there is one, the reference
    assert sorted(timer.asked) == sorted([["kernel", "reference"], ["gelu_tanh", "kernel", "reference"],
                                          ["addcmul", "kernel", "reference"]])


def test_a_site_where_eagers_ops_win_runs_the_reference_composition(monkeypatch):
    actual, expected, backend = _compile(monkeypatch, FakeTimer({"reference": 0.1}))
    assert_close(actual, expected)
    calls = _calls(backend.graphs[0])
    assert not any(t.namespace == "mindiesd" for t in calls if isinstance(t, torch._ops.OpOverload))
    assert calls[aten.rsqrt.default] == 1 and calls[aten.tanh.default] == 1  # the reference's aten ops
    assert all(": reference (" in line for line in backend.report().records[0].kernel_choices)


def test_a_composition_that_wins_takes_the_sites_place(monkeypatch):
    actual, expected, backend = _compile(monkeypatch, FakeTimer({"gelu_tanh": 0.1, "addcmul": 0.1}))
    assert_close(actual, expected)
    calls = _calls(backend.graphs[0])
    assert calls[mindiesd.fast_gelu.default] == calls[mindiesd.mul_add.default] == 0
    assert calls[aten.gelu.default] == 1 and calls[aten.addcmul.default] == 1
    assert calls[mindiesd.rms_norm.default] == 1  # its kernel tied with the reference: the op stays
    gelu = next(n for n in backend.graphs[0].graph.nodes if n.target is aten.gelu.default)
    assert gelu.kwargs.get("approximate") == "tanh"


def test_a_candidate_that_computes_something_else_is_never_chosen(monkeypatch):
    monkeypatch.setitem(choice_module.COMPOSITIONS, "fast_gelu", (("wrong", lambda x: torch.relu(x)),))
    actual, expected, backend = _compile(monkeypatch, FakeTimer({"wrong": 0.001}))
    assert_close(actual, expected)
    assert _calls(backend.graphs[0])[mindiesd.fast_gelu.default] == 1
    gelu_line = next(line for line in backend.report().records[0].kernel_choices if line.startswith("fast_gelu"))
    assert ": kernel (" in gelu_line and "wrong -" in gelu_line  # not valid there: no time


def test_a_site_whose_op_disagrees_with_its_reference_runs_another_candidate(monkeypatch):
    """The op is the declared choice, but a measurement that sees it give another answer does not keep it."""
    def off_by_one(node, fact):
        return lambda *args, **kwargs: node.target(*args, **kwargs) + 1

    monkeypatch.setattr(choice_module, "_runner_call", off_by_one)
    actual, expected, backend = _compile(monkeypatch, FakeTimer({"kernel": 0.001}))
    assert_close(actual, expected)
    calls = _calls(backend.graphs[0])
    assert not any(getattr(t, "namespace", None) == "mindiesd" for t in calls)
    lines = backend.report().records[0].kernel_choices
    assert len(lines) == 3 and all("kernel -" in line and ": kernel (" not in line for line in lines)


@pytest.mark.parametrize("kernel_choice", ["declared", "auto"])
def test_declared_and_auto_on_the_cpu_measure_nothing(monkeypatch, kernel_choice):
    def refuse(candidates, device):
        raise AssertionError("measured")

    actual, expected, backend = _compile(monkeypatch, refuse, kernel_choice=kernel_choice)
    assert_close(actual, expected)
    assert backend.report().records[0].kernel_choices == []
    assert _calls(backend.graphs[0])[mindiesd.mul_add.default] == 1


def test_a_warm_start_takes_the_stored_choice_without_measuring(monkeypatch, tmp_path):
    _compile(monkeypatch, FakeTimer({"reference": 0.1}), cache_dir=str(tmp_path))
    timer = FakeTimer({"kernel": 0.1})
    actual, expected, backend = _compile(monkeypatch, timer, cache_dir=str(tmp_path))
    assert_close(actual, expected)
    record = backend.report().records[0]
    assert record.cache == "hit" and timer.asked == []
    assert all(": reference (" in line for line in record.kernel_choices)
    assert _calls(backend.graphs[0])[mindiesd.mul_add.default] == 0


def test_the_measured_choice_and_the_declared_one_are_cached_apart(monkeypatch, tmp_path):
    _compile(monkeypatch, FakeTimer({"reference": 0.1}), cache_dir=str(tmp_path))
    _, _, backend = _compile(monkeypatch, None, kernel_choice="declared", cache_dir=str(tmp_path))
    assert backend.report().records[0].cache == "stored"
    assert _calls(backend.graphs[0])[mindiesd.mul_add.default] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measuring_with_the_real_timer_gives_eagers_values_and_times_every_candidate(dtype):
    actual, expected, backend = _compile(None, None, dtype=dtype)  # the real timer
    assert_close(actual, expected, dtype)
    lines = backend.report().records[0].kernel_choices
    assert len(lines) == 3
    for line in lines:
        assert " ms)" in line and "kernel " in line and "reference " in line and " - " not in line


def test_sites_with_one_signature_are_measured_once(monkeypatch):
    class Twice(torch.nn.Module):
        def forward(self, x, y, z):
            return (x * y + z) * 2, (y * x + z) * 3, (x[:, :3] * y[:, :3] + z[:, :3]) * 4

    monkeypatch.setattr(choice_module, "time_candidates", timer := FakeTimer({"kernel": 0.1}))
    backend = MindieSDBackend(CompilationConfig(cache_dir=None, kernel_choice="measure"), keep_graphs=True)
    g = torch.Generator().manual_seed(1)
    x, y, z = (torch.randn(2, 5, 8, generator=g) for _ in range(3))
    with torch.no_grad():
        torch.compile(Twice(), backend=backend, fullgraph=True)(x, y, z)
    torch._dynamo.reset()
    lines = backend.report().records[0].kernel_choices
    assert len(timer.asked) == 2 and len(lines) == 2  # the two full-size sites share one measurement
    assert any(" x2: " in line for line in lines)


def test_kernel_choice_takes_only_its_three_values():
    assert CompilationConfig().kernel_choice == "auto"
    with pytest.raises(SettingTypeError, match="kernel_choice"):
        CompilationConfig(kernel_choice="fastest")


def test_auto_measures_on_an_accelerator_without_capture_only():
    assert choice_module.measuring("auto", "cuda", capture=False)
    assert choice_module.measuring("auto", "npu", capture=False)
    assert not choice_module.measuring("auto", "cuda", capture=True)
    assert not choice_module.measuring("auto", "cpu", capture=False)
    assert choice_module.measuring("measure", "cpu", capture=False)
    assert not choice_module.measuring("declared", "cuda", capture=False)


def test_an_ahead_of_time_artifact_keeps_its_measured_choice(monkeypatch, tmp_path):
    from mindiesd.compilation import aot_compile

    monkeypatch.setattr(choice_module, "time_candidates", FakeTimer({"addcmul": 0.1}))
    config = CompilationConfig(cache_dir=str(tmp_path), kernel_choice="measure")
    args = _inputs()
    with torch.no_grad():
        model = aot_compile(Block().eval(), MindieSDBackend(config))
        expected = model(*args)
        assert list(model.forward.outcomes.values()) == ["stored"]
        stored = model.forward.kernel_choices()
        assert any(line.startswith("mul_add") and ": addcmul (" in line for line in stored)
        torch._dynamo.reset()
        timer = FakeTimer({"kernel": 0.1})
        monkeypatch.setattr(choice_module, "time_candidates", timer)
        fresh = Block().eval()
        fresh.load_state_dict(model.state_dict())
        reloaded = aot_compile(fresh, MindieSDBackend(config))
        torch.testing.assert_close(reloaded(*args), expected, rtol=0, atol=0)
    assert list(reloaded.forward.outcomes.values()) == ["loaded"] and timer.asked == []
    assert reloaded.forward.kernel_choices() == stored
    graph, = reloaded.forward.graphs()
    assert _calls(graph)[aten.addcmul.default] == 1 and _calls(graph)[mindiesd.mul_add.default] == 0


@pytest.mark.slow
@pytest.mark.parametrize("winner", ["reference", "composition"])
@pytest.mark.parametrize("name", __import__("mindiesd.zoo", fromlist=["MODELS"]).MODELS)
def test_every_registry_model_runs_whatever_wins_at_each_site(monkeypatch, name, winner):
    """Each site's op replaced by its reference's aten ops, or by its ATen composition where it has one: every
    registry model (tiny, fp32) still compiles without a fallback and gives eager's output."""
    from mindiesd import zoo

    favoured = {"reference"} if winner == "reference" else {"addcmul", "gelu_tanh"}
    monkeypatch.setattr(choice_module, "time_candidates",
                        lambda candidates, device: {k: 0.1 if k in favoured else 1.0 for k in candidates})
    case = zoo.build(name, "tiny")
    backend = MindieSDBackend(CompilationConfig(cache_dir=None, kernel_choice="measure"), keep_graphs=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        actual = torch.compile(case.model, backend=backend)(**case.inputs)[0]
        expected = case.model(**case.inputs)[0]
    torch._dynamo.reset()
    assert ((actual - expected).abs().max() / expected.abs().max()).item() < 1e-5
    lines = [line for record in backend.report().records for line in record.kernel_choices]
    assert lines and all(record.fallback is None for record in backend.report().records)
    if winner == "reference":
        assert all(": reference (" in line for line in lines)
        measured = {choice_module.FAMILIES[f].op.name for f in choice_module.measured_families()}
        left = [n for gm in backend.graphs for n in gm.graph.nodes if getattr(n.target, "_opname", None) in measured
                and getattr(n.target, "namespace", None) == "mindiesd"]
        assert all(choice_module._signature(n) is None for n in left)  # only sites with symbolic shapes stay
