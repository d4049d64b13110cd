"""Device graphs on a real NVIDIA GPU (skipped without one), and the stream adapter against a stand-in module."""

import contextlib
import gc

import pytest
import torch

from mindiesd.compilation import CompilationConfig, MindieSDBackend
from mindiesd.compilation.runtime.device_graph import StreamGraphAdapter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


class _FakeStream:
    def __init__(self, device=None):
        self.waits = 0

    def wait_stream(self, other):
        self.waits += 1


class _FakeDeviceModule:
    """Records the calls a capture makes: the order of warm-up, capture and the pool used."""

    def __init__(self):
        self.events, self.pools = [], []
        self.fail_end = False
        self._current = _FakeStream()
        module = self

        class Graph:
            def capture_begin(self, pool=None):
                module.events.append("capture_begin")
                module.pools.append(pool)

            def capture_end(self):
                module.events.append("capture_end")
                if module.fail_end:
                    raise RuntimeError("capture invalidated")

            def reset(self):
                module.events.append("reset")

            def replay(self):
                module.events.append("replay")

        self.Graph = Graph

    Stream = _FakeStream

    def current_stream(self, device=None):
        return self._current

    @contextlib.contextmanager
    def stream(self, s):
        self.events.append("side_stream")
        yield

    def synchronize(self, device=None):
        self.events.append("synchronize")

    def graph_pool_handle(self):
        self.events.append("new_pool")
        return object()


def test_stream_adapter_warms_up_then_captures_each_signature_into_its_own_pool(monkeypatch):
    module = _FakeDeviceModule()
    adapter = StreamGraphAdapter(module, module.Graph, torch.device("cpu"))
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1))
    calls = []

    def fn(x):
        calls.append(module.events[-1])
        return x + 1

    for _ in range(2):
        graph, out = adapter.capture(fn, [torch.zeros(2)], warmup=1)
    assert calls == ["side_stream", "capture_begin", "side_stream", "capture_begin"]
    # one pool per capture: signatures replay in any order and are evicted one by one
    assert module.events.count("new_pool") == 2 and module.pools[0] is not module.pools[1]
    assert not collected, "no garbage collection around a capture"


@pytest.mark.parametrize("end_fails", [False, True])
def test_a_failed_capture_ends_the_capture_resets_the_graph_and_raises_its_own_error(end_fails):
    """The stream and the generators leave capture state (capture_end), the graph frees what it holds (reset),
    and the runner sees the error that made the capture fail, not a secondary one."""
    module = _FakeDeviceModule()
    module.fail_end = end_fails
    adapter = StreamGraphAdapter(module, module.Graph, torch.device("cpu"))

    def fn(x):
        if module.events[-1] == "capture_begin":
            raise RuntimeError("operation not permitted when stream is capturing")
        return x + 1

    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        adapter.capture(fn, [torch.zeros(2)], warmup=1)
    assert module.events[-2:] == ["capture_end", "reset"]


def _tiny_flux(device):
    from mindiesd import zoo

    return zoo.build("flux", "tiny", dtype=torch.float32, device=device)


@cuda
def test_tiny_flux_captured_equals_uncaptured():
    case = _tiny_flux("cuda")
    plain = torch.compile(case.model, backend=MindieSDBackend())
    backend = MindieSDBackend(CompilationConfig(aclgraph_with_compile=True))
    graphed = torch.compile(case.model, backend=backend)
    with torch.no_grad():
        expected = plain(**case.inputs)[0]
        torch._dynamo.reset()
        for _ in range(3):
            out = graphed(**case.inputs)[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert backend.runners and backend.runners[0].stats.captures == 1 and backend.runners[0].stats.replays == 3


@cuda
def test_real_capture_never_replays_freed_folded_constants():
    """clear_frozen_caches() frees the folded constants; a capture replaying their addresses would read reused memory."""
    from fusion_utils import WeightedBlock
    from mindiesd.compilation import clear_frozen_caches

    model = WeightedBlock(d=256).cuda()
    backend = MindieSDBackend(CompilationConfig(aclgraph_with_compile=True))
    graphed = torch.compile(model, backend=backend)
    x = torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        for round_ in range(4):
            for _ in range(2):
                torch.testing.assert_close(graphed(x), model(x), rtol=1e-4, atol=1e-4)
            model.freqs.data.copy_(torch.randn_like(model.freqs))  # bypasses the version counter
            clear_frozen_caches()
            scratch = [torch.randn(256, device="cuda") for _ in range(64)]  # reuses the freed blocks
            del scratch
    runner = backend.runners[0]
    assert runner.stats.released == 4 and runner.stats.captures == 4 and len(runner.signatures()) == 0


@cuda
def test_memory_is_bounded_by_max_graphs():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(1024, 256)).cuda()
    backend = MindieSDBackend(CompilationConfig(aclgraph_with_compile=True, aclgraph_max_graphs=2))
    graphed = torch.compile(model, backend=backend, dynamic=True)  # one graph; one capture per shape
    with torch.no_grad():
        for rows in (512, 1024):
            graphed(torch.randn(rows, 256, device="cuda"))
        torch.cuda.synchronize()
        after_two = torch.cuda.memory_allocated()
        for rows in (1536, 2048, 512, 1024, 1536, 2048):
            graphed(torch.randn(rows, 256, device="cuda"))
        torch.cuda.synchronize()
    assert len(backend.runners) == 1
    assert len(backend.runners[0]._captures) == 2 and backend.runners[0].stats.evictions == 6
    assert torch.cuda.memory_allocated() < after_two + 64 * 2**20
