"""What aot decides on fake strides is checked on the real ones (``compilation/cleanup/layout_checks.py``): a group norm
of a tensor whose fake and real strides differ in a dim of size 1 runs as eager does, under both runners."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import aten_graph, assert_close, run_compiled
from mindiesd.compilation import CompilationConfig
from mindiesd.compilation.runtime import executor
from mindiesd.compilation.cleanup.layout_checks import restore_layout_checks

aten = torch.ops.aten


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _calls(gm):
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _norm_of_heads_as_image(x, weight, bias):
    """AutoencoderKL's attention output: ``[1, HW, C]`` transposed and viewed as ``[1, C, H, W]``, whose batch
    stride is 2048 in the trace and 32 when it runs; the trace calls it channels-last, the real tensor is not."""
    return F.group_norm(x.transpose(-1, -2).reshape(1, 32, 8, 8), 8, weight, bias)


@pytest.mark.parametrize("use_executor", [True, False], ids=["executor", "generated"])
def test_group_norm_of_a_view_whose_size_one_stride_the_trace_gets_wrong(monkeypatch, use_executor):
    monkeypatch.setenv(executor.ENV, "1" if use_executor else "0")
    args = (_randn(1, 64, 32), _randn(32, seed=1), _randn(32, seed=2))
    actual, expected, _, backend = run_compiled(_norm_of_heads_as_image, *args,
                                                config=CompilationConfig(strict=True))
    assert_close(actual, expected)
    calls = _calls(backend.graphs[0])
    assert calls[aten.group_norm.default] == 1 and calls[aten.native_group_norm.default] == 0


def test_group_norm_whose_statistics_are_read_stays_the_kernel():
    def norm_and_mean(x, weight, bias):
        out, mean, _ = aten.native_group_norm.default(x, weight, bias, 1, 32, 64, 8, 1e-5)
        return out, mean

    gm = aten_graph(norm_and_mean, _randn(1, 32, 8, 8), _randn(32, seed=1), _randn(32, seed=2))
    assert restore_layout_checks(gm.graph) == 0
    assert _calls(gm)[aten.native_group_norm.default] == 1
