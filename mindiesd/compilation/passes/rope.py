"""Rotary position embedding in its five usual forms, all replaced by ``mindiesd.rope``.

- interleaved pairs (Flux ``apply_rotary_emb``): ``x*cos + rot(x)*sin`` with
  ``rot(x) = stack([-x_odd, x_even], -1).view(x.shape)``, ``x_even, x_odd = x.view(..., -1, 2).unbind(-1)``;
- half-rotated (``rotate_half``, ``use_real_unbind_dim=-2``): ``rot(x) = cat([-x2, x1], -1)`` with the halves
  taken by ``view(..., 2, -1).unbind(-2)``, by two slices or by ``chunk``;
- Wan's strided form: the even and odd outputs written into ``empty_like(x)`` through ``slice_scatter`` with step 2,
  from per-pair cos/sin;
- complex multiplication: ``view_as_real(view_as_complex(x.view(..., -1, 2)) * freqs).flatten(-2)``;
- a 2x2 matrix per pair (the original Flux code, HiDream, PRX): ``x_ = x.reshape(..., D/2, 1, 2)``,
  ``freqs[..., 0] * x_[..., 0] + freqs[..., 1] * x_[..., 1]`` with ``freqs`` of shape ``[..., D/2, 2, 2]``. Any
  matrix ``M`` fits the fused op: with full-width tables ``cos = (M00, M11)`` and ``sin = (-M01, M10)`` per pair,
  ``x*cos + rot(x)*sin`` is ``M @ (x_even, x_odd)``, so nothing about the table's values has to be proven.

With and without fp32 upcast of the input; the fused op computes in fp32 and rounds once to the dtype of the
replaced node.
"""

from __future__ import annotations

import functools

import torch

from ...ops.dtypes import is_compute_float
from ..fx_utils import float_tensor, known_eq, same_shape, tensor_val, val
from .matcher import Cast, Lit, Op, OutCast, Var
from .base import FusionPass, Rule
from .patterns import item

aten = torch.ops.aten

_X = Var("x")


# -- interleaved (Flux) ----------------------------------------------------------------------------------------
_pairs = Op(aten.unbind.int, Op(aten.view.default, _X, Var("pair_shape")), Lit("pair_dim"), name="pairs")
_rot_interleaved = Op(
    aten.view.default,
    Op(aten.stack.default, [Op(aten.neg.default, item(_pairs, 1)), item(_pairs, 0)], Lit("stack_dim")),
    Var("rot_shape"),
)


def _rotary_sum(rotated):
    """``x*cos + rotated*sin``, operands in either order; the rotated side is matched first (it binds x)."""
    return OutCast(
        Op(
            aten.add.Tensor,
            Op(aten.mul.Tensor, Cast(rotated), Var("sin"), commutative=True),
            Op(aten.mul.Tensor, Cast(_X), Var("cos"), commutative=True),
            commutative=True,
        )
    )


# -- half-rotated ----------------------------------------------------------------------------------------------
_halves_unbind = Op(aten.unbind.int, Op(aten.view.default, _X, Var("half_shape")), Lit("half_dim"), name="halves")
_halves_split = Op(aten.split.Tensor, _X, Lit("split_size"), Lit("split_dim"), name="halves")


def _rotate_halves(halves):
    """``cat([-x2, x1], -1)`` of the two halves of x."""
    return Op(aten.cat.default, [Op(aten.neg.default, item(halves, 1)), item(halves, 0)], Lit("cat_dim"))


_rot_half_unbind = _rotate_halves(_halves_unbind)
_rot_half_split = _rotate_halves(_halves_split)
_rot_half_slice = Op(
    aten.cat.default,
    [
        Op(aten.neg.default, Op(aten.slice.Tensor, _X, Lit("hi_dim"), Lit("hi_start"), Lit("hi_end"))),
        Op(aten.slice.Tensor, _X, Lit("lo_dim"), Lit("lo_start"), Lit("lo_end")),
    ],
    Lit("cat_dim"),
)

# -- Wan (strided writes into empty_like) ----------------------------------------------------------------------
_even = Op(
    aten.sub.Tensor,
    Op(aten.mul.Tensor, item(_pairs, 0), Var("cos"), commutative=True),
    Op(aten.mul.Tensor, item(_pairs, 1), Var("sin"), commutative=True),
)
_odd = Op(
    aten.add.Tensor,
    Op(aten.mul.Tensor, item(_pairs, 0), Var("sin"), commutative=True),
    Op(aten.mul.Tensor, item(_pairs, 1), Var("cos"), commutative=True),
    commutative=True,
)


def _strided_write(buffer, values, start):
    return Op(
        aten.slice_scatter.default,
        buffer,
        Op(aten.copy.default, Op(aten.slice.Tensor, buffer, Lit("w_dim"), start, Lit("w_end"), 2), values),
        Lit("w_dim"), start, Lit("w_end"), 2,
    )


_empty = Op(aten.empty_like.default, _X, kwargs={"pin_memory": Var(), "memory_format": Var()})
_wan_even_first = _strided_write(_strided_write(_empty, _even, 0), _odd, 1)
_wan_odd_first = _strided_write(_strided_write(_empty, _odd, 1), _even, 0)

# -- complex multiplication ------------------------------------------------------------------------------------
_complex = OutCast(
    Op(
        aten.view.default,
        Op(
            aten.view_as_real.default,
            Op(
                aten.mul.Tensor,
                Op(aten.view_as_complex.default, Op(aten.view.default, Cast(_X), Var("pair_shape"))),
                Var("freqs"),
                commutative=True,
            ),
        ),
        Var("out_shape"),
    )
)

# -- 2x2 matrix per pair ---------------------------------------------------------------------------------------
_x_pairs = Op(aten.view.default, Cast(_X), Var("pair_shape"), name="x_pairs")


def _matrix_term(column):
    """``freqs[..., column] * x_[..., column]``: column j of every pair's matrix times element j of the pair."""
    return Op(
        aten.mul.Tensor,
        Op(aten.select.int, Cast(Var("freqs")), Lit("freqs_dim"), column, shared=True),
        Op(aten.select.int, _x_pairs, Lit("x_dim"), column),
        commutative=True,
    )


_matrix = OutCast(
    Op(
        aten.view.default,
        Op(aten.add.Tensor, _matrix_term(0), _matrix_term(1), commutative=True, name="rotated"),
        Var("out_shape"),
    )
)


def _norm_dim(dim, rank):
    return dim + rank if isinstance(dim, int) and dim < 0 else dim


_NO_X = "x is not a floating-point tensor with an even last dimension"


def _of_even_x(check):
    """A rule's check that first requires x to be a floating-point tensor whose last dim D is not provably odd,
    then runs ``check(m, x, D)``."""

    @functools.wraps(check)
    def checked(m, root):
        x = float_tensor(m["x"], min_rank=1)
        if x is None:
            return _NO_X
        d = x.shape[-1]
        # Under dynamic=True d is symbolic; each form's pair or half view then implies that d is even (eager's
        # view would fail otherwise), and the fused op checks it again at run time.
        if isinstance(d, int) and d % 2:
            return _NO_X
        return check(m, x, d)

    return checked


def _pair_view_ok(m, x, d):
    shape = m["pair_shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) != x.dim() + 1 or shape[-1] != 2:
        return False
    if not same_shape(shape[:-2], x.shape[:-1]):
        return False
    return shape[-2] == -1 or known_eq(shape[-2], d // 2)


def _reaches_end(end, d):
    """A slice end that covers the whole dimension d (the usual "to the end" sentinel, or d itself)."""
    return end >= 2**62 or known_eq(end, d)


def _pairs_ok(m, x, d):
    """x viewed as [..., D/2, 2] and unbound along the pair dimension."""
    return _pair_view_ok(m, x, d) and _norm_dim(m["pair_dim"], x.dim() + 1) == x.dim()


def _tables_ok(*tables):
    return all(tensor_val(t) is not None for t in tables)


def _per_pair(table, d):
    """A table with one entry per pair of x's last dim (or one broadcast over all of them)."""
    return table.dim() > 0 and (known_eq(table.shape[-1], d // 2) or known_eq(table.shape[-1], 1))


def _emit(m, root, emit, interleaved, cos, sin):
    out_dtype = tensor_val(root).dtype
    return emit(torch.ops.mindiesd.rope.default, m["x"], cos, sin, interleaved, out_dtype=out_dtype)


def _build_from_tables(interleaved):
    """The builder of a form whose bound ``cos`` and ``sin`` are the fused op's tables as they are."""
    return lambda m, root, emit: _emit(m, root, emit, interleaved, m["cos"], m["sin"])


@_of_even_x
def _check_interleaved(m, x, d):
    if not _pairs_ok(m, x, d):
        return "x is not viewed as [..., D/2, 2] and unbound along the pairs"
    if _norm_dim(m["stack_dim"], x.dim() + 1) != x.dim() or not same_shape(m["rot_shape"], x.shape):
        return "the rotated pairs are not stacked last and viewed back to x's shape"
    return None if _tables_ok(m["cos"], m["sin"]) else "cos or sin is not a tensor"


def _halves_ok(m, x, d):
    rank = x.dim()
    if "half_shape" in m.bindings:
        shape = m["half_shape"]
        if not isinstance(shape, (list, tuple)) or len(shape) != rank + 1 or shape[-2] != 2:
            return False
        if not same_shape(shape[:-2], x.shape[:-1]) or not (shape[-1] == -1 or known_eq(shape[-1], d // 2)):
            return False
        return _norm_dim(m["half_dim"], rank + 1) == rank - 1
    if "split_size" in m.bindings:
        pieces = val(m["halves"])
        return (known_eq(m["split_size"], d // 2) and _norm_dim(m["split_dim"], rank) == rank - 1
                and isinstance(pieces, (list, tuple)) and len(pieces) == 2)
    if _norm_dim(m["lo_dim"], rank) != rank - 1 or _norm_dim(m["hi_dim"], rank) != rank - 1:
        return False
    return (m["lo_start"] == 0 and known_eq(m["lo_end"], d // 2) and known_eq(m["hi_start"], d // 2)
            and _reaches_end(m["hi_end"], d))


@_of_even_x
def _check_half(m, x, d):
    if _norm_dim(m["cat_dim"], x.dim()) != x.dim() - 1:
        return "the rotated halves are not concatenated along the last dimension"
    if not _halves_ok(m, x, d):
        return "the halves are not x's two halves of its last dimension"
    return None if _tables_ok(m["cos"], m["sin"]) else "cos or sin is not a tensor"


@_of_even_x
def _check_wan(m, x, d):
    if not _pairs_ok(m, x, d) or _norm_dim(m["w_dim"], x.dim()) != x.dim() - 1 or not _reaches_end(m["w_end"], d):
        return "the even and odd outputs are not written over the whole last dimension of x"
    for name in ("cos", "sin"):
        t = tensor_val(m[name])
        if t is None or not _per_pair(t, d):
            return f"{name} is not a per-pair table (last dim D/2 or 1)"
    return None


@_of_even_x
def _check_complex(m, x, d):
    freqs = tensor_val(m["freqs"])
    if freqs is None or not freqs.dtype.is_complex or freqs.dim() == 0:
        return "freqs is not a complex tensor"
    if not _pair_view_ok(m, x, d) or not same_shape(m["out_shape"], x.shape):
        return "x is not viewed as [..., D/2, 2], or the result not viewed back to x's shape"
    if not _per_pair(freqs, d):
        return "freqs is not a per-pair table (last dim D/2 or 1)"
    return None


def _build_complex(m, root, emit):
    as_real = emit(aten.view_as_real.default, m["freqs"])
    cos = emit(aten.select.int, as_real, -1, 0)
    sin = emit(aten.select.int, as_real, -1, 1)
    return _emit(m, root, emit, True, cos, sin)


@_of_even_x
def _check_matrix(m, x, d):
    rank = x.dim()
    shape = m["pair_shape"]
    if not (isinstance(shape, (list, tuple)) and len(shape) == rank + 2 and shape[-1] == 2 and shape[-2] == 1
            and same_shape(shape[:-3], x.shape[:-1]) and (shape[-3] == -1 or known_eq(shape[-3], d // 2))):
        return "x is not viewed as [..., D/2, 1, 2]"
    if _norm_dim(m["x_dim"], rank + 2) != rank + 1:
        return "the pair elements are not selected along the last dimension"
    freqs = tensor_val(m["freqs"])
    if (freqs is None or not is_compute_float(freqs.dtype) or freqs.dim() < 3 or not known_eq(freqs.shape[-1], 2)
            or not known_eq(freqs.shape[-2], 2) or not known_eq(freqs.shape[-3], d // 2)):
        return "freqs is not a [..., D/2, 2, 2] table of floats"
    if _norm_dim(m["freqs_dim"], freqs.dim()) != freqs.dim() - 1:
        return "the matrix columns are not selected along the last dimension of freqs"
    rotated = tensor_val(m["rotated"])
    # the sum has x's leading dims exactly: freqs broadcasts into x without enlarging it
    if rotated is None or not same_shape(rotated.shape, [*x.shape[:-1], d // 2, 2]):
        return "freqs does not broadcast into x's leading dimensions"
    if not same_shape(m["out_shape"], x.shape):
        return "the rotated pairs are not viewed back to x's shape"
    return None


def _matrix_entry(emit, freqs, row, column):
    return emit(aten.select.int, emit(aten.select.int, freqs, -1, column), -1, row)


def _interleave(emit, even, odd):
    """[..., D/2] even and odd entries -> [..., D] with even[i] at 2i and odd[i] at 2i + 1."""
    return emit(aten.flatten.using_ints, emit(aten.stack.default, [even, odd], -1), -2, -1)


def _build_matrix(m, root, emit):
    freqs = m["freqs"]
    cos = _interleave(emit, _matrix_entry(emit, freqs, 0, 0), _matrix_entry(emit, freqs, 1, 1))
    sin = _interleave(emit, emit(aten.neg.default, _matrix_entry(emit, freqs, 0, 1)), _matrix_entry(emit, freqs, 1, 0))
    return _emit(m, root, emit, True, cos, sin)


class RoPEPass(FusionPass):
    family = "rope"
    rules = (
        Rule("interleaved", _rotary_sum(_rot_interleaved), _build_from_tables(True), _check_interleaved),
        Rule("half_unbind", _rotary_sum(_rot_half_unbind), _build_from_tables(False), _check_half),
        Rule("half_split", _rotary_sum(_rot_half_split), _build_from_tables(False), _check_half),
        Rule("half_slice", _rotary_sum(_rot_half_slice), _build_from_tables(False), _check_half),
        Rule("wan_even_first", OutCast(_wan_even_first), _build_from_tables(True), _check_wan),
        Rule("wan_odd_first", OutCast(_wan_odd_first), _build_from_tables(True), _check_wan),
        Rule("complex", _complex, _build_complex, _check_complex),
        Rule("matrix", _matrix, _build_matrix, _check_matrix),
    )
