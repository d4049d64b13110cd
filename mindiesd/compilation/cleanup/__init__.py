"""Graph clean-up: the steps that run on a graph around the fusion passes, not fusing anything themselves.

* :mod:`.layout_checks` (before the passes): puts back the layout checks that aot decided on fake strides, so
  that they are made on the real tensors;
* :data:`AFTER_FUSION`, in this order, on the fused main graph: :mod:`.copies` drops the copies that duplicate a
  computed value, :mod:`.tidy` removes the calls that compute nothing new, dead code goes, and :mod:`.write_into`
  (last: the graph writes in place from there on) writes results where they are read.

The pass manager runs the after-fusion steps as it runs the passes (:meth:`PassManager.run_steps`): each timed,
logged at debug level and written to the graph log before and after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch.fx import GraphModule

from .copies import drop_copies
from .tidy import tidy
from .write_into import write_into

__all__ = ["CleanupStep", "AFTER_FUSION"]


@dataclass(frozen=True)
class CleanupStep:
    """One step: its name (in logs and the graph log) and what it does to a graph module in place, returning what
    it changed (a count, or counts by kind)."""

    name: str
    run: Callable[[GraphModule], Any]


def _dead_code(gm: GraphModule) -> bool:
    return gm.graph.eliminate_dead_code()


#: The steps after the fusion passes, in order.
AFTER_FUSION = (
    CleanupStep("drop_copies", lambda gm: drop_copies(gm.graph)),
    CleanupStep("tidy", lambda gm: tidy(gm.graph)),
    CleanupStep("dead_code", _dead_code),
    CleanupStep("write_into", lambda gm: write_into(gm.graph)),
)
