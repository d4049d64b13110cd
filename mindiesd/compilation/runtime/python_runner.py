"""The function that runs a fused graph: straight-line Python generated for it, with less per-call overhead.

A ``GraphModule``'s forward calls every aten op through ``OpOverload.__call__`` (a Python frame around the
operator's C++ handle) and every fused op through the dispatcher, which calls back into Python for the op's
layout adapter, its input checks and the resolution of its output dtype before the C++ kernel runs. In a graph
whose shapes are static (Dynamo guards them) all of that is known when the graph is compiled. The function made
here is the same program with that work done once:

* aten ops are called through their Python bindings (``torch.addmm``, ``Tensor.view``, ...: the overloads of
  :data:`BOUND_OVERLOADS`, each checked to reach that very overload), which parse their arguments directly, else
  through their C++ handles (``OpOverload._op``, what ``OpOverload.__call__`` calls, a boxed call that costs
  about twice as much);
* a fused op whose kernel on the graph's device is the C++ CPU kernel of :mod:`mindiesd.ops.kernels.cpp` and
  whose shapes are static calls the C++ entry point directly, inline in the generated code, with its output
  dtype resolved from the traced output. A row-major output is the kernel's result as it is; for an output in
  another memory order the runner does what the layout adapter would (the input and the arguments that
  broadcast against it permuted into that order, the result permuted back); where the adapter would copy, the
  op keeps it. Where the entry point declines a form (it returns None) or raises, or where the process has no
  C++ kernels, the op runs through the dispatcher as before;
* while a profiler is recording, the graph's own forward runs instead (so that the profile sees every
  ``mindiesd::`` op through the dispatcher): one check per call, not one per op;
* every other node runs as the ``GraphModule``'s forward runs it; a value is released after its last use, as
  FX's generated code does.

The graph itself is not changed: it is what is inspected (``MindieSDBackend(keep_graphs=True)``), counted and
stored. Any failure to generate gives the graph's own forward. The compiled code object is stored with a cached
graph (:func:`compiled_code`), so a load skips Python's ``compile`` of the generated text (most of the generation's
cost: 5.6 of 8.8 ms for mid Flux's 570 nodes) when the text it generates is the one stored.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import marshal
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.fx import GraphModule, Node

from ..fx_utils import known_row_major

log = logging.getLogger("mindiesd.compilation")

__all__ = ["runner", "direct_kernel", "traced_facts", "compiled_code"]

#: (sha256 of the generated text, the marshalled code object compiled from it): what a cached graph stores.
CompiledCode = Tuple[str, bytes]

_profiling = torch._C._autograd._profiler_enabled


def _static(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and all(type(s) is int for s in (*value.shape, *value.stride()))


#: What the straight call of a fused op needs to know from the trace: its output dtype, and the order of the
#: output's dimensions in memory when it is not row-major (None when it is).
Fact = Tuple[torch.dtype, Optional[Tuple[int, ...]]]


def _plan(name: str, out: torch.Tensor) -> Optional[Tuple[Optional[Tuple[int, ...]]]]:
    """``(order,)`` where the layout adapter would call the kernel straight (``order`` None: a row-major output) or
    on inputs permuted to the output's memory order (``order``: that order, the permuted result being exactly the
    output's strides); None where it copies (the normalised dimension is not innermost)."""
    from mindiesd.ops import layout

    shape, strides = tuple(out.shape), tuple(out.stride())
    if strides == layout.contiguous_strides(shape):
        return (None,)
    order = layout._memory_order(shape, strides)
    if name in layout.ROW_OPS and order[-1] != len(shape) - 1:
        return None
    permuted = layout.contiguous_strides(tuple(shape[d] for d in order))
    back = [0] * len(order)
    for position, dim in enumerate(order):
        back[dim] = permuted[position]
    return (tuple(order),) if tuple(back) == strides else None


def traced_facts(gm: GraphModule) -> Dict[str, Fact]:
    """The fused-op nodes of ``gm`` (by name) whose traced values allow the straight call: static shapes, a CPU
    output in a layout the kernel gives without a copy; and the linear layers on the CPU (the C++ entry of
    ``_cpp/linear.cpp``). Stored with a cached graph, whose loaded nodes carry no traced values."""
    facts: Dict[str, Fact] = {}
    for node in gm.graph.nodes:
        target = node.target
        if target is torch.ops.aten.linear.default:
            out = node.meta.get("val")  # any shapes: the entry reads them at run time
            if isinstance(out, torch.Tensor) and out.device.type == "cpu":
                facts[node.name] = (out.dtype, None)
            continue
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
                or target.namespace != "mindiesd":
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
            continue
        if _static(out) and all(_static(arg.meta.get("val")) for arg in node.all_input_nodes
                                if not isinstance(arg.meta.get("val"), (int, float, bool, list, tuple))):
            plan = _plan(target._opname, out)
        else:  # symbolic sizes: the straight call where the output is row-major at every size the graph serves
            plan = (None,) if known_row_major(out) else None
        if plan is not None:
            facts[node.name] = (out.dtype, plan[0])
    return facts



@dataclass(frozen=True)
class _Direct:
    """How the runner calls a fused op's C++ entry point: the entry's name, where each of its arguments comes from
    (``("arg", i)``, ``("kwarg", name)`` or ``("const", value)``), the output dtype it takes resolved (None where it
    takes none), and the output's memory order where it is not row-major."""

    name: str
    picks: Tuple[Tuple[str, Any], ...]
    out_dtype: Optional[torch.dtype]
    order: Optional[Tuple[int, ...]]


def _direct_plan(node: Node, fact: Fact) -> Optional[_Direct]:
    """The straight call of the fused op of ``node`` on its C++ CPU kernel (``fact``: its output dtype and memory
    order, from :func:`traced_facts`), or None where this process runs the op otherwise (see the module doc)."""
    target = node.target
    out_dtype, order = fact
    from mindiesd.ops import registry
    from mindiesd.ops.kernels import cpp

    name = target._opname
    kernel = cpp.KERNELS.get(name)
    if kernel is None or registry.DEVICE_KERNELS.get("cpu", {}).get(name) is not kernel:
        return None  # no C++ kernel for the op, or a kernel the user registered in its place
    parameters = list(inspect.signature(kernel).parameters)
    takes_dtype = parameters[-1:] == ["out_dtype"]
    positional = parameters[:-1] if takes_dtype else parameters
    arguments = target._schema.arguments  # the kernel takes the schema's leading arguments, in order
    if [a.name for a in arguments][:len(positional)] != positional:
        return None
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    picks: List[Tuple[str, Any]] = []
    for index, parameter in enumerate(positional):
        if index < len(node.args):
            picks.append(("arg", index))
        elif parameter in node.kwargs:
            picks.append(("kwarg", parameter))
        elif parameter in defaults:
            picks.append(("const", defaults[parameter]))
        else:
            return None
    if order is not None and not all(kind == "arg" for kind, _ in picks):
        return None
    return _Direct(name, tuple(picks), out_dtype if takes_dtype else None, order)


def _cpp_enabled() -> bool:
    from mindiesd.ops.kernels import cpp_build

    return cpp_build.enabled()


def direct_kernel(node: Node, fact: Fact) -> Optional[Callable[..., Any]]:
    """A function that runs the fused op of ``node`` straight on its C++ CPU kernel and permutes as the layout
    adapter would (for an output that is not row-major; the runner inlines the row-major call), or None where
    this process runs the op otherwise."""
    plan = _direct_plan(node, fact)
    if plan is None:
        return None
    from mindiesd.ops import layout

    overload, name, order = node.target, plan.name, plan.order
    count = len(plan.picks)
    entry = _LazyEntry(name)
    rank = len(order) if order is not None else 0
    inverse = [0] * rank
    for position, dim in enumerate(order or ()):
        inverse[dim] = position
    # as the adapter does: x (a row op's) and the arguments that broadcast against it move with the order
    moved = set(layout._TABLE_ARGS[name]) | ({0} if name in layout.ROW_OPS else set())
    moved_args = tuple(sorted(i for i in moved if i < count))
    tail = (plan.out_dtype,) if plan.out_dtype is not None else ()

    def call(*args: Any, **kw: Any) -> Any:
        if not _profiling():
            values = list(args[:count])
            for i in moved_args:
                value = values[i]
                if isinstance(value, torch.Tensor):
                    if value.dim() < rank:
                        value = value[(None,) * (rank - value.dim())]
                    values[i] = value.permute(order)
            try:
                result = entry(*values, *tail)
            except Exception:  # noqa: BLE001  (the op's own path runs it, or raises its own error)
                result = None
            if result is not None:
                return result.permute(inverse) if order is not None else result
        return overload(*args, **kw)

    call.__name__ = call.__qualname__ = f"direct_{name}"
    return call


class _LazyEntry:
    """A fused op's C++ entry point, looked up on the first call (never while a graph is being traced, which may
    not build or load the kernels); where the generated code reads it from its globals, the first call puts the
    entry point itself there. Without a C++ kernel in this process it returns None: the op's own path runs."""

    __slots__ = ("name", "namespace", "slot", "entry")

    def __init__(self, name: str, namespace: Optional[Dict[str, Any]] = None, slot: str = ""):
        self.name, self.namespace, self.slot, self.entry = name, namespace, slot, None

    def __call__(self, *args: Any) -> Any:
        if self.entry is None:
            from mindiesd.ops.kernels import cpp_build

            module = cpp_build._extension if cpp_build._resolved else cpp_build.extension()
            self.entry = (getattr(module, self.name, None) if module is not None else None) or _declined
            if self.namespace is not None:
                self.namespace[self.slot] = self.entry
        return self.entry(*args)


def _declined(*args: Any) -> None:
    return None


#: The aten overloads the runner calls through their Python bindings (the functions of ``torch``, ``torch._C._nn``
#: and the methods of tensors), which parse their arguments without the boxed call of ``OpOverload._op`` (a view
#: costs 0.7 us instead of 1.4). Each binding dispatches exactly what this overload dispatches for the arguments an
#: aten graph passes: the overload itself, or for ``linear`` (which :mod:`.tidy` puts back in place of its
#: decomposition) the same decomposition (``tests/compile/test_python_runner.py`` checks every one under a dispatch mode).
BOUND_OVERLOADS: Tuple[str, ...] = (
    "view.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims", "t.default", "permute.default",
    "expand.default", "transpose.int", "select.int", "split.Tensor", "split_with_sizes.default", "unbind.int",
    "as_strided.default", "addmm.default", "mm.default", "bmm.default", "baddbmm.default", "cat.default",
    "stack.default", "clone.default", "mul.Tensor", "add.Tensor", "sub.Tensor", "div.Tensor", "silu.default",
    "gelu.default", "sin.default", "cos.default", "exp.default", "neg.default", "rsqrt.default", "sigmoid.default",
    "tanh.default", "relu.default", "pow.Tensor_Scalar", "mean.dim", "sum.dim_IntList", "amax.default",
    "_softmax.default", "native_layer_norm.default", "addcmul.default", "where.self", "index_select.default",
    "_scaled_dot_product_flash_attention_for_cpu.default", "view_as_real.default", "view_as_complex.default",
    "linear.default", "empty.memory_format", "cos.out", "sin.out", "exp.out", "sigmoid.out", "tanh.out", "rsqrt.out",
    "mul.out", "add.out", "sub.out", "div.out", "linear.out", "mm.out", "addmm.out",
)


def binding(overload: Any) -> Optional[Callable[..., Any]]:
    """The Python binding the runner calls for the aten ``overload`` (see :data:`BOUND_OVERLOADS`), or None."""
    if not isinstance(overload, torch._ops.OpOverload) or overload.namespace != "aten" \
            or f"{overload._opname}.{overload._overloadname}" not in _BOUND:
        return None
    name = overload._opname
    for namespace in (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase):
        found = getattr(namespace, name, None)
        if found is not None:
            return found
    return None


_BOUND = frozenset(BOUND_OVERLOADS)

#: Tensor methods whose one size argument may be passed as separate ints (``x.view(2, 3)``), which their parser
#: takes in half the time of a list.
SIZE_AS_INTS = {"view.default": torch._C.TensorBase.view, "permute.default": torch._C.TensorBase.permute,
                "expand.default": torch._C.TensorBase.expand}


def _sizes_as_ints(node: Node) -> bool:
    """Whether the runner passes the size list of ``node`` (a :data:`SIZE_AS_INTS` op) as separate ints."""
    if len(node.args) != 2 or not isinstance(node.args[1], (list, tuple)) or not node.args[1]:
        return False
    return all(type(size) is int for size in node.args[1])


class _Source:
    """The generated lines and the globals they read."""

    def __init__(self, gm: GraphModule, facts: Mapping[str, Fact]):
        self.gm, self.facts = gm, facts
        self.globals: Dict[str, Any] = {"_gm": gm}
        self.names: Dict[Node, str] = {}
        self._bound: Dict[Any, str] = {}
        self.entries: Dict[str, str] = {}  # global -> the C++ entry point it stands for
        self.direct = 0

    def bind(self, value: Any, prefix: str) -> str:
        name = self._bound.get(id(value))
        if name is None:
            name = f"_{prefix}{len(self.globals)}"
            self.globals[name] = value
            self._bound[id(value)] = name
        return name

    def expr(self, value: Any) -> str:
        if isinstance(value, Node):
            return self.names[value]
        if value is None or isinstance(value, (bool, str)):
            return repr(value)
        if type(value) is int:
            return repr(value)
        if type(value) is float and math.isfinite(value):
            return repr(value)
        if isinstance(value, list):  # FX's immutable_list included
            return "[" + ", ".join(self.expr(v) for v in value) + "]"
        if type(value) is tuple:
            return "(" + "".join(self.expr(v) + ", " for v in value) + ")"
        if isinstance(value, dict) and all(type(k) is str for k in value):
            return "{" + ", ".join(f"{k!r}: {self.expr(v)}" for k, v in value.items()) + "}"
        return self.bind(value, "c")

    def entry(self, name: str) -> str:
        """The global through which the generated code calls the C++ entry point ``name`` (see :class:`_LazyEntry`)."""
        slot = self._bound.get(("entry", name))
        if slot is None:
            slot = f"_k{len(self.globals)}"
            self.globals[slot] = None  # a _LazyEntry of the namespace the code runs in
            self._bound[("entry", name)] = slot
            self.entries[slot] = name
        return slot

    def statements(self, node: Node, out: str) -> List[str]:
        """The lines that compute ``node`` into ``out``."""
        target = node.target
        args = [self.expr(a) for a in node.args] + [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()]
        if target is operator.getitem and len(node.args) == 2 and not node.kwargs:
            return [f"{out} = {args[0]}[{args[1]}]"]
        fact = self.facts.get(node.name)
        if target is torch.ops.aten.linear.default and fact is not None and not node.kwargs \
                and 2 <= len(node.args) <= 3 and _cpp_enabled():
            self.direct += 1
            values = args if len(args) == 3 else [*args, "None"]
            return [  # the C++ entry declines what it does not cover (see _cpp/linear.cpp): torch's linear runs
                "try:",
                f"    {out} = {self.entry('linear')}({', '.join(values)})",
                "except Exception:",
                f"    {out} = None",
                f"if {out} is None:",
                f"    {out} = {self.bind(binding(target), 'b')}({', '.join(args)})",
            ]
        plan = _direct_plan(node, fact) if fact is not None else None
        if plan is not None:
            self.direct += 1
            if plan.order is not None:  # the adapter's permutations around the call: a function of its own
                return [f"{out} = {self.bind(direct_kernel(node, fact), 'd')}({', '.join(args)})"]
            values = [args[where] if kind == "arg" else self.expr(node.kwargs[where]) if kind == "kwarg"
                      else self.expr(where) for kind, where in plan.picks]
            if plan.out_dtype is not None:
                values.append(self.expr(plan.out_dtype))
            return [  # a declined form (None) or a failure runs the op's own path, which raises its own error
                "try:",
                f"    {out} = {self.entry(plan.name)}({', '.join(values)})",
                "except Exception:",
                f"    {out} = None",
                f"if {out} is None:",
                f"    {out} = {self.bind(target._op, 'op')}({', '.join(args)})",
            ]
        if type(target) is torch._ops.OpOverload:
            method = SIZE_AS_INTS.get(f"{target._opname}.{target._overloadname}")
            if method is not None and target.namespace == "aten" and _sizes_as_ints(node):
                sizes = [self.expr(size) for size in node.args[1]]
                rest = [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()]
                return [f"{out} = {self.bind(method, 'b')}({', '.join([args[0], *sizes, *rest])})"]
            bound = binding(target)
            name = self.bind(bound, "b") if bound is not None else self.bind(target._op, "op")
        else:
            name = self.bind(target, "f")
        return [f"{out} = {name}({', '.join(args)})"]


def runner(gm: GraphModule, facts: Optional[Mapping[str, Fact]] = None,
           code: Optional[CompiledCode] = None) -> Callable[..., Any]:
    """The function that runs ``gm`` (its forward where it cannot be generated). ``facts``: its
    :func:`traced_facts`, where its nodes carry no traced values (a graph loaded from the cache); ``code``: the
    :func:`compiled_code` stored with it, used when the generated text is the one it was compiled from."""
    try:
        return _generate(gm, traced_facts(gm) if facts is None else facts, code)
    except Exception as exc:  # noqa: BLE001  (the graph's own forward is always correct)
        log.debug("straight-line code not generated (%s: %s); the graph's forward runs", type(exc).__name__, exc)
        return gm.forward


def compiled_code(run: Callable[..., Any]) -> Optional[CompiledCode]:
    """What a cached graph stores of the runner ``run``: the digest of its text and its code object, marshalled
    (None for a graph's own forward)."""
    module_code = getattr(run, "module_code", None)
    if module_code is None:
        return None
    return run.digest, marshal.dumps(module_code)


def _module_code(text: str, digest: str, stored: Optional[CompiledCode], filename: str):
    if stored is not None and stored[0] == digest:
        try:
            return marshal.loads(stored[1])
        except (EOFError, ValueError, TypeError) as exc:  # a damaged entry: compile the text again
            log.debug("stored runner code not loaded (%s); compiling it", exc)
    return compile(text, filename, "exec")


def _generate(gm: GraphModule, facts: Mapping[str, Fact], stored: Optional[CompiledCode] = None) -> Callable[..., Any]:
    graph = gm.graph
    if type(graph._codegen) is not torch.fx.graph.CodeGen:
        return gm.forward  # a graph with its own calling convention
    nodes = list(graph.nodes)
    last_use: Dict[Node, Node] = {}
    for node in reversed(nodes):
        for used in node.all_input_nodes:
            last_use.setdefault(used, node)
    released: Dict[Node, List[Node]] = {}
    for value, user in last_use.items():
        released.setdefault(user, []).append(value)

    source = _Source(gm, facts)
    params: List[str] = []
    body: List[str] = []
    for index, node in enumerate(nodes):
        name = f"v{index}"
        source.names[node] = name
        if node.op == "placeholder":
            if node.args or node.kwargs:
                return gm.forward  # a default value: keep FX's handling
            params.append(name)
            continue
        if node.op == "output":
            body.append(f"return {source.expr(node.args[0])}")
            break
        if node.op == "get_attr":
            body.append(f"{name} = {source.bind(_Attribute(node.target), 'a')}(_gm)")
        elif node.op == "call_function":
            body.extend(source.statements(node, name))
        else:
            return gm.forward  # call_module / call_method: not in aten graphs
        dead = [source.names[v] for v in released.get(node, ())]
        if not node.users:
            dead.append(name)
        if dead:
            body.append(" = ".join(dead) + " = None")
    # while a profiler records, the graph's own forward runs, so that it sees every op through the dispatcher
    body.insert(0, f"if _profiling(): return _gm.forward({', '.join(params)})")
    code = "def forward(" + ", ".join(params) + "):\n" + "".join(f"    {line}\n" for line in body)
    namespace = dict(source.globals, _profiling=_profiling)
    for slot, entry_name in source.entries.items():
        namespace[slot] = _LazyEntry(entry_name, namespace, slot)
    digest = hashlib.sha256(code.encode()).hexdigest()
    module_code = _module_code(code, digest, stored, f"<mindiesd runner {id(gm):x}>")
    exec(module_code, namespace)  # noqa: S102  (generated here, or stored from the same text)
    forward = namespace["forward"]
    forward.source = code  # type: ignore[attr-defined]
    forward.digest, forward.module_code = digest, module_code  # type: ignore[attr-defined]
    forward.direct_ops = source.direct  # type: ignore[attr-defined]
    return forward


class _Attribute:
    """Reads ``gm.<dotted target>`` each call (a graph's attribute may be replaced after compilation)."""

    __slots__ = ("path",)

    def __init__(self, target: str):
        self.path = target.split(".")

    def __call__(self, gm: GraphModule) -> Any:
        value: Any = gm
        for part in self.path:
            value = getattr(value, part)
        return value
