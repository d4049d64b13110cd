"""A fused graph run from C++: one call from Python per forward instead of one per op.

The generated runner of :mod:`.codegen` calls each op through its Python binding: about 0.6 us of argument
parsing and result wrapping per call (a ``view`` costs 0.8 us from Python, 0.2 us from C++), the most of a
forward's host time once the ops are fused. Here the graph becomes a list of instructions for the ``Program``
of ``_cpp/executor.cpp``: per node the operator's handle, where each schema argument comes from (a value slot,
a list of slots, a constant converted once to the schema's type), the slots of its returns and the slots released
after it. A run calls every operator through the dispatcher's boxed entry, which reaches the same kernels as the
Python call, and a fused op with a C++ CPU kernel through that kernel's entry point, as the generated runner does.

The executor runs a graph only where every node is an operator overload, a ``getitem`` of one's returns, a
placeholder, a ``get_attr`` (read each call, as the graph's forward does) or Python arithmetic on the graph's
symbolic sizes (:data:`_ARITHMETIC`, computed in C++ with Python's semantics), and the output is a tuple or list
of values: a higher-order op or any other Python callable keeps the generated runner. Symbolic ints and floats
arrive as numbers; int lists partly computed from them are filled per call. It needs the C++ kernels' extension module, loaded on the first call (never
while a graph is traced); without it, or where a program cannot be built, the generated runner runs. While a
profiler records, the generated runner runs too (and with it the graph's own forward), so that the profile sees
every op. ``MINDIESD_EXECUTOR=0`` keeps the generated runner everywhere.

Views and ``out=`` writes run below the autograd and view-tracking layers only while grad mode is off and where
every write in place of the graph goes into a buffer the graph allocates itself (:func:`_writes_own_buffers`):
nothing outside the forward can observe the version counters or view links that layer would keep, except where
an output is a view. The views that reach an output (:func:`_output_views`) therefore run above that layer, so
outputs keep eager's view relation with each other and with the inputs (``_base``, one version counter, autograd's
check of an in-place write to a saved tensor).
"""

from __future__ import annotations

import logging
import operator
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.fx import GraphModule, Node

from ..fx_utils import ALLOCATIONS, is_number

log = logging.getLogger("mindiesd.compilation")

__all__ = ["ENV", "VIEW_GEOMETRIES_ENV", "BoundCall", "enabled", "CppRunner", "instructions", "runner", "view_geometries"]

#: ``MINDIESD_EXECUTOR=0``: every graph runs through the generated Python runner.
ENV = "MINDIESD_EXECUTOR"
#: ``MINDIESD_VIEW_GEOMETRIES=N``: per view op, the input geometries (sizes) whose views a program memoises
#: (default :data:`DEFAULT_VIEW_GEOMETRIES`; 0: none, every view op is called).
VIEW_GEOMETRIES_ENV = "MINDIESD_VIEW_GEOMETRIES"
DEFAULT_VIEW_GEOMETRIES = 8

aten = torch.ops.aten
_profiling = torch._C._autograd._profiler_enabled

#: Ops whose result is a view of their first argument: the walk from a written value to the buffer it is part of.
_VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.slice.Tensor, aten.select.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.as_strided.default, aten.t.default, aten.transpose.int, aten.expand.default, aten.narrow.default,
    aten.unbind.int,
})


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def runner(gm: GraphModule, facts: Optional[Mapping[str, Any]] = None, code: Any = None) -> Callable[..., Any]:
    """What runs ``gm``: the generated runner of :func:`.python_runner.runner` (same arguments), through the executor
    where it is on (an :class:`CppRunner` whose fallback is that runner; its attributes are the runner's)."""
    from . import python_runner

    facts = python_runner.traced_facts(gm) if facts is None else facts
    generated = python_runner.runner(gm, facts, code)
    if generated == gm.forward or not enabled():
        return generated
    return CppRunner(gm, facts, generated)


def view_geometries() -> int:
    """How many input geometries each view op of a program built now memoises (``MINDIESD_VIEW_GEOMETRIES``);
    ValueError naming the variable for a value that is not a non-negative integer."""
    text = os.environ.get(VIEW_GEOMETRIES_ENV, "").strip()
    if not text:
        return DEFAULT_VIEW_GEOMETRIES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{VIEW_GEOMETRIES_ENV}={text!r}: expected a non-negative integer (the input sizes whose "
                         f"views each view op keeps; default {DEFAULT_VIEW_GEOMETRIES}, 0 for none)")
    return value


class _Unsupported(Exception):
    """A graph the executor does not run (the generated runner does)."""


def _root(value: Any) -> Any:
    while isinstance(value, Node) and value.op == "call_function" and \
            (value.target in _VIEWS or value.target is operator.getitem):
        value = value.args[0]
    return value


def _writes_own_buffers(nodes: List[Node]) -> bool:
    """Whether every argument an op of the graph writes in place is (a view of) a buffer the graph allocates."""
    for node in nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        if not schema.is_mutable:
            continue
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            written = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            root = _root(written)
            if not (isinstance(root, Node) and root.op == "call_function" and root.target in ALLOCATIONS):
                return False
    return True


_TENSOR_TYPES = frozenset({"Tensor", "Optional[Tensor]", "Tensor?"})
_INT_LISTS = frozenset({"List[int]", "int[]", "SymInt[]", "List[SymInt]", "Optional[List[int]]"})

#: The instruction name of a Python operator on numbers (``_cpp/executor.cpp`` computes it, named by overload).
_ARITHMETIC_OP = "mindiesd::arithmetic"

#: Python's operators on sizes that the executor computes, by the name the C++ side knows them by.
_ARITHMETIC: Dict[Any, str] = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.floordiv: "floordiv",
    operator.mod: "mod", operator.truediv: "truediv", operator.neg: "neg", operator.pow: "pow",
    torch.sym_max: "max", torch.sym_min: "min", torch.sym_float: "float", torch.sym_int: "int", torch.sym_sum: "sum",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
    operator.ge: "ge",
}




def _output_views(output: Node) -> List[Node]:
    """The view ops whose results reach a graph output through views only. They run above the view-tracking
    layer, so that an output keeps eager's view relation (``_base``, a shared version counter) with the tensor
    it views: another output, an input or an intermediate two outputs view."""
    found: List[Node] = []
    values = output.args[0] if output.op == "output" and isinstance(output.args[0], (list, tuple)) else ()
    for value in values:
        while isinstance(value, Node) and value.op == "call_function" and \
                (value.target in _VIEWS or value.target is operator.getitem):
            if value.target is not operator.getitem and value not in found:
                found.append(value)
            value = value.args[0]
    return found


def _list_kind(type_text: str) -> Optional[str]:
    if type_text in ("List[Tensor]", "Tensor[]"):
        return "tensors"
    if type_text in ("List[Optional[Tensor]]", "Tensor?[]", "List[Tensor?]"):
        return "optional_tensors"
    return None


_SCHEMAS: Dict[Any, tuple] = {}


def _schema_of(target: Any) -> tuple:
    """(name, overload, [(argument, type text, has a default)], argument names, return type texts) of an operator
    overload, read once per overload."""
    found = _SCHEMAS.get(target)
    if found is None:
        schema = target._schema
        arguments = tuple((a.name, str(a.type), a.has_default_value()) for a in schema.arguments)
        found = (schema.name, schema.overload_name or "", arguments, frozenset(a[0] for a in arguments),
                 tuple(str(r.type) for r in schema.returns))
        _SCHEMAS[target] = found
    return found


Instruction = Tuple[str, str, List[Tuple[str, Any]], List[int], List[Tuple[int, int]], List[int], Optional[tuple],
                    bool]


class _Builder:
    def __init__(self, gm: GraphModule, facts: Mapping[str, Any]):
        self.gm, self.facts = gm, facts
        self.slot: Dict[Node, int] = {}  # a node's single value
        self.returns: Dict[Node, List[int]] = {}  # a node with several returns: slot per return (-1 unread)
        self.elements: Dict[Node, Dict[int, int]] = {}  # a node returning a list: slot per element read
        self.instructions: List[list] = []
        self.at: Dict[Node, int] = {}  # node -> index of its instruction
        self.count = 0

    def new(self) -> int:
        self.count += 1
        return self.count - 1

    def encode(self, value: Any, type_text: str) -> Tuple[str, Any]:
        if isinstance(value, Node):
            if value not in self.slot:
                raise _Unsupported(f"{value.name} is not one value")
            if type_text in _TENSOR_TYPES and is_number(value):
                return ("scalar", self.slot[value])  # a symbolic number where a tensor goes: wrapped per call
            return ("slot", self.slot[value])
        if isinstance(value, (list, tuple)) and any(isinstance(v, Node) for v in value):
            if type_text in _INT_LISTS:
                items = []
                for item in value:
                    if isinstance(item, Node) and item in self.slot and is_number(item):
                        items.append((True, self.slot[item]))
                    elif type(item) is int:
                        items.append((False, item))
                    else:
                        raise _Unsupported(f"a {type_text} element {item!r}")
                return ("ints", items)
            kind = _list_kind(type_text)
            if kind is None:
                raise _Unsupported(f"a list of values for {type_text}")
            slots = []
            for item in value:
                if item is None and kind == "optional_tensors":
                    slots.append(-1)
                elif isinstance(item, Node) and item in self.slot:
                    slots.append(self.slot[item])
                else:
                    raise _Unsupported("a list mixing values and constants")
            return (kind, slots)
        if type_text in _TENSOR_TYPES and type(value) in (bool, int, float):
            return ("number", value)
        return ("const", value)

    def operator(self, node: Node) -> None:
        target = node.target
        name, overload, arguments, names, returns = _schema_of(target)
        if len(node.args) > len(arguments) or any(k not in names for k in node.kwargs):
            raise _Unsupported(f"arguments of {target} beyond its schema")
        args: List[Tuple[str, Any]] = []
        for index, (argument, type_text, has_default) in enumerate(arguments):
            if index < len(node.args):
                args.append(self.encode(node.args[index], type_text))
            elif argument in node.kwargs:
                args.append(self.encode(node.kwargs[argument], type_text))
            elif has_default:
                args.append(("default", None))
            else:
                raise _Unsupported(f"{target}: no value for {argument}")
        getitems = [user for user in node.users if user.target is operator.getitem]
        others = [user for user in node.users if user.target is not operator.getitem]
        outs = [-1] * len(returns)
        if len(returns) == 1 and _list_kind(returns[0]) is not None:
            if others:
                outs[0] = self.slot[node] = self.new()
            self.elements[node] = {}
        elif len(returns) == 1:
            if node.users:
                outs[0] = self.slot[node] = self.new()
        else:
            if others:
                raise _Unsupported(f"the returns of {target} used together")
            self.returns[node] = outs
        if getitems and node not in self.elements and node not in self.returns:
            raise _Unsupported(f"getitem of the one return of {target}")
        self.at[node] = len(self.instructions)
        self.instructions.append([name, overload, args, outs, [], [], self.direct(node), False])

    def arithmetic(self, node: Node) -> None:
        """A Python operator on the graph's sizes (``SymInt``/``SymFloat`` values, numbers): one instruction that
        computes it in C++ with Python's semantics."""
        name = _ARITHMETIC.get(node.target)
        values = node.args[0] if name == "sum" and len(node.args) == 1 else node.args
        if name is None or node.kwargs or not isinstance(values, (list, tuple)) or not values or \
                name != "sum" and len(values) > 2:
            raise _Unsupported(f"the callable {node.target}")
        args = []
        for value in values:
            if isinstance(value, Node):
                if value not in self.slot or not is_number(value):
                    raise _Unsupported(f"{node.target} of {value.name}")
                args.append(("slot", self.slot[value]))
            elif type(value) in (bool, int, float):
                args.append(("const", value))
            else:
                raise _Unsupported(f"{node.target} of {value!r}")
        self.slot[node] = self.new()
        self.at[node] = len(self.instructions)
        self.instructions.append([_ARITHMETIC_OP, name, args, [self.slot[node]], [], [], None, False])

    def getitem(self, node: Node) -> None:
        source, index = node.args if len(node.args) == 2 and not node.kwargs else (None, None)
        if type(index) is not int or not isinstance(source, Node) or index < 0:
            raise _Unsupported("a getitem the executor does not read")
        if source in self.returns:
            outs = self.returns[source]
            if index >= len(outs):
                raise _Unsupported("getitem beyond the returns")
            if outs[index] < 0:
                outs[index] = self.new()
            self.slot[node] = outs[index]
        elif source in self.elements:
            elements = self.elements[source]
            if index not in elements:
                elements[index] = self.new()
                self.instructions[self.at[source]][4].append((index, elements[index]))
            self.slot[node] = elements[index]
        else:
            raise _Unsupported(f"getitem of {source}")

    def direct(self, node: Node) -> Optional[tuple]:
        """(entry, args, out_dtype, order, moved) of the straight call of a fused op's C++ entry, or None."""
        from . import python_runner

        target = node.target
        if target is aten.linear.out:  # the entry declines what is not 2-D CPU rows into a contiguous buffer
            if not 2 <= len(node.args) <= 3 or set(node.kwargs) - {"bias", "out"} or "out" not in node.kwargs \
                    or not python_runner._cpp_enabled():
                return None
            arguments = target._schema.arguments
            values = [self.encode(a, str(arguments[i].type)) for i, a in enumerate(node.args)]
            if len(values) < 3:
                values.append(self.encode(node.kwargs["bias"], str(arguments[2].type)) if "bias" in node.kwargs
                              else ("const", None))
            return ("linear_out", values + [self.encode(node.kwargs["out"], str(arguments[3].type))], None, None, [])
        fact = self.facts.get(node.name)
        if fact is None:
            return None
        if target is aten.linear.default:
            if node.kwargs or not 2 <= len(node.args) <= 3 or not python_runner._cpp_enabled():
                return None
            arguments = target._schema.arguments
            values = [self.encode(a, str(arguments[i].type)) for i, a in enumerate(node.args)]
            return ("linear", values + [("const", None)] * (3 - len(values)), None, None, [])
        plan = python_runner._direct_plan(node, fact)
        if plan is None:
            return None
        from mindiesd.ops import layout

        arguments = target._schema.arguments
        values = []
        for position, (kind, where) in enumerate(plan.picks):
            type_text = str(arguments[position].type)
            if kind == "arg":
                values.append(self.encode(node.args[where], type_text))
            elif kind == "kwarg":
                values.append(self.encode(node.kwargs[where], type_text))
            else:
                values.append(("const", where))
        moved: List[int] = []
        if plan.order is not None:
            name = plan.name
            every = set(layout._TABLE_ARGS[name]) | ({0} if name in layout.ROW_OPS else set())
            moved = sorted(i for i in every if i < len(plan.picks))
        return (plan.name, values, plan.out_dtype, list(plan.order) if plan.order is not None else None, moved)


def _take(args: List[Tuple[str, Any]], slot: int) -> None:
    """Marks the read of ``slot`` in a boxed call's ``args`` as its last (the value moves into the call) where it is
    the call's only read of it."""
    reads = [i for i, (kind, value) in enumerate(args) if kind == "slot" and value == slot]
    in_lists = any(kind in ("tensors", "optional_tensors") and slot in value for kind, value in args)
    if len(reads) == 1 and not in_lists:
        args[reads[0]] = ("take", slot)


def instructions(gm: GraphModule, facts: Mapping[str, Any]) -> Optional[Tuple[int, List[int], list, List[int],
                                                                                 bool, bool, List[str]]]:
    """What the ``Program`` of ``gm`` is built from: (slot count, input slots, instructions, output slots, whether
    the output is a list, whether the ops may run below autograd, the ``get_attr`` targets read after the
    placeholders), or None where the executor does not run the graph (see the module doc)."""
    nodes = list(gm.graph.nodes)
    builder = _Builder(gm, facts)
    placeholders: List[int] = []
    attributes: List[Tuple[int, str]] = []
    outputs: Optional[List[int]] = None
    output_is_list = False
    try:
        for node in nodes:
            if node.op == "placeholder":
                if node.args or node.kwargs:
                    return None
                builder.slot[node] = builder.new()
                placeholders.append(builder.slot[node])
            elif node.op == "get_attr":
                builder.slot[node] = builder.new()
                attributes.append((builder.slot[node], node.target))
            elif node.op == "call_function" and node.target is operator.getitem:
                builder.getitem(node)
            elif node.op == "call_function" and type(node.target) is torch._ops.OpOverload:
                builder.operator(node)
            elif node.op == "call_function" and node.target in _ARITHMETIC:
                builder.arithmetic(node)
            elif node.op == "output":
                value = node.args[0]
                if not isinstance(value, (list, tuple)):
                    return None
                output_is_list = isinstance(value, list)
                outputs = []
                for item in value:
                    if item is None:
                        outputs.append(-1)
                    elif isinstance(item, Node) and item in builder.slot:
                        outputs.append(builder.slot[item])
                    else:
                        return None
            else:
                return None
    except _Unsupported as exc:
        log.debug("the executor does not run this graph: %s", exc)
        return None
    if outputs is None:
        return None
    kept = set(outputs)
    last: Dict[int, int] = {}
    for index, instruction in enumerate(builder.instructions):
        direct = instruction[6]
        for kind, value in instruction[2] + (direct[1] if direct else []):
            if kind in ("slot", "scalar"):
                last[value] = index
            elif kind in ("tensors", "optional_tensors"):
                for slot in value:
                    if slot >= 0:
                        last[slot] = index
            elif kind == "ints":
                for is_slot, item in value:
                    if is_slot:
                        last[item] = index
        for slot in instruction[3] + [slot for _, slot in instruction[4]]:  # a value nobody reads
            if slot >= 0:
                last.setdefault(slot, index)
    for slot, index in last.items():
        if slot not in kept:
            builder.instructions[index][5].append(slot)
            _take(builder.instructions[index][2], slot)
    for node in _output_views(nodes[-1]):
        builder.instructions[builder.at[node]][7] = True
    inputs = placeholders + [slot for slot, _ in attributes]
    return (builder.count, inputs, [tuple(i) for i in builder.instructions], outputs, output_is_list,
            _writes_own_buffers(nodes), [target for _, target in attributes])


class CppRunner:
    """The runner of a graph through the C++ executor, built on its first call; ``fallback`` (the generated runner)
    runs where the executor does not (see the module doc). Its attributes are the fallback's."""

    def __init__(self, gm: GraphModule, facts: Mapping[str, Any], fallback: Callable[..., Any]):
        self.gm, self.facts, self.fallback = gm, dict(facts), fallback
        self.program: Any = None  # None: not built yet; False: not run here
        self.attributes: List[Any] = []

    def __getattr__(self, name: str) -> Any:
        if name in ("gm", "facts", "fallback", "program", "attributes"):
            raise AttributeError(name)
        return getattr(self.fallback, name)

    def _build(self, args: Tuple[Any, ...] = ()) -> Any:
        from . import python_runner
        from mindiesd.ops.kernels import cpp_build

        self.program = False
        if not all(arg is None or isinstance(arg, (torch.Tensor, bool, int, float)) for arg in args):
            return False
        module = cpp_build._extension if cpp_build._resolved else cpp_build.extension()
        if module is None or not hasattr(module, "Program"):
            return False
        spec = instructions(self.gm, self.facts)
        if spec is None:
            return False
        count, inputs, program, outputs, output_is_list, below, attributes = spec
        memo = view_geometries()  # a wrong setting is an error, not a quiet fallback to the generated runner
        try:
            built = module.Program(count, inputs, list(program), outputs, output_is_list, below, memo)
        except Exception as exc:  # noqa: BLE001  (a constant or schema it cannot take: the generated runner)
            log.debug("executor program not built (%s: %s); the generated runner runs", type(exc).__name__, exc)
            return False
        self.attributes = [python_runner._Attribute(target) for target in attributes]
        self.program = built
        return built

    def __call__(self, *args: Any) -> Any:
        program = self.program
        if program is None:
            program = self._build(args)
        if program is False or _profiling():
            return self.fallback(*args)
        if self.attributes:
            args = (*args, *(attribute(self.gm) for attribute in self.attributes))
        return program.run(args)

    def bound(self, main_inputs: List[int], folded_for: Callable[[Tuple[Any, ...]], Tuple[Any, ...]]) -> "BoundCall":
        """The call on a frozen graph's original inputs (``FrozenGraph.bind``): the folded constants of these
        weights, then the arguments at ``main_inputs``, chosen in C++."""
        return BoundCall(self, list(main_inputs), folded_for, False)

    def inference(self) -> "BoundCall":
        """This call with grad mode off (what ``cache.inference_call`` makes of a runner), switched in C++."""
        return BoundCall(self, None, None, True)


class BoundCall:
    """An :class:`CppRunner` runner called on other inputs than its graph's: a frozen graph's original inputs
    (``selection``: the positions main reads, after the folded constants ``folded_for`` returns) and/or with grad
    mode off (``no_grad``). The program chooses the inputs and switches grad mode itself; where the executor does
    not run, the same call goes through Python."""

    def __init__(self, executed: CppRunner, selection: Optional[List[int]],
                 folded_for: Optional[Callable[[Tuple[Any, ...]], Tuple[Any, ...]]], no_grad: bool):
        self.executed, self.selection, self.folded_for, self.no_grad = executed, selection, folded_for, no_grad
        self.ready = False  # the program has this selection

    def inference(self) -> "BoundCall":
        return BoundCall(self.executed, self.selection, self.folded_for, True)

    def _slow(self, args: Tuple[Any, ...]) -> Any:
        if self.selection is not None:
            args = (*self.folded_for(args), *[args[i] for i in self.selection])
        if self.no_grad:
            with torch.no_grad():
                return self.executed(*args)
        return self.executed(*args)

    def __call__(self, *args: Any) -> Any:
        if not self.ready or _profiling():
            return self._first(args)
        if self.selection is None:
            return self.executed.program.run(args, self.no_grad)
        return self.executed.program.run_selected(self.folded_for(args), args, self.no_grad)

    def _first(self, args: Tuple[Any, ...]) -> Any:
        executed = self.executed
        result = self._slow(args)  # builds the program on the first call
        if executed.program is not False and not executed.attributes and not _profiling():
            if self.selection is not None:
                executed.program.selection = self.selection
            self.ready = True
        return result

    @property
    def runs_in_cpp(self) -> bool:
        """Whether calls run through the C++ executor (builds the program when it has not been built)."""
        executed = self.executed
        program = executed.program if executed.program is not None else executed._build()
        return program is not False
