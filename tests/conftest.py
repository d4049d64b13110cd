"""Shared set-up of the suite, by layer: ``unit`` (settings, matcher), ``ops`` (the fused operators and their
kernels), ``compile`` (the backend on small modules), ``models`` (diffusers transformers, pipelines, LoRA,
regional and multi-device runs), ``bench`` (the benchmark tooling). ``-m "not slow"`` is the quick set."""

import os
import sys
import time

# The persistent compile cache is off for the suite: a test must compile what it tests, not load an entry that an
# earlier run stored. tests/compile/test_cache.py turns it on, in folders of its own.
os.environ["MINDIESD_CACHE_DIR"] = "off"
# The shared helpers (fusion_utils) sit beside this file; the tests live one folder below it.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402

# Two intra-op threads at most; under pytest-xdist (`-n auto`, as CI runs) the cores are shared among the workers,
# so that the workers do not oversubscribe them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

_KERNEL_BUILD: dict = {}


@pytest.fixture(scope="session", autouse=True)
def cpu_kernel_build():
    """Build (or load from its cache) the C++ CPU kernels once, before any test, so that their one-time cost
    is charged here and reported at the end rather than to whichever test first runs a CPU kernel."""
    from mindiesd.ops.kernels.cpp import build_cpu_kernels, cpu_kernel_implementation

    start = time.perf_counter()
    build_cpu_kernels()
    _KERNEL_BUILD["seconds"] = time.perf_counter() - start
    _KERNEL_BUILD["implementation"] = cpu_kernel_implementation()
    yield _KERNEL_BUILD["implementation"]


def pytest_terminal_summary(terminalreporter):
    if _KERNEL_BUILD:
        terminalreporter.write_line(
            f"mindiesd CPU kernels: {_KERNEL_BUILD['implementation']}; "
            f"build or cache load {_KERNEL_BUILD['seconds']:.1f} s (session fixture cpu_kernel_build)"
        )


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts from default settings and an empty Dynamo cache, and leaves diffusers' process-wide
    attention backend as it found it (``model.set_attention_backend`` sets it for every model built after)."""
    from mindiesd.compilation import CompilationConfig

    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    active = dispatch._AttentionBackendRegistry._active_backend if dispatch is not None else None
    CompilationConfig.reset()
    torch._dynamo.reset()
    yield
    CompilationConfig.reset()
    torch._dynamo.reset()
    if dispatch is None:
        dispatch = sys.modules.get("diffusers.models.attention_dispatch")
        active = dispatch.AttentionBackendName(dispatch.DIFFUSERS_ATTN_BACKEND) if dispatch is not None else None
    if dispatch is not None:
        dispatch._AttentionBackendRegistry._active_backend = active
