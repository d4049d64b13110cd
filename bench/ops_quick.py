"""Quick CPU timing: the eager op sequence each fused op replaces vs its CPU kernel.

Shapes: fp32 [2, 4096, 1024] (rope: x [1, 4096, 24, 128], cos/sin [1, 4096, 1, 128]).
The candidates of one case run interleaved in one process, so drift in
machine load hits them alike; the median of ``--reps`` runs is reported.

    python bench/ops_quick.py [--reps 30] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import mindiesd.ops  # noqa: F401  (registers torch.ops.mindiesd)

OPS = torch.ops.mindiesd
EPS = 1e-6


def eager_rms_norm(x, weight):
    """diffusers RMSNorm.forward for fp32 input."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden = x * torch.rsqrt(variance + EPS)
    return hidden * weight


def eager_adalayernorm(x, scale, shift):
    """AdaLayerNorm modulation as written in DiT blocks."""
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale) + shift


def eager_rope_flux(x, cos, sin):
    """Flux apply_rotary_emb (interleaved pairs, full-width cos/sin)."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def eager_rope_rotate_half(x, cos, sin):
    """Half-rotated RoPE: x * cos + rotate_half(x) * sin."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def eager_gelu_formula(x):
    """Tanh GELU written out, as some model code does."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def timed_medians(candidates: dict[str, Callable[[], torch.Tensor]], reps: int) -> dict[str, float]:
    """Median seconds per candidate, calling them round-robin ``reps`` times."""
    for run in candidates.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, run in candidates.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def build_cases() -> dict[str, tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]]:
    """Case name -> (eager sequence, fused CPU kernel)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    x = randn(2, 4096, 1024)
    other = randn(2, 4096, 1024)
    weight = randn(1024)
    scale, shift, gate = randn(2, 1, 1024), randn(2, 1, 1024), randn(2, 1, 1024)
    q = randn(1, 4096, 24, 128)
    cos_pairs, sin_pairs = randn(1, 4096, 1, 64), randn(1, 4096, 1, 64)
    cos_interleaved = cos_pairs.repeat_interleave(2, dim=-1)
    sin_interleaved = sin_pairs.repeat_interleave(2, dim=-1)
    cos_half = torch.cat((cos_pairs, cos_pairs), dim=-1)
    sin_half = torch.cat((sin_pairs, sin_pairs), dim=-1)
    cos_general, sin_general = randn(1, 4096, 1, 128), randn(1, 4096, 1, 128)

    return {
        "rms_norm  x[2,4096,1024] w[1024]": (
            lambda: eager_rms_norm(x, weight),
            lambda: OPS.rms_norm.default(x, weight, EPS),
        ),
        "adalayernorm  scale/shift [2,1,1024]": (
            lambda: eager_adalayernorm(x, scale, shift),
            lambda: OPS.adalayernorm.default(x, scale, shift, EPS),
        ),
        "adalayernorm  scale/shift [1024]": (
            lambda: eager_adalayernorm(x, scale[0, 0], shift[0, 0]),
            lambda: OPS.adalayernorm.default(x, scale[0, 0], shift[0, 0], EPS),
        ),
        "rope interleaved  Flux cos/sin": (
            lambda: eager_rope_flux(q, cos_interleaved, sin_interleaved),
            lambda: OPS.rope.default(q, cos_interleaved, sin_interleaved, True),
        ),
        "rope interleaved  general full-width": (
            lambda: eager_rope_flux(q, cos_general, sin_general),
            lambda: OPS.rope.default(q, cos_general, sin_general, True),
        ),
        "rope rotate_half  full-width": (
            lambda: eager_rope_rotate_half(q, cos_half, sin_half),
            lambda: OPS.rope.default(q, cos_half, sin_half, False),
        ),
        "fast_gelu  vs written-out formula": (
            lambda: eager_gelu_formula(x),
            lambda: OPS.fast_gelu.default(x),
        ),
        "fast_gelu  vs F.gelu(tanh)": (
            lambda: F.gelu(x, approximate="tanh"),
            lambda: OPS.fast_gelu.default(x),
        ),
        "mul_add  x*gate[2,1,1024]+residual": (
            lambda: x * gate + other,
            lambda: OPS.mul_add.default(x, gate, other),
        ),
        "mul_add  x*y+z all [2,4096,1024]": (
            lambda: x * other + x,
            lambda: OPS.mul_add.default(x, other, x),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} reps, fp32")
    print(f"{'case':40s} {'eager ms':>9s} {'kernel ms':>10s} {'speedup':>8s}")
    with torch.no_grad():
        for name, (eager, kernel) in build_cases().items():
            medians = timed_medians({"eager": eager, "kernel": kernel}, args.reps)
            speedup = medians["eager"] / medians["kernel"]
            print(
                f"{name:40s} {medians['eager'] * 1e3:9.2f} {medians['kernel'] * 1e3:10.2f} "
                f"{speedup:7.2f}x"
            )


if __name__ == "__main__":
    main()
