"""The generated runner of a fused graph (``compilation/python_runner.py``): same results as the graph's own forward, the
fused ops' C++ kernels called straight where the layout is known, the dispatcher where it is not."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import assert_close, run_compiled
from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDFallbackWarning
from mindiesd.compilation.runtime import python_runner
from mindiesd.compilation import backend as backend_module
from mindiesd.ops import layout, registry
from mindiesd.ops.kernels import cpp

D = 32


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def block(x, w, scale, shift, gate):
    h = F.rms_norm(x, (D,), w, eps=1e-6)
    h = F.layer_norm(h, (D,), eps=1e-6) * (1 + scale) + shift
    h = F.gelu(h, approximate="tanh")
    return x + gate * h


def _inputs(dtype):
    return (_randn(2, 8, D, seed=1).to(dtype), _randn(D, seed=2).to(dtype), _randn(2, 1, D, seed=3).to(dtype),
            _randn(2, 1, D, seed=4).to(dtype), _randn(2, 1, D, seed=5).to(dtype))


EXPECTED = {"rms_norm": 1, "adalayernorm": 1, "fast_gelu": 1, "mul_add": 1}


def _layout_calls(monkeypatch):
    """Counts the dispatcher's layout adapter runs (every fused op through the dispatcher runs it once)."""
    calls = []
    real = layout.output_layout

    def counting(op, args):
        calls.append(op)
        return real(op, args)

    monkeypatch.setattr(layout, "output_layout", counting)
    return calls


@pytest.fixture(autouse=True)
def generated_runner(monkeypatch):
    """These tests are of the generated Python runner; the C++ executor that runs it where it can has its own
    (test_executor.py)."""
    monkeypatch.setenv("MINDIESD_EXECUTOR", "0")


needs_cpp = pytest.mark.skipif(not cpp.KERNELS or registry.DEVICE_KERNELS.get("cpu", {}).get("rms_norm")
                               is not cpp.KERNELS.get("rms_norm"), reason="the C++ CPU kernels are not in use")


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_ops_run_their_cpp_kernels_without_the_dispatcher(dtype, monkeypatch):
    args = _inputs(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        actual, expected, counts, backend = run_compiled(block, *args)
        assert {k: counts[k] for k in EXPECTED} == EXPECTED
        assert_close(actual, expected, dtype)
        assert python_runner.runner(backend.graphs[0]).direct_ops == sum(EXPECTED.values())
        calls = _layout_calls(monkeypatch)
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        with torch.no_grad():
            again = compiled(*args)
    assert calls == []  # no fused op went through the dispatcher's adapter
    assert torch.equal(again, actual)


@needs_cpp
def test_without_the_runner_every_fused_op_goes_through_the_dispatcher(monkeypatch):
    """The check above can fail: the graph's own forward runs the adapter once per fused op."""
    monkeypatch.setattr(backend_module, "runner", lambda gm: gm.forward)
    args = _inputs(torch.float32)
    actual, expected, counts, _ = run_compiled(block, *args)
    calls = _layout_calls(monkeypatch)
    compiled = torch.compile(block, backend=MindieSDBackend(CompilationConfig(cache_dir=None)), fullgraph=True)
    with torch.no_grad():
        compiled(*args)
    assert sorted(calls) == sorted(EXPECTED)
    assert_close(actual, expected)


@needs_cpp
def test_a_profiled_call_shows_every_fused_op():
    """While a profiler records, the fused ops go through the dispatcher, so the profile counts them."""
    args = _inputs(torch.float32)
    _, _, counts, backend = run_compiled(block, *args)
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    with torch.no_grad():
        compiled(*args)  # compiled outside the profile (tracing runs the ops' fake kernels)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(*args)
    names = [e.name for e in prof.events() if e.name.startswith("mindiesd::")]
    assert len(names) == sum(counts.values()) == sum(EXPECTED.values())


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_permuted_output_runs_straight_on_permuted_inputs(dtype, monkeypatch):
    """RMSNorm of a transposed view keeps that layout: the runner permutes the input as the adapter would, calls
    the kernel and permutes its result back, with eager's strides."""

    def fn(x, w):
        return F.rms_norm(x.transpose(1, 2), (D,), w, eps=1e-5) * 2

    x, w = _randn(2, D, 6, D, seed=1).to(dtype), _randn(D, seed=2).to(dtype)
    actual, expected, counts, backend = run_compiled(fn, x, w)
    assert counts["rms_norm"] == 1
    assert python_runner.runner(backend.graphs[0]).direct_ops == 1
    assert_close(actual, expected, dtype)
    calls = _layout_calls(monkeypatch)
    with torch.no_grad():
        again = torch.compile(fn, backend=backend, fullgraph=True)(x, w)
    assert calls == []
    assert torch.equal(again, actual)
    assert again.stride() == expected.stride()


def test_an_output_the_adapter_copies_keeps_the_adapter():
    """The normalised dimension is not innermost: the adapter copies, and the op goes through it."""

    def fn(x, w):
        return F.rms_norm(x.transpose(1, 2), (D,), w, eps=1e-5) * 2

    x, w = _randn(2, D, 6, seed=1), _randn(D, seed=2)
    actual, expected, counts, backend = run_compiled(fn, x, w)
    assert counts["rms_norm"] == 1
    assert python_runner.runner(backend.graphs[0]).direct_ops == 0
    assert_close(actual, expected)
    assert actual.stride() == expected.stride()


@needs_cpp
def test_a_kernel_the_user_registered_is_called_through_the_dispatcher(monkeypatch):
    args = _inputs(torch.float32)
    _, _, _, backend = run_compiled(block, *args)
    assert python_runner.runner(backend.graphs[0]).direct_ops == sum(EXPECTED.values())
    monkeypatch.setitem(registry.DEVICE_KERNELS["cpu"], "rms_norm", lambda *a: None)
    assert python_runner.runner(backend.graphs[0]).direct_ops == sum(EXPECTED.values()) - 1


def test_dynamic_shapes_call_the_entry_where_the_output_is_row_major_at_every_size():
    """With symbolic sizes a fused op whose traced output is row-major for every size (decided from the size
    expressions) calls its C++ entry straight, and every size matches eager."""
    args = _inputs(torch.float32)
    actual, expected, counts, backend = run_compiled(block, *args, dynamic=True)
    assert counts["rms_norm"] == 1
    fused = sum(1 for n in backend.graphs[0].graph.nodes if str(n.target).startswith("mindiesd."))
    assert fused >= 1 and python_runner.runner(backend.graphs[0]).direct_ops == fused
    assert_close(actual, expected)
    longer = tuple(a if a.dim() < 3 or a.shape[1] == 1 else _randn(2, 13, D, seed=9) for a in args)
    compiled = torch.compile(block, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        assert_close(compiled(*longer), block(*longer))


def test_values_are_released_after_their_last_use():
    """Like FX's own code, the runner drops each intermediate once nothing later reads it."""
    args = _inputs(torch.float32)
    _, _, _, backend = run_compiled(block, *args)
    gm = backend.graphs[0]
    source = python_runner.runner(gm).source
    lines = source.splitlines()
    returned = lines[-1]
    assert returned.strip().startswith("return")
    for line in lines[1:-1]:
        if " = None" in line or "=" not in line:
            continue
        name = line.split("=")[0].strip()
        later = "\n".join(lines[lines.index(line) + 1:])
        assert f"{name} = None" in later or f" {name} = " in later or name in returned, name


def test_a_graph_that_cannot_be_generated_runs_its_own_forward():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 3)))  # call_module: not an aten graph
    assert python_runner.runner(gm) == gm.forward


def test_cache_hits_run_the_generated_code(tmp_path, monkeypatch):
    args = _inputs(torch.float32)
    config = CompilationConfig(cache_dir=str(tmp_path))
    first = MindieSDBackend(config)
    with torch.no_grad():
        expected = torch.compile(block, backend=first, fullgraph=True)(*args)
    torch._dynamo.reset()
    second = MindieSDBackend(config)
    calls = _layout_calls(monkeypatch)
    with torch.no_grad():
        actual = torch.compile(block, backend=second, fullgraph=True)(*args)
    assert [r.cache for r in second.report().records] == ["hit"]
    assert torch.equal(actual, expected)
    if cpp.KERNELS and registry.DEVICE_KERNELS.get("cpu", {}).get("rms_norm") is cpp.KERNELS.get("rms_norm"):
        assert calls == []


def test_a_cache_hit_runs_the_stored_code_without_compiling_the_text(tmp_path, monkeypatch):
    args = _inputs(torch.float32)
    config = CompilationConfig(cache_dir=str(tmp_path))
    with torch.no_grad():
        expected = torch.compile(block, backend=MindieSDBackend(config), fullgraph=True)(*args)
    torch._dynamo.reset()
    compiled_texts = []
    real_compile = compile

    def counting(text, *rest, **kwargs):
        compiled_texts.append(text)
        return real_compile(text, *rest, **kwargs)

    monkeypatch.setattr(python_runner, "compile", counting, raising=False)
    second = MindieSDBackend(config, keep_graphs=True)
    with torch.no_grad():
        actual = torch.compile(block, backend=second, fullgraph=True)(*args)
    assert [r.cache for r in second.report().records] == ["hit"]
    assert compiled_texts == [] and torch.equal(actual, expected)


def test_stored_code_of_another_text_or_damaged_is_compiled_again(monkeypatch):
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.mul.Tensor(x, 2.0))
    run = python_runner.runner(gm)
    digest, data = python_runner.compiled_code(run)
    x = torch.randn(3)
    compiled_texts = []
    real_compile = compile
    monkeypatch.setattr(python_runner, "compile", lambda text, *a: compiled_texts.append(text) or real_compile(text, *a),
                        raising=False)
    assert torch.equal(python_runner.runner(gm, code=(digest, data))(x), x * 2) and compiled_texts == []
    for stored in (("another text", data), (digest, data[:5])):
        assert torch.equal(python_runner.runner(gm, code=stored)(x), x * 2)
    assert len(compiled_texts) == 2 and python_runner.compiled_code(gm.forward) is None


@needs_cpp
def test_forms_the_cpp_kernel_declines_run_through_the_dispatcher(monkeypatch):
    """float64: the C++ entry points return None, and the op's own path (the aten composition) runs."""
    args = _inputs(torch.float64)
    actual, expected, counts, backend = run_compiled(block, *args)
    assert {k: counts[k] for k in EXPECTED} == EXPECTED
    assert python_runner.runner(backend.graphs[0]).direct_ops == sum(EXPECTED.values())
    calls = _layout_calls(monkeypatch)
    with torch.no_grad():
        again = torch.compile(block, backend=backend, fullgraph=True)(*args)
    assert sorted(calls) == sorted(EXPECTED)
    torch.testing.assert_close(again, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def _binding_examples():
    """Arguments an aten graph passes to each overload of ``python_runner.BOUND_OVERLOADS``, one call or more each."""
    x, y = _randn(2, 3, 4, seed=1), _randn(2, 3, 4, seed=2)
    m, n, b = _randn(3, 4, seed=3), _randn(4, 5, seed=4), _randn(5, seed=5)
    q, k, v = (_randn(1, 2, 6, 8, seed=s) for s in (6, 7, 8))
    c = _randn(2, 3, 4, 2, seed=9)
    return {
        "view.default": [(x, [6, 4])], "unsqueeze.default": [(x, 1)], "squeeze.dim": [(x[:, :1], 1)],
        "squeeze.dims": [(x[:1, :1], [0, 1])], "t.default": [(m,)], "permute.default": [(x, [2, 0, 1])],
        "expand.default": [(x[:, :1], [2, 3, 4])], "transpose.int": [(x, 0, 2)], "select.int": [(x, 1, 2)],
        "split.Tensor": [(x, 2, -1)], "split_with_sizes.default": [(x, [1, 3], -1)], "unbind.int": [(x, 1)],
        "as_strided.default": [(x, [3, 4], [4, 1], 2)], "addmm.default": [(b, m, n)], "mm.default": [(m, n)],
        "bmm.default": [(x, x.transpose(1, 2))], "baddbmm.default": [(x[:, :, :3], x, x.transpose(1, 2))],
        "cat.default": [([x, y], -1), ([x, y],)], "stack.default": [([x, y], 1)],
        "clone.default": [(x.transpose(0, 1), {"memory_format": torch.contiguous_format}), (x,)],
        "mul.Tensor": [(x, y), (x, 2.5), (x, 1000)], "add.Tensor": [(x, y), (x, 1), (x, y, {"alpha": 2})],
        "sub.Tensor": [(x, y), (x, 1.5)], "div.Tensor": [(x, y), (x, 3)], "silu.default": [(x,)],
        "gelu.default": [(x,), (x, {"approximate": "tanh"})], "sin.default": [(x,)], "cos.default": [(x,)],
        "exp.default": [(x,)], "neg.default": [(x,)], "rsqrt.default": [(x.abs(),)], "sigmoid.default": [(x,)],
        "tanh.default": [(x,)], "relu.default": [(x,)], "pow.Tensor_Scalar": [(x, 2), (x, 0.5)],
        "mean.dim": [(x, [-1], True), (x, [1])], "sum.dim_IntList": [(x, [-1], True)], "amax.default": [(x, [-1], True)],
        "_softmax.default": [(x, -1, False)], "native_layer_norm.default": [(x, [4], None, None, 1e-6), (x, [4], b[:4], b[1:], 1e-5)],
        "addcmul.default": [(x, y, x), (x, y, x, {"value": 2})], "where.self": [(x > 0, x, y)],
        "index_select.default": [(x, 1, torch.tensor([0, 2]))],
        "_scaled_dot_product_flash_attention_for_cpu.default": [(q, k, v), (q, k, v, 0.0, False, {"scale": 0.5})],
        "view_as_real.default": [(torch.view_as_complex(c),)], "view_as_complex.default": [(c,)],
        "linear.default": [(x, n.t(), b), (m, n.t(), b)],
        "empty.memory_format": [([2, 3], {"dtype": torch.float32, "device": torch.device("cpu"), "pin_memory": False})],
        **{f"{name}.out": [(x.abs() + 0.5, {"out": torch.empty(2, 3, 4, dtype=torch.float16)}),
                           (x, {"out": torch.empty(2, 3, 8)[..., :4]})]
           for name in ("cos", "sin", "exp", "sigmoid", "tanh", "rsqrt")},
        **{f"{name}.out": [(x, y, {"out": torch.empty(2, 3, 4, dtype=torch.float16)}), (x, 2.5, {"out": torch.empty(2, 3, 4)})]
           for name in ("mul", "add", "sub", "div")},
        "mm.out": [(m, n, {"out": torch.empty(3, 5)})], "addmm.out": [(b, m, n, {"out": torch.empty(6, 5)[:3]})],
        "linear.out": [(m, n.t(), b, {"out": torch.empty(6, 5)[:3]}), (m, n.t(), None, {"out": torch.empty(3, 5)})],
    }


def test_every_bound_overload_reaches_that_overload_with_its_result():
    """The runner calls these aten overloads through their Python bindings: each must dispatch what the overload of
    the graph dispatches (the overload itself, not a sibling; linear's decomposition for linear) and give what
    ``OpOverload`` gives."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class FirstOp(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    aten_view = torch.ops.aten.view.default
    examples = _binding_examples()
    assert sorted(examples) == sorted(python_runner.BOUND_OVERLOADS)
    for name, calls in examples.items():
        packet, overload_name = name.rsplit(".", 1)
        overload = getattr(getattr(torch.ops.aten, packet), overload_name)
        bound = python_runner.binding(overload)
        assert bound is not None, name
        for call in calls:
            kwargs = call[-1] if isinstance(call[-1], dict) else {}
            args = call[:-1] if kwargs else call
            with FirstOp() as mode:
                got = bound(*args, **kwargs)
            with FirstOp() as reference:
                want = overload(*args, **kwargs)
            assert mode.ops == reference.ops, (name, mode.ops, reference.ops)
            composite = name == "linear.default"  # decomposed above the dispatcher, by the binding as by the op
            assert mode.ops[:1] == ([aten_view] if composite and args[0].dim() == 3 else
                                    [torch.ops.aten.t.default] if composite else [overload]), name
            for a, b in zip(*(r if isinstance(r, (tuple, list)) else (r,) for r in (got, want))):
                if isinstance(b, torch.Tensor):
                    if name != "empty.memory_format":  # uninitialised memory: its layout is what is compared
                        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
                    assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), name
    for name, method in python_runner.SIZE_AS_INTS.items():  # these take their sizes as separate ints
        (x, sizes), = examples[name]
        packet, overload_name = name.rsplit(".", 1)
        overload = getattr(getattr(torch.ops.aten, packet), overload_name)
        with FirstOp() as mode:
            got = method(x, *sizes)
        assert mode.ops == [overload] and torch.equal(got, overload(x, sizes)), name
    assert python_runner.binding(torch.ops.aten.slice.Tensor) is None  # no binding: the boxed call
    assert python_runner.binding(torch.ops.mindiesd.rms_norm.default) is None


class _Linears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(D, 3 * D), torch.nn.Linear(3 * D, D)

    def forward(self, x):
        return self.b(torch.sigmoid(self.a(x)))


class _CountingExtension:
    """The C++ extension with its linear entry counted."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def linear(self, *args):
        self.calls += 1
        return self.module.linear(*args)

    def __getattr__(self, name):
        return getattr(self.module, name)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_layers_run_the_cpp_entry_with_torch_linear_bits(dtype, monkeypatch):
    """The runner calls each linear layer's C++ entry (the CPU GEMM kernels without the dispatcher's autograd
    layers): the same values, bit for bit, as torch's linear."""
    model = _Linears().to(dtype)
    x = _randn(2, 8, D, seed=6).to(dtype)
    counting = _CountingExtension(cpp.cpp_build.extension())
    monkeypatch.setattr(cpp.cpp_build, "_extension", counting)
    backend = MindieSDBackend(CompilationConfig(cache_dir=None), keep_graphs=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        expected = model(x)
        actual = compiled(x)
        again = compiled(x)
    linears = [n for n in backend.graphs[0].graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 2 and python_runner.runner(backend.graphs[0]).direct_ops == 2
    assert counting.calls == 4, "each linear layer of each call ran the entry"
    assert torch.equal(actual, expected) and torch.equal(again, expected)


@needs_cpp
def test_the_linear_entry_declines_what_needs_the_dispatcher():
    """Where autograd, a dispatch mode, autocast or a tensor subclass could matter, the entry declines (None) and
    torch's linear runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    linear = cpp.cpp_build.extension().linear
    x, w, b = _randn(2, 8, D), _randn(3 * D, D, seed=1), _randn(3 * D, seed=2)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for args in ((x, w, b), (x, w, None), (x[0], w, b), (x[0], w, None)):
            args = tuple(a.to(dtype) if a is not None else None for a in args)
            assert torch.equal(linear(*args), F.linear(*args)), dtype
    assert linear(x.transpose(0, 1), w, b) is None  # a strided 3-D input: torch's own decomposition
    assert linear(x[None], w, b) is None and linear(x, w.double(), b) is None
    w_grad = w.clone().requires_grad_()
    assert linear(x, w_grad, b) is None  # grad mode on, an input that requires grad: autograd records it
    with torch.no_grad():
        assert linear(x, w_grad, b) is not None
    with Seen():
        assert linear(x, w, b) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, w, b) is None
