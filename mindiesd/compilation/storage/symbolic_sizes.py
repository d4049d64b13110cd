"""Symbolic sizes in the persistent cache: the key names each size by where Dynamo read it, and the shape guards a
compile adds are stored with the entry and added again where the entry is loaded.

A graph Dynamo traced with symbolic sizes (``dynamic=True``, or automatic dynamic after a second size) takes its
sizes as symbols (``s0``, ``s1``, …) of the frame's ``ShapeEnv``. What the backend makes of it is valid for every
size that satisfies the guards on those symbols: Dynamo's own (made before the backend runs, and checked by the
frame) and those the compile adds (a pass or aot evaluating a condition on a size: they go into the same
``ShapeEnv`` and from there into the frame's guards). A cache hit skips the compile, so it replays the second kind:
each stored guard is mapped onto this process's symbols, checked against the sizes at hand (an entry whose guards
these sizes fail is a miss: it would be wrong for them) and added to the ``ShapeEnv`` as the compile would have.

Symbols are named in the key and in stored guards by their source (``L['x'].size()[1]``), not by their number,
which depends on the order Dynamo met them in.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

import sympy
import torch

__all__ = ["SymbolicSizes"]

_NUMBERS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _symbolic_values(value: Any) -> Iterable[Any]:
    if isinstance(value, _NUMBERS):
        yield value
    elif isinstance(value, torch.Tensor):
        for size in (*value.shape, *value.stride(), value.storage_offset()):
            if isinstance(size, torch.SymInt):
                yield size


class SymbolicSizes:
    """The symbols of one graph's inputs, named by source; made with :meth:`of` before the compile, so that
    :meth:`added_guards` are the guards the compile added."""

    def __init__(self, shape_env: Any, traced: Sequence[Any]):
        self.shape_env = shape_env
        #: The inputs as Dynamo traced them (fake tensors with symbolic sizes; the backend gets real ones).
        self.traced = list(traced)
        #: The source name of every symbol the ShapeEnv has (those without a source have none here).
        self.names: Dict[sympy.Symbol, str] = {}
        for symbol, sources in shape_env.var_to_sources.items():
            if sources:
                name = sources[0].name
                self.names[symbol] = name() if callable(name) else name  # a method before torch 2.13
        self.guards_before = len(shape_env.guards)

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Optional["SymbolicSizes"]:
        """The symbolic sizes of the inputs of Dynamo's graph ``gm``, or None when every size is a number."""
        traced = [node.meta.get("example_value", node.meta.get("val"))
                  for node in gm.graph.nodes if node.op == "placeholder"]
        if len(traced) != len(example_inputs) or any(t is None for t in traced):
            traced = list(example_inputs)
        for value in traced:
            for size in _symbolic_values(value):
                return cls(size.node.shape_env, traced)
        return None

    # ------------------------------------------------------------------------------------------------ naming

    def _by_name(self, expr: sympy.Basic) -> Optional[sympy.Basic]:
        """``expr`` with its symbols replaced by symbols named after their sources; None when one has none."""
        mapping = {}
        for symbol in expr.free_symbols:
            name = self.names.get(symbol)
            if name is None:
                return None
            mapping[symbol] = sympy.Symbol(name, **symbol.assumptions0)
        return expr.xreplace(mapping)

    def text(self, value: Any) -> str:
        """How a size (a number, a ``SymInt`` …) reads in the key: its expression over source names."""
        if isinstance(value, _NUMBERS):
            expr = self._by_name(value.node.expr)
            return "?" if expr is None else str(expr)
        return str(value)

    def key_lines(self) -> List[str]:
        """What the key holds besides the inputs' sizes: the value range of each symbol and the guards Dynamo made
        so far, which decide what a pass can prove about the sizes without guarding."""
        lines = [f"range {name} {self.shape_env.var_to_range.get(symbol)}" for symbol, name in self.names.items()]
        for guard in self.shape_env.guards[:self.guards_before]:
            expr = self._by_name(guard.expr)
            lines.append(f"guard {'?' if expr is None else expr}")
        lines.append(f"sympy {sympy.__version__}")
        return sorted(lines)

    # ---------------------------------------------------------------------------------------------- guards

    def added_guards(self) -> Optional[List[sympy.Basic]]:
        """The guards the compile added, over source names (to store); None when one is on a size with no source
        (a size computed inside the graph), which a later process could not map."""
        stored = []
        for guard in self.shape_env.guards[self.guards_before:]:
            expr = self._by_name(guard.expr)
            if expr is None:
                return None
            stored.append(expr)
        return stored

    def _values(self) -> Dict[sympy.Symbol, Any]:
        """The sizes at hand (the hints of the symbols)."""
        values = getattr(self.shape_env, "backed_var_to_val", None)  # var_to_val before torch 2.13
        return values if values is not None else self.shape_env.var_to_val

    def replay(self, stored: Sequence[sympy.Basic]) -> bool:
        """Add the stored guards to this ShapeEnv, as the compile that stored them added them; False (and nothing
        added) when one of them names a size these inputs lack or is false for the sizes at hand."""
        symbols = {name: symbol for symbol, name in self.names.items()}
        mapped = []
        for expr in stored:
            mapping = {}
            for symbol in expr.free_symbols:
                own = symbols.get(symbol.name)
                if own is None:
                    return False
                mapping[symbol] = own
            guard = expr.xreplace(mapping)
            if not _holds(guard, self._values()):
                return False
            mapped.append(guard)
        for guard in mapped:
            self.shape_env.evaluate_expr(guard)
        return True


def _holds(expr: sympy.Basic, values: Dict[sympy.Symbol, Any]) -> bool:
    try:
        return bool(expr.xreplace(values))
    except TypeError:  # a relation sympy cannot decide at these values
        return False
