"""Tests of the Triton kernels (mindiesd/ops/kernels/triton.py) in Triton's interpreter.

The kernels run on CPU tensors with TRITON_INTERPRET=1.  Triton fixes that
mode when it is first imported (its own library functions are decorated
then), and other tests in a pytest process may import Triton earlier, so
the kernel tests (class ``TestKernels``) run in a fresh pytest process that
has the variable set from the start; ``test_kernels_in_interpreter`` starts
it.  Run with TRITON_INTERPRET=1 already set, this module runs the class
directly.  The wrappers are called directly: CPU tensors never reach the
"cuda" dispatch key.  On a machine with a CUDA device the class also runs
in this process, on the GPU, with the compiled kernels.

The interpreter rounds float32 -> bfloat16 by truncation, where GPUs round
to nearest even, so bfloat16 results are compared with a tolerance of one
bfloat16 step; the float32 computation itself is checked exactly through
``out_dtype=torch.float32``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from mindiesd.ops import registry, reference  # noqa: E402
from mindiesd.ops.kernels import triton as kernels  # noqa: E402
import op_checks  # noqa: E402
from op_checks import DTYPES, TOLERANCES  # noqa: E402

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not IN_INTERPRETER else "cpu"
REPO_ROOT = Path(__file__).resolve().parents[2]
INTERPRETER_RUN_TIMEOUT_S = 300



def randn(*shape, dtype=torch.float32, seed=0):
    return op_checks.randn(*shape, dtype=dtype, seed=seed, device=DEVICE)


def check(name, *args):
    """The Triton wrapper agrees with the reference on dtype, shape, layout and values."""
    out = getattr(kernels, name)(*args)
    expected = getattr(reference, name)(*args)
    assert out.dtype == expected.dtype
    assert out.shape == expected.shape
    assert out.is_contiguous()
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(
        out.to(torch.float64), expected.to(torch.float64), rtol=rtol, atol=atol
    )
    return out


class TestKernels:
    """The kernels against the reference, in the interpreter or on a CUDA device."""

    __test__ = IN_INTERPRETER or DEVICE == "cuda"

    def test_kernels_run_where_expected(self):
        kind = type(kernels._rms_norm_kernel).__name__
        assert kind == ("InterpretedFunction" if IN_INTERPRETER else "JITFunction")

    # ----------------------------------------------------------------------------
    # rms_norm
    # ----------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("width", [40, 96, 1000])
    def test_rms_norm(self, width, dtype):
        x = randn(2, 3, width, dtype=dtype)
        check("rms_norm", x, randn(width, dtype=dtype, seed=1), 1e-6)
        check("rms_norm", x, None, 1e-2)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_rms_norm_computes_in_float32(self, dtype):
        x = randn(3, 96, dtype=dtype)
        weight = randn(96, dtype=dtype, seed=1)
        out = kernels.rms_norm(x, weight, 1e-6, torch.float32)
        torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6, torch.float32))

    def test_rms_norm_weight_forms_and_mixed_dtypes(self):
        x = randn(2, 5, 24)
        check("rms_norm", x, randn(2, 5, 24, seed=1), 1e-6)
        check("rms_norm", x, randn(2, 1, 24, seed=1), 1e-6)
        check("rms_norm", x, randn(1, 24, seed=1), 1e-6)
        check("rms_norm", x.to(torch.bfloat16), randn(24, seed=1), 1e-6)
        check("rms_norm", x, randn(24, seed=1, dtype=torch.float16), 1e-6, torch.bfloat16)
        check("rms_norm", x.double(), randn(24, seed=1, dtype=torch.float64), 1e-6)
        check("rms_norm", randn(40), randn(40, seed=1), 1e-6)

    def test_rms_norm_non_contiguous(self):
        base = randn(4, 6, 80)
        check("rms_norm", base[:, :, :40], randn(40, seed=1), 1e-6)  # row stride > width
        check("rms_norm", base.transpose(0, 1), None, 1e-6)  # permuted rows
        check("rms_norm", base[..., ::2], randn(40, seed=1), 1e-6)  # strided last dim
        check("rms_norm", randn(6, 40).t(), None, 1e-6)  # last dim is the slow one

    def test_rms_norm_chunked_rows(self, monkeypatch):
        monkeypatch.setattr(kernels, "MAX_ROW_BLOCK", 32)
        for width in (40, 96, 1000):
            x = randn(3, width)
            check("rms_norm", x, randn(width, seed=1), 1e-6)
            check("rms_norm", x.to(torch.bfloat16)[:, : width // 2], None, 1e-6)

    # ----------------------------------------------------------------------------
    # adalayernorm
    # ----------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("width", [40, 96, 1000])
    def test_adalayernorm(self, width, dtype):
        x = randn(2, 3, width, dtype=dtype)
        check("adalayernorm", x, randn(2, 1, width, seed=1), randn(width, seed=2), 1e-6)
        check(
            "adalayernorm",
            x,
            randn(width, dtype=dtype, seed=1),
            randn(width, dtype=dtype, seed=2),
            1e-6,
        )

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_adalayernorm_computes_in_float32(self, dtype):
        x = randn(2, 3, 96, dtype=dtype)
        scale, shift = randn(2, 1, 96, dtype=dtype, seed=1), randn(96, dtype=dtype, seed=2)
        out = kernels.adalayernorm(x, scale, shift, 1e-6, torch.float32)
        torch.testing.assert_close(
            out, reference.adalayernorm(x, scale, shift, 1e-6, torch.float32)
        )

    def test_adalayernorm_modulation_forms(self):
        x = randn(2, 5, 24)
        check("adalayernorm", x, randn(2, 5, 24, seed=1), randn(2, 5, 24, seed=2), 1e-6)
        check("adalayernorm", x, randn(5, 1, seed=1), randn(1, 5, 24, seed=2), 1e-5)
        check("adalayernorm", x, randn(1, seed=1), randn(seed=2), 1e-5)
        x4 = randn(2, 3, 4, 24)
        check("adalayernorm", x4, randn(2, 1, 1, 24, seed=1), randn(1, 3, 1, 24, seed=2), 1e-6)

    def test_adalayernorm_non_contiguous_and_chunked(self, monkeypatch):
        base = randn(3, 4, 2 * 96)
        scale = randn(3, 1, 2 * 96, seed=1)[..., ::2]
        shift = randn(96, seed=2)
        check("adalayernorm", base[..., ::2], scale, shift, 1e-6)
        check("adalayernorm", base.transpose(0, 1)[..., :96], scale.transpose(0, 1), shift, 1e-6)
        monkeypatch.setattr(kernels, "MAX_ROW_BLOCK", 32)
        check("adalayernorm", base[..., :100], randn(100, seed=1), randn(100, seed=2), 1e-6)
        check("adalayernorm", randn(2, 1000), randn(2, 1, 1000, seed=1)[0], randn(1000), 1e-6)

    # ----------------------------------------------------------------------------
    # rope
    # ----------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("interleaved", [True, False])
    @pytest.mark.parametrize("table_width", ["full", "pair", "one"])
    def test_rope_table_forms(self, table_width, interleaved, dtype):
        x = randn(2, 5, 3, 40, dtype=dtype)  # [B, S, H, D]
        last = {"full": 40, "pair": 20, "one": 1}[table_width]
        cos, sin = randn(1, 5, 1, last, seed=1), randn(5, 1, last, seed=2)
        check("rope", x, cos.to(dtype), sin.to(dtype), interleaved)
        check("rope", x, cos, sin, interleaved)  # float32 tables: float32 output

    @pytest.mark.parametrize("interleaved", [True, False])
    def test_rope_broadcast_layouts(self, interleaved):
        x = randn(2, 3, 6, 8)  # [B, H, S, D]
        check("rope", x, randn(6, 8, seed=1), randn(6, 8, seed=2), interleaved)
        check("rope", x, randn(2, 1, 6, 4, seed=1), randn(1, 3, 1, 4, seed=2), interleaved)
        check("rope", x, randn(2, 3, 6, 8, seed=1), randn(8, seed=2), interleaved)
        check("rope", randn(6, 2), randn(6, 1, seed=1), randn(6, 2, seed=2), interleaved)

    @pytest.mark.parametrize("interleaved", [True, False])
    def test_rope_non_contiguous(self, interleaved):
        qkv = randn(2, 6, 3, 4, 16)  # [B, S, 3, H, D]
        query = qkv[:, :, 0].transpose(1, 2)  # [B, H, S, D] view
        cos = randn(6, 32, seed=1)[:, ::2]  # strided table
        sin = randn(16, 6, seed=2).t()  # transposed table
        check("rope", query, cos, sin, interleaved)
        key = randn(2, 6, 4, 32)[..., ::2]  # [B, S, H, D] with a strided last dim
        check("rope", key, cos.unsqueeze(1), sin.unsqueeze(1), interleaved)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_rope_computes_in_float32(self, dtype):
        x = randn(2, 4, 3, 16, dtype=dtype)
        cos, sin = randn(4, 1, 8, dtype=dtype, seed=1), randn(4, 1, 8, dtype=dtype, seed=2)
        for interleaved in (True, False):
            out = kernels.rope(x, cos, sin, interleaved, torch.float32)
            torch.testing.assert_close(
                out, reference.rope(x, cos, sin, interleaved, torch.float32)
            )

    def test_rope_large_pairs_use_several_programs(self, monkeypatch):
        monkeypatch.setattr(kernels, "ROPE_TILE", 16)
        x = randn(3, 5, 96)
        check("rope", x, randn(5, 96, seed=1), randn(5, 48, seed=2), True)
        check("rope", x, randn(5, 48, seed=1), randn(5, 96, seed=2), False)

    # ----------------------------------------------------------------------------
    # fast_gelu and mul_add
    # ----------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
    @pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
    def test_fast_gelu(self, dtype):
        x = randn(3, 1000, dtype=dtype) * 4
        check("fast_gelu", x)
        check("fast_gelu", x[:, 1::3])
        check("fast_gelu", x.t())
        check("fast_gelu", randn(dtype=dtype))
        extremes = torch.tensor([-30.0, -8.0, -1e-4, 0.0, 1e-4, 8.0, 30.0], device=DEVICE)
        extremes = extremes.to(dtype)
        check("fast_gelu", extremes)

    @pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
    @pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
    @pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
    def test_glu(self, dtype, activation):
        x = randn(3, 5, 2 * 500, dtype=dtype) * 4
        check("glu", x, None, activation, False)
        check("glu", x, None, activation, True)
        # the halves of a strided view (the MLP part of a fused projection), read in place
        check("glu", randn(2, 7, 3 * 48, dtype=dtype)[..., 48:], None, activation, True)
        check("glu", randn(2, 40, 5, dtype=dtype).transpose(1, 2), None, activation, False)
        a, b = randn(7, 33, dtype=dtype), randn(7, 33, dtype=dtype, seed=1)
        check("glu", a, b, activation, True)
        check("glu", a, b, activation, False)
        edges = torch.tensor([-100.0, -30.0, -8.0, -1e-4, 0.0, 1e-4, 8.0, 30.0, 100.0], device=DEVICE).to(dtype)
        check("glu", edges, torch.full_like(edges, 3.0), activation, True)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_mul_add(self, dtype):
        x = randn(2, 5, 40, dtype=dtype)
        check("mul_add", x, randn(2, 1, 40, seed=1, dtype=dtype), randn(2, 5, 40, seed=2))
        x = randn(5, 1, dtype=dtype)
        check("mul_add", x, randn(96, seed=1, dtype=dtype), randn(1, seed=2, dtype=dtype))
        x = randn(1, 7, 1, 40, dtype=dtype)
        check("mul_add", x, randn(3, 1, 2, 1, seed=1), randn(40, seed=2, dtype=dtype))

    def test_mul_add_layouts_and_fallbacks(self):
        base = randn(4, 6, 80)
        check("mul_add", base[..., ::2], randn(6, 4, 40, seed=1).transpose(0, 1), randn(seed=3))
        # Broadcasting that leaves six dims after coalescing: copied to contiguous.
        check("mul_add", randn(2, 1, 2, 1, 2, 1), randn(1, 2, 1, 2, 1, 2, seed=1), randn(2, seed=2))
        check("mul_add", randn(), randn(seed=1), randn(seed=2))
        check("mul_add", randn(0, 4), randn(4, seed=1), randn(1, seed=2))
        ints = torch.arange(6, device=DEVICE).reshape(2, 3)
        torch.testing.assert_close(kernels.mul_add(ints, ints, ints), ints * ints + ints)

    def test_many_row_dims_are_copied_to_contiguous(self):
        x = randn(2, 2, 2, 2, 2, 8).permute(4, 3, 2, 1, 0, 5)
        check("rms_norm", x, randn(8, seed=1), 1e-6)
        check("adalayernorm", x, randn(2, 1, 2, 1, 2, 8, seed=1), randn(8, seed=2), 1e-6)
        check("rope", x, randn(2, 1, 2, 1, 1, 8, seed=1), randn(8, seed=2), True)

    def test_empty_inputs(self):
        check("rms_norm", randn(0, 8), randn(8, seed=1), 1e-6)
        check("adalayernorm", randn(2, 0, 8), randn(8, seed=1), randn(8, seed=2), 1e-6)
        check("rope", randn(0, 3, 8), randn(8, seed=1), randn(8, seed=2), False)
        check("fast_gelu", randn(3, 0))
        check("glu", randn(3, 0), None, "silu", False)

    def test_validation_is_shared_with_the_reference(self):
        with pytest.raises(ValueError, match="must be even"):
            kernels.rope(randn(2, 5), randn(5), randn(5), True)
        with pytest.raises(ValueError, match="does not broadcast"):
            kernels.rms_norm(randn(2, 8), randn(4), 1e-6)
        with pytest.raises(ValueError, match="do not broadcast together"):
            kernels.mul_add(randn(2, 3), randn(4), randn(1))


def test_kernels_in_interpreter():
    """Run TestKernels in a fresh pytest process with TRITON_INTERPRET=1."""
    command = [sys.executable, "-m", "pytest", f"{__file__}::TestKernels", "-p", "no:cacheprovider"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=INTERPRETER_RUN_TIMEOUT_S,
    )
    report = result.stdout[-12000:] + result.stderr[-4000:]
    assert result.returncode == 0, report
    print(report.strip().splitlines()[-1])


test_kernels_in_interpreter.__test__ = not IN_INTERPRETER


# ----------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------


def test_register_needs_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "register_device_kernel", lambda *args: calls.append(args))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.register() is False
    assert calls == []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(registry, "DEVICE_KERNELS", {})
    assert kernels.register() is True
    assert sorted(name for name, _, _ in calls) == sorted(registry.SCHEMAS)
    assert {device for _, device, _ in calls} == {"cuda"}
    assert all(kernel is kernels.KERNELS[name] for name, _, kernel in calls)


def test_import_does_not_load_triton_without_cuda():
    script = textwrap.dedent(
        """
        import sys
        import torch
        import mindiesd.ops
        assert not torch.cuda.is_available()
        assert "triton" not in sys.modules, "triton was imported"
        assert "mindiesd.ops.kernels.triton" not in sys.modules
        assert "cuda" not in mindiesd.ops.registry.DEVICE_KERNELS
        print("ok")
        """
    )
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_cuda_tensors_dispatch_to_the_triton_kernels():
    assert registry.DEVICE_KERNELS["cuda"] == kernels.KERNELS
    x, weight = randn(4, 96), randn(96, seed=1)
    out = torch.ops.mindiesd.rms_norm.default(x, weight, 1e-6)
    torch.testing.assert_close(out, kernels.rms_norm(x, weight, 1e-6), rtol=0, atol=0)
