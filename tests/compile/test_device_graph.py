"""Device-graph capture semantics, on CPU through the simulated adapter (records captures and replays)."""

import gc
import logging
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import FAMILIES, WeightedBlock, count_fused
from mindiesd.compilation import (
    CompilationConfig,
    DeviceGraphCaptureWarning,
    DeviceGraphRunner,
    DeviceGraphUnavailableWarning,
    MindieSDBackend,
    SimulatedGraphAdapter,
    clear_frozen_caches,
    freezing,
    register_adapter,
)
from mindiesd.compilation import DanglingCaptureError, DeviceGraphUnavailableError
from torch._dynamo.exc import BackendCompilerFailed


@pytest.fixture
def adapter():
    sim = SimulatedGraphAdapter()
    register_adapter("cpu", lambda device: sim)
    yield sim
    register_adapter("cpu", None)


Block = WeightedBlock


def captured(model, **settings):
    config = CompilationConfig(**{"aclgraph_with_compile": True, **settings})
    backend = MindieSDBackend(config, keep_graphs=True)
    return torch.compile(model, backend=backend), backend


def call(compiled, *args):
    with torch.no_grad():
        return compiled(*args)


def test_capture_once_then_replay(adapter):
    model = Block()
    compiled, backend = captured(model)
    x = torch.randn(4, 16)
    outs = [call(compiled, x) for _ in range(3)]
    for out in outs:
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    runner = backend.runners[0]
    assert (runner.stats.captures, runner.stats.replays) == (1, 3)
    assert adapter.warmups == 1, "one warm-up run precedes the capture"
    assert count_fused(backend)["rms_norm"] == 1 and count_fused(backend)["fast_gelu"] == 1


def test_new_values_same_signature_replay_with_new_values(adapter):
    model = Block()
    compiled, backend = captured(model)
    for seed in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(call(compiled, x), model(x), rtol=1e-5, atol=1e-5)
    assert backend.runners[0].stats.captures == 1


def runner_for(fn, max_graphs=4, safe=True, weights=()):
    return DeviceGraphRunner(fn, SimulatedGraphAdapter(), weights, max_graphs, safe)


@pytest.mark.parametrize(
    "second",
    [
        lambda x: x.clone(),  # same signature: hit
        lambda x: torch.randn(5, 8),  # shape
        lambda x: x.double(),  # dtype
        lambda x: x.t().contiguous().t(),  # strides
    ],
    ids=["same", "shape", "dtype", "stride"],
)
def test_signature_covers_shape_dtype_stride(second):
    runner = runner_for(lambda x: x * 2)
    x = torch.randn(8, 8)
    runner(x)
    y = second(x)
    torch.testing.assert_close(runner(y), y * 2)
    expected = 1 if second(x).shape == x.shape and second(x).dtype == x.dtype and second(x).stride() == x.stride() else 2
    assert runner.stats.captures == expected


def test_non_tensor_arguments_are_part_of_the_signature():
    runner = runner_for(lambda x, k: x * k)
    x = torch.ones(3)
    assert runner(x, 2)[0] == 2 and runner(x, 3)[0] == 3 and runner(x, 2)[0] == 2
    assert runner.stats.captures == 2


def test_lru_eviction_is_logged(caplog):
    runner = runner_for(lambda x: x + 1, max_graphs=2)
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    with caplog.at_level(logging.INFO, logger="mindiesd.compilation"):
        runner(a), runner(b), runner(a), runner(c)  # b is the least recently used when c arrives
    assert runner.stats.evictions == 1
    assert "evicted the least recently used" in caplog.text
    runner(a)
    assert runner.stats.captures == 3, "a stayed captured"
    runner(b)
    assert runner.stats.captures == 4, "b was evicted and is captured again"


def test_replay_copies_activations_only(adapter):
    model = Block(d=64)
    compiled, backend = captured(model)
    x = torch.randn(8, 64)
    call(compiled, x)
    runner = backend.runners[0]
    after_capture = runner.stats.bytes_copied
    for _ in range(5):
        call(compiled, torch.randn(8, 64))
    weight_bytes = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
    assert runner.stats.bytes_copied - after_capture == 5 * x.nbytes
    assert weight_bytes > x.nbytes


def test_weight_moved_to_new_storage_selects_a_new_capture(adapter):
    model = Block()
    compiled, backend = captured(model)
    x = torch.randn(4, 16)
    call(compiled, x)
    model.lin.weight.data = torch.randn(16, 16)
    torch.testing.assert_close(call(compiled, x), model(x), rtol=1e-5, atol=1e-5)
    assert backend.runners[0].stats.captures == 2


@pytest.mark.parametrize("freezing", [True, False])
def test_weight_changed_in_place_is_captured_again(adapter, freezing):
    model = Block()
    compiled, backend = captured(model, enable_freezing=freezing)
    x = torch.randn(4, 16)
    before = call(compiled, x)
    with torch.no_grad():
        model.freqs.mul_(3.0)  # feeds a folded constant when freezing is on
        model.norm.weight.add_(1.0)
    after = call(compiled, x)
    torch.testing.assert_close(after, model(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)
    stats = backend.runners[0].stats
    if freezing:  # folded again: the capture reading the old folded constants is dropped, a new one made
        assert (stats.captures, stats.released, len(backend.runners[0].signatures())) == (2, 1, 1)
    else:
        assert stats.recaptures == 1


def test_one_compiled_graph_serving_two_instances(adapter):
    backend = MindieSDBackend(CompilationConfig(aclgraph_with_compile=True))
    first, second = Block(seed=1), Block(seed=2)
    compiled_first = torch.compile(first, backend=backend)
    compiled_second = torch.compile(second, backend=backend)
    x = torch.randn(4, 16)
    for _ in range(2):
        torch.testing.assert_close(call(compiled_first, x), first(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(call(compiled_second, x), second(x), rtol=1e-5, atol=1e-5)
    runner = backend.runners[0]
    assert len(backend.runners) == 1 and runner.stats.captures == 2 and runner.stats.recaptures == 0


def test_safe_output_mode_false_returns_static_outputs(adapter):
    model = Block()
    compiled, _ = captured(model, safe_output_mode=False)
    x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
    out1 = call(compiled, x1)
    expected1 = model(x1)
    out2 = call(compiled, x2)
    torch.testing.assert_close(out2, model(x2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out1, out2)  # the next replay overwrote the earlier output
    assert not torch.allclose(out1, expected1)


def test_safe_output_mode_true_keeps_earlier_outputs(adapter):
    model = Block()
    compiled, _ = captured(model)
    x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
    out1 = call(compiled, x1)
    call(compiled, x2)
    torch.testing.assert_close(out1, model(x1), rtol=1e-5, atol=1e-5)


def test_aclgraph_only_captures_without_fusion_and_with_compile_wins(adapter):
    compiled_only, backend_only = captured(Block(), aclgraph_only=True, aclgraph_with_compile=False)
    call(compiled_only, torch.randn(2, 16))
    assert count_fused(backend_only) == {f: 0 for f in FAMILIES}
    assert backend_only.runners[0].stats.captures == 1
    compiled_both, backend_both = captured(Block(), aclgraph_only=True)
    call(compiled_both, torch.randn(2, 16))
    assert count_fused(backend_both)["rms_norm"] == 1
    assert backend_both.runners[0].stats.captures == 1


def test_cpu_without_adapter_warns_once_and_runs_uncaptured():
    from mindiesd.compilation.runtime import device_graph

    device_graph._warned_unavailable.clear()
    model = Block()
    compiled, backend = captured(model)
    x = torch.randn(3, 16)
    with pytest.warns(DeviceGraphUnavailableWarning, match="unavailable on cpu"):
        out = call(compiled, x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert backend.runners == []
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceGraphUnavailableWarning)
        call(captured(Block())[0], x)


def test_cpu_without_adapter_strict_raises():
    compiled, _ = captured(Block(), strict=True)
    with pytest.raises(BackendCompilerFailed, match="unavailable on cpu") as raised:
        call(compiled, torch.randn(3, 16))
    assert isinstance(raised.value.inner_exception, DeviceGraphUnavailableError)


def test_failed_capture_falls_back_for_that_signature(adapter, monkeypatch):
    def failing_capture(fn, args, warmup):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(adapter, "capture", failing_capture)
    model = Block()
    compiled, backend = captured(model)
    x = torch.randn(3, 16)
    with pytest.warns(DeviceGraphCaptureWarning, match="not permitted when stream is capturing"):
        out = call(compiled, x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceGraphCaptureWarning)
        torch.testing.assert_close(call(compiled, x), model(x), rtol=1e-5, atol=1e-5)
    stats = backend.runners[0].stats
    assert (stats.failed_captures, stats.uncaptured_calls, stats.captures) == (1, 2, 0)


def test_two_threads_share_one_compiled_module(adapter):
    model = Block()
    compiled, backend = captured(model)
    call(compiled, torch.randn(4, 16))  # compile before the threads start
    errors = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(30):
            x = torch.randn(4, 16, generator=g)
            out = call(compiled, x)
            if not torch.allclose(out, model(x), rtol=1e-5, atol=1e-5):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert backend.runners[0].stats.captures == 1


def test_spec_variable_length_example(adapter):
    dim, max_len = 16, 12
    transformer = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(dim, dim))
    model = torch.compile(transformer, backend=MindieSDBackend(CompilationConfig(aclgraph_with_compile=True)))
    with torch.no_grad():
        _ = model(torch.randn(max_len, dim))  # triggers the capture
        for actual_len in (3, 7, 12):
            chunk = torch.randn(actual_len, dim)
            padded = F.pad(chunk, (0, 0, 0, max_len - actual_len))
            output = model(padded)[:actual_len]
            torch.testing.assert_close(output, transformer(chunk), rtol=1e-5, atol=1e-5)
    assert adapter.captures == 1


def test_nested_outputs(adapter):
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return {"sample": h, "extras": (h * 2, [h.sum()])}

    model = Nested()
    compiled, _ = captured(model)
    x = torch.randn(2, 8)
    for _ in range(2):
        out, ref = call(compiled, x), model(x)
        torch.testing.assert_close(out["sample"], ref["sample"])
        torch.testing.assert_close(out["extras"][0], ref["extras"][0])
        torch.testing.assert_close(out["extras"][1][0], ref["extras"][1][0])


def test_max_graphs_setting_is_validated():
    from mindiesd.compilation import SettingTypeError

    with pytest.raises(SettingTypeError):
        CompilationConfig(aclgraph_max_graphs=0)


def test_bench_capture_columns(adapter):
    from mindiesd import zoo
    from mindiesd.benchmarks import common, models

    row = models.run_case(zoo.build("wan", "tiny"), iters=2, warmup=0, capture=True, progress=common.QuietProgress())
    assert row["capture_first_s"] > 0 and row["capture_ms"] > 0 and row["capture_speedup"] > 0
    assert adapter.captures == 1 and adapter.replays >= 3
    assert "captured_ms" in models.format_table([row])


# ---------------------------------------------------------------------------------------------- what a capture owns
def test_simulated_adapter_detects_a_freed_read():
    cache = {"table": torch.randn(4)}
    runner = runner_for(lambda x: x * cache["table"])
    x = torch.randn(4)
    runner(x)
    cache["table"] = torch.randn(4)  # the captured table is freed; a real graph would still read its address
    with pytest.raises(DanglingCaptureError, match="freed since the capture"):
        runner(x)


def test_simulated_adapter_detects_a_moved_read():
    table = torch.randn(4)
    runner = runner_for(lambda x: x * table)
    x = torch.randn(4)
    runner(x)
    table.data = torch.randn(4)
    with pytest.raises(DanglingCaptureError, match="moved from"):
        runner(x)


def test_capture_owns_the_weights_it_reads_and_the_simulated_graph_does_not():
    runner = runner_for(lambda w, x: x @ w, weights=(0,))
    w, x = torch.randn(4, 4), torch.randn(2, 4)
    alive = weakref.ref(w)
    runner(w, x)
    del w
    gc.collect()
    assert alive() is not None, "the capture holds what it replays the address of"
    runner.clear()
    gc.collect()
    assert alive() is None, "nothing but the capture kept it"


def eager(model, x):
    with torch.no_grad():
        return model(x)


def test_clear_frozen_caches_drops_the_captures_that_read_the_cleared_constants(adapter):
    model = Block()
    compiled, backend = captured(model)
    x = torch.randn(4, 16)
    for _ in range(2):
        torch.testing.assert_close(call(compiled, x), eager(model, x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.freqs.data.copy_(torch.randn(16))  # bypasses the version counter, as docs/device-graphs.md says
    clear_frozen_caches()
    replays = adapter.replays
    for _ in range(3):
        torch.testing.assert_close(call(compiled, x), eager(model, x), rtol=1e-5, atol=1e-5)
    runner = backend.runners[0]
    assert adapter.replays - replays == 3
    assert (runner.stats.captures, runner.stats.released, len(runner.signatures())) == (2, 1, 1)


def test_fold_cache_eviction_never_leaves_a_capture_reading_evicted_constants(adapter, monkeypatch):
    monkeypatch.setattr(freezing, "MAX_WEIGHT_SETS", 1)
    backend = MindieSDBackend(CompilationConfig(aclgraph_with_compile=True))
    first, second = Block(seed=1), Block(seed=2)
    compiled = {first: torch.compile(first, backend=backend), second: torch.compile(second, backend=backend)}
    x = torch.randn(4, 16)
    for model in (first, first, second, second, first, first, second):
        torch.testing.assert_close(call(compiled[model], x), eager(model, x), rtol=1e-5, atol=1e-5)
    runner = backend.runners[0]
    assert len(backend.runners) == 1 and adapter.replays == 7
    assert runner.stats.captures == 4 and len(runner.signatures()) == 1


def test_param_data_swapped_away_and_back_replays_live_constants(adapter):
    model = Block()
    compiled, backend = captured(model)
    x = torch.randn(4, 16)
    original = model.lin.weight.data
    torch.testing.assert_close(call(compiled, x), eager(model, x), rtol=1e-5, atol=1e-5)
    model.lin.weight.data = torch.randn(16, 16)
    torch.testing.assert_close(call(compiled, x), eager(model, x), rtol=1e-5, atol=1e-5)
    model.lin.weight.data = original
    for _ in range(2):
        torch.testing.assert_close(call(compiled, x), eager(model, x), rtol=1e-5, atol=1e-5)
    assert adapter.replays == 4


def test_signature_changes_when_folded_constants_are_recomputed(adapter):
    model = Block()
    compiled, backend = captured(model)
    x = torch.randn(4, 16)
    call(compiled, x)
    runner = backend.runners[0]
    (before,) = runner.signatures()
    clear_frozen_caches()
    call(compiled, x)
    (after,) = runner.signatures()
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert before[-1][0] == "reads" and changed == [len(before) - 1], "only the folded constants' addresses changed"


def test_replay_copies_activations_only_folded_constants_included(adapter):
    model = Block(d=64)
    compiled, backend = captured(model)
    x = torch.randn(8, 64)
    call(compiled, x)
    runner = backend.runners[0]
    assert backend.report().records[0].folded_constants >= 1
    assert runner.stats.bytes_copied == x.nbytes, "the capture copied the activation, not the folded table"
    for _ in range(3):
        call(compiled, torch.randn(8, 64))
    assert runner.stats.bytes_copied == 4 * x.nbytes


def test_a_host_scalar_input_selects_its_own_capture(adapter):
    """A 0-dim CPU tensor (eps under dynamic=True) is read on the host at capture: a new value, a new capture."""
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(16, eps=1e-6)
    backend = MindieSDBackend(CompilationConfig(aclgraph_with_compile=True))
    compiled = torch.compile(norm, backend=backend, dynamic=True)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        for eps in (1e-6, 0.5, 1e-6):
            norm.eps = eps
            torch.testing.assert_close(compiled(x), norm(x), rtol=1e-5, atol=1e-5)
    runner = backend.runners[0]
    assert len(backend.runners) == 1 and runner.stats.captures == 2 and len(runner.signatures()) == 2


def test_a_symbolic_size_graph_captures_once_per_size_within_the_lru_bound(adapter):
    """dynamic=True: one compiled graph with symbolic sizes serves every length; the runner captures it once per
    input signature and keeps at most ``aclgraph_max_graphs`` captures, evicting the least recently used. A size
    seen again while still captured replays, an evicted one is captured afresh; every output is eager's."""
    torch.manual_seed(0)
    model = Block()
    config = CompilationConfig(aclgraph_with_compile=True, aclgraph_max_graphs=2)
    backend = MindieSDBackend(config, keep_graphs=True)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    lengths = (4, 6, 4, 9, 6)  # 9 evicts 6 (4 was used more recently); 6 is then captured afresh
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for length in lengths:
            x = torch.randn(length, 16)
            torch.testing.assert_close(call(compiled, x), model(x), rtol=1e-5, atol=1e-5)
    assert len(backend.report().records) == 1, "one symbolic graph for every length"
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for g in backend.graphs for n in g.graph.nodes)
    [runner] = backend.runners
    assert runner.stats.captures == 4 and runner.stats.replays == len(lengths)
    assert len(runner.signatures()) == 2
