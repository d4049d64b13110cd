"""The memory layout of every mindiesd op's output, and the adapter that gives each kernel that layout.

A fused op replaces a sequence of aten ops, so it must return what that sequence returns: the same shape, dtype
*and strides*; a later ``view`` in the model, or Dynamo's stride guards on the next compiled region, depend on
them. The rule, the one eager's sequences follow (elementwise ops follow their inputs' layout):

* ``rms_norm``, ``rope``, ``fast_gelu``: the layout of ``torch.empty_like(x)``: x's strides when x is dense
  (a transposed or permuted view, channels-last), else dense strides in x's dimension order (a slice);
* ``adalayernorm``: contiguous, as ``layer_norm``'s output is;
* ``glu``: the layout of ``torch.empty_like(first)``, ``first`` being x, or x's first half along the last dim
  when the op takes x alone (dense strides in x's dimension order): that of eager's ``first * act(second)``;
* ``linear_gelu``, ``cat_linear``: contiguous, as a linear layer's output is (``x.shape[:-1] +
  (weight.shape[0],)``; for ``cat_linear`` x is the list of inputs it concatenates, and the first one's leading
  dimensions count);
* ``norm_rope``: contiguous, of the shape of the concatenation of its inputs (argument 0) along argument 1;
* ``group_norm_silu``: ``like_x``, as ``group_norm``'s output (contiguous, channels-last); its kernels give it
  themselves (``OWN_LAYOUT``), the adapter copies only a row-major result of a kernel that does not;
* ``mul_add``: the layout eager's ``x * y + z`` gives (TensorIterator's rule, applied twice), or that of
  ``z + x * y`` with ``addend_first`` (the operand order decides between layouts that differ).

The fake kernels (tracing), the reference and every device kernel obey it. Device kernels are written for
contiguous outputs; :func:`conform` runs them over the inputs permuted into the output's memory order, so the
result comes out already in place, and copies only when no permutation gives the layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "declare", "output_layout", "empty_output", "concat_shape", "restride", "conform", "ROW_OPS",
           "memory_order", "Permutation", "ROW_MAJOR", "call_plan"]

#: The output layout rules: ``like_x`` follows ``torch.empty_like(x)``; ``contiguous`` is dense row-major;
#: ``broadcast`` is the layout eager's ``x * y + z`` gives over the broadcast operands (or ``z + x * y``'s when
#: the op's argument 3, ``addend_first``, is set); ``gemm`` is the dense row-major
#: ``x.shape[:-1] + (weight.shape[0],)`` of a linear layer (argument 1 is the weight; argument 0 may be a list of
#: inputs concatenated along the last dimension); ``gated`` is ``like_x`` of
#: x's first half along the last dim when argument 1 is None (glu of one tensor), else ``like_x``; ``concat`` is
#: the dense row-major ``cat(x, dim)`` of the list x (argument 0) along dim (argument 1).
LAYOUTS = ("like_x", "contiguous", "broadcast", "gemm", "gated", "concat")

#: Ops that work along the last dimension: a permutation may move every dimension but that one.
ROW_OPS: set = globals().get("ROW_OPS", set())
#: Positional arguments, per op, that broadcast against x and move with it under a permutation.
_TABLE_ARGS: dict = globals().get("_TABLE_ARGS", {})
#: Per op, its layout rule (one of LAYOUTS).
_LAYOUT: dict = globals().get("_LAYOUT", {})
#: Per op, how many leading arguments its device kernels take (None: all of them).
_ARITY: dict = globals().get("_ARITY", {})
#: Per op, its input checks (they explain shapes that do not broadcast).
_CHECKS: dict = globals().get("_CHECKS", {})
#: Ops whose kernels return the rule's layout themselves: never permuted (``group_norm_silu``, whose channels are
#: not a dimension a permutation may move).
OWN_LAYOUT: set = globals().get("OWN_LAYOUT", set())


def declare(op: str, layout: str, table_args: tuple, kernel_arity: int | None, rows: bool, checks: Callable,
            own_layout: bool = False) -> None:
    """Record the layout facts of ``op`` (called by ``registry.declare`` from the op's declaration)."""
    _LAYOUT[op], _TABLE_ARGS[op], _ARITY[op], _CHECKS[op] = layout, table_args, kernel_arity, checks
    if rows:
        ROW_OPS.add(op)
    if own_layout:
        OWN_LAYOUT.add(op)


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _meta(shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    return torch.empty_strided(tuple(shape), tuple(strides), device="meta")


@functools.lru_cache(maxsize=1024)
def _like_layout(shape: tuple, strides: tuple) -> tuple:
    return shape, torch.empty_like(_meta(shape, strides)).stride()


@functools.lru_cache(maxsize=1024)
def _mul_add_layout(x: tuple, y: tuple, z: tuple, addend_first: bool) -> tuple:
    product = _meta(*x) * _meta(*y)
    out = _meta(*z) + product if addend_first else product + _meta(*z)
    return tuple(out.shape), out.stride()


@functools.lru_cache(maxsize=1024)
def _first_half_layout(shape: tuple, strides: tuple) -> tuple:
    half = _meta(shape, strides)[..., : shape[-1] // 2]
    return tuple(half.shape), torch.empty_like(half).stride()


def _halves(args: Sequence) -> bool:
    """Whether a ``gated`` op takes x alone (its two halves) rather than x and y."""
    return len(args) < 2 or args[1] is None


def _addend_first(args: Sequence) -> bool:
    return bool(args[3]) if len(args) > 3 else False


def _key(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride()


def _traced(t) -> bool:
    if isinstance(t, (list, tuple)):
        t = t[0]
    return isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta"


def output_layout(op: str, args: Sequence) -> tuple:
    """(shape, strides) of ``op``'s output for input tensors ``args`` (the schema's order)."""
    if _traced(args[0]):
        out = empty_output(op, args, torch.float32)
        return tuple(out.shape), out.stride()
    layout = _LAYOUT[op]
    if layout == "broadcast":
        try:
            return _mul_add_layout(_key(args[0]), _key(args[1]), _key(args[2]), _addend_first(args))
        except RuntimeError:
            _CHECKS[op](args[0], args[1], args[2])  # raises the op's own error, naming the shapes
            raise
    if layout == "gated" and _halves(args):
        return _first_half_layout(*_key(args[0]))
    if layout in ("contiguous", "gemm", "concat"):
        if layout == "contiguous":
            shape = tuple(args[0].shape)
        else:
            shape = _gemm_shape(args[0], args[1]) if layout == "gemm" else concat_shape(args[0], args[1])
        return shape, contiguous_strides(shape)
    return _like_layout(*_key(args[0]))


def _gemm_shape(x, weight: torch.Tensor) -> tuple:
    if isinstance(x, (list, tuple)):  # the inputs of a concatenation
        x = x[0]
    return (*x.shape[:-1], weight.shape[0])


def concat_shape(xs, dim: int) -> tuple:
    first = xs[0]
    d = dim % first.dim()
    return (*first.shape[:d], sum(x.shape[d] for x in xs), *first.shape[d + 1:])


def empty_output(op: str, args: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised output of ``op`` with the layout of the rule, for fake and meta tensors as well.

    The rule is evaluated on the inputs themselves, so symbolic sizes (``dynamic=True``) stay symbolic.
    """
    x = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
    layout = _LAYOUT[op]
    if layout == "broadcast":
        product = args[0] * args[1]
        template = args[2] + product if _addend_first(args) else product + args[2]
        return torch.empty_strided(template.shape, template.stride(), dtype=dtype, device=x.device)
    if layout == "contiguous":
        return x.new_empty(x.shape, dtype=dtype)
    if layout == "gemm":
        return x.new_empty(_gemm_shape(x, args[1]), dtype=dtype)
    if layout == "concat":
        return x.new_empty(concat_shape(args[0], args[1]), dtype=dtype)
    if layout == "gated" and _halves(args):
        return torch.empty_like(x[..., : x.shape[-1] // 2], dtype=dtype)
    return torch.empty_like(x, dtype=dtype)


def restride(result: torch.Tensor, strides: tuple) -> torch.Tensor:
    """``result`` itself when it has ``strides``, else a copy that has them (differentiable)."""
    if result.stride() == strides:
        return result
    out = torch.empty_strided(result.shape, strides, dtype=result.dtype, device=result.device)
    return out.copy_(result)


def memory_order(shape: Sequence[int], strides: Sequence[int]) -> list:
    """Dimensions from outermost to innermost; among equal strides a size-1 dimension goes inside the other,
    where a contiguous tensor of the permuted shape gives it the same stride."""
    return sorted(range(len(shape)), key=lambda d: (-strides[d], shape[d] == 1, d))


def _aligned(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[(None,) * (rank - t.dim())] if t.dim() < rank else t


@dataclass(frozen=True)
class Permutation:
    """How a kernel that returns row-major results gives an output in another memory order: the arguments at
    ``moved`` (x of a row op, and those that broadcast against x) are permuted into ``order``, the kernel runs on
    them, and its result is permuted back by ``inverse``. ``exact``: that result has exactly the output's strides
    (else the adapter restrides it: a copy). The one place this permutation is worked out: the adapter
    (:func:`conform`) applies it, and both runners call a kernel with it (the C++ executor from ``order``,
    ``inverse`` and ``moved``). :data:`ROW_MAJOR` (empty ``order``) is the kernel's result as it is."""

    order: tuple
    inverse: tuple
    moved: tuple
    exact: bool

    @classmethod
    def of(cls, op: str, order: Sequence[int], exact: bool = True) -> "Permutation":
        inverse = [0] * len(order)
        for position, dim in enumerate(order):
            inverse[dim] = position
        moved = set(_TABLE_ARGS[op]) | ({0} if op in ROW_OPS else set())
        return cls(tuple(order), tuple(inverse), tuple(sorted(moved)), exact)

    @property
    def row_major(self) -> bool:
        return not self.order

    def call(self, kernel: Callable[..., torch.Tensor], args: Sequence) -> torch.Tensor:
        """``kernel(*args)`` with the moved arguments permuted and the result permuted back (None where the
        kernel returns None: it declined the form)."""
        if self.row_major:
            return kernel(*args)
        values, rank = list(args), len(self.order)
        for i in self.moved:
            if i < len(values) and isinstance(values[i], torch.Tensor):
                values[i] = _aligned(values[i], rank).permute(self.order)
        result = kernel(*values)
        return result.permute(self.inverse) if result is not None else None


#: The call of a kernel whose output is row-major: no permutation.
ROW_MAJOR = Permutation((), (), (), True)


def call_plan(op: str, shape: Sequence[int], strides: Sequence[int]) -> Permutation | None:
    """How ``op``'s kernel is called for an output of ``shape`` and ``strides``: :data:`ROW_MAJOR` (also for an
    ``OWN_LAYOUT`` op, whose kernels give the strides), a
    :class:`Permutation` into the output's memory order, or None where no permutation gives the layout (a row
    op whose normalised dimension is not innermost: the adapter copies)."""
    shape, strides = tuple(shape), tuple(strides)
    if strides == contiguous_strides(shape) or op in OWN_LAYOUT:
        return ROW_MAJOR
    order = memory_order(shape, strides)
    if op in ROW_OPS and order[-1] != len(shape) - 1:
        return None
    permuted = contiguous_strides(tuple(shape[d] for d in order))
    back = [0] * len(order)
    for position, dim in enumerate(order):
        back[dim] = permuted[position]
    return Permutation.of(op, order, exact=tuple(back) == strides)


def conform(op: str, kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``kernel`` (which returns a contiguous tensor) made to return the layout of the rule."""
    arity = _ARITY[op]  # kernels take no layout flag (mul_add's addend_first): the adapter applies it

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        if kwargs:
            args = args + tuple(kwargs.values())
        shape, strides = output_layout(op, args)
        args = args[:arity] if arity else args
        plan = call_plan(op, shape, strides)
        if plan is None:  # the normalised dimension is not innermost
            return restride(kernel(*args), strides)
        return restride(plan.call(kernel, args), strides)

    run.unconformed = kernel
    return run
