"""Tests of the mindiesd fused operators (CPU kernels, reference, fakes, API)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import mindiesd.ops as ops
from mindiesd.ops import registry, reference
from mindiesd.ops.kernels import cpu as _cpu
from op_checks import DTYPES, assert_matches, randn  # noqa: E402

OPS = torch.ops.mindiesd

EPS_VALUES = [1e-6, 1e-2]




def check_kernel(name, args, expected, dtype):
    """The dispatched CPU kernel agrees with the reference and with ``expected``."""
    out = getattr(OPS, name).default(*args)
    ref = getattr(reference, name)(*args)
    assert out.dtype == ref.dtype
    assert out.shape == ref.shape
    assert out.stride() == ref.stride()  # the layout rule of mindiesd.ops.layout, in both
    assert_matches(out, ref, dtype)
    assert_matches(out, expected, dtype)
    return out


def up(t):
    return None if t is None else t.to(torch.float64)


# ----------------------------------------------------------------------------
# Registration and opcheck
# ----------------------------------------------------------------------------

OPCHECK_CASES = [
    ("rms_norm", lambda: (randn(2, 5, 24), randn(24, seed=1), 1e-6)),
    ("rms_norm", lambda: (randn(3, 40), None, 1e-5)),
    ("rms_norm", lambda: (randn(3, 40), randn(40, seed=1), 1e-5, torch.float64)),
    ("rope", lambda: (randn(2, 6, 3, 8), randn(6, 1, 8, seed=1), randn(6, 1, 8, seed=2), True)),
    ("rope", lambda: (randn(2, 6, 3, 8), randn(6, 1, 4, seed=1), randn(6, 1, 4, seed=2), False)),
    ("rope", lambda: (randn(6, 8), randn(6, 8, seed=1), randn(6, 8, seed=2), False, None)),
    (
        "adalayernorm",
        lambda: (randn(2, 5, 24), randn(2, 1, 24, seed=1), randn(2, 1, 24, seed=2), 1e-6),
    ),
    ("adalayernorm", lambda: (randn(2, 5, 24), randn(24, seed=1), randn(24, seed=2), 1e-5, None)),
    ("glu", lambda: (randn(2, 5, 24), None, "silu", False)),
    ("glu", lambda: (randn(2, 5, 40)[..., 4:28], None, "gelu", True)),
    ("glu", lambda: (randn(3, 17), randn(3, 17, seed=1), "gelu_tanh", True)),
    ("fast_gelu", lambda: (randn(4, 33),)),
    ("mul_add", lambda: (randn(2, 5, 24), randn(2, 1, 24, seed=1), randn(2, 5, 24, seed=2))),
    ("mul_add", lambda: (randn(5, 1), randn(24, seed=1), randn(1, seed=2))),
]


@pytest.mark.parametrize("name, make_args", OPCHECK_CASES)
def test_opcheck(name, make_args):
    torch.library.opcheck(getattr(OPS, name).default, make_args())


@pytest.mark.parametrize("name", sorted(registry.SCHEMAS))
def test_registered_kernels(name):
    qualname = f"mindiesd::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd")
    assert name in registry.DEVICE_KERNELS["cpu"]
    assert str(getattr(OPS, name).default._schema) == f"mindiesd::{registry.SCHEMAS[name]}"


def test_reload_does_not_register_twice():
    library = registry.LIBRARY
    importlib.reload(registry)
    assert registry.LIBRARY is library
    x = randn(2, 16)
    torch.testing.assert_close(OPS.rms_norm.default(x, None, 1e-6), reference.rms_norm(x))


def test_registering_again_replaces_the_kernel_without_registering_twice(monkeypatch):
    """torch 2.11 refuses a second Python kernel for one op and dispatch key: a kernel registered where one is
    already swaps what the dispatcher's kernel calls, and the dispatcher is not asked again."""
    original = registry.DEVICE_KERNELS["cpu"]["rms_norm"]

    def refuse(*args, **kwargs):
        raise RuntimeError("not allowed: there's already a kernel registered from python for this dispatch key")

    monkeypatch.setattr(registry.LIBRARY, "impl", refuse)
    calls = []

    def mine(x, weight, eps, out_dtype=None):
        calls.append(x.shape)
        return original(x, weight, eps, out_dtype)

    x = randn(2, 16)
    try:
        registry.register_device_kernel("rms_norm", "cpu", mine)
        torch.testing.assert_close(OPS.rms_norm.default(x, None, 1e-6), reference.rms_norm(x))
        assert calls == [x.shape]
    finally:
        registry.register_device_kernel("rms_norm", "cpu", original)
    assert registry.DEVICE_KERNELS["cpu"]["rms_norm"] is original
    OPS.rms_norm.default(x, None, 1e-6)
    assert calls == [x.shape]  # the original kernel is back


def test_fresh_reimport_and_light_import():
    script = textwrap.dedent(
        """
        import gc, sys
        import torch
        before = set(sys.modules)
        import mindiesd.ops
        added = set(sys.modules) - before
        heavy = sorted(m for m in added if m.startswith(("diffusers", "torch._inductor")))
        assert not heavy, heavy
        for module in [m for m in sys.modules if m.startswith("mindiesd")]:
            del sys.modules[module]
        gc.collect()
        import mindiesd.ops as again
        gc.collect()
        x = torch.randn(3, 8)
        torch.testing.assert_close(again.rms_norm(x), again.reference.rms_norm(x))
        torch.testing.assert_close(
            torch.ops.mindiesd.fast_gelu.default(x), torch.nn.functional.gelu(x, approximate="tanh")
        )
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_register_device_kernel_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown operator"):
        ops.register_device_kernel("no_such_op", "cpu", _cpu.rms_norm)
    with pytest.raises(ValueError, match="no dispatch key"):
        ops.register_device_kernel("rms_norm", "quantum", _cpu.rms_norm)


def test_public_api():
    names = {"rms_norm", "rope", "adalayernorm", "fast_gelu", "mul_add", "reference"}
    assert set(ops.__all__) >= names
    for name in ("rms_norm", "rope", "adalayernorm", "fast_gelu", "mul_add"):
        assert callable(getattr(ops, name))
        assert callable(getattr(ops.reference, name))


# ----------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------


def rms_norm_eager(x, weight, eps):
    return F.rms_norm(up(x), (x.shape[-1],), up(weight), eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", EPS_VALUES)
@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 24), (2, 3, 4, 1000)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches(dtype, eps, shape, with_weight):
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[-1], dtype=dtype, seed=1) if with_weight else None
    check_kernel("rms_norm", (x, weight, eps), rms_norm_eager(x, weight, eps), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_non_contiguous(dtype):
    base = randn(6, 4, 2 * 72, dtype=dtype)
    weight = randn(2 * 72, dtype=dtype, seed=1)[::2]
    for x in (base.transpose(0, 1), base[..., ::2]):
        w = weight if x.shape[-1] == weight.shape[0] else None
        check_kernel("rms_norm", (x, w, 1e-6), rms_norm_eager(x, w, 1e-6), dtype)


def test_rms_norm_float64_and_broadcast_weight():
    x = randn(2, 5, 40, dtype=torch.float64)
    weight = randn(5, 40, dtype=torch.float64, seed=1)
    expected = F.rms_norm(x, (40,), None, 1e-6) * weight
    check_kernel("rms_norm", (x, weight, 1e-6), expected, torch.float64)


def test_rms_norm_dtypes():
    x = randn(3, 16, dtype=torch.bfloat16)
    assert OPS.rms_norm.default(x, None, 1e-6).dtype == torch.bfloat16
    assert OPS.rms_norm.default(x, randn(16), 1e-6).dtype == torch.float32
    assert OPS.rms_norm.default(x, randn(16, dtype=torch.float16), 1e-6).dtype == torch.float32
    out = OPS.rms_norm.default(x, None, 1e-6, torch.float32)
    assert out.dtype == torch.float32
    assert_matches(out, rms_norm_eager(x, None, 1e-6), torch.float32)
    x32 = randn(3, 16)
    out = OPS.rms_norm.default(x32, None, 1e-6, torch.bfloat16)
    assert torch.equal(out, reference.rms_norm(x32, None, 1e-6, torch.bfloat16))


def test_rms_norm_errors():
    with pytest.raises(ValueError, match="`weight`"):
        OPS.rms_norm.default(randn(3, 16), randn(15), 1e-6)
    with pytest.raises(ValueError, match="`weight`.*more dimensions"):
        OPS.rms_norm.default(randn(16), randn(2, 16), 1e-6)
    with pytest.raises(ValueError, match="at least one dimension"):
        OPS.rms_norm.default(torch.tensor(1.0), None, 1e-6)


# ----------------------------------------------------------------------------
# rope
# ----------------------------------------------------------------------------


def rope_flux(x, cos, sin):
    """diffusers/Flux apply_rotary_emb with use_real_unbind_dim=-1."""
    x_real, x_imag = up(x).reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(-2)
    return up(x) * up(cos) + x_rotated * up(sin)


def rope_interleaved_elementwise(x, cos, sin):
    """The interleaved full-width formula, element by element."""
    x, cos, sin = up(x), up(cos), up(sin)
    out = torch.empty(torch.broadcast_shapes(x.shape, cos.shape, sin.shape), dtype=x.dtype)
    out[..., 0::2] = x[..., 0::2] * cos[..., 0::2] - x[..., 1::2] * sin[..., 0::2]
    out[..., 1::2] = x[..., 1::2] * cos[..., 1::2] + x[..., 0::2] * sin[..., 1::2]
    return out


def rope_complex(x, cos_pairs, sin_pairs):
    """Interleaved per-pair RoPE as complex multiplication."""
    as_complex = torch.view_as_complex(up(x).reshape(*x.shape[:-1], -1, 2).contiguous())
    rotated = as_complex * torch.complex(up(cos_pairs), up(sin_pairs))
    return torch.view_as_real(rotated).flatten(-2)


def rope_rotate_half(x, cos, sin):
    first, second = up(x).chunk(2, dim=-1)
    return up(x) * up(cos) + torch.cat((-second, first), dim=-1) * up(sin)


def rope_half_pairs(x, cos_pairs, sin_pairs):
    first, second = up(x).chunk(2, dim=-1)
    c, s = up(cos_pairs), up(sin_pairs)
    return torch.cat((first * c - second * s, second * c + first * s), dim=-1)


# (x shape, table shape without its last dim)
ROPE_LAYOUTS = [
    ((2, 6, 3, 16), (1, 6, 1)),  # rank 4, [1, S, 1, D] tables
    ((6, 3, 40), (6, 1)),  # rank 3, [S, 1, D] tables, D = 40
    ((6, 24), (6,)),  # rank 2, [S, D] tables
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, table_lead", ROPE_LAYOUTS)
def test_rope_interleaved(dtype, x_shape, table_lead):
    width = x_shape[-1]
    x = randn(*x_shape, dtype=dtype)
    cos_pairs = randn(*table_lead, width // 2, dtype=dtype, seed=1)
    sin_pairs = randn(*table_lead, width // 2, dtype=dtype, seed=2)
    # per pair: complex multiplication
    expected = rope_complex(x, cos_pairs, sin_pairs)
    check_kernel("rope", (x, cos_pairs, sin_pairs, True), expected, dtype)
    # Flux full-width tables (repeat_interleave of the pair tables)
    cos_flux = cos_pairs.repeat_interleave(2, dim=-1)
    sin_flux = sin_pairs.repeat_interleave(2, dim=-1)
    check_kernel("rope", (x, cos_flux, sin_flux, True), rope_flux(x, cos_flux, sin_flux), dtype)
    # general full-width tables (every element its own value)
    cos_full = randn(*table_lead, width, dtype=dtype, seed=3)
    sin_full = randn(*table_lead, width, dtype=dtype, seed=4)
    expected = rope_interleaved_elementwise(x, cos_full, sin_full)
    check_kernel("rope", (x, cos_full, sin_full, True), expected, dtype)
    torch.testing.assert_close(expected, rope_flux(x, cos_full, sin_full))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, table_lead", ROPE_LAYOUTS)
def test_rope_rotate_half(dtype, x_shape, table_lead):
    width = x_shape[-1]
    x = randn(*x_shape, dtype=dtype)
    cos_full = randn(*table_lead, width, dtype=dtype, seed=1)
    sin_full = randn(*table_lead, width, dtype=dtype, seed=2)
    expected = rope_rotate_half(x, cos_full, sin_full)
    check_kernel("rope", (x, cos_full, sin_full, False), expected, dtype)
    cos_pairs = randn(*table_lead, width // 2, dtype=dtype, seed=3)
    sin_pairs = randn(*table_lead, width // 2, dtype=dtype, seed=4)
    expected = rope_half_pairs(x, cos_pairs, sin_pairs)
    check_kernel("rope", (x, cos_pairs, sin_pairs, False), expected, dtype)
    doubled = (torch.cat((cos_pairs, cos_pairs), -1), torch.cat((sin_pairs, sin_pairs), -1))
    torch.testing.assert_close(expected, rope_rotate_half(x, *doubled))


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_broadcast_last_dim_and_mixed_widths(interleaved):
    x = randn(2, 5, 3, 8)
    cos = randn(1, 5, 1, 1, seed=1)
    sin_pairs = randn(5, 1, 4, seed=2)
    if interleaved:
        sin_full = sin_pairs.repeat_interleave(2, -1)
    else:
        sin_full = torch.cat((sin_pairs, sin_pairs), -1)
    expected = reference.rope(x, cos.expand(1, 5, 1, 8), sin_full, interleaved)
    check_kernel("rope", (x, cos, sin_pairs, interleaved), expected, torch.float32)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_non_contiguous(interleaved, dtype):
    cos = randn(1, 6, 1, 16, dtype=dtype, seed=1)
    sin = randn(1, 6, 1, 16, dtype=dtype, seed=2)
    layouts = [
        randn(2, 3, 6, 16, dtype=dtype).transpose(1, 2),  # even strides
        randn(2, 6, 3, 17, dtype=dtype)[..., :16],  # odd strides
        randn(2, 6, 16, 3, dtype=dtype).transpose(-1, -2),  # last dim strided
    ]
    formula = rope_interleaved_elementwise if interleaved else rope_rotate_half
    for x in layouts:
        check_kernel("rope", (x, cos, sin, interleaved), formula(x, cos, sin), dtype)
        pairs = (cos[..., ::2], sin[..., ::2])  # non-contiguous per-pair tables
        pair_formula = rope_complex if interleaved else rope_half_pairs
        check_kernel("rope", (x, *pairs, interleaved), pair_formula(x, *pairs), dtype)


def test_rope_dtypes():
    x = randn(4, 8, dtype=torch.bfloat16)
    cos32, sin32 = randn(4, 4, seed=1), randn(4, 4, seed=2)
    assert OPS.rope.default(x, cos32.bfloat16(), sin32.bfloat16(), True).dtype == torch.bfloat16
    out = OPS.rope.default(x, cos32, sin32, True)
    assert out.dtype == torch.float32
    assert_matches(out, rope_complex(x, cos32, sin32), torch.float32)
    out = OPS.rope.default(x, cos32, sin32, False, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.rope(x, cos32, sin32, False, torch.bfloat16))
    x64 = randn(4, 8, dtype=torch.float64)
    out = OPS.rope.default(x64, cos32, sin32, True)
    assert out.dtype == torch.float64
    assert_matches(out, rope_complex(x64, cos32, sin32), torch.float64)


def test_rope_errors():
    x = randn(2, 6, 3, 8)
    table = randn(6, 1, 8)
    with pytest.raises(ValueError, match="last dim of `x` must be even"):
        OPS.rope.default(randn(2, 7), randn(7), randn(7), True)
    with pytest.raises(ValueError, match="last dim of `cos`"):
        OPS.rope.default(x, randn(6, 1, 3), table, True)
    with pytest.raises(ValueError, match="last dim of `sin`"):
        OPS.rope.default(x, table, randn(6, 1, 6), False)
    with pytest.raises(ValueError, match="`cos`.*does not broadcast"):
        OPS.rope.default(x, randn(4, 6, 1, 8), table, True)
    with pytest.raises(ValueError, match="`sin`.*does not broadcast"):
        OPS.rope.default(x, table, randn(6, 3, 3, 8), True)
    with pytest.raises(ValueError, match="`cos`.*more dimensions"):
        OPS.rope.default(randn(6, 8), randn(1, 6, 8), randn(6, 8), True)


# ----------------------------------------------------------------------------
# adalayernorm
# ----------------------------------------------------------------------------


def adalayernorm_eager(x, scale, shift, eps):
    return F.layer_norm(up(x), (x.shape[-1],), eps=eps) * (1 + up(scale)) + up(shift)


# (x shape, scale/shift shape): covers every CPU kernel path
ADALN_LAYOUTS = [
    ((2, 5, 24), (24,)),  # one affine layer_norm
    ((2, 5, 24), (1, 1, 24)),
    ((2, 5, 96), (2, 1, 96)),  # per batch slice
    ((2, 3, 4, 40), (2, 1, 1, 40)),  # rank 4
    ((2, 3, 4, 40), (2, 3, 1, 40)),  # rank 4, two modulated dims
    ((3, 8, 1000), (3, 8, 1000)),  # per token: layer_norm + addcmul
    ((6, 48), (6, 1)),  # rank 2, last dim broadcast
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", EPS_VALUES)
@pytest.mark.parametrize("x_shape, mod_shape", ADALN_LAYOUTS)
def test_adalayernorm_matches(dtype, eps, x_shape, mod_shape):
    x = randn(*x_shape, dtype=dtype)
    scale = randn(*mod_shape, dtype=dtype, seed=1)
    shift = randn(*mod_shape, dtype=dtype, seed=2)
    expected = adalayernorm_eager(x, scale, shift, eps)
    check_kernel("adalayernorm", (x, scale, shift, eps), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adalayernorm_non_contiguous(dtype):
    x = randn(5, 2, 96, dtype=dtype).transpose(0, 1)
    scale = randn(2, 96, 1, dtype=dtype, seed=1).transpose(1, 2)
    shift = randn(2, 1, 192, dtype=dtype, seed=2)[..., ::2]
    expected = adalayernorm_eager(x, scale, shift, 1e-6)
    check_kernel("adalayernorm", (x, scale, shift, 1e-6), expected, dtype)
    x_strided = randn(2, 5, 192, dtype=dtype)[..., ::2]
    expected = adalayernorm_eager(x_strided, scale, shift, 1e-6)
    check_kernel("adalayernorm", (x_strided, scale, shift, 1e-6), expected, dtype)


def test_adalayernorm_dtypes():
    x = randn(2, 5, 24, dtype=torch.bfloat16)
    scale, shift = randn(2, 1, 24, seed=1), randn(2, 1, 24, seed=2)
    out = OPS.adalayernorm.default(x, scale, shift, 1e-6)
    assert out.dtype == torch.float32
    assert_matches(out, adalayernorm_eager(x, scale, shift, 1e-6), torch.float32)
    out = OPS.adalayernorm.default(x, scale, shift, 1e-6, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    expected = reference.adalayernorm(x, scale, shift, 1e-6, torch.bfloat16)
    assert_matches(out, expected, torch.bfloat16)
    out = OPS.adalayernorm.default(x, scale.double(), shift, 1e-6, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_matches(out, adalayernorm_eager(x, scale, shift, 1e-6), torch.bfloat16)
    x64 = x.double()
    out = OPS.adalayernorm.default(x64, scale, shift, 1e-6)
    assert out.dtype == torch.float64
    assert_matches(out, adalayernorm_eager(x64, scale, shift, 1e-6), torch.float64)


def test_adalayernorm_errors():
    x = randn(2, 5, 24)
    with pytest.raises(ValueError, match="`scale`.*does not broadcast"):
        OPS.adalayernorm.default(x, randn(2, 1, 12), randn(24), 1e-6)
    with pytest.raises(ValueError, match="`shift`.*does not broadcast"):
        OPS.adalayernorm.default(x, randn(24), randn(3, 1, 24), 1e-6)
    with pytest.raises(ValueError, match="`scale`.*more dimensions"):
        OPS.adalayernorm.default(x, randn(1, 2, 1, 24), randn(24), 1e-6)


# ----------------------------------------------------------------------------
# fast_gelu and mul_add
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 24), (2, 3, 4, 1000)])
def test_fast_gelu_matches(dtype, shape):
    x = randn(*shape, dtype=dtype) * 3
    out = check_kernel("fast_gelu", (x,), F.gelu(up(x), approximate="tanh"), dtype)
    assert out.dtype == dtype
    if dtype != torch.float64:
        # the tanh approximation, not the sigmoid one
        sigmoid_gelu = x.float() * torch.sigmoid(1.702 * x.float())
        assert not torch.allclose(out.float(), sigmoid_gelu, atol=1e-3)


def test_fast_gelu_non_contiguous():
    x = randn(40, 6).t()
    check_kernel("fast_gelu", (x,), F.gelu(up(x), approximate="tanh"), torch.float32)
    x = randn(6, 80)[:, ::2]
    check_kernel("fast_gelu", (x,), F.gelu(up(x), approximate="tanh"), torch.float32)


MUL_ADD_LAYOUTS = [
    ((2, 5, 24), (2, 5, 24), (2, 5, 24)),
    ((2, 5, 24), (2, 1, 24), (2, 5, 24)),  # gated residual
    ((24,), (2, 5, 1), (1, 5, 24)),  # output larger than every input
    ((2, 3, 4, 1000), (1000,), (2, 1, 1, 1000)),
    ((7, 96), (), (96,)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", MUL_ADD_LAYOUTS)
def test_mul_add_matches(dtype, shapes):
    x, y, z = (randn(*shape, dtype=dtype, seed=seed) for seed, shape in enumerate(shapes))
    out = check_kernel("mul_add", (x, y, z), up(x) * up(y) + up(z), dtype)
    assert out.shape == torch.broadcast_shapes(*shapes)
    assert out.dtype == dtype


def test_mul_add_non_contiguous_and_mixed_dtypes():
    x = randn(24, 5).t()
    y = randn(5, 48, seed=1)[:, ::2]
    z = randn(24, seed=2)
    check_kernel("mul_add", (x, y, z), up(x) * up(y) + up(z), torch.float32)
    xb = x.bfloat16()
    out = OPS.mul_add.default(xb, y, z.half())
    assert out.dtype == torch.float32
    assert_matches(out, up(xb) * up(y) + up(z.half()), torch.float32)
    out = OPS.mul_add.default(xb, y.bfloat16(), z.half())
    assert out.dtype == torch.float32
    bf16_only = OPS.mul_add.default(xb, y.bfloat16(), z.bfloat16())
    assert torch.equal(bf16_only, reference.mul_add(xb, y.bfloat16(), z.bfloat16()))


def test_mul_add_zero_dim_operand_promotes():
    x, y, z = randn(3, 4), torch.tensor(2.5, dtype=torch.float64), randn(4, seed=1)
    out = OPS.mul_add.default(x, y, z)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x.double() * 2.5 + z.double())
    with FakeTensorMode() as mode:
        fake = OPS.mul_add.default(mode.from_tensor(x), mode.from_tensor(y), mode.from_tensor(z))
    assert (fake.shape, fake.dtype) == (out.shape, out.dtype)


def test_mul_add_integer_and_bool():
    x, y, z = torch.arange(6).view(2, 3), torch.tensor([2, 3, 4]), torch.tensor(7)
    assert torch.equal(OPS.mul_add.default(x, y, z), x * y + z)
    a = torch.tensor([True, False, True, False])
    b = torch.tensor([True, True, False, False])
    out = OPS.mul_add.default(a, b, torch.tensor([False, False, False, True]))
    assert out.dtype == torch.bool
    assert out.tolist() == [True, False, False, True]


def test_mul_add_errors():
    with pytest.raises(ValueError, match="do not broadcast"):
        OPS.mul_add.default(randn(2, 3), randn(4), randn(3))


def test_fast_gelu_rejects_integers():
    with pytest.raises(ValueError, match="floating-point"):
        OPS.fast_gelu.default(torch.arange(4))


# ----------------------------------------------------------------------------
# Fake kernels
# ----------------------------------------------------------------------------


def test_fake_shapes_and_dtypes():
    with FakeTensorMode():
        x = torch.empty(2, 5, 24, dtype=torch.bfloat16)
        weight = torch.empty(24)
        out = OPS.rms_norm.default(x, weight, 1e-6)
        assert (out.shape, out.dtype) == ((2, 5, 24), torch.float32)
        out = OPS.rms_norm.default(x, None, 1e-6, torch.float16)
        assert (out.shape, out.dtype) == ((2, 5, 24), torch.float16)

        q = torch.empty(2, 6, 3, 8, dtype=torch.bfloat16)
        cos = torch.empty(1, 6, 1, 4, dtype=torch.bfloat16)
        out = OPS.rope.default(q, cos, cos, True)
        assert (out.shape, out.dtype) == ((2, 6, 3, 8), torch.bfloat16)
        out = OPS.rope.default(q, cos.float(), cos, False)
        assert out.dtype == torch.float32

        scale = torch.empty(2, 1, 24, dtype=torch.bfloat16)
        out = OPS.adalayernorm.default(x, scale, scale, 1e-6)
        assert (out.shape, out.dtype) == ((2, 5, 24), torch.bfloat16)
        out = OPS.adalayernorm.default(x, scale, scale, 1e-6, torch.float32)
        assert out.dtype == torch.float32

        out = OPS.fast_gelu.default(x)
        assert (out.shape, out.dtype) == ((2, 5, 24), torch.bfloat16)

        z = torch.empty(1, 5, 24, dtype=torch.float64)
        out = OPS.mul_add.default(torch.empty(24), torch.empty(2, 5, 1), z)
        assert (out.shape, out.dtype) == ((2, 5, 24), torch.float64)
        assert out.is_contiguous()


def test_fake_validates_like_the_kernel():
    with FakeTensorMode():
        x = torch.empty(2, 6, 3, 8)
        with pytest.raises(ValueError, match="`weight`"):
            OPS.rms_norm.default(x, torch.empty(7), 1e-6)
        with pytest.raises(ValueError, match="`cos`.*does not broadcast"):
            OPS.rope.default(x, torch.empty(4, 6, 1, 8), torch.empty(8), True)
        with pytest.raises(ValueError, match="must be even"):
            OPS.rope.default(torch.empty(3, 5), torch.empty(5), torch.empty(5), True)
        with pytest.raises(ValueError, match="`shift`"):
            OPS.adalayernorm.default(x, torch.empty(8), torch.empty(5, 1, 1, 8), 1e-6)
        with pytest.raises(ValueError, match="do not broadcast"):
            OPS.mul_add.default(x, torch.empty(5), x)


def test_symbolic_trace():
    def block(x, cos, sin, weight, scale, shift):
        h = OPS.adalayernorm.default(x, scale, shift, 1e-6)
        h = OPS.mul_add.default(OPS.fast_gelu.default(h), scale, x)
        q = OPS.rms_norm.default(h.unflatten(-1, (3, 8)), weight, 1e-6)
        return OPS.rope.default(q, cos, sin, True)

    def inputs(tokens):
        return (
            randn(2, tokens, 24),
            randn(tokens, 1, 4, seed=1),
            randn(tokens, 1, 4, seed=2),
            randn(8, seed=3),
            randn(2, 1, 24, seed=4),
            randn(2, 1, 24, seed=5),
        )

    graph = make_fx(block, tracing_mode="symbolic")(*inputs(5))
    output_node = next(n for n in graph.graph.nodes if n.op == "output")
    traced_shape = output_node.args[0].meta["val"].shape
    assert any(isinstance(size, torch.SymInt) for size in traced_shape)
    args = inputs(11)
    torch.testing.assert_close(graph(*args), block(*args))


# ----------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------


API_CASES = [
    ("rms_norm", lambda: (randn(2, 5, 24), randn(24, seed=1))),
    ("rope", lambda: (randn(2, 6, 3, 8), randn(6, 1, 4, seed=1), randn(6, 1, 4, seed=2))),
    ("adalayernorm", lambda: (randn(2, 5, 24), randn(2, 1, 24, seed=1), randn(2, 1, 24, seed=2))),
    ("glu", lambda: (randn(2, 5, 24),)),
    ("glu", lambda: (randn(3, 17), randn(3, 17, seed=1))),
    ("fast_gelu", lambda: (randn(4, 33),)),
    ("mul_add", lambda: (randn(2, 5, 24), randn(2, 1, 24, seed=1), randn(2, 5, 24, seed=2))),
]


@pytest.mark.parametrize("name, make_args", API_CASES)
def test_api_inference_uses_op(name, make_args):
    args = make_args()
    out = getattr(ops, name)(*args)
    torch.testing.assert_close(out, getattr(reference, name)(*args))
    for tensor in args:
        tensor.requires_grad_(True)
    with torch.no_grad():
        out = getattr(ops, name)(*args)
    assert out.grad_fn is None


@pytest.mark.parametrize("name, make_args", API_CASES)
def test_api_backward_through_reference(name, make_args):
    args = [tensor.double().requires_grad_(True) for tensor in make_args()]
    out = getattr(ops, name)(*args)
    assert out.grad_fn is not None
    cotangent = randn(*out.shape, dtype=torch.float64, seed=9)
    grads = torch.autograd.grad(out, args, cotangent)
    eager = {
        "rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "rope": lambda x, c, s: rope_complex(x, c, s),
        "adalayernorm": lambda x, sc, sh: adalayernorm_eager(x, sc, sh, 1e-6),
        "glu": lambda *t: (lambda a, b: a * F.silu(b))(*(t if len(t) == 2 else t[0].chunk(2, dim=-1))),
        "fast_gelu": lambda x: F.gelu(x, approximate="tanh"),
        "mul_add": lambda x, y, z: x * y + z,
    }[name]
    expected = torch.autograd.grad(eager(*args), args, cotangent)
    for grad, expected_grad in zip(grads, expected):
        torch.testing.assert_close(grad, expected_grad)


def test_api_defaults():
    x = randn(3, 16)
    torch.testing.assert_close(ops.rms_norm(x), F.rms_norm(x, (16,), None, 1e-6))
    q = randn(3, 16)
    cos, sin = randn(3, 8, seed=1), randn(3, 8, seed=2)
    torch.testing.assert_close(ops.rope(q, cos, sin), rope_complex(q, cos, sin).float())
    scale, shift = randn(16, seed=3), randn(16, seed=4)
    torch.testing.assert_close(
        ops.adalayernorm(x, scale, shift), adalayernorm_eager(x, scale, shift, 1e-6).float()
    )
