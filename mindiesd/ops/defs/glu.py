"""``mindiesd::glu``: a gated activation, ``act(gate) * value``, rounded once.

The gated feed-forwards of DiTs compute it from one projection split in two halves along the last dimension
(diffusers' ``GEGLU`` and ``SwiGLU``, Flux2, OmniGen) or from two projections (the LLaMA-style
``silu(w1(x)) * w3(x)`` of HiDream, Lumina2, AuraFlow; PRX with tanh-GELU). The op covers both:

* ``y`` None: ``x``'s last dimension holds two halves ``[first, second]``; the kernels read ``x`` in place
  (it is often itself a strided view of a wider projection) and never materialise the halves;
* ``y`` given: ``first = x`` and ``second = y``, of one shape.

``gate_first`` says which of the two is activated: ``act(first) * second`` when set, else ``first * act(second)``
(diffusers' ``GEGLU``/``SwiGLU`` activate the second half). ``activation`` is ``"silu"``, ``"gelu"`` (exact, erf)
or ``"gelu_tanh"`` (the tanh approximation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import registry
from .._rules import compute_dtype, finish, promote, require_floating, shape_str, tanh_gelu

#: The activations the op computes, by the name its ``activation`` argument takes.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def glu_rules(
    x: torch.Tensor, y: torch.Tensor | None, activation: str
) -> tuple[torch.dtype, torch.dtype]:
    """Validate glu inputs; return (output dtype, compute dtype)."""
    require_floating("glu", x=x, y=y)
    if activation not in ACTIVATIONS:
        raise ValueError(f"mindiesd.glu: `activation` must be one of {ACTIVATIONS}, got {activation!r}")
    if y is None:
        if x.dim() < 1 or x.shape[-1] % 2 != 0:
            raise ValueError(
                f"mindiesd.glu: without `y`, the last dim of `x` {shape_str(x.shape)} must hold two halves "
                "of one even size"
            )
        promoted = x.dtype
    else:
        if tuple(y.shape) != tuple(x.shape):
            raise ValueError(
                f"mindiesd.glu: `x` {shape_str(x.shape)} and `y` {shape_str(y.shape)} must have one shape"
            )
        promoted = promote(x.dtype, y.dtype)
    return promoted, compute_dtype(promoted)


def halves(x: torch.Tensor, y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second): x's two halves along the last dim (views), or x and y."""
    if y is not None:
        return x, y
    width = x.shape[-1] // 2
    return x[..., :width], x[..., width:]


def activate(values: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation ``activation`` of ``values``, composed of aten ops in their dtype."""
    if activation == "silu":
        return F.silu(values)
    if activation == "gelu":
        return F.gelu(values)
    return tanh_gelu(values)


def reference(
    x: torch.Tensor, y: torch.Tensor | None = None, activation: str = "silu", gate_first: bool = False
) -> torch.Tensor:
    """``act(first) * second`` with ``gate_first``, else ``first * act(second)`` (see the module doc)."""
    out_dtype, work_dtype = glu_rules(x, y, activation)
    first, second = (t.to(work_dtype) for t in halves(x, y))
    result = activate(first, activation) * second if gate_first else first * activate(second, activation)
    return finish(result, out_dtype, "glu", x, y)


GLU = registry.declare(registry.OpDef(
    schema="glu(Tensor x, Tensor? y, str activation, bool gate_first) -> Tensor",
    layout="gated", table_args=(1,), layout_args=2,
    reference=reference, checks=glu_rules,
))

public = registry.public_function(GLU, """A gated activation, rounded once: ``act(first) * second`` with
    ``gate_first``, else ``first * act(second)``.

    ``first`` and ``second`` are the two halves of x's last dim when ``y`` is None (x holds a projection's
    output ``[first, second]``), else x and y (one shape). ``activation``: ``"silu"``, ``"gelu"`` (exact) or
    ``"gelu_tanh"``. Output: the shape of one half (or of x), dtype promote(x, y), the layout of eager's
    product (``torch.empty_like`` of ``first``).
    """)
