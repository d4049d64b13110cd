"""``mindiesd::fast_gelu``: tanh-approximated GELU."""

from __future__ import annotations

import torch

from .. import registry
from .._rules import compute_dtype, finish, require_floating, tanh_gelu


def fast_gelu_rules(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """Validate fast_gelu input; return (output dtype, compute dtype)."""
    require_floating("fast_gelu", x=x)
    return x.dtype, compute_dtype(x.dtype)


def reference(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GELU, the function of F.gelu(x, approximate="tanh")."""
    out_dtype, work_dtype = fast_gelu_rules(x)
    return finish(tanh_gelu(x.to(work_dtype)), out_dtype, "fast_gelu", x)


FAST_GELU = registry.declare(registry.OpDef(
    schema="fast_gelu(Tensor x) -> Tensor",
    layout="like_x",
    reference=reference, checks=fast_gelu_rules,
))

public = registry.public_function(
    FAST_GELU, """Tanh-approximated GELU (same function as F.gelu(approximate="tanh")).""")
