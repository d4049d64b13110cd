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

The runner is generated from the graph's lowered program (:mod:`.lowering`), the one the C++ executor runs: the
last uses, the straight calls and their layout permutations come from there. The graph itself is not changed: it is what is inspected (``MindieSDBackend(keep_graphs=True)``), counted and
stored. Any failure to generate gives the graph's own forward. The compiled code object is stored with a cached
graph (:func:`compiled_code`), so a load skips Python's ``compile`` of the generated text (most of the generation's
cost: 5.6 of 8.8 ms for mid Flux's 570 nodes) when the text it generates is the one stored.
"""

from __future__ import annotations

import hashlib
import logging
import marshal
import math
import operator
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.fx import GraphModule, Node

from .lowering import Fact, Instruction, LazyEntry, Program, lower

log = logging.getLogger("mindiesd.compilation")

__all__ = ["runner", "generate", "compiled_code", "Attribute"]

#: (sha256 of the generated text, the marshalled code object compiled from it): what a cached graph stores.
CompiledCode = Tuple[str, bytes]

_profiling = torch._C._autograd._profiler_enabled


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

    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.globals: Dict[str, Any] = {"_gm": gm}
        self.names: Dict[Node, str] = {}
        self._bound: Dict[Any, str] = {}
        self.entries: Dict[str, str] = {}  # global -> the C++ entry point it stands for

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
        """The global through which the generated code calls the C++ entry point ``name`` (see :class:`LazyEntry`)."""
        slot = self._bound.get(("entry", name))
        if slot is None:
            slot = f"_k{len(self.globals)}"
            self.globals[slot] = None  # a LazyEntry of the namespace the code runs in
            self._bound[("entry", name)] = slot
            self.entries[slot] = name
        return slot

    def statements(self, instruction: Instruction, out: str) -> List[str]:
        """The lines that compute the instruction's node into ``out``."""
        node = instruction.node
        target = node.target
        args = [self.expr(a) for a in node.args] + [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()]
        if instruction.kind == "get_attr":
            return [f"{out} = {self.bind(Attribute(node.target), 'a')}(_gm)"]
        if target is operator.getitem and len(node.args) == 2 and not node.kwargs:
            return [f"{out} = {args[0]}[{args[1]}]"]
        direct = instruction.direct
        if direct is not None and direct.python:
            if not direct.permutation.row_major:  # the permutations around the call: a function of its own
                return [f"{out} = {self.bind(direct.function(target), 'd')}({', '.join(args)})"]
            values = [args[where] if kind == "arg" else self.expr(node.kwargs[where]) if kind == "kwarg"
                      else self.expr(where) for kind, where in direct.picks]
            if direct.out_dtype is not None:
                values.append(self.expr(direct.out_dtype))
            fallback = binding(target) if direct.fallback == "binding" else target._op
            return [  # a declined form (None) or a failure runs the op's own path, which raises its own error
                "try:",
                f"    {out} = {self.entry(direct.entry)}({', '.join(values)})",
                "except Exception:",
                f"    {out} = None",
                f"if {out} is None:",
                f"    {out} = {self.bind(fallback, 'b' if direct.fallback == 'binding' else 'op')}({', '.join(args)})",
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
    :func:`.lowering.traced_facts`, where its nodes carry no traced values (a graph loaded from the cache); ``code``: the
    :func:`compiled_code` stored with it, used when the generated text is the one it was compiled from."""
    try:
        return generate(lower(gm, facts), code)
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


def generate(program: Program, stored: Optional[CompiledCode] = None) -> Callable[..., Any]:
    """The runner generated from ``program`` (the graph's own forward where the program says Python cannot run
    it as straight-line code); ``stored``: as :func:`runner`'s ``code``."""
    gm = program.gm
    if program.python_reason is not None:
        log.debug("straight-line code not generated (%s); the graph's forward runs", program.python_reason)
        return gm.forward
    source = _Source(gm)
    params: List[str] = []
    for index, node in enumerate(gm.graph.nodes):
        source.names[node] = f"v{index}"
    for node in program.params:
        params.append(source.names[node])
    body: List[str] = []
    for instruction in program.instructions:
        if instruction.kind not in ("get_attr", "call", "arithmetic", "getitem", "python"):
            raise ValueError(f"an instruction of kind {instruction.kind!r}")
        name = source.names[instruction.node]
        body.extend(source.statements(instruction, name))
        if instruction.frees:
            body.append(" = ".join(source.names[value] for value in instruction.frees) + " = None")
    body.append(f"return {source.expr(program.output)}")
    # while a profiler records, the graph's own forward runs, so that it sees every op through the dispatcher
    body.insert(0, f"if _profiling(): return _gm.forward({', '.join(params)})")
    code = "def forward(" + ", ".join(params) + "):\n" + "".join(f"    {line}\n" for line in body)
    namespace = dict(source.globals, _profiling=_profiling)
    for slot, entry_name in source.entries.items():
        namespace[slot] = LazyEntry(entry_name, namespace, slot)
    digest = hashlib.sha256(code.encode()).hexdigest()
    module_code = _module_code(code, digest, stored, f"<mindiesd runner {id(gm):x}>")
    exec(module_code, namespace)  # noqa: S102  (generated here, or stored from the same text)
    forward = namespace["forward"]
    forward.source = code  # type: ignore[attr-defined]
    forward.digest, forward.module_code = digest, module_code  # type: ignore[attr-defined]
    forward.direct_ops = program.direct_calls  # type: ignore[attr-defined]
    return forward


class Attribute:
    """Reads ``gm.<dotted target>`` each call (a graph's attribute may be replaced after compilation)."""

    __slots__ = ("path",)

    def __init__(self, target: str):
        self.path = target.split(".")

    def __call__(self, gm: GraphModule) -> Any:
        value: Any = gm
        for part in self.path:
            value = getattr(value, part)
        return value
