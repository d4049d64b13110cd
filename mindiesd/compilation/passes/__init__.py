"""The fusion passes, one per family, in the order of :data:`mindiesd.families.FAMILIES` (which says why)."""

from __future__ import annotations

from typing import Dict, Type

from ...families import FAMILIES, resolve
from .base import FusionPass, Rule

#: Family name -> pass class, in run order.
PASSES: Dict[str, Type[FusionPass]] = {name: resolve(family.fusion_pass) for name, family in FAMILIES.items()}

for _name, _cls in PASSES.items():
    if _cls.family != _name:
        raise RuntimeError(f"the pass of family {_name!r} ({_cls.__name__}) says it is {_cls.family!r}")

__all__ = ["PASSES", "FusionPass", "Rule"]
