"""Reference definitions of the mindiesd fused operators (each defined in its module under ``defs/``).

Each function is a plain composition of aten ops and is the definition of
correct for its operator: every device kernel is tested against it.  The
arithmetic runs in the compute dtype (float32 for float16/bfloat16 inputs,
otherwise the promoted dtype) and is rounded once, at the end, to the output
dtype.  Outputs have the layout of ``mindiesd.ops.layout``'s rule (that of
the op sequence each one replaces), matching the fake kernels.  The
functions are differentiable, so ``mindiesd.ops`` also uses them whenever
autograd needs a gradient.
"""

from __future__ import annotations

from .defs.adalayernorm import reference as adalayernorm
from .defs.cat_linear import reference as cat_linear
from .defs.channel_rms_norm import reference as channel_rms_norm
from .defs.dequant_linear import reference as dequant_linear
from .defs.fast_gelu import reference as fast_gelu
from .defs.glu import reference as glu
from .defs.group_norm_silu import reference as group_norm_silu
from .defs.int8_linear import reference as int8_linear
from .defs.linear_gelu import reference as linear_gelu
from .defs.mul_add import reference as mul_add
from .defs.norm_rope import reference as norm_rope
from .defs.rms_norm import reference as rms_norm
from .defs.rope import full_width
from .defs.rope import reference as rope

__all__ = ["adalayernorm", "cat_linear", "channel_rms_norm", "dequant_linear", "fast_gelu", "full_width", "glu", "group_norm_silu", "int8_linear",
           "linear_gelu", "mul_add", "norm_rope", "rms_norm", "rope"]
