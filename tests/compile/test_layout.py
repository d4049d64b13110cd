"""Fused ops keep eager's memory layout, so fusion survives a later ``view`` and regional compilation.

Every family gets inputs that are transposed views (``[B, H, S, D]`` from ``transpose(1, 2)`` of ``[B, S, H, D]``),
permuted, sliced with a step, channels-last and broadcast. Each test module ends with a ``view`` that succeeds
only on eager's layout. The fused op must fire (counted), the output and its strides must be eager's, and no
fallback may hide a failure of the optimised graph.
"""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import assert_close, only, run_compiled
from mindiesd.benchmarks.ops import eager_rope, eager_rope_rotate_half
from mindiesd.compilation import MindieSDFallbackWarning
from mindiesd.ops import layout as op_layout

B, S, H, D = 2, 6, 3, 16
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def layout(name: str, dtype=torch.float32, seed=0) -> torch.Tensor:
    """A ``[B, H, S, D]`` tensor with the named memory layout."""
    if name == "transposed":
        t = _randn(B, S, H, D, seed=seed).transpose(1, 2)
    elif name == "permuted":  # no dimension in its usual place: D is not the innermost
        t = _randn(S, D, B, H, seed=seed).permute(2, 3, 0, 1)
    elif name == "step_slice":
        t = _randn(B, H, S, 2 * D, seed=seed)[..., ::2]
    elif name == "channels_last":
        t = _randn(B, H, S, D, seed=seed).contiguous(memory_format=torch.channels_last)
    elif name == "broadcast":  # one row per head, broadcast over heads (zero stride, overlapping)
        t = _randn(B, 1, S, D, seed=seed).expand(B, H, S, D)
    elif name == "contiguous":
        t = _randn(B, H, S, D, seed=seed)
    else:
        raise ValueError(name)
    return t.to(dtype) if dtype != torch.float32 else t


LAYOUTS = ["transposed", "permuted", "step_slice", "channels_last", "broadcast"]


def _flatten_in_memory_order(y: torch.Tensor, order) -> torch.Tensor:
    """``view(-1)`` in the memory order ``order``: raises unless y has exactly that dense layout."""
    return y.permute(order).view(-1)


def check_layout(fn, family, *args, dtype=torch.float32, count=1):
    """Compile ``fn(*args)`` followed by a view that needs eager's layout; assert fused, equal, no fallback."""
    with torch.no_grad():
        eager = fn(*args)
    order = op_layout.memory_order(tuple(eager.shape), eager.stride())

    def with_view(*a):
        y = fn(*a)
        return y, _flatten_in_memory_order(y, order)

    with warnings.catch_warnings():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        (out, flat), (ref, ref_flat), counts, backend = run_compiled(with_view, *args)
    assert backend.report().fallbacks == [], backend.report().fallbacks
    assert counts == only(family, count), counts
    assert out.stride() == ref.stride(), (out.stride(), ref.stride())
    assert_close(out, ref, dtype)
    assert_close(flat, ref_flat, dtype)


# ---------------------------------------------------------------------------------------------- rms_norm
def _rms_explicit(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def _rms_diffusers(x, w):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + 1e-5)
    return y.to(x.dtype) * w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("form", [_rms_explicit, _rms_diffusers, lambda x, w: F.rms_norm(x, [D], w, 1e-6)],
                         ids=["explicit", "diffusers", "F.rms_norm"])
def test_rms_norm_keeps_layout(form, name, dtype):
    check_layout(form, "rms_norm", layout(name, dtype), _randn(D, seed=1).to(dtype), dtype=dtype)


# ---------------------------------------------------------------------------------------------- rope
def _cos_sin():
    freqs = _randn(S, D // 2, seed=5)
    return freqs.cos().repeat_interleave(2, -1), freqs.sin().repeat_interleave(2, -1)


_rope_flux = eager_rope  # Flux's apply_rotary_emb, as the op bench times it
_rope_half = eager_rope_rotate_half


def _rope_wan(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("form", [_rope_flux, _rope_half, _rope_wan], ids=["flux", "rotate_half", "wan"])
def test_rope_keeps_layout(form, name, dtype):
    cos, sin = _cos_sin()
    if form is _rope_half:
        cos, sin = cos[..., : D // 2].repeat(1, 2), sin[..., : D // 2].repeat(1, 2)
    check_layout(form, "rope", layout(name, dtype), cos, sin, dtype=dtype)


@pytest.mark.parametrize("name", ["transposed", "broadcast", "contiguous"])
def test_rope_complex_keeps_layout(name):
    def fn(x, freqs):  # the complex form (Lumina, Wan 2.1): needs a unit-stride last dim
        rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs
        return torch.view_as_real(rotated).flatten(3).type_as(x)

    freqs = torch.polar(torch.ones(S, D // 2), _randn(S, D // 2, seed=3))
    check_layout(fn, "rope", layout(name), freqs)


# ---------------------------------------------------------------------------------------------- adalayernorm
def _adaln(x, scale, shift):
    return F.layer_norm(x, (D,), eps=1e-6) * (1 + scale) + shift


def _adaln_wan(x, scale, shift):
    return (F.layer_norm(x.float(), (D,), eps=1e-6) * (1 + scale) + shift).type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("form", [_adaln, _adaln_wan], ids=["zero", "wan_fp32"])
def test_adalayernorm_keeps_layout(form, name, dtype):
    mod_dtype = torch.float32 if form is _adaln_wan else dtype
    scale, shift = _randn(B, 1, 1, D, seed=1).to(mod_dtype), _randn(B, 1, 1, D, seed=2).to(mod_dtype)
    check_layout(form, "adalayernorm", layout(name, dtype), scale, shift, dtype=dtype)


# ---------------------------------------------------------------------------------------------- fast_gelu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_fast_gelu_keeps_layout(name, dtype):
    check_layout(lambda x: F.gelu(x, approximate="tanh"), "fast_gelu", layout(name, dtype), dtype=dtype)


# ---------------------------------------------------------------------------------------------- mul_add
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("role", ["x", "y", "z"])
@pytest.mark.parametrize("order", ["xy+z", "z+xy"])
def test_mul_add_keeps_layout(order, role, name, dtype):
    """One operand with the named layout, the others contiguous; the gate broadcasts over S."""
    full = {"x": _randn(B, H, S, D, seed=1), "y": _randn(B, H, 1, D, seed=2), "z": _randn(B, H, S, D, seed=3)}
    full[role] = layout(name, seed=4)
    x, y, z = (full[k].to(dtype) for k in "xyz")
    fn = (lambda x, y, z: x * y + z) if order == "xy+z" else (lambda x, y, z: z + x * y)
    check_layout(fn, "mul_add", x, y, z, dtype=dtype)


def test_gated_residual_of_a_transposed_sum_then_view():
    """Flux-style residual gate on an attention output transposed back from heads, then flattened."""

    def fn(hidden, attn, gate):
        attn = attn.transpose(1, 2)  # [B, S, H, D] view of [B, H, S, D]
        out = hidden + gate * attn
        return out

    hidden = _randn(B, S, H, D, seed=1)
    attn = _randn(B, H, S, D, seed=2)
    gate = _randn(B, 1, 1, D, seed=3)
    check_layout(fn, "mul_add", hidden, attn, gate)


# ---------------------------------------------------------------------------------------------- the ops
OPS = {
    "rms_norm": lambda x, ops: ops.rms_norm(x, _randn(D, seed=1).to(x.dtype), 1e-6),
    "rope": lambda x, ops: ops.rope(x, *_cos_sin(), True),
    "adalayernorm": lambda x, ops: ops.adalayernorm(x, _randn(B, 1, 1, D, seed=1), _randn(D, seed=2), 1e-6),
    "fast_gelu": lambda x, ops: ops.fast_gelu(x),
    "mul_add": lambda x, ops: ops.mul_add(_randn(B, 1, 1, D, seed=1), x, _randn(B, H, S, D, seed=2)),
}


@pytest.mark.parametrize("name", LAYOUTS + ["contiguous"])
@pytest.mark.parametrize("op", list(OPS))
def test_op_layout_is_the_rule_in_every_implementation(op, name):
    """The registered CPU kernel, the reference and the fake kernel all return the rule's strides."""
    import mindiesd.ops as ops
    from mindiesd.ops import reference
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = layout(name)
    expected = op_layout.output_layout(op, _inputs_of(op, x))[1]
    kernel = OPS[op](x, ops)
    assert kernel.stride() == expected
    ref = OPS[op](x, reference)
    assert ref.stride() == expected
    torch.testing.assert_close(kernel, ref, rtol=1e-5, atol=1e-5)
    with FakeTensorMode() as mode:
        fake = OPS[op](mode.from_tensor(x), torch.ops.mindiesd)
    assert fake.stride() == expected


def _inputs_of(op, x):
    if op == "mul_add":
        return (_randn(B, 1, 1, D), x, _randn(B, H, S, D))
    return (x,)


@pytest.mark.parametrize("name", LAYOUTS)
def test_rule_matches_eager_sequences(name):
    """The rule is eager's: each op's layout equals that of the sequence it replaces, on real tensors."""
    x = layout(name)
    w = _randn(D, seed=1)
    assert op_layout.output_layout("rms_norm", (x,))[1] == _rms_explicit(x, w).stride()
    assert op_layout.output_layout("fast_gelu", (x,))[1] == F.gelu(x, approximate="tanh").stride()
    cos, sin = _cos_sin()
    assert op_layout.output_layout("rope", (x,))[1] == _rope_flux(x, cos, sin).stride()
    scale = _randn(B, 1, 1, D, seed=2)
    assert op_layout.output_layout("adalayernorm", (x,))[1] == _adaln(x, scale, scale).stride()
    y, z = _randn(B, 1, 1, D), _randn(B, H, S, D)
    assert op_layout.output_layout("mul_add", (y, x, z))[1] == (y * x + z).stride()


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("implementation", ["composition", "cpp"])
def test_conform_gives_every_cpu_kernel_the_rule(implementation, op, name):
    """The raw kernels write contiguous outputs; behind ``conform`` each returns the rule's strides and values."""
    from mindiesd.ops import reference
    from mindiesd.ops.kernels import cpp as _cpp_kernels, cpu as _cpu

    if implementation == "cpp":
        if not _cpp_kernels.enabled():
            pytest.skip(f"C++ kernels are disabled by {_cpp_kernels.ENABLE_ENV}={os.environ[_cpp_kernels.ENABLE_ENV]}")
        if not _cpp_kernels.build_cpu_kernels():  # else the wrappers would quietly run the compositions
            pytest.skip(f"C++ CPU kernels unavailable: {_cpp_kernels.cpu_kernel_implementation()}")
    kernels = _cpu.KERNELS if implementation == "composition" else _cpp_kernels.KERNELS
    x = layout(name)
    ref = OPS[op](x, reference)
    out = OPS[op](x, _Positional({k: op_layout.conform(k, kernels[k]) for k in kernels}))
    assert out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class _Positional:
    """Calls kernels the way the dispatcher does: every schema argument positionally."""

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, op):
        return self.kernels[op]


def test_a_registered_device_kernel_gets_the_layout(monkeypatch):
    """Any kernel registered for a device (Triton, torch_npu, a user's) is put behind the layout adapter."""
    from mindiesd.ops import registry

    original = registry.DEVICE_KERNELS["cpu"]["fast_gelu"]
    calls = []

    def contiguous_only(x):
        calls.append(x.is_contiguous())
        return F.gelu(x.contiguous(), approximate="tanh")

    try:
        registry.register_device_kernel("fast_gelu", "cpu", contiguous_only)
        x = layout("transposed")
        out = torch.ops.mindiesd.fast_gelu(x)
        assert calls == [True]  # the adapter handed the kernel x in its memory order: no copy
        assert out.stride() == x.stride()
        torch.testing.assert_close(out, F.gelu(x, approximate="tanh"))
    finally:
        registry.register_device_kernel("fast_gelu", "cpu", original)
