"""The fusion passes, one per family, in the order they run.

Order matters where forms overlap: RoPE and adaLN contain multiply-adds, so they run before mul_add, which would
otherwise take their sums apart; rms_norm runs first since its output feeds RoPE.
"""

from __future__ import annotations

from typing import Dict, Type

from .adalayernorm import AdaLayerNormPass
from .base import FusionPass, Rule
from .fast_gelu import FastGeluPass
from .mul_add import MulAddPass
from .rms_norm import RMSNormPass
from .rope import RoPEPass

#: Family name -> pass class, in run order (the keys of config.FAMILY_SWITCHES, same order).
PASSES: Dict[str, Type[FusionPass]] = {
    "rms_norm": RMSNormPass,
    "rope": RoPEPass,
    "adalayernorm": AdaLayerNormPass,
    "fast_gelu": FastGeluPass,
    "mul_add": MulAddPass,
}

__all__ = ["PASSES", "FusionPass", "Rule"]
