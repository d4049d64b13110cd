"""The persistent compile cache (``CompilationConfig.cache_dir``).

What a user checks: a second compile of the same graph (after ``torch._dynamo.reset()``, or in a new process)
loads the entry instead of compiling, runs the same fused ops and gives eager's output; anything that can
change the result (settings, input shapes, dtype, the code) is another entry; the weights' values are not in
the key and are folded at run time; a broken, truncated or foreign entry is ignored with a warning and compiled
again; concurrent writers leave a whole entry.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from fusion_utils import AddsTable, WeightedBlock, assert_close, count_fused
from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDFallbackWarning
from mindiesd.compilation.storage import cache as graph_cache
from mindiesd.compilation import config as config_module
from mindiesd.compilation.storage.cache import GraphCache, MindieSDCacheWarning


def _compile_and_run(model, *args, cache_dir, **settings):
    """A fresh Dynamo, a fresh backend with the cache in ``cache_dir``; returns (output, backend)."""
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(cache_dir=str(cache_dir), **settings), keep_graphs=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        out = torch.compile(model, backend=backend, fullgraph=True)(*args)
    return out, backend


def _states(backend):
    return [r.cache for r in backend.report().records]


@pytest.fixture
def block():
    torch.manual_seed(0)
    return WeightedBlock(16), torch.randn(2, 8, 16)


def test_second_compile_loads_the_entry_and_fuses_the_same(tmp_path, block):
    model, x = block
    with torch.no_grad():
        expected = model(x)
    cold_out, cold = _compile_and_run(model, x, cache_dir=tmp_path)
    assert _states(cold) == ["stored"]
    assert len(graph_cache.cache_entries(str(tmp_path))) == 1
    warm_out, warm = _compile_and_run(model, x, cache_dir=tmp_path)
    assert _states(warm) == ["hit"]
    assert warm.report().cache_hits == 1
    assert count_fused(warm) == count_fused(cold) and count_fused(warm)["rms_norm"] == 1
    assert count_fused(warm)["fast_gelu"] == 1
    assert warm.report().matches == cold.report().matches
    assert warm.report().records[0].folded_constants == cold.report().records[0].folded_constants > 0
    assert_close(warm_out, expected)
    assert_close(cold_out, expected)


def test_the_fused_op_runs_on_a_hit(tmp_path, block):
    model, x = block
    _compile_and_run(model, x, cache_dir=tmp_path)
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path)))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(x)
    names = [e.name for e in prof.events()]
    assert _states(backend) == ["hit"]
    assert names.count("mindiesd::rms_norm") == 1 and names.count("mindiesd::fast_gelu") == 1


def test_weights_are_not_in_the_key_and_are_folded_at_run_time(tmp_path, block):
    model, x = block
    _compile_and_run(model, x, cache_dir=tmp_path)
    other = WeightedBlock(16, seed=7)  # same structure, other weights and buffer (the folded table changes)
    with torch.no_grad():
        expected = other(x)
    out, backend = _compile_and_run(other, x, cache_dir=tmp_path)
    assert _states(backend) == ["hit"]
    assert_close(out, expected)
    # a weight changed in place after the load is folded again, as in a fresh compile
    compiled = torch.compile(other, backend=backend, fullgraph=True)
    with torch.no_grad():
        other.freqs.mul_(3.0)
        other.norm.weight.add_(1.0)
        assert_close(compiled(x), other(x))


@pytest.mark.parametrize(
    "change",
    ["rope_off_changes_nothing_but_the_key", "gelu_off", "freezing_off", "shape", "dtype", "grad_mode"],
)
def test_what_can_change_the_result_is_another_entry(tmp_path, block, change):
    model, x = block
    _compile_and_run(model, x, cache_dir=tmp_path)
    settings = {}
    args = (x,)
    if change == "rope_off_changes_nothing_but_the_key":
        settings = {"fusion_patterns": {"enable_rope": False}}
    elif change == "gelu_off":
        settings = {"fusion_patterns": {"enable_fast_gelu": False}}
    elif change == "freezing_off":
        settings = {"enable_freezing": False}
    elif change == "shape":
        args = (torch.randn(2, 12, 16),)
    elif change == "dtype":
        model = model.to(torch.bfloat16)
        args = (x.to(torch.bfloat16),)
    if change == "grad_mode":
        torch._dynamo.reset()
        backend = MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path)), keep_graphs=True)
        for p in model.parameters():
            p.requires_grad_(False)
        torch.compile(model, backend=backend, fullgraph=True)(x)  # grad enabled, nothing requires it
        assert _states(backend) == ["stored"]
        return
    out, backend = _compile_and_run(model, *args, cache_dir=tmp_path, **settings)
    assert _states(backend) == ["stored"], change
    assert len(graph_cache.cache_entries(str(tmp_path))) == 2
    with torch.no_grad():
        assert_close(out, model(*args))
    if change == "gelu_off":
        assert count_fused(backend)["fast_gelu"] == 0


def test_run_time_settings_share_the_entry(tmp_path, block):
    model, x = block
    _compile_and_run(model, x, cache_dir=tmp_path)
    _, backend = _compile_and_run(model, x, cache_dir=tmp_path, strict=True, graph_log_url=str(tmp_path / "log"),
                                  safe_output_mode=False, aclgraph_max_graphs=3)
    assert _states(backend) == ["hit"]


def test_the_code_is_in_the_key(tmp_path):
    class A(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x, approximate="tanh") * 2.0

    class B(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x, approximate="tanh") * 3.0

    x = torch.randn(4, 8)
    _, first = _compile_and_run(A(), x, cache_dir=tmp_path)
    out, second = _compile_and_run(B(), x, cache_dir=tmp_path)
    assert _states(first) == _states(second) == ["stored"]
    assert_close(out, B()(x))


def _entry_path(tmp_path: Path) -> Path:
    (path,) = graph_cache.cache_entries(str(tmp_path))
    return path


@pytest.mark.parametrize("damage", ["truncated", "flipped_byte", "garbage", "empty", "foreign_key", "other_format",
                                    "wrong_payload"])
def test_a_broken_entry_is_ignored_with_a_warning_and_compiled_again(tmp_path, block, damage):
    model, x = block
    with torch.no_grad():
        expected = model(x)
    _compile_and_run(model, x, cache_dir=tmp_path)
    path = _entry_path(tmp_path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped_byte":
        damaged = bytearray(data)
        damaged[-100] ^= 0xFF
        path.write_bytes(bytes(damaged))
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "foreign_key":
        key = path.stem
        path.write_bytes(data.replace(key.encode(), ("0" * len(key)).encode(), 1))
    elif damage == "other_format":
        path.write_bytes(data.replace(f'"format": {graph_cache.FORMAT}'.encode(), b'"format": 99', 1))
    elif damage == "wrong_payload":
        GraphCache(str(tmp_path)).store(path.stem, graph_cache.CachedGraph(main=torch.fx.symbolic_trace(
            torch.nn.Identity()), fold=torch.fx.symbolic_trace(torch.nn.Identity()), fold_inputs=[0], n_folded=5))
    with pytest.warns(MindieSDCacheWarning, match="ignoring the unusable entry"):
        out, backend = _compile_and_run(model, x, cache_dir=tmp_path)
    assert _states(backend) == ["stored"]
    assert_close(out, expected)
    _, again = _compile_and_run(model, x, cache_dir=tmp_path)  # the entry was written anew
    assert _states(again) == ["hit"]


def test_an_unwritable_folder_warns_and_compiles(tmp_path, block):
    model, x = block
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(MindieSDCacheWarning, match="cannot write"):
        out, backend = _compile_and_run(model, x, cache_dir=blocker / "cache")
    assert _states(backend) == ["store failed"]
    with torch.no_grad():
        assert_close(out, model(x))


def _store_many(root: str, key: str, n: int, payload_size: int) -> None:
    gm = torch.fx.symbolic_trace(AddsTable(payload_size))  # the graph reads the table: it is stored with it
    for _ in range(n):
        GraphCache(root).store(key, graph_cache.CachedGraph(main=gm, nodes_after=payload_size))


def test_concurrent_writers_leave_a_whole_entry(tmp_path):
    key = "ab" + "0" * 62
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_store_many, args=(str(tmp_path), key, 20, size)) for size in (100_000, 150_000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDCacheWarning)
        entry = GraphCache(str(tmp_path)).load(key)
    assert entry is not None and entry.nodes_after in (100_000, 150_000)
    assert entry.main.table.numel() == entry.nodes_after  # the payload is one writer's, whole
    assert torch.equal(entry.main(torch.zeros(())), torch.full((entry.nodes_after,), float(entry.nodes_after)))
    assert not list(tmp_path.glob("**/*.tmp"))


def test_graphs_that_are_not_cached_say_why(tmp_path):
    x = torch.randn(4, 8)

    def returns_a_view_of_its_input(t):
        return t.view(8, 4), torch.nn.functional.gelu(t, approximate="tanh")

    _, backend = _compile_and_run(returns_a_view_of_its_input, x, cache_dir=tmp_path)
    assert _states(backend) == ["not cached: an output aliases an input or an intermediate"]

    def mutates(t):
        t.add_(1.0)
        return torch.nn.functional.gelu(t, approximate="tanh")

    _, backend = _compile_and_run(mutates, x.clone(), cache_dir=tmp_path)
    assert _states(backend) == ["not cached: input mutation"]

    lin = torch.nn.Linear(8, 8)
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path)))
    torch.compile(lin, backend=backend)(x).sum().backward()
    assert _states(backend) == ["not cached: training graph"]
    assert lin.weight.grad is not None
    assert graph_cache.cache_entries(str(tmp_path)) == []


def test_cache_off(tmp_path, block, monkeypatch):
    model, x = block
    _, backend = _compile_and_run(model, x, cache_dir=tmp_path, **{})
    assert _states(backend) == ["stored"]
    torch._dynamo.reset()
    off = MindieSDBackend(CompilationConfig(cache_dir=None))
    with torch.no_grad():
        torch.compile(model, backend=off)(x)
    assert _states(off) == ["off"]
    for value, expected in (("off", None), ("", None), ("0", None), (str(tmp_path / "env"), str(tmp_path / "env"))):
        monkeypatch.setenv(config_module.ENV_VAR, value)
        CompilationConfig.reset()
        assert CompilationConfig.cache_dir == expected
    monkeypatch.delenv(config_module.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    CompilationConfig.reset()
    assert CompilationConfig.cache_dir == str(tmp_path / "xdg" / "mindiesd")


def test_bad_cache_dir_values_raise():
    from mindiesd.compilation import SettingTypeError

    with pytest.raises(SettingTypeError, match="cache_dir must be None or a folder path"):
        CompilationConfig.cache_dir = 3
    with pytest.raises(SettingTypeError, match="cache_dir"):
        CompilationConfig(cache_dir="s3://bucket/cache")


def test_clear_and_describe(tmp_path, block):
    model, x = block
    _compile_and_run(model, x, cache_dir=tmp_path)
    folder, entries, size = graph_cache.describe(str(tmp_path))
    assert folder == tmp_path and entries == 1 and size > 0
    assert graph_cache.clear_cache(str(tmp_path)) == 1
    assert graph_cache.cache_entries(str(tmp_path)) == []
    from mindiesd.__main__ import main

    _compile_and_run(model, x, cache_dir=tmp_path)
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert graph_cache.cache_entries(str(tmp_path)) == []


def test_cache_command_reads_the_configured_folder_when_given_none(tmp_path, monkeypatch, capsys):
    from mindiesd.__main__ import main

    monkeypatch.setattr(CompilationConfig, "cache_dir", str(tmp_path))
    assert main(["cache"]) == 0 and capsys.readouterr().out.startswith(f"{tmp_path}: 0 entries")
    artifacts = tmp_path / graph_cache.ARTIFACT_FOLDER
    artifacts.mkdir()
    (artifacts / f"{'0' * 64}{graph_cache.ARTIFACT_SUFFIX}").write_bytes(graph_cache.frame(b"x", "0" * 64))
    assert main(["cache"]) == 0 and "1 entry (0 graphs, 1 ahead-of-time artifact)" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0 and "removed 1 entry from" in capsys.readouterr().out
    assert graph_cache.artifact_files(str(tmp_path)) == [] and not artifacts.exists()
    monkeypatch.setattr(CompilationConfig, "cache_dir", None)
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.startswith(f"the compile cache is off ({config_module.ENV_VAR}=")


_SCRIPT = textwrap.dedent(
    """
    import sys, warnings, torch
    warnings.simplefilter("error")
    from mindiesd import zoo
    from mindiesd.compilation import CompilationConfig, MindieSDBackend
    case = zoo.build(sys.argv[1], "tiny")
    backend = MindieSDBackend(CompilationConfig(cache_dir=sys.argv[2]))
    with torch.no_grad():
        expected = case.model(**case.inputs)[0]
        out = torch.compile(case.model, backend=backend)(**case.inputs)[0]
    error = float(((out - expected).abs().max() / expected.abs().max()))
    assert error < 1e-5, error
    report = backend.report()
    print([r.cache for r in report.records], sorted(report.matches.items()))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_a_new_process_loads_what_the_first_stored(tmp_path, name):
    pytest.importorskip("diffusers")
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, MINDIESD_CACHE_DIR="off")

    def run():
        done = subprocess.run([sys.executable, str(script), name, str(tmp_path / "cache")], env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    cold, warm = run(), run()
    assert cold.startswith("['stored']") and warm.startswith("['hit']"), (cold, warm)
    assert cold.split("] ", 1)[1] == warm.split("] ", 1)[1]  # the same fused counts


# ----------------------------------------------------------------------------------------------- symbolic sizes


class _NormLinearView(torch.nn.Module):
    """RMSNorm, a linear layer, tanh-GELU and a view whose size is computed from the input's: a graph with
    symbolic sizes that the executor runs with size arithmetic."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = torch.nn.RMSNorm(16, eps=1e-6), torch.nn.Linear(16, 16)

    def forward(self, x):
        y = torch.nn.functional.gelu(self.linear(self.norm(x)), approximate="tanh")
        return y.view(x.shape[0], x.shape[1] // 2, -1) * 2


def _dynamic(model, lengths, cache_dir):
    """A fresh Dynamo and backend; ``model`` compiled with ``dynamic=True`` and run at each length; returns the
    outputs, eager's and the backend."""
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(cache_dir=str(cache_dir)), keep_graphs=True)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    outs, expected = [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        for length in lengths:
            x = torch.randn(2, length, 16)
            outs.append(compiled(x))
            expected.append(model(x))
    return outs, expected, backend


def test_a_graph_with_symbolic_sizes_is_stored_and_loaded_for_sizes_never_compiled(tmp_path):
    """``dynamic=True``: the symbolic graph is stored; a later process (here: after ``torch._dynamo.reset()``)
    that starts at another size loads it, runs it in the executor and serves every size from it."""
    torch.manual_seed(0)
    model = _NormLinearView().eval()
    outs, expected, cold = _dynamic(model, [8, 12], tmp_path)
    assert _states(cold) == ["stored"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        warm_outs, warm_expected, warm = _dynamic(model, [20, 6, 8], tmp_path)
    assert _states(warm) == ["hit"]
    assert count_fused(warm) == count_fused(cold) and count_fused(warm)["rms_norm"] == 1
    for out, want in zip(outs + warm_outs, expected + warm_expected):
        assert_close(out, want)
    [path] = graph_cache.cache_entries(str(tmp_path))
    entry = GraphCache(str(tmp_path)).load(path.stem)
    # aot's trace guards on the view's size arithmetic: stored over the input's source, holding at every length
    assert entry.guards and all("L['x'].size()[1]" in str(g) for g in entry.guards), entry.guards
    assert graph_cache.runnable(entry).runs_in_cpp, "the loaded symbolic graph runs in the executor"


def test_shape_guards_the_compile_added_are_replayed_on_a_hit(tmp_path, monkeypatch):
    """A compile that specializes on a size adds a guard to Dynamo's frame. A hit skips the compile, so the entry
    replays the guard: a size the guard refuses makes Dynamo recompile, and an entry whose guard the first size
    already fails is a miss. Without the replay, the entry would run for a size it was never valid for."""
    from mindiesd.compilation import backend as backend_module

    fuse = backend_module.fuse

    def fuse_specializing(context, frozen, aten_gm, passes, graph_log):
        sizes = [n.meta["val"] for n in aten_gm.graph.nodes
                 if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt)]
        assert sizes and bool(sizes[-1] > 10)  # guards that the length is above 10
        return fuse(context, frozen, aten_gm, passes, graph_log)

    torch.manual_seed(0)
    model = _NormLinearView().eval()
    monkeypatch.setattr(backend_module, "fuse", fuse_specializing)
    _dynamic(model, [12], tmp_path)
    monkeypatch.setattr(backend_module, "fuse", fuse)
    [path] = graph_cache.cache_entries(str(tmp_path))
    stored = GraphCache(str(tmp_path)).load(path.stem).guards
    assert {"L['x'].size()[1] > 10", "10 < L['x'].size()[1]"} & {str(g) for g in stored}, stored

    outs, expected, warm = _dynamic(model, [14, 16, 8], tmp_path)
    # 14 and 16 run the loaded graph; 8 fails the replayed guard: Dynamo compiles again (this compile adds no guard)
    assert _states(warm) == ["hit", "stored"]
    for out, want in zip(outs, expected):
        assert_close(out, want)

    outs, expected, cold = _dynamic(model, [4, 6], tmp_path)
    assert _states(cold) == ["hit"], "the entry stored for 8 and below (no guard) serves 4 and 6"
