"""The fused ops, one module each (checks, reference, declaration, public function), declared in family order."""

from .int8_linear import INT8_LINEAR
from .dequant_linear import DEQUANT_LINEAR
from .rms_norm import RMS_NORM
from .rope import ROPE
from .norm_rope import NORM_ROPE
from .adalayernorm import ADALAYERNORM
from .group_norm_silu import GROUP_NORM_SILU
from .channel_rms_norm import CHANNEL_RMS_NORM
from .glu import GLU
from .linear_gelu import LINEAR_GELU
from .fast_gelu import FAST_GELU
from .mul_add import MUL_ADD
from .cat_linear import CAT_LINEAR

__all__ = ["INT8_LINEAR", "DEQUANT_LINEAR", "RMS_NORM", "ROPE", "NORM_ROPE", "ADALAYERNORM", "GROUP_NORM_SILU", "CHANNEL_RMS_NORM",
           "GLU",
           "LINEAR_GELU", "FAST_GELU", "MUL_ADD", "CAT_LINEAR"]
