"""The device-graph runner's place in the pipeline (ACLGraph on Ascend, CUDA graphs on NVIDIA).

:func:`wrap_for_capture` receives the final callable of a compiled graph and returns what Dynamo will call.
Capture itself (static buffers, per-signature cache, replay) is not implemented yet: when a configuration asks
for it, one warning says so and the compiled graph runs uncaptured, or ``strict`` raises.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from .config import CompilationConfig

__all__ = ["wrap_for_capture", "DeviceGraphUnavailableWarning"]


class DeviceGraphUnavailableWarning(UserWarning):
    """Device-graph capture was asked for but cannot happen; the graph runs uncaptured."""


_warned = False


def wrap_for_capture(fn: Callable[..., Any], config: CompilationConfig) -> Callable[..., Any]:
    global _warned
    if not config.capture:
        return fn
    message = ("mindiesd: device-graph capture (aclgraph_only / aclgraph_with_compile) is not available in this "
               "version; the compiled graph runs uncaptured")
    if config.strict:
        raise RuntimeError(message)
    if not _warned:
        warnings.warn(message, DeviceGraphUnavailableWarning, stacklevel=2)
        _warned = True
    return fn
