"""What the op tests share: the tolerance per dtype, the dtypes, seeded inputs and the comparison."""

from __future__ import annotations

import torch

#: (rtol, atol) for comparing an output against a float32/float64 expectation, per output dtype.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-3),
    torch.float16: (2e-3, 1e-4),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    """A seeded normal tensor (drawn on the CPU, so every device sees the same values)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def assert_matches(actual, expected, dtype):
    """Compare ``actual`` (any dtype) with a high-precision expectation, within ``dtype``'s tolerance."""
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), rtol=rtol, atol=atol)
