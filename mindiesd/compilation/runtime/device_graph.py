"""Device-graph capture and replay (ACLGraph on Ascend, CUDA graphs on NVIDIA).

:class:`DeviceGraphRunner` wraps the final callable of a compiled graph. Per input signature (shapes, strides,
dtypes, devices and non-tensor values of the activations, plus the addresses of the weights) it captures once
and replays afterwards::

    new signature ──> warm-up on a side stream ──> capture into its own pool ──> replay
    known signature ──> copy activations into the static buffers ──> replay
    weights changed in place since the capture ──> capture again (never replays stale folded weights)

Only activations are copied on replay. Parameters, buffers and folded constants are read where they are: their
addresses are part of the signature, so a compiled graph serving several module instances keeps one capture per
instance, and a weight moved to new storage (``param.data = ...``) selects (or makes) another capture.

The number of captures kept is bounded by ``aclgraph_max_graphs``; the least recently used is evicted, and the
log says so. Each capture has its own memory pool (see :class:`StreamGraphAdapter`). Calls are serialised by a lock, so two threads can
share a compiled module; with ``safe_output_mode=False`` the returned tensors are the static outputs, which the
next replay of the same capture overwrites (by any thread): clone what you keep.

Where no device graph exists (CPU tensors, no CUDA, no torch_npu) one warning says so and the compiled graph
runs uncaptured; ``strict`` raises instead. A capture that fails (an op that syncs with the host, say) makes
that signature run uncaptured, with a warning naming the cause.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import CompilationConfig
from ..freezing import add_release_listener

log = logging.getLogger("mindiesd.compilation")

__all__ = [
    "DeviceGraphRunner",
    "DeviceGraphUnavailableWarning",
    "DeviceGraphCaptureWarning",
    "DanglingCaptureError",
    "DeviceGraphUnavailableError",
    "StreamGraphAdapter",
    "SimulatedGraphAdapter",
    "register_adapter",
    "adapter_for",
    "wrap_for_capture",
    "WARMUP_RUNS",
]

#: Eager runs on a side stream before each capture (lazy initialisation, autotuning, folded weights).
WARMUP_RUNS = 1


class DeviceGraphUnavailableWarning(UserWarning):
    """Device-graph capture was asked for but the device has none; the graph runs uncaptured."""


class DeviceGraphCaptureWarning(UserWarning):
    """A capture failed; that input signature runs uncaptured."""


# ---------------------------------------------------------------------------------------------- adapters
class StreamGraphAdapter:
    """Capture through a torch device module with CUDA-graph semantics (``torch.cuda``, ``torch.npu``).

    The capture skips the garbage collection and cache emptying that ``torch.cuda.graph()`` does on entry:
    captures happen while the model is being served, and both would stall it.

    Each capture gets its own memory pool. One pool shared by several graphs is safe only when they replay in the
    order they were captured: a later capture may place its static outputs in memory an earlier one uses for its
    intermediates, which that one's next replay overwrites, and the signatures of a served model replay in any
    order, with the least recently used evicted (whose pool then returns to the allocator). A capture that fails
    ends the capture and resets its graph, so neither the stream nor the device's random generators stay in
    capture state; the exception goes on to the runner, which runs that signature uncaptured.
    """

    def __init__(self, module: Any, graph_class: Any, device: torch.device):
        self.module, self.graph_class, self.device = module, graph_class, device
        self.name = device.type

    def capture(self, fn: Callable[..., Any], args: Sequence[Any], warmup: int) -> Tuple[Any, Any]:
        module = self.module
        current = module.current_stream(self.device)
        side = module.Stream(self.device)
        side.wait_stream(current)
        with module.stream(side):
            for _ in range(warmup):
                fn(*args)
        current.wait_stream(side)
        module.synchronize(self.device)
        graph = self.graph_class()
        with module.stream(side):
            graph.capture_begin(pool=module.graph_pool_handle())
            try:
                outputs = fn(*args)
            except BaseException:
                _abandon(graph)
                raise
            graph.capture_end()
        current.wait_stream(side)
        return graph, outputs


def _abandon(graph: Any) -> None:
    """After a failure inside a capture: end it (the stream leaves capture mode, the generators their graph
    state) and free what the graph holds; errors of these two steps are secondary to the one that failed."""
    for step in (graph.capture_end, getattr(graph, "reset", None)):
        if step is None:
            continue
        try:
            step()
        except Exception as exc:  # noqa: BLE001
            log.debug("cleaning up a failed capture: %s: %s", type(exc).__name__, exc)


class DeviceGraphUnavailableError(RuntimeError):
    """Capture was asked for (``strict=True``) on a device that has no device graph."""


class DanglingCaptureError(RuntimeError):
    """A replay would read a tensor that was freed or moved since the capture (a real graph reads stale memory)."""


class _Read:
    """A tensor a capture reads but did not produce: held weakly, with the address the graph recorded."""

    __slots__ = ("ref", "ptr", "what")

    def __init__(self, tensor: torch.Tensor, what: str):
        self.ref = weakref.ref(tensor)
        self.ptr = _address(tensor)
        self.what = f"a {tensor.dtype} tensor of shape {list(tensor.shape)} {what}"

    def problem(self) -> Optional[str]:
        tensor = self.ref()
        if tensor is None:
            return f"{self.what} was freed since the capture"
        ptr = _address(tensor)
        if ptr != self.ptr:
            return f"{self.what} moved from {self.ptr:#x} to {ptr:#x} since the capture"
        return None


def _address(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:  # no storage (a tensor subclass without data)
        return 0


class _ReadRecorder(TorchDispatchMode):
    """Records every tensor an op reads that no earlier op of the same run produced."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Dict[int, torch.Tensor] = {}  # strong only while recording, so ids stay unique
        self.reads: List[_Read] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) not in self.seen:
                self.seen[id(t)] = t
                self.reads.append(_Read(t, f"read by {func}"))
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.setdefault(id(t), t)
        return out


class _SimulatedGraph:
    """Holds what a real graph holds: addresses (here weak references), not the tensors themselves."""

    def __init__(self, adapter: "SimulatedGraphAdapter", fn: Callable[..., Any], args: Sequence[Any],
                 outputs: Any, reads: List[_Read]):
        self.adapter, self.fn, self.reads = adapter, fn, reads
        self.args = [_Read(a, f"passed as static input {i}") if isinstance(a, torch.Tensor) else a
                     for i, a in enumerate(args)]
        leaves, self.out_spec = pytree.tree_flatten(outputs)
        self.outputs = [weakref.ref(t) if isinstance(t, torch.Tensor) else None for t in leaves]

    def check(self) -> None:
        """Raise :class:`DanglingCaptureError` if a tensor the capture reads was freed or moved."""
        for read in itertools.chain(self.reads, (a for a in self.args if isinstance(a, _Read))):
            problem = read.problem()
            if problem is not None:
                raise DanglingCaptureError(f"mindiesd: replaying a {self.adapter.name} graph would read stale "
                                           f"memory: {problem}")

    def replay(self) -> None:
        self.check()
        self.adapter.replays += 1
        fresh = self.fn(*[a.ref() if isinstance(a, _Read) else a for a in self.args])
        for ref, new in zip(self.outputs, pytree.tree_leaves(fresh)):
            static = ref() if ref is not None else None
            if static is not None:
                static.copy_(new)


class SimulatedGraphAdapter:
    """A stand-in device graph for CPU: "capture" records the callable and its static buffers, "replay" runs it
    on those buffers and writes the results into the static outputs, as a real replay would. For tests and
    for dry-running the capture logic on a machine without a device.

    The capture run records every tensor the captured ops read without producing it; a replay raises
    :class:`DanglingCaptureError` when one of them was freed or moved, where a real graph would read stale memory.
    """

    name = "simulated"

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0
        self.warmups = 0

    def capture(self, fn: Callable[..., Any], args: Sequence[Any], warmup: int) -> Tuple[Any, Any]:
        for _ in range(warmup):
            self.warmups += 1
            fn(*args)
        recorder = _ReadRecorder()
        with recorder:
            outputs = fn(*args)
        self.captures += 1
        return _SimulatedGraph(self, fn, args, outputs, recorder.reads), outputs


AdapterFactory = Callable[[torch.device], Optional[Any]]
_adapter_factories: Dict[str, AdapterFactory] = {}
_adapters: Dict[Tuple[str, Optional[int]], Any] = {}
_adapters_lock = threading.Lock()


def register_adapter(device_type: str, factory: Optional[AdapterFactory]) -> None:
    """Use ``factory(device)`` to make the adapter of ``device_type`` (None restores the built-in choice)."""
    with _adapters_lock:
        if factory is None:
            _adapter_factories.pop(device_type, None)
        else:
            _adapter_factories[device_type] = factory
        for key in [k for k in _adapters if k[0] == device_type]:
            del _adapters[key]


def _builtin_adapter(device: torch.device) -> Optional[Any]:
    if device.type == "cuda" and torch.cuda.is_available():
        return StreamGraphAdapter(torch.cuda, torch.cuda.CUDAGraph, device)
    if device.type == "npu":
        npu = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "NPUGraph"):
            return StreamGraphAdapter(npu, npu.NPUGraph, device)
    return None


def adapter_for(device: torch.device) -> Optional[Any]:
    """The (shared) adapter of a device, or None where the device has no device graph."""
    key = (device.type, device.index)
    with _adapters_lock:
        if key not in _adapters:
            factory = _adapter_factories.get(device.type, _builtin_adapter)
            _adapters[key] = factory(device)
        return _adapters[key]


# ---------------------------------------------------------------------------------------------- runner
def _tensor_signature(t: torch.Tensor) -> Tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _stored_signature(t: torch.Tensor) -> Tuple[Any, ...]:
    """A tensor read where it is: its address and how it is read."""
    return (_address(t), tuple(t.shape), t.stride(), t.dtype, t.device)


@dataclass
class _Capture:
    graph: Any
    static_inputs: List[Any]  # the activations' static buffers, and every weight argument itself
    outputs: Any
    weight_versions: Tuple[int, ...]
    signature: Tuple[Any, ...]
    owned: Tuple[torch.Tensor, ...]  # tensors read that are not arguments (folded constants): kept alive here


@dataclass
class RunnerStats:
    """What a runner did: for tests, benchmarks and the log."""

    captures: int = 0
    replays: int = 0
    evictions: int = 0
    recaptures: int = 0
    failed_captures: int = 0
    uncaptured_calls: int = 0
    bytes_copied: int = 0
    released: int = 0  # captures dropped because tensors they read left the fold cache


_live_runners: "weakref.WeakSet[DeviceGraphRunner]" = weakref.WeakSet()


def _release_captures_reading(tensors: Sequence[torch.Tensor]) -> None:
    ids = {id(t) for t in tensors}
    for runner in list(_live_runners):
        runner.release(ids)


add_release_listener(_release_captures_reading)


class DeviceGraphRunner:
    """Captures ``fn`` once per input signature and replays it.

    ``weight_indices`` are the positions of parameters, buffers and other inputs whose storage stays put
    between calls: they are never copied, only checked. ``reads(*args)``, where given, returns the tensors that
    ``fn(*args)`` reads besides its arguments (the folded constants of those weights): their addresses are part of
    the signature and each capture holds them, so a replay never reads memory that was freed or reused.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        adapter: Any,
        weight_indices: Sequence[int],
        max_graphs: int,
        safe_outputs: bool,
        label: str = "graph",
        warmup: int = WARMUP_RUNS,
        reads: Optional[Callable[..., Sequence[torch.Tensor]]] = None,
    ):
        self.fn, self.adapter, self.label, self.warmup, self.reads = fn, adapter, label, warmup, reads
        self.weight_indices = tuple(weight_indices)
        self.max_graphs, self.safe_outputs = max_graphs, safe_outputs
        self.stats = RunnerStats()
        self._captures: "OrderedDict[Tuple[Any, ...], _Capture]" = OrderedDict()
        self._uncapturable: set = set()
        self._lock = threading.RLock()
        self._weight_set = frozenset(self.weight_indices)
        _live_runners.add(self)

    def __call__(self, *args: Any) -> Any:
        owned = tuple(self.reads(*args)) if self.reads is not None else ()
        signature = self.signature(args, owned)
        with self._lock:
            capture = self._captures.get(signature)
            if capture is not None and capture.weight_versions != self._weight_versions(args):
                log.info("%s: a weight changed in place since its capture; capturing again", self.label)
                del self._captures[signature]
                self.stats.recaptures += 1
                capture = None
            if capture is None:
                if signature in self._uncapturable:
                    self.stats.uncaptured_calls += 1
                    return self.fn(*args)
                capture = self._capture(signature, args, owned)
                if capture is None:
                    self.stats.uncaptured_calls += 1
                    return self.fn(*args)
            else:
                self._captures.move_to_end(signature)
                self._load(capture, args)
            capture.graph.replay()
            self.stats.replays += 1
            outputs = capture.outputs
            if self.safe_outputs:
                outputs = pytree.tree_map_only(torch.Tensor, torch.clone, outputs)
            return outputs

    def signature(self, args: Sequence[Any], owned: Sequence[torch.Tensor] = ()) -> Tuple[Any, ...]:
        """Activations by shape, strides, dtype and device; weights by address (Dynamo's guards already fix their
        shape, strides and dtype); other tensors read where they are by address and layout; other values as they
        are."""
        parts = []
        weights = self._weight_set
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if i in weights:
                    parts.append(a.data_ptr())
                elif a.dim() == 0 and a.device.type == "cpu":
                    # a host scalar (a float Dynamo made an input, such as eps): the graph reads it on the host
                    # at capture, so its value selects the capture
                    parts.append(_tensor_signature(a) + (a.item(),))
                else:
                    parts.append(_tensor_signature(a))
            else:
                parts.append(a)
        if owned:
            parts.append(("reads",) + tuple(_stored_signature(t) for t in owned))
        return tuple(parts)

    def signatures(self) -> List[Tuple[Any, ...]]:
        """The signatures captured now, least recently used first."""
        with self._lock:
            return list(self._captures)

    def release(self, tensor_ids: "set[int]") -> int:
        """Drop the captures that read any of these tensors (by ``id``; they are leaving a cache)."""
        with self._lock:
            gone = [sig for sig, c in self._captures.items() if any(id(t) in tensor_ids for t in c.owned)]
            for sig in gone:
                del self._captures[sig]
            self.stats.released += len(gone)
        if gone:
            log.info("%s: dropped %d capture(s) reading folded constants that left the cache", self.label, len(gone))
        return len(gone)

    def _weight_versions(self, args: Sequence[Any]) -> Tuple[int, ...]:
        return tuple(args[i]._version for i in self.weight_indices if isinstance(args[i], torch.Tensor))

    def _load(self, capture: _Capture, args: Sequence[Any]) -> None:
        copied = 0
        for i, (static, arg) in enumerate(zip(capture.static_inputs, args)):
            if i in self._weight_set or not isinstance(arg, torch.Tensor) or static is arg:
                continue
            if static.data_ptr() != arg.data_ptr():
                static.copy_(arg)
                copied += arg.nbytes
        self.stats.bytes_copied += copied

    def _capture(self, signature: Tuple[Any, ...], args: Sequence[Any],
                 owned: Tuple[torch.Tensor, ...] = ()) -> Optional[_Capture]:
        static_inputs = [
            a if (i in self._weight_set or not isinstance(a, torch.Tensor))
            else torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
            for i, a in enumerate(args)
        ]
        self.stats.bytes_copied += sum(
            a.nbytes for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in self._weight_set
        )
        start = time.perf_counter()
        try:
            graph, outputs = self.adapter.capture(self.fn, static_inputs, self.warmup)
        except Exception as exc:
            self._uncapturable.add(signature)
            self.stats.failed_captures += 1
            warnings.warn(
                f"mindiesd: capturing {self.label} as a device graph failed ({type(exc).__name__}: {exc}); "
                "this input signature runs uncaptured", DeviceGraphCaptureWarning, stacklevel=3,
            )
            return None
        capture = _Capture(graph, static_inputs, outputs, self._weight_versions(args), signature, owned)
        self._captures[signature] = capture
        self.stats.captures += 1
        log.info("%s: captured signature %d as a %s graph in %.2f s (%d kept)", self.label, self.stats.captures,
                 self.adapter.name, time.perf_counter() - start, len(self._captures))
        while len(self._captures) > self.max_graphs:
            evicted_signature, _ = self._captures.popitem(last=False)
            self.stats.evictions += 1
            log.info("%s: evicted the least recently used capture (aclgraph_max_graphs=%d)", self.label,
                     self.max_graphs)
        return capture

    def clear(self) -> None:
        with self._lock:
            self._captures.clear()
            self._uncapturable.clear()


# ---------------------------------------------------------------------------------------------- entry
_warned_unavailable: set = set()


def wrap_for_capture(
    fn: Callable[..., Any],
    config: CompilationConfig,
    device: Optional[torch.device],
    weight_indices: Sequence[int] = (),
    label: str = "graph",
    reads: Optional[Callable[..., Sequence[torch.Tensor]]] = None,
) -> Callable[..., Any]:
    """``fn`` behind a :class:`DeviceGraphRunner` when the settings ask for capture and ``device`` (the graph's)
    has one."""
    if not config.capture:
        return fn
    adapter = adapter_for(device) if device is not None else None
    if adapter is None:
        where = device.type if device is not None else "this graph (no tensor input)"
        message = (f"mindiesd: device-graph capture (aclgraph_only / aclgraph_with_compile) is unavailable on "
                   f"{where}; the compiled graph runs uncaptured")
        if config.strict:
            raise DeviceGraphUnavailableError(message)
        if where not in _warned_unavailable:
            _warned_unavailable.add(where)
            warnings.warn(message, DeviceGraphUnavailableWarning, stacklevel=2)
        return fn
    return DeviceGraphRunner(fn, adapter, weight_indices, config.aclgraph_max_graphs, config.safe_output_mode, label,
                             reads=reads)
