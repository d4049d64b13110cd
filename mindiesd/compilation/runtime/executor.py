"""A fused graph run from C++: one call from Python per forward instead of one per op.

The generated runner of :mod:`.python_runner` calls each op through its Python binding: about 0.6 us of argument
parsing and result wrapping per call (a ``view`` costs 0.8 us from Python, 0.2 us from C++), the most of a
forward's host time once the ops are fused. Here the graph's lowered program (:mod:`.lowering`, the one the
generated runner is made from) is loaded by the ``Program`` of ``_cpp/executor.cpp``: per instruction the
operator, where each schema argument comes from (a value slot, a list of slots, a constant converted once to the
schema's type), the slots of its returns and the slots released after it. A run calls every operator through the dispatcher's boxed entry, which reaches the same kernels as the
Python call, and a fused op with a C++ CPU kernel through that kernel's entry point, as the generated runner does.

The executor runs a graph only where every node is an operator overload, a ``getitem`` of one's returns, a
placeholder, a ``get_attr`` (read each call, as the graph's forward does) or Python arithmetic on the graph's
symbolic sizes (:data:`.lowering.ARITHMETIC`, computed in C++ with Python's semantics), and the output is a tuple or list
of values: a higher-order op or any other Python callable keeps the generated runner. Symbolic ints and floats
arrive as numbers; int lists partly computed from them are filled per call. It needs the C++ kernels' extension module, loaded on the first call (never
while a graph is traced); without it, or where a program cannot be built, the generated runner runs. While a
profiler records, the generated runner runs too (and with it the graph's own forward), so that the profile sees
every op. ``MINDIESD_EXECUTOR=0`` keeps the generated runner everywhere.

Views and ``out=`` writes run below the autograd and view-tracking layers only while grad mode is off and where
every write in place of the graph goes into a buffer the graph allocates itself (the program's ``below_autograd``):
nothing outside the forward can observe the version counters or view links that layer would keep, except where
an output is a view. The views that reach an output (instructions marked ``tracked``) therefore run above that layer, so
outputs keep eager's view relation with each other and with the inputs (``_base``, one version counter, autograd's
check of an in-place write to a saved tensor).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch
from torch.fx import GraphModule

from .lowering import Fact, Program, lower
from .python_runner import Attribute, generate

log = logging.getLogger("mindiesd.compilation")

__all__ = ["ENV", "VIEW_GEOMETRIES_ENV", "BoundCall", "enabled", "CppRunner", "runner", "view_geometries"]

#: ``MINDIESD_EXECUTOR=0``: run every graph through the generated runner instead.
ENV = "MINDIESD_EXECUTOR"
#: ``MINDIESD_VIEW_GEOMETRIES=N``: per view op, the input geometries (sizes) whose views a program memoises
#: (default :data:`DEFAULT_VIEW_GEOMETRIES`; 0: none, every view op is called).
VIEW_GEOMETRIES_ENV = "MINDIESD_VIEW_GEOMETRIES"
DEFAULT_VIEW_GEOMETRIES = 8

_profiling = torch._C._autograd._profiler_enabled


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def runner(gm: GraphModule, facts: Optional[Mapping[str, Fact]] = None, code: Any = None) -> Callable[..., Any]:
    """What runs ``gm``: the graph lowered once (``facts``: as :func:`.lowering.lower` takes them), the runner
    generated from that program (``code``: as :func:`.python_runner.runner` takes it), run through the executor
    where it is on (a :class:`CppRunner` whose fallback is that runner; its attributes are the runner's)."""
    try:
        program = lower(gm, facts)
        generated = generate(program, code)
    except Exception as exc:  # noqa: BLE001  (the graph's own forward is always correct)
        log.debug("graph not lowered (%s: %s); the graph's forward runs", type(exc).__name__, exc)
        return gm.forward
    if generated == gm.forward or not enabled() or program.cpp_reason is not None:
        return generated
    return CppRunner(gm, program, generated)


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


class CppRunner:
    """The runner of a graph through the C++ executor, built on its first call from the graph's lowered
    ``program``; ``fallback`` (the runner generated from the same program) runs where the executor does not (see
    the module doc). Its attributes are the fallback's."""

    def __init__(self, gm: GraphModule, program: Program, fallback: Callable[..., Any]):
        self.gm, self.lowered, self.fallback = gm, program, fallback
        self.program: Any = None  # None: not built yet; False: not run here
        self.attributes: List[Any] = []

    def __getattr__(self, name: str) -> Any:
        if name in ("gm", "lowered", "fallback", "program", "attributes"):
            raise AttributeError(name)
        return getattr(self.fallback, name)

    def _build(self, args: Tuple[Any, ...] = ()) -> Any:
        from mindiesd.ops.kernels import cpp_build

        self.program = False
        if not all(arg is None or isinstance(arg, (torch.Tensor, bool, int, float)) for arg in args):
            return False
        lowered = self.lowered
        if lowered.cpp_reason is not None:
            return False
        module = cpp_build._extension if cpp_build._resolved else cpp_build.extension()
        if module is None or not hasattr(module, "Program"):
            return False
        memo = view_geometries()  # a wrong setting is an error, not a quiet fallback to the generated runner
        try:
            built = module.Program(lowered, memo)
        except Exception as exc:  # noqa: BLE001  (a constant or schema it cannot take: the generated runner)
            log.debug("executor program not built (%s: %s); the generated runner runs", type(exc).__name__, exc)
            return False
        self.attributes = [Attribute(target) for target in lowered.attributes]
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
