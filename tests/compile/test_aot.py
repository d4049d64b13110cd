"""Ahead-of-time artifacts (mindiesd.compilation.aot_compile): a second process loads the compiled forward without
Dynamo, with the same outputs and fused ops; new resolutions, changed weights, stale and corrupt artifacts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from mindiesd import zoo  # noqa: E402
from mindiesd.compilation import (  # noqa: E402
    AotForward,
    CompilationConfig,
    MindieSDBackend,
    MindieSDCacheWarning,
    MindieSDFallbackWarning,
    aot_compile,
)
from mindiesd.compilation.storage import cache as graph_cache  # noqa: E402
from mindiesd.compilation.families import SPEC_FAMILIES  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
PROCESS_TIMEOUT_S = 300

#: One process: build the model, compile it ahead of time with the cache folder, run it once; print what happened.
_PROCESS = textwrap.dedent("""
    import json, sys, time, warnings
    from collections import Counter
    import torch
    from torch._dynamo.utils import counters
    from mindiesd import zoo
    from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDFallbackWarning, aot_compile

    name, folder, out_path, regional = sys.argv[1:5]
    warnings.simplefilter("error", MindieSDFallbackWarning)
    case = zoo.build(name, "tiny")
    with torch.no_grad():
        eager = case.model(**case.inputs)[0]
    case.model._repeated_blocks = zoo.repeated_blocks(case.model)
    model = aot_compile(case.model, MindieSDBackend(CompilationConfig(cache_dir=folder)), regional=regional == "1")
    forwards = [m.forward for m in model.modules() if "forward" in m.__dict__]
    start = time.perf_counter()
    with torch.no_grad():
        out = model(**case.inputs)[0]
    first_call = time.perf_counter() - start
    torch.save(out, out_path)
    fused = Counter(n.target.__name__.split(".")[0] for f in forwards for g in f.graphs() for n in g.graph.nodes
                    if n.op == "call_function" and str(n.target).startswith("mindiesd."))
    print(json.dumps({"outcomes": sorted(o for f in forwards for o in f.outcomes.values()), "first_call_s": first_call,
                      "frames": counters["stats"].get("unique_graphs", 0), "fused": dict(fused),
                      "expected": {k: v for k, v in case.expected().items() if v},
                      "error": ((out - eager).abs().max() / eager.abs().max()).item()}))
""")


def _process(name: str, folder: Path, out_path: Path, regional: bool = False) -> dict:
    result = subprocess.run([sys.executable, "-c", _PROCESS, name, str(folder), str(out_path), str(int(regional))],
                            cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [
    "flux", pytest.param("sd3", marks=pytest.mark.slow), pytest.param("wan", marks=pytest.mark.slow)])
def test_a_second_process_loads_the_artifact_without_tracing(name, tmp_path):
    first = _process(name, tmp_path / "cache", tmp_path / "first.pt")
    second = _process(name, tmp_path / "cache", tmp_path / "second.pt")
    assert first["outcomes"] == ["stored"] and first["frames"] == 1
    assert second["outcomes"] == ["loaded"] and second["frames"] == 0, "the second process traced the model"
    for run in (first, second):
        fused = {k: v for k, v in run["fused"].items() if k in SPEC_FAMILIES}  # cat_linear apart (fp32 only)
        assert fused == {k: v for k, v in run["expected"].items() if k in SPEC_FAMILIES}, run
        assert run["error"] <= 1e-5
    torch.testing.assert_close(torch.load(tmp_path / "second.pt"), torch.load(tmp_path / "first.pt"), rtol=0, atol=0)
    assert len(graph_cache.artifact_files(str(tmp_path / "cache"))) == 1
    # how much faster the warm start is, is measured by `bench model ... --aot --cache-dir DIR` (docs/cache.md), not
    # here: a wall-clock ratio in a test fails on a loaded machine


@pytest.mark.slow
def test_regional_artifacts_one_per_block_class_shared_by_its_blocks(tmp_path):
    """Tiny Flux: 2 double-stream and 4 single-stream blocks give 3 artifacts (the first single block reads its
    input in another layout than the others, which Dynamo's stride guards tell apart); the blocks of one signature
    share it, and a second process loads each artifact once."""
    first = _process("flux", tmp_path / "cache", tmp_path / "first.pt", regional=True)
    second = _process("flux", tmp_path / "cache", tmp_path / "second.pt", regional=True)
    assert first["outcomes"] == ["shared"] * 3 + ["stored"] * 3 and first["frames"] == 3
    assert second["outcomes"] == ["loaded"] * 3 + ["shared"] * 3 and second["frames"] == 0
    assert len(graph_cache.artifact_files(str(tmp_path / "cache"))) == 3
    for run in (first, second):
        assert run["error"] <= 1e-5
        for family in ("rms_norm", "rope", "norm_rope"):  # every site of these is in a block
            assert run["fused"].get(family, 0) == run["expected"].get(family, 0), run
        assert run["fused"]["norm_rope"] > 0, run
    torch.testing.assert_close(torch.load(tmp_path / "second.pt"), torch.load(tmp_path / "first.pt"), rtol=0, atol=0)


def _flux(seed: int = 0):
    return zoo.build("flux", "tiny", seed=seed)


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _eager(model, inputs):
    with torch.no_grad():
        return type(model).forward(model, **inputs)[0]


def _fused(forward: AotForward) -> Counter:
    return Counter(str(n.target).split(".")[1] for g in forward.graphs() for n in g.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("mindiesd."))


def test_in_one_process_a_new_module_loads_and_a_new_resolution_compiles(tmp_path):
    config = CompilationConfig(cache_dir=str(tmp_path))
    case = _flux()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        model = aot_compile(case.model, MindieSDBackend(config))
        assert model is case.model and isinstance(model.forward, AotForward)
        torch.testing.assert_close(_run(model, case.inputs), _eager(model, case.inputs))
        image = case.inputs["hidden_states"]  # (batch, image tokens, channels): twice the tokens
        taller = {**case.inputs, "hidden_states": torch.cat([image, image.flip(1)], dim=1),
                  "img_ids": torch.cat([case.inputs["img_ids"]] * 2)}
        torch.testing.assert_close(_run(model, taller), _eager(model, taller))
        assert list(model.forward.outcomes.values()) == ["stored", "stored"]
        assert len(graph_cache.artifact_files(str(tmp_path))) == 2

        torch._dynamo.reset()
        again = _flux()
        reloaded = aot_compile(again.model, MindieSDBackend(config))
        torch.testing.assert_close(_run(reloaded, again.inputs), _eager(again.model, again.inputs))
        torch.testing.assert_close(_run(reloaded, taller), _eager(again.model, taller))
    assert list(reloaded.forward.outcomes.values()) == ["loaded", "loaded"]
    assert _fused(reloaded.forward) == _fused(model.forward)
    assert _fused(reloaded.forward)["rms_norm"] == 2 * again.expected()["rms_norm"]


def test_weights_changed_after_loading_are_seen(tmp_path):
    config = CompilationConfig(cache_dir=str(tmp_path))
    case = _flux()
    _run(aot_compile(case.model, MindieSDBackend(config)), case.inputs)
    torch._dynamo.reset()
    other = _flux()
    model = aot_compile(other.model, MindieSDBackend(config))
    before = _run(model, other.inputs)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # in place, as load_state_dict and a LoRA hot-swap write
    after = _run(model, other.inputs)
    assert list(model.forward.outcomes.values()) == ["loaded"]
    assert ((after - before).abs().max() / before.abs().max()).item() > 1e-2
    torch.testing.assert_close(after, _eager(model, other.inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_changed_version_or_setting_compiles_a_new_artifact(tmp_path, monkeypatch):
    case = _flux()
    _run(aot_compile(case.model, MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path)))), case.inputs)
    versions = graph_cache._versions()
    monkeypatch.setattr(graph_cache, "_versions", lambda: {**versions, "diffusers": "0.0.0"})
    for config in (CompilationConfig(cache_dir=str(tmp_path)),
                   CompilationConfig(cache_dir=str(tmp_path), enable_freezing=False)):
        torch._dynamo.reset()
        other = _flux()
        model = aot_compile(other.model, MindieSDBackend(config))
        torch.testing.assert_close(_run(model, other.inputs), _eager(other.model, other.inputs))
        assert list(model.forward.outcomes.values()) == ["stored"]
    assert len(graph_cache.artifact_files(str(tmp_path))) == 3


@pytest.mark.parametrize("damage", [pytest.param("truncated", marks=pytest.mark.slow), "garbage",
                                    pytest.param("foreign", marks=pytest.mark.slow)])
def test_a_damaged_artifact_warns_and_compiles_again(damage, tmp_path):
    case = _flux()
    _run(aot_compile(case.model, MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path)))), case.inputs)
    (path,) = graph_cache.artifact_files(str(tmp_path))
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00not an artifact",
                      "foreign": graph_cache.frame(b"payload", "another key")}[damage])
    torch._dynamo.reset()
    other = _flux()
    model = aot_compile(other.model, MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path))))
    with pytest.warns(MindieSDCacheWarning, match="unusable artifact"):
        out = _run(model, other.inputs)
    torch.testing.assert_close(out, _eager(other.model, other.inputs))
    assert list(model.forward.outcomes.values()) == ["stored"]
    assert graph_cache.unframe(path.read_bytes(), path.stem)  # overwritten with a whole artifact


class _Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(16, eps=1e-6)

    def forward(self, x):
        y = self.norm(x)
        torch._dynamo.graph_break()
        return self.norm(y) * 2


def _run_twice(model, x):
    """The first output of two calls, and the cache and fallback warnings they gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _run_plain(model, x)
        _run_plain(model, x)
    messages = [str(w.message) for w in caught if issubclass(w.category, MindieSDCacheWarning)]
    return out, messages, [w for w in caught if issubclass(w.category, MindieSDFallbackWarning)]


def test_a_forward_with_graph_breaks_runs_through_torch_compile_with_one_warning(tmp_path):
    model = aot_compile(_Breaks(), MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path))))
    x = torch.randn(2, 8, 16)
    out, messages, fallbacks = _run_twice(model, x)
    assert len(messages) == 1 and "torch.compile" in messages[0], messages
    assert not fallbacks
    torch.testing.assert_close(out, _Breaks.forward(model, x))
    (outcome,) = model.forward.outcomes.values()
    assert outcome.startswith("torch.compile:")
    assert graph_cache.artifact_files(str(tmp_path)) == []


def test_a_torch_without_ahead_of_time_compilation_falls_back_to_torch_compile_with_one_warning(tmp_path,
                                                                                               monkeypatch):
    """Where torch lacks ahead-of-time compilation (torch._dynamo.aot_compile_types), the forward runs through
    torch.compile, and one warning names the torch version."""
    from mindiesd.compilation import ahead_of_time

    monkeypatch.setattr(ahead_of_time, "_Serializable", object)
    model = aot_compile(_NormLinear().eval(), MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path))))
    x = torch.randn(2, 5, 16)
    out, messages, _ = _run_twice(model, x)
    assert len(messages) == 1 and f"torch {torch.__version__} has no ahead-of-time compilation" in messages[0]
    torch.testing.assert_close(out, _NormLinear.forward(model, x))
    assert graph_cache.artifact_files(str(tmp_path)) == []


def _run_plain(model, x):
    with torch.no_grad():
        return model(x)


def test_without_a_cache_folder_the_artifact_stays_in_memory():
    case = _flux()
    model = aot_compile(case.model, MindieSDBackend(CompilationConfig(cache_dir=None)))
    torch.testing.assert_close(_run(model, case.inputs), _eager(case.model, case.inputs))
    assert list(model.forward.outcomes.values()) == ["compiled"]
    assert _fused(model.forward)["rope"] == case.expected()["rope"]


def test_misuse_is_refused_clearly():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        aot_compile(lambda x: x)
    with pytest.raises(TypeError, match="MindieSDBackend"):
        aot_compile(torch.nn.Linear(2, 2), backend="inductor")
    model = aot_compile(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already compiled ahead of time"):
        aot_compile(model)
    del model.forward
    assert not isinstance(model.forward, AotForward)


@pytest.mark.slow
def test_lora_hotswap_after_loading_takes_effect_without_compiling(tmp_path):
    pytest.importorskip("peft")
    from lora_utils import lora_state_dict

    config = CompilationConfig(cache_dir=str(tmp_path))
    first = _flux()
    first.model.load_lora_adapter(lora_state_dict(first.model, 1), adapter_name="style", prefix=None)
    _run(aot_compile(first.model, MindieSDBackend(config)), first.inputs)
    torch._dynamo.reset()

    case = _flux()
    style, other_style = lora_state_dict(case.model, 1), lora_state_dict(case.model, 2)
    case.model.load_lora_adapter(style, adapter_name="style", prefix=None)
    model = aot_compile(case.model, MindieSDBackend(config))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        before = _run(model, case.inputs)
        model.load_lora_adapter(other_style, adapter_name="style", prefix=None, hotswap=True)
        swapped = _run(model, case.inputs)
    assert list(model.forward.outcomes.values()) == ["loaded"], "the hot-swap compiled again"
    del model.forward
    swapped_eager = _run(model, case.inputs)
    assert ((swapped_eager - before).abs().max() / before.abs().max()).item() > 1e-3
    torch.testing.assert_close(swapped, swapped_eager, rtol=1e-5, atol=1e-5)


def test_device_graph_capture_wraps_a_loaded_artifact(tmp_path):
    from mindiesd.compilation import SimulatedGraphAdapter, register_adapter

    simulator = SimulatedGraphAdapter()
    register_adapter("cpu", lambda device: simulator)
    try:
        config = CompilationConfig(cache_dir=str(tmp_path), aclgraph_with_compile=True)
        case = _flux()
        _run(aot_compile(case.model, MindieSDBackend(config)), case.inputs)
        torch._dynamo.reset()
        other = _flux()
        model = aot_compile(other.model, MindieSDBackend(config))
        captures = simulator.captures
        outs = [_run(model, other.inputs) for _ in range(3)]
    finally:
        register_adapter("cpu", None)
    assert list(model.forward.outcomes.values()) == ["loaded"]
    assert simulator.captures == captures + 1 and simulator.replays >= 2, "captured afresh, then replayed"
    for out in outs:
        torch.testing.assert_close(out, _eager(other.model, other.inputs))


class _NormLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = torch.nn.RMSNorm(16, eps=1e-6), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(self.norm(x)) + x


def test_dynamic_shapes_one_artifact_serves_several_lengths(tmp_path):
    """dynamic=True: one symbolic graph for every sequence length (a model whose code specializes a size, as
    diffusers' Flux does for its rotary tables, gets one artifact per size instead: its guards tell them apart)."""
    backend = MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path)))
    model = aot_compile(_NormLinear().eval(), backend, dynamic=True)
    for length in (8, 12, 20):
        x = torch.randn(2, length, 16)
        torch.testing.assert_close(_run_plain(model, x), _NormLinear.forward(model, x))
    assert list(model.forward.outcomes.values()) == ["stored"]
    assert [r.matches["rms_norm"] for r in backend.report().records] == [1]
    assert any(isinstance(n.meta.get("val"), torch.SymInt) or n.type is torch.SymInt
               for n in model.forward.graphs()[0].graph.nodes if n.op == "placeholder"), "no symbolic size"

    # another process that starts at a length never compiled loads the same artifact and runs it in the executor
    torch._dynamo.reset()
    again = aot_compile(_NormLinear().eval(), MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path))),
                        dynamic=True)
    for length in (31, 8):
        x = torch.randn(2, length, 16)
        torch.testing.assert_close(_run_plain(again, x), _NormLinear.forward(again, x))
    assert list(again.forward.outcomes.values()) == ["loaded"]
    [artifact] = again.forward._artifacts.values()
    assert artifact._artifacts.compiled_fn.run.runs_in_cpp, "the loaded symbolic graph runs in the executor"


@pytest.mark.slow
def test_flux_with_dynamic_shapes_runs_each_resolution_correctly(tmp_path):
    case = _flux()
    model = aot_compile(case.model, MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path))), dynamic=True)
    image = case.inputs["hidden_states"]
    taller = {**case.inputs, "hidden_states": torch.cat([image, image.flip(1)], dim=1),
              "img_ids": torch.cat([case.inputs["img_ids"]] * 2)}
    for inputs in (case.inputs, taller, case.inputs):
        torch.testing.assert_close(_run(model, inputs), _eager(case.model, inputs), rtol=1e-5, atol=1e-5)
    assert set(model.forward.outcomes.values()) == {"stored"} and len(model.forward.outcomes) <= 2
    # a new process loads them whatever size it starts at: the artifacts of one signature are told apart by guards
    torch._dynamo.reset()
    again = _flux()
    reloaded = aot_compile(again.model, MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path))), dynamic=True)
    for inputs in (taller, case.inputs):
        torch.testing.assert_close(_run(reloaded, inputs), _eager(again.model, inputs), rtol=1e-5, atol=1e-5)
    assert set(reloaded.forward.outcomes.values()) == {"loaded"}


def test_a_module_whose_forward_a_hook_replaced_is_compiled_in_place_with_one_warning(tmp_path):
    """diffusers' hooks (context parallelism, offloading) set the module's forward: an artifact of the class's
    forward would bypass them, so the module is compiled with torch.compile in place instead."""
    model = _NormLinear().eval()
    plain_forward = model.forward
    model.forward = lambda x: plain_forward(x) * 3  # what a hook does
    x = torch.randn(2, 5, 16)
    with pytest.warns(MindieSDCacheWarning, match="forward of its own"):
        compiled = aot_compile(model, MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path))))
    assert compiled is model and not isinstance(model.forward, AotForward) and model._compiled_call_impl is not None
    torch.testing.assert_close(_run_plain(model, x), _NormLinear.forward(model, x) * 3)
    assert graph_cache.artifact_files(str(tmp_path)) == []
