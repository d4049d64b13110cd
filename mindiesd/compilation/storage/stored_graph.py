"""FX graph modules as data, for the graph cache and the ahead-of-time artifacts.

``GraphModule`` pickles its generated code and, when unpickled, re-traces that code with a symbolic tracer to
rebuild the graph and then generates and compiles the code again: on a deep model's graphs (thousands of nodes)
that is most of a warm start. Here a graph is stored as

* its nodes: op, name, target (an operator by its qualified name), arguments with nodes as positions, and which
  nodes are numbers (sizes of a graph with symbolic shapes: :func:`is_number`; no other traced value is kept);
* the attributes its nodes read (``get_attr`` / ``call_module`` targets);
* its forward, generated and compiled when stored, as a marshalled code object (the key of every entry names
  the Python version, so the bytecode is only read by the interpreter that wrote it).

Loading execs the code object and gives a :class:`StoredGraphModule`: a ``GraphModule`` whose graph is rebuilt
from the nodes only when something reads ``.graph`` (a pass, a report, a test), so running a loaded graph costs
neither a trace nor code generation nor compilation. A graph with a code generator of its own (pytree inputs) is
rebuilt eagerly as a plain ``GraphModule``, as is one whose code reads a global that cannot be imported by name.
"""

from __future__ import annotations

import copy
import hashlib
import marshal
from typing import Any, Dict, List, Tuple

import torch
from torch.fx import Graph, GraphModule
from torch.fx.graph import CodeGen
from torch.fx.graph_module import _format_import_block
from torch.package import sys_importer

from ..fx_utils import is_number

__all__ = ["state_of", "graph_module", "placeholders", "is_number", "StoredGraphModule"]


class _Ref(int):
    """A node's position, where a stored node's arguments refer to it."""

    __slots__ = ()

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_Ref, (int(self),))


def _target_state(target: Any) -> Tuple[Any, ...]:
    if isinstance(target, torch._ops.OpOverload):  # not picklable: stored by name
        return ("op", target.namespace, target._opname, target._overloadname)
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, name = target._qualified_op_name.split("::")
        return ("packet", namespace, name)
    return ("value", target)


def _target(state: Tuple[Any, ...]) -> Any:
    kind, *rest = state
    if kind == "op":
        namespace, name, overload = rest
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    if kind == "packet":
        namespace, name = rest
        return getattr(getattr(torch.ops, namespace), name)
    if kind == "value":
        return rest[0]
    raise ValueError(f"unknown node target kind {kind!r}")


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _assign(owner: torch.nn.Module, target: str, value: Any) -> None:
    *path, leaf = target.split(".")
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, torch.nn.Module):
        owner.add_module(leaf, value)
    elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        owner.register_buffer(leaf, value)
    else:
        setattr(owner, leaf, value)


def state_of(gm: GraphModule) -> Dict[str, Any]:
    """``gm`` as plain, picklable data (see the module doc)."""
    if isinstance(gm, StoredGraphModule) and gm._stored_state is not None and "_built_graph" not in gm.__dict__:
        return gm._stored_state  # loaded and never opened: what was loaded is what it is
    graph = gm.graph
    index: Dict[torch.fx.Node, _Ref] = {}
    nodes = []
    for node in graph.nodes:
        args = torch.fx.node.map_arg(node.args, index.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, index.__getitem__)
        nodes.append((node.op, node.name, _target_state(node.target), args, kwargs))
        index[node] = _Ref(len(index))
    attributes = {node.target: _attribute(gm, node.target)
                  for node in graph.nodes if node.op in ("get_attr", "call_module")}
    state: Dict[str, Any] = {"nodes": nodes, "attributes": attributes,
                             "placeholders": sum(1 for node in graph.nodes if node.op == "placeholder"),
                             "numbers": [i for i, node in enumerate(graph.nodes) if is_number(node)]}
    if type(graph._codegen) is not CodeGen:
        state["codegen"] = graph._codegen
        return state
    python_code = graph.python_code(root_module="self")
    try:
        imports = _format_import_block(python_code.globals, sys_importer)
    except Exception:  # a global the code needs that cannot be imported by name: rebuilt (and generated) on load
        return state
    source = imports + python_code.src
    name = f"<mindiesd graph {hashlib.sha256(source.encode()).hexdigest()[:16]}>"
    state["source"] = python_code.src
    state["code"] = marshal.dumps(compile(source, name, "exec", dont_inherit=True))
    return state


def _rebuild(state: Dict[str, Any]) -> Graph:
    graph = Graph()
    if state.get("codegen") is not None:
        graph._codegen = state["codegen"]
    made: List[torch.fx.Node] = []

    def resolve(value: Any) -> Any:
        if type(value) is _Ref:
            return made[value]
        if isinstance(value, tuple):
            return tuple(resolve(v) for v in value)
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(resolve(value.start), resolve(value.stop), resolve(value.step))
        return value

    for op, name, target, args, kwargs in state["nodes"]:
        made.append(graph.create_node(op, _target(target), resolve(args), resolve(kwargs), name=name))
    for index in state.get("numbers", ()):
        made[index].meta["number"] = True
    return graph


def graph_module(state: Any) -> GraphModule:
    """The graph module ``state`` (from :func:`state_of`) describes; a ``GraphModule`` is returned as it is."""
    if isinstance(state, GraphModule):
        return state
    if not isinstance(state, dict) or "nodes" not in state:
        raise ValueError("not a stored graph")
    if "code" not in state:
        root = torch.nn.Module()
        for target, value in sorted(state["attributes"].items(), key=lambda item: item[0].count(".")):
            _assign(root, target, value)
        return GraphModule(root, _rebuild(state))
    return StoredGraphModule(state)


def placeholders(gm: GraphModule) -> int:
    """How many inputs ``gm`` takes (without rebuilding a loaded graph)."""
    if isinstance(gm, StoredGraphModule) and "_built_graph" not in gm.__dict__:
        return gm._stored_state["placeholders"]
    return sum(1 for node in gm.graph.nodes if node.op == "placeholder")


class StoredGraphModule(GraphModule):
    """A loaded graph module: its forward is the stored code; its graph is rebuilt from the stored nodes the
    first time it is read. Assigning a graph regenerates the code as for any ``GraphModule``."""

    def __init__(self, state: Dict[str, Any]) -> None:
        torch.nn.Module.__init__(self)
        self.__class__.__name__ = "GraphModule"
        for target, value in sorted(state["attributes"].items(), key=lambda item: item[0].count(".")):
            _assign(self, target, value)
        self._stored_state = state
        self._code = state["source"]
        self._tracer_cls = None
        self._tracer_extras = {}
        self.meta = {}
        self._replace_hooks, self._create_node_hooks, self._erase_node_hooks, self._deepcopy_hooks = [], [], [], []
        self.shape_env = None
        namespace: Dict[str, Any] = {}
        exec(marshal.loads(state["code"]), namespace)  # noqa: S102  (code this library generated and stored)
        type(self).forward = namespace["forward"]

    @property  # type: ignore[override]
    def _graph(self) -> Graph:
        graph = self.__dict__.get("_built_graph")
        if graph is None:
            graph = _rebuild(self._stored_state)
            graph.owning_module = self
            self.__dict__["_built_graph"] = graph
        return graph

    @_graph.setter
    def _graph(self, graph: Graph) -> None:
        self.__dict__["_built_graph"] = graph

    def _plain(self) -> GraphModule:
        graph = Graph()
        graph.output(graph.graph_copy(self.graph, {}))
        return GraphModule(self, graph)

    def __deepcopy__(self, memo: Dict[int, Any]) -> GraphModule:
        return copy.deepcopy(self._plain(), memo)

    def __reduce__(self) -> Tuple[Any, ...]:
        return self._plain().__reduce__()
