"""One lowering of a fused graph into the program both runners run.

A fused graph is lowered once, here, into a :class:`Program`: one :class:`Instruction` per node, with the slot of
its value, where each schema argument comes from (an :class:`Operand`), the values released after it (last uses),
whether it is a view that reaches an output, and the straight call of a fused op's C++ entry point
(:class:`DirectCall`: the entry, the arguments it takes, the resolved output dtype and the layout
:class:`~mindiesd.ops.layout.Permutation` around it). The two runners read that program and work nothing out for
themselves:

* the C++ executor (:mod:`.executor`, ``ops/_cpp/executor.cpp``) loads :attr:`Program.cpp_instructions`, reading
  each field by name, where :attr:`Program.cpp_reason` is None;
* the generated Python runner (:mod:`.python_runner`) emits one statement per instruction: what must run in
  Python (higher-order ops and other callables, a profiler, ``MINDIESD_EXECUTOR=0``) runs the same program.

Liveness is node by node (a value is released after the last node that reads it, or after itself where nothing
reads it); the executor's slots are released after the last of its instructions at or before that node.
"""

from __future__ import annotations

import bisect
import inspect
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.fx import GraphModule, Node

from ...ops.layout import ROW_MAJOR, Permutation, call_plan
from ..fx_utils import ALLOCATIONS, is_number, known_row_major

log = logging.getLogger("mindiesd.compilation")

__all__ = ["Fact", "traced_facts", "Operand", "DirectCall", "direct_call", "Instruction", "Program", "lower",
           "LazyEntry", "cpp_enabled", "ARITHMETIC", "VIEW_OPS"]

aten = torch.ops.aten
_profiling = torch._C._autograd._profiler_enabled

#: What the straight call of a fused op needs to know from the trace: its output dtype, and the order of the
#: output's dimensions in memory when it is not row-major (None when it is).
Fact = Tuple[torch.dtype, Optional[Tuple[int, ...]]]

#: Ops whose result is a view of their first argument: the walk from a written value to the buffer it is part of,
#: and from an output to the views that reach it.
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.slice.Tensor, aten.select.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.as_strided.default, aten.t.default, aten.transpose.int, aten.expand.default, aten.narrow.default,
    aten.unbind.int,
})

#: Python's operators on sizes that the executor computes, by the name the C++ side knows them by.
ARITHMETIC: Dict[Any, str] = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.floordiv: "floordiv",
    operator.mod: "mod", operator.truediv: "truediv", operator.neg: "neg", operator.pow: "pow",
    torch.sym_max: "max", torch.sym_min: "min", torch.sym_float: "float", torch.sym_int: "int", torch.sym_sum: "sum",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
    operator.ge: "ge",
}

#: The instruction name of a Python operator on numbers (``_cpp/executor.cpp`` computes it, named by overload).
ARITHMETIC_OP = "mindiesd::arithmetic"


# ---------------------------------------------------------------------------------------------- traced facts


def _static(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and all(type(s) is int for s in (*value.shape, *value.stride()))


def traced_facts(gm: GraphModule) -> Dict[str, Fact]:
    """The fused-op nodes of ``gm`` (by name) whose traced values allow the straight call: static shapes, a CPU
    output in a layout the kernel gives without a copy; and the linear layers on the CPU (the C++ entry of
    ``_cpp/linear.cpp``). Stored with a cached graph, whose loaded nodes carry no traced values."""
    facts: Dict[str, Fact] = {}
    for node in gm.graph.nodes:
        target = node.target
        if target is aten.linear.default:
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
            plan = call_plan(target._opname, out.shape, out.stride())
            if plan is None or not plan.exact:
                continue
            facts[node.name] = (out.dtype, plan.order or None)
        elif known_row_major(out):  # symbolic sizes: row-major at every size the graph serves
            facts[node.name] = (out.dtype, None)
    return facts


# ---------------------------------------------------------------------------------------------- the program


@dataclass(frozen=True)
class Operand:
    """Where one argument comes from, as the executor reads it: ``slot`` (a value), ``take`` (a value read for
    the last time, moved into the call), ``scalar`` (a symbolic number where a tensor goes), ``const`` (a
    constant, converted once to the schema's type), ``number`` (a Python number where a tensor goes), ``ints``
    (an int list, ``value`` pairs of (is a slot, slot or int)), ``tensors``/``optional_tensors`` (slots, -1 for
    None), ``default`` (the schema's default)."""

    kind: str
    value: Any = None


@dataclass
class DirectCall:
    """The straight call of an op's C++ entry point ``entry``: the entry takes the schema's leading arguments
    (``picks``: ``("arg", i)``, ``("kwarg", name)`` or ``("const", value)`` each; ``operands``: the same for the
    executor), then ``out_dtype`` where it takes one; for an output that is not row-major, ``permutation``. Where
    the entry declines (returns None) or raises, ``fallback`` runs: the op's own boxed call (``"op"``), or for
    ``linear`` aten's Python binding (``"binding"``). ``python``: the Python runner calls it too (``linear.out``
    runs straight from C++ only)."""

    entry: str
    picks: Tuple[Tuple[str, Any], ...]
    out_dtype: Optional[torch.dtype] = None
    permutation: Permutation = ROW_MAJOR
    fallback: str = "op"
    python: bool = True
    operands: List[Operand] = field(default_factory=list)

    @property
    def order(self) -> Optional[List[int]]:
        return list(self.permutation.order) if not self.permutation.row_major else None

    @property
    def moved(self) -> List[int]:
        return [i for i in self.permutation.moved if i < len(self.picks)]

    def function(self, overload: Any) -> Callable[..., Any]:
        """The call as a Python function of the node's arguments: the entry with the arguments it takes and the
        permutation around it, ``overload`` itself where the entry declines or raises, or while a profiler
        records (so that the profile sees the op)."""
        entry, picks, permutation = LazyEntry(self.entry), self.picks, self.permutation
        tail = (self.out_dtype,) if self.out_dtype is not None else ()

        def kernel(*values: Any) -> Any:
            return entry(*values, *tail)

        def call(*args: Any, **kwargs: Any) -> Any:
            if not _profiling():
                values = [args[where] if kind == "arg" else kwargs[where] if kind == "kwarg" else where
                          for kind, where in picks]
                try:
                    result = permutation.call(kernel, values)
                except Exception:  # noqa: BLE001  (the op's own path runs it, or raises its own error)
                    result = None
                if result is not None:
                    return result
            return overload(*args, **kwargs)

        call.__name__ = call.__qualname__ = f"direct_{self.entry}"
        return call


def cpp_enabled() -> bool:
    from mindiesd.ops.kernels import cpp_build

    return cpp_build.enabled()


def direct_call(node: Node, fact: Optional[Fact]) -> Optional[DirectCall]:
    """The straight call of ``node`` on its C++ CPU kernel (``fact``: from :func:`traced_facts`), or None where
    this process runs it otherwise: an op without a C++ kernel, or with one the user registered in its place, an
    entry whose parameters are not the schema's leading arguments, a node without the traced facts."""
    target = node.target
    if target is aten.linear.out:  # the entry declines what is not 2-D CPU rows into a contiguous buffer
        if not 2 <= len(node.args) <= 3 or set(node.kwargs) - {"bias", "out"} or "out" not in node.kwargs \
                or not cpp_enabled():
            return None
        bias = ("arg", 2) if len(node.args) == 3 else ("kwarg", "bias") if "bias" in node.kwargs else ("const", None)
        return DirectCall("linear_out", (("arg", 0), ("arg", 1), bias, ("kwarg", "out")), python=False)
    if fact is None:
        return None
    out_dtype, order = fact
    if target is aten.linear.default:
        if node.kwargs or not 2 <= len(node.args) <= 3 or not cpp_enabled():
            return None
        bias = ("arg", 2) if len(node.args) == 3 else ("const", None)
        return DirectCall("linear", (("arg", 0), ("arg", 1), bias), fallback="binding")
    from mindiesd.ops import registry
    from mindiesd.ops.kernels import cpp

    name = target._opname
    kernel = cpp.KERNELS.get(name)
    if kernel is None or registry.DEVICE_KERNELS.get("cpu", {}).get(name) is not kernel:
        return None
    parameters = list(inspect.signature(kernel).parameters)
    takes_dtype = parameters[-1:] == ["out_dtype"]
    positional = parameters[:-1] if takes_dtype else parameters
    arguments = target._schema.arguments
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
    permutation = Permutation.of(name, order) if order is not None else ROW_MAJOR
    if not permutation.row_major and not all(kind == "arg" for kind, _ in picks):
        return None
    return DirectCall(name, tuple(picks), out_dtype if takes_dtype else None, permutation)


@dataclass
class Instruction:
    """One node of the graph. ``kind``: ``call`` (an operator overload), ``arithmetic`` (Python's operator on
    sizes, named in ``overload``), ``getitem``, ``get_attr`` or ``python`` (any other callable: the Python runner
    only). ``slot``: its value's slot (-1: none); ``outs``: the slots of a call's returns (-1 where unread);
    ``elements``: (index, slot) of the elements of a returned list that are read; ``frees``: the values released
    after it; ``slot_frees``: the slots the executor releases after it; ``tracked``: a view that reaches an
    output (it keeps eager's view relation); ``direct``: the straight call of a C++ entry."""

    node: Node
    kind: str
    slot: int = -1
    name: str = ""
    overload: str = ""
    operands: List[Operand] = field(default_factory=list)
    outs: List[int] = field(default_factory=list)
    elements: List[Tuple[int, int]] = field(default_factory=list)
    frees: List[Node] = field(default_factory=list)
    slot_frees: List[int] = field(default_factory=list)
    tracked: bool = False
    direct: Optional[DirectCall] = None


@dataclass
class Program:
    """A graph lowered once (see the module doc). ``params``: the placeholders, in order; ``attributes``: the
    ``get_attr`` targets, read each call after the arguments; ``output_slots``: the slot of each output (-1:
    None); ``below_autograd``: views and ``out=`` writes may run below the autograd layer with grad mode off;
    ``cpp_reason``/``python_reason``: why the executor / the Python runner does not run it (None: it does)."""

    gm: GraphModule
    instructions: List[Instruction]
    params: List[Node]
    attributes: List[str]
    slot_of: Dict[Node, int]
    slot_count: int
    output: Any
    output_slots: List[int]
    output_is_list: bool
    below_autograd: bool
    cpp_reason: Optional[str] = None
    python_reason: Optional[str] = None

    @property
    def inputs(self) -> List[int]:
        """The slots the executor fills from its arguments: the placeholders', then the attributes'."""
        return [self.slot_of[node] for node in self.params] + \
            [i.slot for i in self.instructions if i.kind == "get_attr"]

    @property
    def cpp_instructions(self) -> List[Instruction]:
        return [i for i in self.instructions if i.kind in ("call", "arithmetic")]

    @property
    def direct_calls(self) -> int:
        """How many nodes the Python runner calls straight on their C++ entry."""
        return sum(1 for i in self.instructions if i.direct is not None and i.direct.python)


class _NotInCpp(Exception):
    """What the executor does not run (the Python runner does)."""


_TENSOR_TYPES = frozenset({"Tensor", "Optional[Tensor]", "Tensor?"})
_INT_LISTS = frozenset({"List[int]", "int[]", "SymInt[]", "List[SymInt]", "Optional[List[int]]"})


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


class _Lowering:
    def __init__(self, gm: GraphModule, facts: Mapping[str, Fact]):
        self.gm, self.facts = gm, facts
        self.slot: Dict[Node, int] = {}  # a node's single value
        self.returns: Dict[Node, List[int]] = {}  # a node with several returns: slot per return (-1 unread)
        self.elements: Dict[Node, Instruction] = {}  # a node returning a list: its instruction
        self.count = 0
        self.cpp_reason: Optional[str] = None

    def new(self) -> int:
        self.count += 1
        return self.count - 1

    def not_in_cpp(self, reason: str) -> None:
        if self.cpp_reason is None:
            self.cpp_reason = reason

    def encode(self, value: Any, type_text: str) -> Operand:
        if isinstance(value, Node):
            if value not in self.slot:
                raise _NotInCpp(f"{value.name} is not one value")
            if type_text in _TENSOR_TYPES and is_number(value):
                return Operand("scalar", self.slot[value])  # a symbolic number where a tensor goes
            return Operand("slot", self.slot[value])
        if isinstance(value, (list, tuple)) and any(isinstance(v, Node) for v in value):
            if type_text in _INT_LISTS:
                items = []
                for item in value:
                    if isinstance(item, Node) and item in self.slot and is_number(item):
                        items.append((True, self.slot[item]))
                    elif type(item) is int:
                        items.append((False, item))
                    else:
                        raise _NotInCpp(f"a {type_text} element {item!r}")
                return Operand("ints", items)
            kind = _list_kind(type_text)
            if kind is None:
                raise _NotInCpp(f"a list of values for {type_text}")
            slots = []
            for item in value:
                if item is None and kind == "optional_tensors":
                    slots.append(-1)
                elif isinstance(item, Node) and item in self.slot:
                    slots.append(self.slot[item])
                else:
                    raise _NotInCpp("a list mixing values and constants")
            return Operand(kind, slots)
        if type_text in _TENSOR_TYPES and type(value) in (bool, int, float):
            return Operand("number", value)
        return Operand("const", value)

    def call(self, node: Node) -> Instruction:
        target = node.target
        name, overload, arguments, names, returns = _schema_of(target)
        instruction = Instruction(node, "call", name=name, overload=overload,
                                  direct=direct_call(node, self.facts.get(node.name)))
        getitems = [user for user in node.users if user.target is operator.getitem]
        others = [user for user in node.users if user.target is not operator.getitem]
        outs = [-1] * len(returns)
        if len(returns) == 1 and _list_kind(returns[0]) is not None:
            if others:
                outs[0] = self.slot[node] = self.new()
            self.elements[node] = instruction
        elif len(returns) == 1:
            if node.users:
                outs[0] = self.slot[node] = self.new()
        elif others:
            self.not_in_cpp(f"the returns of {target} used together")
        else:
            self.returns[node] = outs
        instruction.outs, instruction.slot = outs, self.slot.get(node, -1)
        try:
            if getitems and node not in self.elements and node not in self.returns:
                raise _NotInCpp(f"getitem of the one return of {target}")
            if len(node.args) > len(arguments) or any(k not in names for k in node.kwargs):
                raise _NotInCpp(f"arguments of {target} beyond its schema")
            for index, (argument, type_text, has_default) in enumerate(arguments):
                if index < len(node.args):
                    instruction.operands.append(self.encode(node.args[index], type_text))
                elif argument in node.kwargs:
                    instruction.operands.append(self.encode(node.kwargs[argument], type_text))
                elif has_default:
                    instruction.operands.append(Operand("default"))
                else:
                    raise _NotInCpp(f"{target}: no value for {argument}")
            direct = instruction.direct
            if direct is not None:
                direct.operands = [
                    self.encode(node.args[where] if kind == "arg" else node.kwargs[where],
                                arguments[position][1]) if kind != "const" else Operand("const", where)
                    for position, (kind, where) in enumerate(direct.picks)]
        except _NotInCpp as exc:
            self.not_in_cpp(str(exc))
        return instruction

    def arithmetic(self, node: Node) -> Instruction:
        """A Python operator on the graph's sizes: one instruction the executor computes with Python's semantics."""
        name = ARITHMETIC[node.target]
        instruction = Instruction(node, "arithmetic", name=ARITHMETIC_OP, overload=name)
        self.slot[node] = instruction.slot = self.new()
        instruction.outs = [instruction.slot]
        values = node.args[0] if name == "sum" and len(node.args) == 1 else node.args
        try:
            if node.kwargs or not isinstance(values, (list, tuple)) or not values or name != "sum" and len(values) > 2:
                raise _NotInCpp(f"the callable {node.target}")
            for value in values:
                if isinstance(value, Node):
                    if value not in self.slot or not is_number(value):
                        raise _NotInCpp(f"{node.target} of {value.name}")
                    instruction.operands.append(Operand("slot", self.slot[value]))
                elif type(value) in (bool, int, float):
                    instruction.operands.append(Operand("const", value))
                else:
                    raise _NotInCpp(f"{node.target} of {value!r}")
        except _NotInCpp as exc:
            self.not_in_cpp(str(exc))
        return instruction

    def getitem(self, node: Node) -> Instruction:
        instruction = Instruction(node, "getitem")
        source, index = node.args if len(node.args) == 2 and not node.kwargs else (None, None)
        if type(index) is not int or not isinstance(source, Node) or index < 0:
            self.not_in_cpp("a getitem the executor does not read")
        elif source in self.returns:
            outs = self.returns[source]
            if index >= len(outs):
                self.not_in_cpp("getitem beyond the returns")
            else:
                if outs[index] < 0:
                    outs[index] = self.new()
                self.slot[node] = instruction.slot = outs[index]
        elif source in self.elements:
            unpack = self.elements[source].elements
            slot = dict(unpack).get(index)
            if slot is None:
                slot = self.new()
                unpack.append((index, slot))
            self.slot[node] = instruction.slot = slot
        else:
            self.not_in_cpp(f"getitem of {source}")
        return instruction


def _root(value: Any) -> Any:
    while isinstance(value, Node) and value.op == "call_function" and \
            (value.target in VIEW_OPS or value.target is operator.getitem):
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


def _output_views(output: Node) -> List[Node]:
    """The view ops whose results reach a graph output through views only. They run above the view-tracking
    layer, so that an output keeps eager's view relation (``_base``, a shared version counter) with the tensor
    it views: another output, an input or an intermediate two outputs view."""
    found: List[Node] = []
    values = output.args[0] if output.op == "output" and isinstance(output.args[0], (list, tuple)) else ()
    for value in values:
        while isinstance(value, Node) and value.op == "call_function" and \
                (value.target in VIEW_OPS or value.target is operator.getitem):
            if value.target is not operator.getitem and value not in found:
                found.append(value)
            value = value.args[0]
    return found


def _release(program: Program) -> None:
    """The last uses: each instruction's ``frees`` (the values whose last reader it is, and its own value where
    nothing reads it), and the executor's ``slot_frees`` (a slot goes after the last of the executor's
    instructions at or before the latest release of the nodes that hold it; an output's never)."""
    position = {node: index for index, node in enumerate(program.gm.graph.nodes)}
    last_use: Dict[Node, Node] = {}
    for node in reversed(list(program.gm.graph.nodes)):
        for used in node.all_input_nodes:
            last_use.setdefault(used, node)
    by_node = {instruction.node: instruction for instruction in program.instructions}
    for value, user in last_use.items():
        if user in by_node:
            by_node[user].frees.append(value)
    for instruction in program.instructions:
        if not instruction.node.users:
            instruction.frees.append(instruction.node)
    if program.cpp_reason is not None:
        return
    released_at: Dict[int, int] = {}  # slot -> position of the last node that releases a node holding it
    for instruction in program.instructions:
        for value in instruction.frees:
            slot = program.slot_of.get(value, -1)
            if slot >= 0:
                released_at[slot] = max(released_at.get(slot, -1), position[instruction.node])
    kept = set(program.output_slots)
    cpp = program.cpp_instructions
    starts = [position[i.node] for i in cpp]
    for slot, at in released_at.items():
        if slot in kept:
            continue
        index = bisect.bisect_right(starts, at) - 1
        if index < 0:  # released before any instruction: an input nothing reads
            continue
        instruction = cpp[index]
        instruction.slot_frees.append(slot)
        operands = instruction.operands
        reads = [i for i, operand in enumerate(operands) if operand.kind == "slot" and operand.value == slot]
        in_lists = any(o.kind in ("tensors", "optional_tensors") and slot in o.value for o in operands)
        if instruction.kind == "call" and len(reads) == 1 and not in_lists:
            operands[reads[0]] = Operand("take", slot)  # the call's only read, its last: the value moves in


def lower(gm: GraphModule, facts: Optional[Mapping[str, Fact]] = None) -> Program:
    """The program of ``gm`` (``facts``: its :func:`traced_facts`, where its nodes carry no traced values)."""
    facts = traced_facts(gm) if facts is None else facts
    nodes = list(gm.graph.nodes)
    lowering = _Lowering(gm, facts)
    program = Program(gm, [], [], [], lowering.slot, 0, None, [], False, _writes_own_buffers(nodes))
    if type(gm.graph._codegen) is not torch.fx.graph.CodeGen:
        program.python_reason = "the graph has its own calling convention"
    for node in nodes:
        if node.op == "placeholder":
            if node.args or node.kwargs:
                program.python_reason = "a placeholder with a default value"
            lowering.slot[node] = lowering.new()
            program.params.append(node)
        elif node.op == "get_attr":
            lowering.slot[node] = lowering.new()
            program.instructions.append(Instruction(node, "get_attr", slot=lowering.slot[node]))
            program.attributes.append(node.target)
        elif node.op == "call_function" and node.target is operator.getitem:
            program.instructions.append(lowering.getitem(node))
        elif node.op == "call_function" and type(node.target) is torch._ops.OpOverload:
            program.instructions.append(lowering.call(node))
        elif node.op == "call_function" and node.target in ARITHMETIC:
            program.instructions.append(lowering.arithmetic(node))
        elif node.op == "call_function":
            lowering.not_in_cpp(f"the callable {node.target}")
            program.instructions.append(Instruction(node, "python"))
        elif node.op == "output":
            program.output = node.args[0]
            value = node.args[0]
            if not isinstance(value, (list, tuple)):
                lowering.not_in_cpp("an output that is not a tuple or list")
                break
            program.output_is_list = isinstance(value, list)
            for item in value:
                if item is None:
                    program.output_slots.append(-1)
                elif isinstance(item, Node) and item in lowering.slot:
                    program.output_slots.append(lowering.slot[item])
                else:
                    lowering.not_in_cpp("an output that is not one value")
            break
        else:
            program.python_reason = program.python_reason or f"a {node.op} node"
            lowering.not_in_cpp(f"a {node.op} node")
    program.slot_count, program.cpp_reason = lowering.count, lowering.cpp_reason
    if program.output is None and program.cpp_reason is None:
        program.cpp_reason = "no output"
    by_node = {instruction.node: instruction for instruction in program.instructions}
    for node in _output_views(nodes[-1]):
        if node in by_node:
            by_node[node].tracked = True
    _release(program)
    if program.cpp_reason is not None:
        log.debug("the executor does not run this graph: %s", program.cpp_reason)
    return program


class LazyEntry:
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
