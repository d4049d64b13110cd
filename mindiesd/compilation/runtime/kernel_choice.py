"""Each fused op site runs what is fastest for it on the graph's device, measured there.

Whether a fused kernel beats eager's op sequence depends on the device, the dtype and the shape: on a GPU
uncaptured, a kernel launched from Python can cost more than the few kernels eager runs. With
``CompilationConfig.kernel_choice`` ``"measure"`` (``"auto"``: on an accelerator, uncaptured), each site of an
elementwise family (the specification's five, norm_rope, glu) times its candidates on the device, at the site's
shapes, dtypes and strides, on random inputs, and keeps the fastest:

* ``kernel``: the family's op, as registered for the device (Triton on CUDA, torch_npu on Ascend, C++ on CPU),
  called as the generated runner calls it (straight into the C++ entry point on the CPU where shapes are static);
* an ATen composition that computes the same function in fewer kernels than eager's sequence, where the family
  has one (:data:`COMPOSITIONS`: ``mul_add`` as ``addcmul``, ``fast_gelu`` as ``gelu(approximate="tanh")``);
* ``reference``: the op's reference composition, the plain aten ops of eager's sequence, so that a site never runs
  slower than eager would.

A candidate whose output on the site's inputs is not the reference's within the dtype's tolerance, or whose layout
is not the op's, is not chosen (the op included: its site then runs the fastest of the others). The op stays where it wins; elsewhere the candidate's aten ops, traced on the site's
fake inputs, take its place in the graph. The graph is what the persistent cache and the ahead-of-time artifacts
store, so a warm start does not measure again; the choices (with every candidate's time) go into the graph's record
(``MindieSDBackend.report()``) and the graph log. Sites with the same op, arguments and tensor layouts are measured
once. ``"declared"`` takes each family's declared choice (its op wherever it is fused) and measures nothing, for
reproducible runs.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch.fx import Graph, GraphModule, Node
from torch._dispatch.python import no_python_dispatcher
from torch.utils._python_dispatch import _disable_current_modes

from ..families import FAMILIES, SPEC_FAMILIES

log = logging.getLogger("mindiesd.compilation.explain")  # the explain log: every choice with its times

__all__ = ["KERNEL_CHOICES", "COMPOSITIONS", "Choice", "measuring", "choose_kernels", "time_candidates"]

#: The values of ``CompilationConfig.kernel_choice``.
KERNEL_CHOICES = ("auto", "measure", "declared")

#: Device types on which ``auto`` measures (uncaptured).
ACCELERATORS = ("cuda", "npu")


def _addcmul(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, addend_first: bool = False) -> Optional[torch.Tensor]:
    if not (x.dtype == y.dtype == z.dtype):
        return None  # mul_add promotes and rounds once; addcmul would not
    return torch.addcmul(z, x, y)


def _tanh_gelu(x: torch.Tensor) -> Optional[torch.Tensor]:
    return torch.nn.functional.gelu(x, approximate="tanh")


#: Op name -> (candidate name, function of the op's arguments, or None where it does not compute the op there).
COMPOSITIONS: Dict[str, Tuple[Tuple[str, Callable[..., Optional[torch.Tensor]]], ...]] = {
    "mul_add": (("addcmul", _addcmul),),
    "fast_gelu": (("gelu_tanh", _tanh_gelu),),
}

#: Tolerances (rtol = atol) a candidate's output must keep to the reference's, per dtype.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def measuring(kernel_choice: str, device_type: Optional[str], capture: bool) -> bool:
    """Whether sites are measured: ``measure``, or ``auto`` on an accelerator without device-graph capture (a
    captured graph pays no launch, which the measurement would count)."""
    if kernel_choice == "measure":
        return device_type not in (None, "meta")
    return kernel_choice == "auto" and device_type in ACCELERATORS and not capture


def measured_families() -> Tuple[str, ...]:
    """The families whose sites are measured: the elementwise group (fused even where declared slower, so that
    each site can be measured)."""
    return tuple(name for name in SPEC_FAMILIES if FAMILIES[name].has_op)


@dataclass
class Choice:
    """What one site runs and why: the candidates' median milliseconds (None: not a valid candidate there)."""

    op: str
    signature: str
    chosen: str
    ms: Dict[str, Optional[float]] = field(default_factory=dict)
    sites: int = 1

    def describe(self) -> str:
        times = ", ".join(f"{name} {ms:.4f}" if ms is not None else f"{name} -" for name, ms in self.ms.items())
        return f"{self.op} {self.signature} x{self.sites}: {self.chosen} ({times} ms)"


#: ``timer(candidates, device) -> {name: median ms}``: each candidate a no-argument callable.
Timer = Callable[[Mapping[str, Callable[[], Any]], torch.device], Dict[str, float]]


def time_candidates(candidates: Mapping[str, Callable[[], Any]], device: torch.device,
                    rounds: int = 15, budget_s: float = 0.25) -> Dict[str, float]:
    """Median milliseconds per call of each candidate, interleaved round by round (the device synchronised after
    each call: what an uncaptured call costs), after two warm-up calls each; at most ``rounds`` rounds or about
    ``budget_s`` seconds."""
    synchronize = _synchronizer(device)
    for fn in candidates.values():
        fn()
        fn()
    synchronize()
    times: Dict[str, List[float]] = {name: [] for name in candidates}
    start = time.perf_counter()
    for _ in range(rounds):
        for name, fn in candidates.items():
            begin = time.perf_counter()
            fn()
            synchronize()
            times[name].append((time.perf_counter() - begin) * 1e3)
        if time.perf_counter() - start > budget_s and all(len(t) >= 3 for t in times.values()):
            break
    return {name: statistics.median(t) for name, t in times.items()}


def _synchronizer(device: torch.device) -> Callable[[], None]:
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    sync = getattr(module, "synchronize", None)
    return sync if callable(sync) else (lambda: None)


def choose_kernels(gm: GraphModule, device: torch.device, timer: Optional[Timer] = None) -> List[Choice]:
    """Measure every site of a measured family in ``gm`` and put the fastest valid candidate in its place (see the
    module doc); the choices, one per distinct site signature."""
    from mindiesd.ops import registry

    from .lowering import traced_facts

    timer = timer or time_candidates
    measured = {FAMILIES[name].op.name for name in measured_families()}
    facts = traced_facts(gm)
    choices: Dict[Tuple[Any, ...], Choice] = {}
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
                or target.namespace != registry.NAMESPACE or target._opname not in measured:
            continue
        key = _signature(node)
        if key is None:
            continue
        choice = choices.get(key)
        if choice is None:
            # the op as the generated runner calls it: straight into its C++ entry where it can, else dispatched
            fact = facts.get(node.name)
            direct = _runner_call(node, fact) if fact is not None else None
            # real tensors on the device, outside the compile's fake mode, and without the Python dispatcher the
            # compile turns on (every aten call inside a C++ kernel would pass through Python: 7 -> 17 us for a
            # CPU mul_add)
            with _disable_current_modes(), no_python_dispatcher():
                choice = choices[key] = _measure(node, device, timer, direct)
        else:
            choice.sites += 1
        if choice.chosen != "kernel":
            _replace(gm.graph, node, _candidate_fn(target._opname, choice.chosen))
    if choices:
        gm.graph.lint()
    return list(choices.values())


def _runner_call(node: Node, fact: Any) -> Optional[Callable[..., Any]]:
    """The fused op of ``node`` called as the runners call it on the CPU: its C++ entry point with the arguments
    the entry takes (the op itself where the entry declines), or None where the runners dispatch it."""
    from .lowering import direct_call

    direct = direct_call(node, fact)
    return direct.function(node.target) if direct is not None else None


def _signature(node: Node) -> Optional[Tuple[Any, ...]]:
    """What makes two sites the same measurement: the op, its non-tensor arguments and its tensors' layouts; None
    for a site with symbolic shapes (measured nowhere: it keeps its op)."""
    parts: List[Any] = [node.target]
    for leaf in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(leaf, Node):
            value = leaf.meta.get("val")
            if not isinstance(value, torch.Tensor):
                return None
            if not all(type(s) is int for s in (*value.shape, *value.stride())):
                return None
            parts.append((tuple(value.shape), tuple(value.stride()), value.dtype))
        else:
            parts.append(repr(leaf))
    return tuple(parts)


def _describe(node: Node) -> str:
    shapes = []
    for leaf in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(leaf, Node):
            value = leaf.meta["val"]
            shapes.append("x".join(map(str, value.shape)) + f" {str(value.dtype).replace('torch.', '')}")
    return "[" + ", ".join(shapes) + "]"


def _real(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A real tensor with the traced value's shape, strides, dtype and device, random where it is floating point."""
    device = value.device
    out = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=device)
    if value.dtype.is_floating_point:
        values = torch.randn(out.shape, generator=generator, dtype=torch.float32).to(value.dtype)
        out.copy_(values.to(device))
    else:
        out.zero_()
    return out


def _candidate_fn(op: str, name: str) -> Callable[..., Optional[torch.Tensor]]:
    from mindiesd.ops import registry

    if name == "kernel":
        return getattr(getattr(torch.ops, registry.NAMESPACE), op).default
    if name == "reference":
        return _op_def(op).reference
    return dict(COMPOSITIONS.get(op, ()))[name]


def _op_def(op: str):
    for family in FAMILIES.values():
        if family.op is not None and family.op.name == op:
            return family.op
    raise KeyError(op)


def _measure(node: Node, device: torch.device, timer: Timer, direct: Optional[Callable[..., Any]] = None) -> Choice:
    op = node.target._opname
    generator = torch.Generator().manual_seed(0)
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _real(n.meta["val"], generator))
    expected_value = node.meta.get("val")
    names = ["kernel", *(name for name, _ in COMPOSITIONS.get(op, ())), "reference"]
    with torch.no_grad():
        reference = _op_def(op).reference(*args, **kwargs)
        valid: Dict[str, Callable[[], Any]] = {}
        for name in names:
            fn = direct if name == "kernel" and direct is not None else _candidate_fn(op, name)
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (a candidate that cannot run this site is not one)
                log.debug("kernel choice: %s for %s failed (%s)", name, op, exc)
                continue
            if _agrees(result, reference, expected_value):
                valid[name] = lambda fn=fn: fn(*args, **kwargs)
        ms = timer(valid, device) if len(valid) > 1 else {name: float("nan") for name in valid}
    # the fastest valid candidate (a tie keeps the op); where the op itself disagrees with its reference on these
    # inputs, the fastest of the others: a site never runs what gave another answer
    chosen = "kernel"
    if len(valid) > 1 or (valid and "kernel" not in valid):
        chosen = min(valid, key=lambda name: (ms.get(name, float("inf")), name != "kernel"))
    choice = Choice(op=op, signature=_describe(node), chosen=chosen,
                    ms={name: (ms.get(name) if name in valid else None) for name in names})
    log.debug("kernel choice: %s", choice.describe())
    return choice


def _agrees(result: Any, reference: torch.Tensor, traced: Any) -> bool:
    if not isinstance(result, torch.Tensor) or result.shape != reference.shape or result.dtype != reference.dtype:
        return False
    if isinstance(traced, torch.Tensor) and result.stride() != traced.stride():
        return False  # the graph's consumers were traced with the op's layout
    tolerance = _TOLERANCE.get(reference.dtype, 1e-4)
    return torch.allclose(result.float(), reference.float(), rtol=tolerance, atol=tolerance, equal_nan=True)


def _replace(graph: Graph, node: Node, fn: Callable[..., Any]) -> None:
    """``node`` replaced by the aten ops ``fn`` runs on its arguments, traced on their fake values."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, leaf in enumerate(flat) if isinstance(leaf, Node)]
    fakes = [flat[i].meta["val"] for i in positions]

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        leaves = list(flat)
        for i, tensor in zip(positions, tensors):
            leaves[i] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return fn(*args, **kwargs)

    with detect_fake_mode(fakes) or _null():
        traced = make_fx(call, tracing_mode="real")(*fakes)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(node):
        result = graph.graph_copy(traced.graph, dict(zip(placeholders, (flat[i] for i in positions))))
    node.replace_all_uses_with(result)
    graph.erase_node(node)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
