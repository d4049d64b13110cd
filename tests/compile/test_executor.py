"""The C++ executor of fused graphs (``compilation/runtime/executor.py``, ``ops/_cpp/executor.cpp``): it runs every registry
model's graph, bit for bit what the generated Python runner computes; it keeps that runner where it cannot run a
graph (symbolic sizes, a profiler recording, no C++ kernels), and calls Python kernels, autograd and writes in
place as a Python call of each op would."""

import operator
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import assert_close, run_compiled
from mindiesd import zoo
from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDFallbackWarning
from mindiesd.compilation.runtime import executor, python_runner
from mindiesd.compilation.runtime.lowering import DirectCall, Operand, lower
from mindiesd.ops.kernels import cpp, cpp_build

needs_program = pytest.mark.skipif(
    not executor.enabled() or getattr(cpp_build.extension(), "Program", None) is None,
    reason="no C++ kernels extension (or MINDIESD_EXECUTOR=0) in this process")


class _Outcomes(list):
    def __init__(self):
        super().__init__()
        self.runners = []


@pytest.fixture
def builds(monkeypatch):
    """Whether each CppRunner runner built its program (True) or kept the generated runner (False)."""
    outcomes = _Outcomes()
    real = executor.CppRunner._build

    def recording(self, args=()):
        program = real(self, args)
        outcomes.runners.append(self)
        # a graph Dynamo made with symbolic sizes keeps the generated runner: it counts as run if it is one
        outcomes.append(program is not False or _symbolic(self.gm))
        return program

    monkeypatch.setattr(executor.CppRunner, "_build", recording)
    return outcomes


def _symbolic(gm):
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and (isinstance(value, torch.SymInt) or isinstance(value, torch.Tensor) and any(
                not isinstance(size, int) for size in value.shape)):
            return True
    return False


def _compiled_output(case, monkeypatch, use_executor):
    monkeypatch.setenv(executor.ENV, "1" if use_executor else "0")
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(cache_dir=None), keep_graphs=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        compiled = torch.compile(case.model, backend=backend)
        first = compiled(**case.inputs)[0]
        second = compiled(**case.inputs)[0]  # the fast path, after the first call built the program
    torch._dynamo.reset()
    return first, second


@pytest.mark.slow  # 26 models compiled twice: the whole suite runs it, the quick set runs Flux and the block below
@needs_program
@pytest.mark.parametrize("name", zoo.names(size="tiny"))
def test_every_registry_model_runs_in_the_executor_bit_for_bit_as_the_python_runner(name, builds, monkeypatch):
    case = zoo.build(name, "tiny")
    with torch.no_grad():
        expected = case.model(**case.inputs)[0]
    python_first, python_second = _compiled_output(case, monkeypatch, use_executor=False)
    assert builds == []  # no CppRunner runner at all
    first, second = _compiled_output(case, monkeypatch, use_executor=True)
    assert builds and all(builds), f"{name}: the executor did not run its graph"
    assert torch.equal(first, python_first) and torch.equal(second, python_second)
    assert_close(second, expected)


@needs_program
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flux_in_the_executor_fuses_and_matches_eager(dtype, builds, monkeypatch):
    case = zoo.build("flux", "tiny", dtype=dtype)
    with torch.no_grad():
        expected = case.model(**case.inputs)[0]
    first, second = _compiled_output(case, monkeypatch, use_executor=True)
    assert builds and all(builds)
    assert torch.equal(first, second)
    assert_close(second, expected)


def _block(x, w, scale, shift, gate):
    h = F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
    h = F.layer_norm(h, (x.shape[-1],), eps=1e-6) * (1 + scale) + shift
    return x + gate * F.gelu(h, approximate="tanh")


def _block_inputs(rows=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(rows)
    return tuple(torch.randn(*shape, generator=g).to(dtype)
                 for shape in ((2, rows, 32), (32,), (2, 1, 32), (2, 1, 32), (2, 1, 32)))


@needs_program
def test_fused_block_runs_in_the_executor_with_its_fused_ops(builds):
    args = _block_inputs()
    with torch.no_grad():
        actual, expected, counts, _ = run_compiled(_block, *args)
    assert builds == [True]
    assert builds.runners[0].program.direct_calls == 4  # every fused op through its C++ entry point
    assert counts["rms_norm"] == 1 and counts["adalayernorm"] == 1 and counts["fast_gelu"] == 1 \
        and counts["mul_add"] == 1
    assert_close(actual, expected)


@needs_program
class _Linears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 96), torch.nn.Linear(96, 32)

    def forward(self, x):
        return self.b(torch.sigmoid(self.a(x)))


@needs_program
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_layers_run_their_cpp_entry_with_torch_linear_bits(dtype, builds):
    model = _Linears().to(dtype)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(6)).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=MindieSDBackend(CompilationConfig(cache_dir=None)), fullgraph=True)
    with torch.no_grad():
        expected = model(x)
        runs = [compiled(x) for _ in range(3)]
    assert builds == [True] and builds.runners[0].program.direct_calls == 2 * 3
    assert all(torch.equal(run, expected) for run in runs)


@needs_program
def test_a_graph_with_symbolic_sizes_runs_in_the_executor_at_every_size(builds):
    """Sizes the graph computes (``sym_size``, Python arithmetic on them) are evaluated per call in C++; views take
    them, fused ops keep their straight C++ calls, and every size matches eager."""
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(cache_dir=None), keep_graphs=True)
    compiled = torch.compile(_block, backend=backend, dynamic=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        for rows in (8, 12, 8, 20):
            args = _block_inputs(rows)
            assert_close(compiled(*args), _block(*args))
    assert _symbolic(backend.graphs[0]) and builds == [True]
    program = builds.runners[0].program
    assert program is not False and program.direct_calls > 0


@needs_program
@pytest.mark.parametrize("k", [1, 2, 5])
def test_symbolic_int_and_float_arguments_are_numbers_in_the_executor(builds, k):
    """An int argument that changes between calls becomes a symbolic graph input, read where a tensor goes
    (``div.Tensor(x, k)``): the executor wraps it per call as Python would, without falling back."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, k, s: (x * 2.0 - 1.0) / k + s, backend=MindieSDBackend(
        CompilationConfig(cache_dir=None)))
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        for kk, scale in ((k, 0.5), (k + 1, 1.5), (k + 3, 2.5)):
            torch.testing.assert_close(compiled(x, kk, scale), (x * 2.0 - 1.0) / kk + scale)
    assert builds and all(builds)


def test_arithmetic_on_sizes_has_pythons_semantics():
    """Floor division and modulo round toward negative infinity; true division gives a float."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    for placeholder in (a, b):
        placeholder.meta["val"] = 0
    ops = [operator.floordiv, operator.mod, operator.truediv, operator.mul, operator.sub, torch.sym_max]
    values = [graph.call_function(op, (a, b)) for op in ops]
    for value in values:
        value.meta["val"] = 0
    graph.output(tuple(graph.call_function(torch.ops.aten.scalar_tensor.default, (v,)) for v in values))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    program = lower(gm, {})
    module = cpp_build.extension()
    assert program.cpp_reason is None
    if module is None or not hasattr(module, "Program"):
        pytest.skip("no C++ kernels extension in this process")
    built = module.Program(program)
    for x, y in ((7, 2), (-7, 2), (7, -2), (-7, -3)):
        got = [t.item() for t in built.run((x, y))]
        assert got == pytest.approx([op(x, y) for op in ops], rel=1e-6)  # scalar_tensor: float32


@needs_program
def test_a_profiler_sees_every_op_through_the_dispatcher(builds):
    args = _block_inputs()
    torch._dynamo.reset()
    backend = MindieSDBackend(CompilationConfig(cache_dir=None))
    compiled = torch.compile(_block, backend=backend)
    with torch.no_grad():
        compiled(*args)
        compiled(*args)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            profiled = compiled(*args)
        after = compiled(*args)
    names = {event.name for event in prof.events()}
    assert {"mindiesd::adalayernorm", "mindiesd::mul_add"} <= names
    assert builds == [True] and torch.equal(profiled, after)


def test_executor_off_by_environment_keeps_the_generated_runner(builds, monkeypatch):
    monkeypatch.setenv(executor.ENV, "0")
    args = _block_inputs()
    with torch.no_grad():
        actual, expected, _, backend = run_compiled(_block, *args)
    assert builds == []
    assert not isinstance(python_runner.runner(backend.graphs[0]), executor.CppRunner)
    assert_close(actual, expected)


@needs_program
def test_python_numbers_promote_as_scalars(builds):
    """``x * 1000`` with an int64 ``x`` stays int64 and ``x * 2.5`` becomes float32 (not float64): the executor
    passes a Python number where a schema takes a tensor as the wrapped number Python's parser makes of it."""

    def scaled(x, y):
        return x * 1000 + 1, y * 2.5, (y * 3).sum(-1)

    x, y = torch.arange(6).reshape(2, 3), torch.arange(6, dtype=torch.int32).reshape(2, 3)
    torch._dynamo.reset()
    compiled = torch.compile(scaled, backend=MindieSDBackend(CompilationConfig(cache_dir=None)))
    with torch.no_grad():
        compiled(x, y)
        actual = compiled(x, y)
    expected = scaled(x, y)
    assert builds == [True]
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and torch.equal(a, e)


@torch.library.custom_op("mindiesd_test::python_scale", mutates_args=())
def _python_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_python_scale.register_fake
def _(x, factor):
    return torch.empty_like(x)


@needs_program
def test_an_op_implemented_in_python_runs_from_the_executor(builds):
    """The executor releases the GIL while the ops run; an op whose kernel is Python takes it back."""

    def f(x):
        return _python_scale(torch.sin(x), 3.0) + 1

    x = torch.randn(4, 8)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=MindieSDBackend(CompilationConfig(cache_dir=None)), fullgraph=True)
    with torch.no_grad():
        compiled(x)
        actual = compiled(x)
    assert builds == [True]
    assert torch.equal(actual, f(x))


@needs_program
def test_grad_mode_on_runs_the_forward_through_autograd(builds):
    """With grad mode on, the executor calls each op through autograd (no below-autograd shortcut): the graph's
    outputs keep what backward needs, and the gradients are eager's."""
    args = [a.clone().requires_grad_(True) for a in _block_inputs()]
    torch._dynamo.reset()
    compiled = torch.compile(_block, backend=MindieSDBackend(CompilationConfig(cache_dir=None)))
    out = compiled(*args)
    out.square().sum().backward()
    grads = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    _block(*args).square().sum().backward()
    for actual, a in zip(grads, args):
        torch.testing.assert_close(actual, a.grad, rtol=1e-4, atol=1e-4)


def _graph(fn, *args):
    return torch.fx.experimental.proxy_tensor.make_fx(fn)(*args)


def test_writes_into_an_input_rule_out_the_below_autograd_shortcut():
    def own_buffer(x):
        out = torch.empty_like(x)
        torch.mul(x, 2, out=out)
        return (out,)

    def into_input(x, y):
        y.add_(x)
        return (y * 2,)

    x = torch.randn(3, 4)
    own = lower(_graph(own_buffer, x), {})
    assert own.cpp_reason is None and own.below_autograd is True
    written = lower(_graph(into_input, x, x.clone()), {})
    assert written.cpp_reason is None and written.below_autograd is False


def test_a_graph_with_a_python_callable_keeps_the_generated_runner():
    gm = torch.fx.symbolic_trace(lambda x: (torch.sin(x) + 1,))
    program = lower(gm, {})  # torch.sin and operator.add: not operator overloads
    assert "the callable" in program.cpp_reason and "sin" in program.cpp_reason
    assert program.python_reason is None and not isinstance(executor.runner(gm, {}), executor.CppRunner)


@needs_program
def test_instructions_release_each_value_after_its_last_read():
    def chain(x):
        a = torch.ops.aten.sin.default(x)
        b = torch.ops.aten.cos.default(a)
        c = torch.ops.aten.mul.Tensor(a, b)
        return (torch.ops.aten.add.Tensor(c, x),)

    gm = _graph(chain, torch.randn(4))
    program = lower(gm, {})
    freed = [slot for instruction in program.cpp_instructions for slot in instruction.slot_frees]
    # every value but the output is released, once; the Python runner releases the same nodes
    assert sorted(freed) == sorted(set(range(program.slot_count)) - set(program.output_slots))
    released = [node.name for i in program.instructions for node in i.frees]
    assert sorted(released) == sorted({node.name for node in gm.graph.nodes} - {"output", "add"})
    x = torch.randn(4)
    module = cpp_build.extension()
    built = module.Program(program)
    assert len(built) == 4 and torch.equal(built.run((x,))[0], chain(x)[0])
    with pytest.raises(ValueError, match="takes 1 inputs, got 2"):
        built.run((x, x))


@needs_program
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("biased", [True, False])
def test_linear_out_into_a_buffer_runs_its_cpp_entry_with_torch_linear_bits(dtype, biased):
    """``linear.out`` of 2-D rows into a buffer the graph allocates (what ``into.py`` writes) calls the C++ entry,
    which computes torch's linear bit for bit."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, w, b = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("b")
    buffer = graph.call_function(aten.empty.memory_format, ([12, 40],), {"dtype": dtype})
    written = graph.call_function(aten.linear.out, (x, w, b if biased else None), {"out": buffer})
    graph.output((graph.call_function(aten.mul.Tensor, (written, 2.0)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    program = lower(gm, {})
    assert program.below_autograd is True
    assert [i.direct.entry for i in program.cpp_instructions if i.direct] == ["linear_out"]
    built = cpp_build.extension().Program(program, 8)
    gen = torch.Generator().manual_seed(3)
    args = (torch.randn(12, 24, generator=gen).to(dtype), torch.randn(40, 24, generator=gen).to(dtype),
            torch.randn(40, generator=gen).to(dtype))
    with torch.no_grad():
        runs = [built.run(args)[0] for _ in range(2)]
    expected = F.linear(args[0], args[1], args[2] if biased else None) * 2.0
    assert built.direct_calls == 2 and all(torch.equal(run, expected) for run in runs)


@needs_program
def test_every_cpp_kernel_registers_its_executor_entry_and_the_executor_names_none():
    """Each op with a C++ kernel (and aten's linear layer, linear and linear.out) registers the executor's entry
    beside its kernel; the executor finds every one by name, raises for a name none registered, and its source
    names no op."""
    names = set(cpp.KERNELS) | {"linear", "linear_out"}
    assert set(cpp_build.extension().executor_entries()) == names
    source = (cpp_build.SOURCE_DIR / "executor.cpp").read_text()
    assert [name for name in sorted(names) if f'"{name}"' in source] == []
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(aten.relu.default, (x,)),))
    program = lower(torch.fx.GraphModule(torch.nn.Module(), graph), {})
    [relu] = program.cpp_instructions
    relu.direct = DirectCall("no_such_op", (("arg", 0),), operands=[Operand("slot", program.inputs[0])])
    with pytest.raises(ValueError, match=r"no C\+\+ entry point named no_such_op"):
        cpp_build.extension().Program(program, 8)


@needs_program
def test_views_repeat_their_first_calls_geometry_only_for_an_input_of_that_geometry():
    """Below the view-tracking layer a view op's results are made as its first call made them, without a call, while
    its input has that call's sizes and strides; an input of other strides gets the op's own call again."""
    aten = torch.ops.aten

    def views(x):
        a = aten.permute.default(x, [1, 0, 2])
        parts = aten.split.Tensor(a, 2, 1)
        b = aten.unsqueeze.default(parts[1], 0)
        c = aten.slice.Tensor(aten.select.int(b, 1, 2), 1, 1, 3)
        d = aten.t.default(aten.select.int(parts[0], 0, 1))
        return (aten.mul.Tensor(c, 2.0), aten.add.Tensor(d, 1.0))  # views that reach an output are never memoised

    base = torch.arange(5 * 4 * 3, dtype=torch.float32)
    gm = _graph(views, base.view(5, 4, 3))
    program = lower(gm, {})
    assert program.below_autograd is True
    built = cpp_build.extension().Program(program, 8)
    view_ops = 7  # permute, split, unsqueeze, two selects, slice, t

    def check(x):
        expected = views(x)
        with torch.no_grad():
            actual = built.run((x,))
        for got, want in zip(actual, expected):
            assert torch.equal(got, want) and got.stride() == want.stride()

    check(base.view(5, 4, 3))  # the first call: each op runs, its results are kept
    assert built.memoised_views == 0
    check(base.flip(0).view(5, 4, 3) + 0)  # same geometry, other values
    assert built.memoised_views == view_ops
    check(base.view(3, 4, 5).permute(2, 1, 0))  # the same sizes, other strides: the ops run again
    assert built.memoised_views == view_ops
    shifted = torch.arange(2 * 5 * 4 * 3, dtype=torch.float32)[5 * 4 * 3:].view(5, 4, 3)
    assert shifted.storage_offset() == 60
    check(shifted)  # same geometry again, at an offset of its own
    assert built.memoised_views == 2 * view_ops


@needs_program
def test_the_view_memo_keeps_at_most_the_set_number_of_geometries(monkeypatch):
    """``MINDIESD_VIEW_GEOMETRIES`` bounds the input geometries each view op memoises: a geometry past the bound
    runs the op on every call, the memory the memo holds stops growing, and 0 memoises nothing."""
    aten = torch.ops.aten

    def views(x):
        return (aten.mul.Tensor(aten.t.default(aten.select.int(x, 0, 1)), 2.0),)

    gm = _graph(views, torch.randn(3, 4, 5))
    program = lower(gm, {})

    def build(limit):
        monkeypatch.setenv(executor.VIEW_GEOMETRIES_ENV, str(limit))
        return cpp_build.extension().Program(program, executor.view_geometries())

    def run(built, length):
        x = torch.randn(3, 4, length)
        with torch.no_grad():
            [got] = built.run((x,))
        assert torch.equal(got, views(x)[0])

    built = build(2)
    empty = built.view_memo_bytes
    for length in (5, 6, 7):  # three geometries, two kept
        run(built, length)
    kept = built.view_memo_bytes
    assert kept > empty and built.memoised_views == 0
    for length in (5, 6):
        run(built, length)
    assert built.memoised_views == 2 * 2  # select and t, for each kept geometry
    run(built, 7)
    run(built, 8)
    assert built.memoised_views == 4 and built.view_memo_bytes == kept, "past the bound: the op runs, nothing kept"

    unbounded = build(0)
    for length in (5, 5, 6):
        run(unbounded, length)
    assert unbounded.memoised_views == 0 and unbounded.view_memo_bytes == 0

    monkeypatch.setenv(executor.VIEW_GEOMETRIES_ENV, "many")
    with pytest.raises(ValueError, match="MINDIESD_VIEW_GEOMETRIES='many': expected a non-negative integer"):
        executor.view_geometries()


@needs_program
def test_a_graph_loaded_from_the_cache_runs_in_the_executor(builds, tmp_path):
    """A cache hit's graph carries no traced values; the executor runs it all the same, with the C++ entries of
    its fused ops (the stored facts), and computes what the fresh graph computed."""
    args = _block_inputs()
    results = []
    for _ in range(2):
        torch._dynamo.reset()
        backend = MindieSDBackend(CompilationConfig(cache_dir=str(tmp_path)))
        compiled = torch.compile(_block, backend=backend, fullgraph=True)
        with torch.no_grad():
            compiled(*args)
            results.append(compiled(*args))
        results.append(backend.report().records[0].cache)
    torch._dynamo.reset()
    fresh, first_outcome, loaded, second_outcome = results
    assert (first_outcome, second_outcome) == ("stored", "hit")
    assert builds == [True, True] and [runner.program.direct_calls for runner in builds.runners] == [8, 8]
    assert torch.equal(fresh, loaded)


def _aliasing(x):
    h = x * 2 + 1
    return h, h.view(-1)


@needs_program
@pytest.mark.parametrize("grad_mode", [False, True])
def test_outputs_that_view_each_other_keep_eagers_view_relation(builds, grad_mode):
    """An output that is a view of another output is that output's view, as in eager: its ``_base``, one version
    counter, and autograd's check of a saved tensor written in place fires. With grad mode on nothing requires
    grad, so the graph runs as an inference call with grad mode switched off in C++."""
    x = torch.randn(2, 2)
    torch._dynamo.reset()
    compiled = torch.compile(_aliasing, backend=MindieSDBackend(CompilationConfig(cache_dir=None)))
    with torch.set_grad_enabled(grad_mode):
        compiled(x)
        a, b = compiled(x)  # the second call: the program's own path
    assert builds == [True]
    assert torch.equal(b, _aliasing(x)[1])
    assert b._base is a and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    version = a._version
    b.add_(0)
    assert a._version == version + 1
    w = torch.ones(4, requires_grad=True)
    loss = (a.view(-1) * w).sum()
    b.mul_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@needs_program
def test_outputs_viewing_one_intermediate_share_its_version_counter(builds):
    """Two outputs that view one intermediate the graph does not return share its version counter (eager: both
    have that intermediate as ``_base``); a view of an input stays a view of the input."""
    def views(x):
        h = x + 1
        return h.view(-1), h.t(), x.view(-1)

    x = torch.randn(3, 2)
    torch._dynamo.reset()
    compiled = torch.compile(views, backend=MindieSDBackend(CompilationConfig(cache_dir=None)))
    with torch.no_grad():
        compiled(x)
        flat, transposed, of_input = compiled(x)
    assert builds and all(builds)
    assert flat._base is not None and flat._base is transposed._base
    version = transposed._version
    flat.mul_(2)
    assert transposed._version == version + 1 and torch.equal(transposed, (x + 1).t() * 2)
    assert of_input._base is x
    of_input.add_(1)
    assert x._version > 0


@needs_program
def test_views_that_reach_an_output_are_marked_to_run_above_the_view_tracking_layer():
    aten = torch.ops.aten

    def graph(x):
        h = aten.mul.Tensor(x, 2.0)
        inner = aten.view.default(h, [-1])  # read by a computation only: may run below
        return (h, aten.t.default(aten.permute.default(h, [1, 0])), aten.add.Tensor(inner, 1.0))

    gm = _graph(graph, torch.randn(3, 4))
    program = lower(gm, {})
    tracked = sorted(instruction.name for instruction in program.instructions if instruction.tracked)
    assert program.below_autograd is True and tracked == ["aten::permute", "aten::t"]


@needs_program
def test_bound_runs_in_cpp_says_whether_the_program_runs():
    aten = torch.ops.aten
    gm = _graph(lambda x: (aten.mul.Tensor(x, 2.0),), torch.randn(3))
    runner = executor.runner(gm, {})
    assert isinstance(runner, executor.CppRunner)
    assert runner.inference().runs_in_cpp is True
    assert runner.bound([0], lambda args: ()).runs_in_cpp is True
    python_only = executor.runner(torch.fx.symbolic_trace(lambda x: (torch.sin(x) + 1,)), {})
    assert not isinstance(python_only, executor.CppRunner) or python_only.inference().runs_in_cpp is False
