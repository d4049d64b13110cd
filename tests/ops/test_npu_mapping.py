"""Tests of the Ascend mapping (mindiesd/ops/kernels/npu.py) with a stand-in torch_npu.

No NPU (and no PrivateUse1 backend) exists here, so the mapping functions
are called directly on CPU tensors, with a ``torch_npu`` module put into
``sys.modules`` whose functions implement the documented semantics of the
real ones in plain torch and record their calls.  The tests check which op
calls which torch_npu function with which arguments, that mapped results
equal the reference, and that every other input runs the reference.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mindiesd.ops import registry, reference
from mindiesd.ops.kernels import npu as _npu

A2_SOC_VERSION = 223  # Ascend910B3
A3_SOC_VERSION = 250  # Ascend910_9391
OLDER_SOC_VERSIONS = [102, 202]  # Ascend910A, Ascend310P3

TOLERANCES = {
    torch.float32: (1e-6, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-3),
    torch.float16: (2e-3, 1e-4),
}


def randn(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _rotate_half(x):
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_interleaved(x):
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).reshape(x.shape)


class StandInTorchNpu(types.ModuleType):
    """torch_npu's fused ops as documented, in plain torch, recording every call."""

    def __init__(self, soc_version=A2_SOC_VERSION, rotary_mode_argument=True):
        super().__init__("torch_npu")
        self.calls: list[tuple[str, tuple, dict]] = []
        self._C = types.SimpleNamespace(_npu_get_soc_version=lambda: soc_version)
        if rotary_mode_argument:
            self.npu_rotary_mul = self._rotary_mul
        else:
            self.npu_rotary_mul = lambda input, r1, r2: self._rotary_mul(input, r1, r2)

    def names(self):
        return [name for name, _, _ in self.calls]

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        """(x / sqrt(mean(x**2) + eps) * gamma, 1 / rms), over gamma's trailing dims."""
        self.calls.append(("npu_rms_norm", (x, gamma, epsilon), {}))
        assert gamma.dtype == x.dtype, "gamma must have x's dtype"
        assert 2 <= x.dim() <= 8
        dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        values = x.float()
        rstd = torch.rsqrt(values.pow(2).mean(dim=dims, keepdim=True) + epsilon)
        return (values * rstd * gamma.float()).to(x.dtype), rstd

    def _rotary_mul(self, input, r1, r2, rotary_mode="half"):
        """r1 * x + r2 * rotate(x) with rotate_half ("half") or interleaved pairs."""
        self.calls.append(("npu_rotary_mul", (input, r1, r2), {"rotary_mode": rotary_mode}))
        assert input.dim() == r1.dim() == r2.dim() == 4
        assert r1.shape[-1] == r2.shape[-1] == input.shape[-1]
        values = input.float()
        rotate = _rotate_half if rotary_mode == "half" else _rotate_interleaved
        result = r1.float() * values + r2.float() * rotate(values)
        return result.to(input.dtype)

    def npu_group_norm_silu(self, input, weight, bias, group, eps=1e-5):
        """(silu(group_norm(input)), mean, rstd): x of 2 to 8 dims, weight and bias [C] of one dtype no narrower
        than x's, the output in x's dtype."""
        self.calls.append(("npu_group_norm_silu", (input, weight, bias, group, eps), {}))
        assert 2 <= input.dim() <= 8 and weight.shape == bias.shape == (input.shape[1],)
        assert weight.dtype == bias.dtype and torch.promote_types(input.dtype, weight.dtype) == weight.dtype
        values = input.float()
        grouped = values.reshape(input.shape[0], group, -1)
        mean = grouped.mean(-1, keepdim=True)
        rstd = torch.rsqrt(grouped.var(-1, unbiased=False, keepdim=True) + eps)
        per_channel = (1, -1) + (1,) * (input.dim() - 2)
        normed = ((grouped - mean) * rstd).reshape(input.shape) * weight.float().reshape(per_channel)
        normed = normed + bias.float().reshape(per_channel)
        return torch.nn.functional.silu(normed).to(input.dtype), mean.to(input.dtype), rstd.to(input.dtype)

    def npu_swiglu(self, input, dim=-1):
        """silu(A) * B of the first half A and the second half B of input along dim (contiguous input only)."""
        self.calls.append(("npu_swiglu", (input,), {"dim": dim}))
        assert input.is_contiguous() and input.numel() > 0 and 1 <= input.dim() <= 8
        first, second = torch.chunk(input.float(), 2, dim=dim)
        return (torch.nn.functional.silu(first) * second).to(input.dtype)

    def npu_fast_gelu(self, x):
        """x * sigmoid(1.702 x) -- not the tanh GELU."""
        self.calls.append(("npu_fast_gelu", (x,), {}))
        return x * torch.sigmoid(1.702 * x)


@pytest.fixture
def install(monkeypatch):
    """Put a stand-in torch_npu into sys.modules; returns a factory for it."""

    def make(**options):
        module = StandInTorchNpu(**options)
        monkeypatch.setitem(sys.modules, "torch_npu", module)
        _npu.rotary_mul_modes.cache_clear()
        return module

    yield make
    _npu.rotary_mul_modes.cache_clear()


@pytest.fixture
def npu(install):
    return install()


def assert_reference(out, expected):
    assert out.dtype == expected.dtype
    assert out.shape == expected.shape
    assert out.is_contiguous()
    rtol, atol = TOLERANCES.get(expected.dtype, (1e-10, 1e-10))
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_calls_npu_rms_norm(npu, dtype):
    x, weight = randn(2, 5, 40, dtype=dtype), randn(40, dtype=dtype, seed=1)
    out = _npu.rms_norm(x, weight, 1e-5)
    assert npu.names() == ["npu_rms_norm"]
    (called_x, gamma, epsilon) = npu.calls[0][1]
    assert called_x is x and epsilon == 1e-5
    assert gamma.shape == (40,) and gamma.data_ptr() == weight.data_ptr()
    assert_reference(out, reference.rms_norm(x, weight, 1e-5))


def test_rms_norm_without_weight_passes_ones(npu):
    x = randn(3, 96, dtype=torch.bfloat16)
    out = _npu.rms_norm(x, None, 1e-6)
    gamma = npu.calls[0][1][1]
    assert gamma.dtype == torch.bfloat16 and gamma.shape == (96,)
    assert torch.equal(gamma, torch.ones(96, dtype=torch.bfloat16))
    assert_reference(out, reference.rms_norm(x, None, 1e-6))


def test_rms_norm_weight_with_leading_ones_and_lower_dtype(npu):
    x = randn(2, 5, 24)
    weight = randn(1, 1, 24, seed=1)
    assert_reference(_npu.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    assert npu.calls[-1][1][1].shape == (24,)
    low = randn(24, dtype=torch.bfloat16, seed=1)  # promotes into x's float32
    assert_reference(_npu.rms_norm(x, low, 1e-6), reference.rms_norm(x, low, 1e-6))
    assert npu.calls[-1][1][1].dtype == torch.float32


def test_rms_norm_float32_result_rounds_once_to_out_dtype(npu):
    x, weight = randn(4, 40), randn(40, seed=1)
    out = _npu.rms_norm(x, weight, 1e-6, torch.bfloat16)
    assert npu.names() == ["npu_rms_norm"]
    assert_reference(out, reference.rms_norm(x, weight, 1e-6, torch.bfloat16))


@pytest.mark.parametrize(
    "case",
    [
        "weight varies over rows",
        "weight of two dims",
        "scalar weight",
        "weight promotes x",
        "16-bit x, float32 output",
        "float64",
        "one-dim x",
    ],
)
def test_rms_norm_unmatched_forms_use_the_reference(npu, case):
    x, weight, out_dtype = {
        "weight varies over rows": (randn(2, 5, 24), randn(2, 5, 24, seed=1), None),
        "weight of two dims": (randn(2, 5, 24), randn(5, 24, seed=1), None),
        "scalar weight": (randn(2, 5, 24), randn(seed=1), None),
        "weight promotes x": (randn(3, 24, dtype=torch.bfloat16), randn(24, seed=1), None),
        "16-bit x, float32 output": (randn(3, 24, dtype=torch.float16), None, torch.float32),
        "float64": (randn(3, 24, dtype=torch.float64), None, None),
        "one-dim x": (randn(24), randn(24, seed=1), None),
    }[case]
    out = _npu.rms_norm(x, weight, 1e-6, out_dtype)
    assert npu.calls == []
    assert_reference(out, reference.rms_norm(x, weight, 1e-6, out_dtype))


# ----------------------------------------------------------------------------
# rope
# ----------------------------------------------------------------------------

B, N, S, D = 2, 3, 5, 16

# (x shape, table shape) for each documented layout and table form.
HALF_FORMS = {
    "BNSD 11SD": ((B, N, S, D), (1, 1, S, D)),
    "BNSD B1SD": ((B, N, S, D), (B, 1, S, D)),
    "BNSD BNSD": ((B, N, S, D), (B, N, S, D)),
    "BSND 1S1D": ((B, S, N, D), (1, S, 1, D)),
    "BSND BS1D": ((B, S, N, D), (B, S, 1, D)),
    "SBND S11D": ((S, B, N, D), (S, 1, 1, D)),
    "BNSD SD (2-D table)": ((B, N, S, D), (S, D)),
}
INTERLEAVE_FORMS = ["BNSD 11SD", "BSND 1S1D", "SBND S11D", "BNSD SD (2-D table)"]


@pytest.mark.parametrize("soc_version", [A2_SOC_VERSION, A3_SOC_VERSION])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", list(HALF_FORMS))
def test_rope_half_rotation_calls_npu_rotary_mul(install, form, dtype, soc_version):
    npu = install(soc_version=soc_version)
    x_shape, table_shape = HALF_FORMS[form]
    x = randn(*x_shape, dtype=dtype)
    cos, sin = randn(*table_shape, dtype=dtype, seed=1), randn(*table_shape, dtype=dtype, seed=2)
    out = _npu.rope(x, cos, sin, False)
    assert npu.names() == ["npu_rotary_mul"]
    name, (called_x, r1, r2), _ = npu.calls[0]
    assert called_x is x
    assert r1.dim() == 4 and r1.data_ptr() == cos.data_ptr() and r2.data_ptr() == sin.data_ptr()
    assert_reference(out, reference.rope(x, cos, sin, False))


def test_rope_half_rotation_passes_no_mode(npu):
    x, cos, sin = randn(B, N, S, D), randn(S, D, seed=1), randn(S, D, seed=2)
    calls = []
    npu.npu_rotary_mul = lambda *args, **kwargs: calls.append((args, kwargs)) or args[0]
    _npu.rope(x, cos, sin, False)
    assert len(calls) == 1 and len(calls[0][0]) == 3 and calls[0][1] == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", INTERLEAVE_FORMS)
def test_rope_interleaved_calls_interleave_mode(npu, form, dtype):
    x_shape, table_shape = HALF_FORMS[form]
    x = randn(*x_shape, dtype=dtype)
    cos, sin = randn(*table_shape, dtype=dtype, seed=1), randn(*table_shape, dtype=dtype, seed=2)
    out = _npu.rope(x, cos, sin, True)
    assert npu.names() == ["npu_rotary_mul"]
    assert npu.calls[0][2] == {"rotary_mode": "interleave"}
    assert_reference(out, reference.rope(x, cos, sin, True))


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_per_pair_tables_are_widened(npu, interleaved):
    x = randn(B, S, N, D, dtype=torch.bfloat16)
    cos = randn(1, S, 1, D // 2, dtype=torch.bfloat16, seed=1)
    sin = randn(S, 1, D // 2, dtype=torch.bfloat16, seed=2)
    out = _npu.rope(x, cos, sin, interleaved)
    _, (_, r1, r2), _ = npu.calls[0]
    assert r1.shape == r2.shape == (1, S, 1, D)
    widen = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat((t, t), -1))
    assert torch.equal(r1, widen(cos)) and torch.equal(r2, widen(sin).reshape(1, S, 1, D))
    assert_reference(out, reference.rope(x, cos, sin, interleaved))


def test_rope_float32_result_rounds_once_to_out_dtype(npu):
    x, cos, sin = randn(B, N, S, D), randn(S, D, seed=1), randn(S, D, seed=2)
    out = _npu.rope(x, cos, sin, False, torch.float16)
    assert npu.names() == ["npu_rotary_mul"]
    assert_reference(out, reference.rope(x, cos, sin, False, torch.float16))


ROPE_UNMATCHED = {
    # name: (x shape, cos shape, sin shape, interleaved, x dtype, table dtype, out dtype)
    "3-D x": ((N, S, D), (S, D), (S, D), False, torch.float32, torch.float32, None),
    "one-value tables": ((B, N, S, D), (S, 1), (S, 1), False, torch.float32, torch.float32, None),
    "tables of different shapes": (
        (B, N, S, D), (S, D), (B, 1, S, D), False, torch.float32, torch.float32, None,
    ),
    "tables in float32, x in bfloat16": (
        (B, N, S, D), (S, D), (S, D), False, torch.bfloat16, torch.float32, None,
    ),
    "16-bit x, float32 output": (
        (B, N, S, D), (S, D), (S, D), False, torch.float16, torch.float16, torch.float32,
    ),
    "float64": ((B, N, S, D), (S, D), (S, D), False, torch.float64, torch.float64, None),
    "undocumented table form 1NSD": (
        (B, N, S, D), (1, N, S, D), (1, N, S, D), False, torch.float32, torch.float32, None,
    ),
    "interleave with B1SD table": (
        (B, N, S, D), (B, 1, S, D), (B, 1, S, D), True, torch.float32, torch.float32, None,
    ),
    "interleave with full-shape table": (
        (B, N, S, D), (B, N, S, D), (B, N, S, D), True, torch.float32, torch.float32, None,
    ),
    "D of 896": ((1, 2, 3, 896), (3, 896), (3, 896), False, torch.float32, torch.float32, None),
    "half with B of 1000": (
        (1000, 1, 1, 2), (1, 1, 1, 2), (1, 1, 1, 2), False, torch.float32, torch.float32, None,
    ),
    "interleave with B * N of 1000": (
        (40, 25, 1, 2), (1, 1, 1, 2), (1, 1, 1, 2), True, torch.float32, torch.float32, None,
    ),
    "full-shape table with S of 1000": (
        (2, 3, 1000, 2), (2, 3, 1000, 2), (2, 3, 1000, 2), False,
        torch.float32, torch.float32, None,
    ),
}


@pytest.mark.parametrize("case", list(ROPE_UNMATCHED))
def test_rope_unmatched_forms_use_the_reference(npu, case):
    x_shape, cos_shape, sin_shape, interleaved, dtype, table_dtype, out_dtype = ROPE_UNMATCHED[case]
    x = randn(*x_shape, dtype=dtype)
    cos = randn(*cos_shape, dtype=table_dtype, seed=1)
    sin = randn(*sin_shape, dtype=table_dtype, seed=2)
    out = _npu.rope(x, cos, sin, interleaved, out_dtype)
    assert npu.calls == []
    assert_reference(out, reference.rope(x, cos, sin, interleaved, out_dtype))


def test_rope_size_limits_just_inside(npu):
    for x_shape, interleaved in (((999, 1, 1, 2), False), ((40, 24, 1, 2), True)):
        x, cos, sin = randn(*x_shape), randn(1, 1, 1, 2, seed=1), randn(1, 1, 1, 2, seed=2)
        assert_reference(
            _npu.rope(x, cos, sin, interleaved), reference.rope(x, cos, sin, interleaved)
        )
    assert npu.names() == ["npu_rotary_mul", "npu_rotary_mul"]


@pytest.mark.parametrize("soc_version", OLDER_SOC_VERSIONS)
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_uses_the_reference_off_atlas_a2_a3(install, soc_version, interleaved):
    npu = install(soc_version=soc_version)
    x, cos, sin = randn(B, N, S, D), randn(S, D, seed=1), randn(S, D, seed=2)
    out = _npu.rope(x, cos, sin, interleaved)
    assert npu.calls == []
    assert _npu.rotary_mul_modes() == frozenset()
    assert_reference(out, reference.rope(x, cos, sin, interleaved))


def test_rope_interleaved_needs_the_rotary_mode_argument(install):
    npu = install(rotary_mode_argument=False)
    assert _npu.rotary_mul_modes() == frozenset({"half"})
    x, cos, sin = randn(B, N, S, D), randn(S, D, seed=1), randn(S, D, seed=2)
    assert_reference(_npu.rope(x, cos, sin, True), reference.rope(x, cos, sin, True))
    assert npu.calls == []
    assert_reference(_npu.rope(x, cos, sin, False), reference.rope(x, cos, sin, False))
    assert npu.names() == ["npu_rotary_mul"]


def test_rotary_modes_without_soc_information(npu):
    del npu._C
    assert _npu.rotary_mul_modes() == frozenset()


# ----------------------------------------------------------------------------
# glu
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_glu_of_the_first_half_calls_npu_swiglu(npu, dtype):
    x = randn(2, 5, 96, dtype=dtype) * 2
    out = _npu.glu(x, None, "silu", True)
    assert npu.names() == ["npu_swiglu"] and npu.calls[0][2] == {"dim": -1}
    assert_reference(out, reference.glu(x, None, "silu", True))


GLU_UNMAPPED = {
    "second_half_gated": lambda: (randn(2, 5, 96), None, "silu", False),
    "gelu": lambda: (randn(2, 5, 96), None, "gelu", True),
    "gelu_tanh": lambda: (randn(2, 5, 96), None, "gelu_tanh", True),
    "two_tensors": lambda: (randn(2, 5, 48), randn(2, 5, 48, seed=1), "silu", True),
    "strided_halves": lambda: (randn(2, 5, 144)[..., :96], None, "silu", True),
    "float64": lambda: (randn(2, 96, dtype=torch.float64), None, "silu", True),
}


@pytest.mark.parametrize("case", sorted(GLU_UNMAPPED))
def test_glu_other_forms_use_the_reference(npu, case):
    args = GLU_UNMAPPED[case]()
    out = _npu.glu(*args)
    assert npu.calls == []
    assert_reference(out, reference.glu(*args))


def test_glu_is_declared_not_faster_on_npu():
    declared = _npu.GLU.kernels["npu"]
    assert declared.fast is False and "npu_swiglu" in declared.note


# ----------------------------------------------------------------------------
# fast_gelu, adalayernorm, mul_add
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_gelu_never_calls_npu_fast_gelu(npu, dtype):
    x = randn(4, 96, dtype=dtype) * 3
    out = _npu.fast_gelu(x)
    assert npu.calls == []
    assert_reference(out, reference.fast_gelu(x))


def test_npu_fast_gelu_is_a_different_function(npu):
    x = torch.linspace(-4, 4, 81)
    difference = (npu.npu_fast_gelu(x) - reference.fast_gelu(x)).abs().max()
    assert difference > 1e-2


def test_adalayernorm_and_mul_add_use_the_reference(npu):
    x = randn(2, 5, 40, dtype=torch.bfloat16)
    scale, shift = randn(2, 1, 40, seed=1), randn(40, seed=2)
    assert_reference(
        _npu.adalayernorm(x, scale, shift, 1e-6), reference.adalayernorm(x, scale, shift, 1e-6)
    )
    y, z = randn(2, 1, 40, dtype=torch.bfloat16, seed=3), randn(40, dtype=torch.bfloat16, seed=4)
    assert_reference(_npu.mul_add(x, y, z), reference.mul_add(x, y, z))
    assert npu.calls == []


# ----------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------


@pytest.fixture
def recorded_registrations(monkeypatch):
    """Replace the dispatcher registration by a record in a private DEVICE_KERNELS."""
    device_kernels: dict = {}
    calls = []

    def record(name, device_type, kernel):
        calls.append((name, device_type, kernel))
        device_kernels.setdefault(device_type, {})[name] = kernel

    monkeypatch.setattr(registry, "register_device_kernel", record)
    monkeypatch.setattr(registry, "DEVICE_KERNELS", device_kernels)
    return calls


def test_register_binds_all_ops_to_npu(npu, recorded_registrations):
    assert _npu.register() is True
    assert sorted(name for name, _, _ in recorded_registrations) == sorted(_npu.KERNELS)
    assert {device for _, device, _ in recorded_registrations} == {"npu"}
    assert all(kernel is _npu.KERNELS[name] for name, _, kernel in recorded_registrations)
    assert registry.DISPATCH_KEYS["npu"] == "PrivateUse1"
    assert _npu.register() is True
    assert len(recorded_registrations) == len(_npu.KERNELS)  # second call: nothing new


def test_register_without_torch_npu(monkeypatch, recorded_registrations):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    assert _npu.register() is False
    assert recorded_registrations == []


def test_import_registers_no_npu_kernels_without_torch_npu():
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    assert "npu" not in registry.DEVICE_KERNELS
