"""Runs the enabled fusion passes in order, timing each and logging the graph before and after."""

from __future__ import annotations

import logging
import time
from typing import Dict, Sequence

from torch.fx import GraphModule

from .graph_log import GraphLog, graph_text
from .passes import PASSES

log = logging.getLogger("mindiesd.compilation")

__all__ = ["PassManager"]


class PassManager:
    """The passes of ``families`` (names from :data:`PASSES`), run in :data:`PASSES` order."""

    def __init__(self, families: Sequence[str]):
        unknown = set(families) - set(PASSES)
        if unknown:
            raise ValueError(f"unknown fusion families {sorted(unknown)}; known: {list(PASSES)}")
        self.passes = [PASSES[name]() for name in PASSES if name in families]

    def run(self, gm: GraphModule, graph_log: GraphLog) -> Dict[str, int]:
        """Apply every pass to ``gm`` in place; returns the fused-op count per family."""
        matches: Dict[str, int] = {}
        debug = log.isEnabledFor(logging.DEBUG)
        for fusion in self.passes:
            before = graph_text(gm) if (debug or graph_log.enabled) else ""
            start = time.perf_counter()
            matches[fusion.family] = fusion(gm)
            seconds = time.perf_counter() - start
            if debug:
                log.debug("pass %s: %d fused in %.3f s\n--- before ---\n%s\n--- after ---\n%s",
                          fusion.family, matches[fusion.family], seconds, before, graph_text(gm))
            graph_log.pass_pair(fusion.family, before, gm)
        return matches
