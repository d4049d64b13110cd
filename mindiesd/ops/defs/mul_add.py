"""``mindiesd::mul_add``: x * y + z with full broadcasting, rounded once."""

from __future__ import annotations

import torch

from .. import registry
from .._rules import compute_dtype, finish, promote, shape_str


def mul_add_rules(
    x: torch.Tensor, y: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Size, torch.dtype, torch.dtype]:
    """Validate mul_add inputs; return (output shape, output dtype, compute dtype)."""
    try:
        shape = torch.broadcast_shapes(x.shape, y.shape, z.shape)
    except RuntimeError as error:
        raise ValueError(
            f"mindiesd.mul_add: shapes x {shape_str(x.shape)}, y {shape_str(y.shape)} and "
            f"z {shape_str(z.shape)} do not broadcast together"
        ) from error
    promoted = promote(x.dtype, y.dtype, z.dtype)
    return shape, promoted, compute_dtype(promoted)


def reference(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, addend_first: bool = False) -> torch.Tensor:
    """x * y + z with full broadcasting, in the layout of eager's ``z + x * y`` when ``addend_first``."""
    _, out_dtype, work_dtype = mul_add_rules(x, y, z)
    result = x.to(work_dtype) * y.to(work_dtype) + z.to(work_dtype)
    return finish(result, out_dtype, "mul_add", x, y, z, addend_first)


MUL_ADD = registry.declare(registry.OpDef(
    schema="mul_add(Tensor x, Tensor y, Tensor z, bool addend_first=False) -> Tensor",
    layout="broadcast", table_args=(0, 1, 2), kernel_arity=3, rows=False,
    reference=reference, checks=mul_add_rules, layout_args=4,
    output_dtype=lambda x, y, z, addend_first=False: mul_add_rules(x, y, z)[1],
))

public = registry.public_function(MUL_ADD, """x * y + z with full broadcasting, rounded once.

    The output has the memory layout eager's ``x * y + z`` gives, or ``z + x * y``'s with ``addend_first``
    (they differ when the operands' layouts do).
    """)
