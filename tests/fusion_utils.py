"""Compile a function with MindieSDBackend, count the fused ops in its final graphs, compare with eager."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from mindiesd.compilation import families
from mindiesd.compilation import CompilationConfig, MindieSDBackend

#: The elementwise families: the specification's five, norm_rope and glu (the GEMM rewrites are off on CPU by
#: default and tested in test_gemm.py).
FAMILIES = tuple(families.SPEC_FAMILIES)

#: (rtol, atol) per dtype: eager rounds after every op in bf16/fp16, the fused ops round once.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 3e-2),
    torch.float16: (3e-3, 3e-3),
}


def compile_zoo_model(name: str, size: str, config: Optional[CompilationConfig] = None) -> Tuple[Any, Any, Any]:
    """(compiled output, eager output, the final graph) of registry model ``name`` at ``size``, compiled whole
    (``fullgraph``) with a fallback warning an error; the cache off unless ``config`` says otherwise."""
    import warnings

    from mindiesd import zoo
    from mindiesd.compilation import MindieSDFallbackWarning

    case = zoo.build(name, size)
    backend = MindieSDBackend(config or CompilationConfig(cache_dir=None), keep_graphs=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", MindieSDFallbackWarning)
        actual = torch.compile(case.model, backend=backend, fullgraph=True)(**case.inputs)[0]
        expected = case.model(**case.inputs)[0]
    torch._dynamo.reset()
    return actual, expected, backend.graphs[0]


def count_fused(backend: MindieSDBackend) -> Dict[str, int]:
    """Calls of each torch.ops.mindiesd op in the final graphs the backend produced."""
    counts: Counter = Counter()
    for gm in backend.graphs:
        for node in gm.graph.nodes:
            target = node.target
            if node.op == "call_function" and getattr(target, "namespace", None) == "mindiesd":
                counts[target._opname] += 1
    return {family: counts.get(family, 0) for family in FAMILIES}


def run_compiled(
    fn: Callable[..., Any],
    *args: Any,
    config: Optional[CompilationConfig] = None,
    dynamic: Optional[bool] = False,
    fullgraph: bool = True,
) -> Tuple[Any, Any, Dict[str, int], MindieSDBackend]:
    backend = MindieSDBackend(config, keep_graphs=True)
    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    with torch.no_grad():
        expected = fn(*args)
        actual = compiled(*args)
    return actual, expected, count_fused(backend), backend


def assert_close(actual: Any, expected: Any, dtype: Optional[torch.dtype] = None) -> None:
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, dtype)
        return
    if hasattr(expected, "to_tuple"):
        return assert_close(actual.to_tuple(), expected.to_tuple(), dtype)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    rtol, atol = TOLERANCE[dtype or expected.dtype]
    if expected.dtype in (torch.bfloat16, torch.float16) and expected.numel():
        # eager's own rounding error in a chain of low-precision ops scales with the operands, not with each
        # result: a residual sum that cancels to a small value carries the error of its large terms
        atol *= max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


class AddsTable(torch.nn.Module):
    """x + a buffer of ``size`` values: a graph whose stored entry grows with ``size``."""

    def __init__(self, size: int):
        super().__init__()
        self.register_buffer("table", torch.full((size,), float(size)))

    def forward(self, x):
        return x + self.table


class WeightedBlock(torch.nn.Module):
    """RMSNorm, Linear, tanh-GELU and a table derived from a buffer alone (which freezing folds)."""

    def __init__(self, d: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm = torch.nn.RMSNorm(d)
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("freqs", torch.randn(d, generator=g))
        with torch.no_grad():
            self.norm.weight.copy_(torch.randn(d, generator=g))
            self.lin.weight.copy_(torch.randn(d, d, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.cos(self.freqs * 2.0) + 1.0
        return torch.nn.functional.gelu(self.lin(self.norm(x)), approximate="tanh") * table

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """The same function written with functional ops only (no module call)."""
        F = torch.nn.functional
        h = F.linear(F.rms_norm(x, [x.shape[-1]], self.norm.weight), self.lin.weight, self.lin.bias)
        return F.gelu(h, approximate="tanh") * (torch.cos(self.freqs * 2.0) + 1.0)


def spec_counts(matches: Dict[str, int]) -> Dict[str, int]:
    """The counts of the specification's families in a report's ``matches`` (which lists every family)."""
    return {family: matches.get(family, 0) for family in FAMILIES}


def only(family: str, n: int) -> Dict[str, int]:
    """The expected counts: n of one family, none of the others."""
    return {f: (n if f == family else 0) for f in FAMILIES}


def aten_graph(fn, *args):
    """The functional aten graph aot hands the backend (with fake values on every node)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def backend(gm, example_inputs):
        def keep(aten_gm, _):
            graphs.append(aten_gm)
            return aten_gm.forward

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (gm,) = graphs
    return gm
