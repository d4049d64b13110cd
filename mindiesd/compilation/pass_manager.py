"""Runs the enabled fusion passes in order, then the clean-up steps after them, timing each and logging the graph
before and after.

A family is run only where its op has a kernel that beats eager's op sequence on the graph's device (declared
with the op's kernels, or registered by the user), or is forced; elsewhere it is skipped and the reason
recorded (:func:`mindiesd.compilation.families.skip_reason`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Collection, Dict, Optional, Sequence, Set

from torch.fx import GraphModule, Node

from .families import FAMILIES, skip_reason
from .graph_log import GraphLog, graph_text
from .passes import PASSES

log = logging.getLogger("mindiesd.compilation")

__all__ = ["PassManager", "skip_reason"]


class PassManager:
    """The passes of ``families`` (names from :data:`PASSES`), run in :data:`PASSES` order, less those without a
    fast kernel on ``device_type`` (:attr:`skipped`); the families in ``force`` count as fast wherever they
    declare a kernel or rewrite."""

    def __init__(self, families: Sequence[str], device_type: Optional[str] = None, force: Collection[str] = ()):
        unknown = set(families) - set(PASSES)
        if unknown:
            raise ValueError(f"unknown fusion families {sorted(unknown)}; known: {list(PASSES)}")
        self.device_type = device_type
        #: Enabled families left unfused on this device, with the reason.
        self.skipped: Dict[str, str] = {}
        for name in families:
            reason = skip_reason(name, device_type, force)
            if reason is not None:
                self.skipped[name] = reason
        chosen = [PASSES[name]() for name in PASSES if name in families and name not in self.skipped]
        #: The passes of the ``lower`` stage (on the whole aten graph, first; :meth:`run_lower`).
        self.lower_passes = [p for p in chosen if FAMILIES[p.family].stage == "lower"]
        #: The passes of the ``freeze`` stage (on the aten graph before it is split; :meth:`run_freeze`).
        self.freeze_passes = [p for p in chosen if FAMILIES[p.family].stage == "freeze"]
        #: The passes of the ``fusion`` stage (on the main graph; :meth:`run`).
        self.passes = [p for p in chosen if FAMILIES[p.family].stage == "fusion"]

    def run_lower(self, gm: GraphModule, graph_log: GraphLog, *, inductor: bool = True,
                  training: bool = False) -> Dict[str, int]:
        """Apply the ``lower``-stage passes to the whole aten graph ``gm``, frozen or not; returns the rewrites per
        family. ``inductor``: whether a call may be handed to Inductor (the CPU and CUDA, inference graphs);
        ``training``: whether aot builds a training graph."""
        for lowering in self.lower_passes:
            lowering.inductor, lowering.device_type, lowering.training = inductor, self.device_type, training
        return self._apply(self.lower_passes, gm, graph_log)

    def run_freeze(self, gm: GraphModule, constant_inputs: Set[Node], graph_log: GraphLog) -> Dict[str, int]:
        """Apply the ``freeze``-stage passes to the whole aten graph ``gm`` (``constant_inputs``: the placeholders
        of the weights); returns the rewrites per family."""
        return self._apply(self.freeze_passes, gm, graph_log, constant_inputs)

    def run(self, gm: GraphModule, graph_log: GraphLog) -> Dict[str, int]:
        """Apply every ``fusion``-stage pass to ``gm`` in place; returns the fused-op count per family (per rule
        in :meth:`rule_hits`)."""
        return self._apply(self.passes, gm, graph_log)

    def _apply(self, passes: Sequence[Any], gm: GraphModule, graph_log: GraphLog, *extra: Any) -> Dict[str, int]:
        matches: Dict[str, int] = {}
        for fusion in passes:
            matches[fusion.family] = _logged(fusion.family, gm, graph_log, lambda: fusion(gm, *extra),
                                             "fused")
            for family, joined in getattr(fusion, "consumed", {}).items():  # ops a later pass joined into its own
                if family in matches:
                    matches[family] -= joined
        return matches

    @staticmethod
    def run_steps(steps: Sequence[Any], gm: GraphModule, graph_log: GraphLog) -> Dict[str, Any]:
        """Run the clean-up ``steps`` (:class:`~mindiesd.compilation.cleanup.CleanupStep`) on ``gm`` in order, as
        the passes are run: each timed, logged and in the graph log; returns what each changed, by name."""
        return {step.name: _logged(step.name, gm, graph_log, lambda: step.run(gm), "changed") for step in steps}

    def rule_hits(self) -> Dict[str, int]:
        """Rewrites per rule, as ``"family:rule"``, over the runs of this manager (rules that never fired left out)."""
        return {f"{fusion.family}:{rule}": n for fusion in self.lower_passes + self.freeze_passes + self.passes
                for rule, n in fusion.hits.items()}


def _logged(name: str, gm: GraphModule, graph_log: GraphLog, run: Callable[[], Any], verb: str) -> Any:
    """``run()``, timed, with the graph before and after at debug level and in the graph log."""
    debug = log.isEnabledFor(logging.DEBUG)
    before = graph_text(gm) if (debug or graph_log.enabled) else ""
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    if debug:
        log.debug("pass %s: %s %s in %.3f s\n--- before ---\n%s\n--- after ---\n%s",
                  name, result, verb, seconds, before, graph_text(gm))
    graph_log.pass_pair(name, before, gm)
    return result
