"""Runs the enabled fusion passes in order, timing each and logging the graph before and after.

A family is run only where its op has a kernel that beats eager's op sequence on the graph's device (declared
in :mod:`mindiesd.families`, or registered by the user); elsewhere it is skipped and the reason recorded.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Collection, Dict, Optional, Sequence, Set

from torch.fx import GraphModule, Node

from ..families import FAMILIES, Kernel, resolve
from .graph_log import GraphLog, graph_text
from .passes import PASSES

log = logging.getLogger("mindiesd.compilation")

__all__ = ["PassManager", "skip_reason"]


def skip_reason(family: str, device_type: Optional[str], force: Collection[str] = ()) -> Optional[str]:
    """Why ``family`` is not fused for a graph on ``device_type``, or None when it is.

    A fused op must not make the model slower: it needs a registered kernel on the device that is faster than
    eager's sequence (the declared kernel with ``fast=True``, or any kernel a user registered there). A family in
    ``force`` counts as faster wherever it has a kernel or rewrite (to measure it where it is declared slower).
    """
    _check_known(force)
    if device_type is None or device_type == "meta":
        return None
    from mindiesd.ops import _library

    declared = FAMILIES[family].kernels.get(device_type)
    if not FAMILIES[family].has_op:  # a rewrite into aten ops: its declaration says whether it gains there
        if declared is None:
            return f"no {family} rewrite declared for {device_type}"
        if declared.fast or family in force:
            return None
        return f"on {device_type}, {declared.note or 'not faster than eager'}"
    registered = _library.DEVICE_KERNELS.get(device_type, {}).get(family)
    if registered is None:
        if declared is None:
            return f"no {family} kernel for {device_type} (the reference composition is not faster than eager)"
        return f"the {device_type} kernel ({declared.note or declared.target}) is not registered: its runtime is missing"
    if declared is not None and not declared.fast and family not in force and _is_declared(registered, declared):
        return f"the {device_type} kernel is {declared.note or 'not faster than eager'}"
    return None


def _check_known(force: Collection[str]) -> None:
    unknown = set(force) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown fusion families to force {sorted(unknown)}; known: {list(FAMILIES)}")


def _is_declared(registered: Callable[..., Any], declared: Kernel) -> bool:
    """Whether the registered kernel is the declared one (not one a user registered in its place)."""
    for target in (declared.target, declared.native):
        if not target:
            continue
        try:
            kernel = resolve(target)
        except (ImportError, AttributeError):
            continue
        if registered is kernel or getattr(registered, "__wrapped__", None) is kernel:
            return True
    return False


class PassManager:
    """The passes of ``families`` (names from :data:`PASSES`), run in :data:`PASSES` order, less those without a
    fast kernel on ``device_type`` (:attr:`skipped`; ``force``: the families counted as fast, :func:`skip_reason`)."""

    def __init__(self, families: Sequence[str], device_type: Optional[str] = None, force: Collection[str] = ()):
        unknown = set(families) - set(PASSES)
        if unknown:
            raise ValueError(f"unknown fusion families {sorted(unknown)}; known: {list(PASSES)}")
        _check_known(force)
        #: Enabled families left unfused on this device, with the reason.
        self.skipped: Dict[str, str] = {}
        for name in families:
            reason = skip_reason(name, device_type, force)
            if reason is not None:
                self.skipped[name] = reason
        chosen = [PASSES[name]() for name in PASSES if name in families and name not in self.skipped]
        #: The passes of the ``freeze`` stage (on the aten graph before it is split; :meth:`run_freeze`).
        self.freeze_passes = [p for p in chosen if FAMILIES[p.family].stage == "freeze"]
        #: The passes of the ``fusion`` stage (on the main graph; :meth:`run`).
        self.passes = [p for p in chosen if FAMILIES[p.family].stage == "fusion"]

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
        debug = log.isEnabledFor(logging.DEBUG)
        for fusion in passes:
            before = graph_text(gm) if (debug or graph_log.enabled) else ""
            start = time.perf_counter()
            matches[fusion.family] = fusion(gm, *extra)
            seconds = time.perf_counter() - start
            if debug:
                log.debug("pass %s: %d fused in %.3f s\n--- before ---\n%s\n--- after ---\n%s",
                          fusion.family, matches[fusion.family], seconds, before, graph_text(gm))
            graph_log.pass_pair(fusion.family, before, gm)
        return matches

    def rule_hits(self) -> Dict[str, int]:
        """Rewrites per rule, as ``"family:rule"``, over the runs of this manager (rules that never fired left out)."""
        return {f"{fusion.family}:{rule}": n for fusion in self.freeze_passes + self.passes
                for rule, n in fusion.hits.items()}
