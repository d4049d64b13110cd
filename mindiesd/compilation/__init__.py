"""mindiesd.compilation: a ``torch.compile`` backend with pattern fusion and device-graph capture.

    from mindiesd.compilation import MindieSDBackend, CompilationConfig
    model = torch.compile(model, backend=MindieSDBackend())

After ``pip install``, ``torch.compile(model, backend="mindiesd")`` works too (a backend with the global settings
of the moment of each compile).
"""

from __future__ import annotations

from typing import Any, Callable, List

from .ahead_of_time import AotForward, aot_compile, aot_forwards
from .backend import MindieSDBackend, MindieSDFallbackWarning
from .storage.cache import MindieSDCacheWarning
from .config import (
    CompilationConfig,
    CompilationConfigError,
    FusionPatterns,
    SettingTypeError,
    UnknownSettingError,
)
from .runtime.device_graph import (
    DanglingCaptureError,
    DeviceGraphCaptureWarning,
    DeviceGraphRunner,
    DeviceGraphUnavailableError,
    DeviceGraphUnavailableWarning,
    SimulatedGraphAdapter,
    register_adapter,
)
from .freezing import clear_frozen_caches
from .report import CompileReport, GraphRecord, fusion_report, reset_fusion_report

__all__ = [
    "MindieSDBackend",
    "aot_compile",
    "aot_forwards",
    "AotForward",
    "MindieSDCacheWarning",
    "CompilationConfig",
    "FusionPatterns",
    "CompilationConfigError",
    "UnknownSettingError",
    "SettingTypeError",
    "MindieSDFallbackWarning",
    "DeviceGraphUnavailableWarning",
    "DeviceGraphUnavailableError",
    "DeviceGraphCaptureWarning",
    "DanglingCaptureError",
    "DeviceGraphRunner",
    "SimulatedGraphAdapter",
    "register_adapter",
    "CompileReport",
    "GraphRecord",
    "fusion_report",
    "reset_fusion_report",
    "clear_frozen_caches",
]


def _dynamo_backend_entry(gm: Any, example_inputs: List[Any]) -> Callable[..., Any]:
    """The backend registered under the name "mindiesd" (entry point torch_dynamo_backends)."""
    return MindieSDBackend()(gm, example_inputs)
