"""The fusion passes, one per family, in the order of :data:`mindiesd.compilation.families.FAMILIES` (which
says why)."""

from __future__ import annotations

from typing import Dict, Type

from ..families import FAMILIES
from .adalayernorm import AdaLayerNormPass
from .base import FusionPass, Rule
from .cat_linear import CatLinearPass
from .channel_rms_norm import ChannelRmsNormPass
from .conv_channels_last import ConvChannelsLastPass
from .dequant_linear import DequantLinearPass
from .fast_gelu import FastGeluPass
from .flex_attention import FlexAttentionPass
from .glu import GluPass
from .group_norm_silu import GroupNormSiluPass
from .int8_linear import Int8LinearPass
from .linear_gelu import LinearGeluPass
from .merge_projections import MergeProjectionsPass
from .mul_add import MulAddPass
from .norm_rope import NormRopePass
from .rms_norm import RMSNormPass
from .rope import RoPEPass
from .upsample_nearest import UpsampleNearestPass

_CLASSES = {cls.family: cls for cls in (FlexAttentionPass, UpsampleNearestPass, ConvChannelsLastPass, MergeProjectionsPass, Int8LinearPass,
                                        DequantLinearPass, RMSNormPass, RoPEPass, NormRopePass, AdaLayerNormPass, GroupNormSiluPass, ChannelRmsNormPass,
                                        GluPass, LinearGeluPass, FastGeluPass, MulAddPass, CatLinearPass)}
if set(_CLASSES) != set(FAMILIES):
    raise RuntimeError(f"the passes {sorted(_CLASSES)} do not match the families {list(FAMILIES)}")

#: Family name -> pass class, in run order.
PASSES: Dict[str, Type[FusionPass]] = {name: _CLASSES[name] for name in FAMILIES}

__all__ = ["PASSES", "FusionPass", "Rule"]
