"""MindieSDBackend: the ``torch.compile`` backend.

The whole pipeline, per graph that Dynamo hands over::

    Dynamo FX graph ──(cache_dir: an entry for this graph? load it and skip to the runner)
        ──aot (functional aten, inference)──> aten graph
        ──freezing (enable_freezing)──> main graph + folded weights
        ──fusion passes (fusion_patterns.enable_*)──> fused graph ──> stored in cache_dir
        ──device-graph runner (aclgraph_*)──> what Dynamo calls

Any failure on the way gives one warning naming the cause and the unfused Dynamo graph runs instead (``strict``
raises). The same holds at run time: if the optimised graph raises where the unfused one does not, the unfused
one is used from then on.
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence

import torch
from torch.fx import GraphModule

import mindiesd.ops  # noqa: F401  (registers torch.ops.mindiesd.*)

from . import cache as graph_cache
from .config import CompilationConfig
from .device_graph import DeviceGraphRunner, _device_of, wrap_for_capture
from .freezing import FrozenGraph, constant_inputs, split_constants
from .graph_log import GraphLog, resolve_log_dir
from .families import family
from .pass_manager import PassManager, skip_reason
from .report import CompileReport, GraphRecord, fusion_report

log = logging.getLogger("mindiesd.compilation")

__all__ = ["MindieSDBackend", "MindieSDFallbackWarning"]

_graph_ids = itertools.count()

try:
    from torch._dynamo.exc import RestartAnalysis, SkipFrame

    _DYNAMO_CONTROL_FLOW: tuple = (RestartAnalysis, SkipFrame)
except ImportError:  # pragma: no cover - other torch versions
    _DYNAMO_CONTROL_FLOW = ()


class MindieSDFallbackWarning(UserWarning):
    """An internal failure made a graph run unfused; the message names the cause."""


def _is_weight(t: Any) -> bool:
    """Parameters and buffers: Dynamo marks them as static inputs."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


def _node_count(gm: GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


class MindieSDBackend:
    """Pass as ``torch.compile(model, backend=MindieSDBackend())``.

    The settings are a snapshot of :class:`CompilationConfig` taken here (or ``config``, copied), so later
    changes to the global settings affect only backends created later. With ``keep_graphs=True`` the final
    graph of every compile is kept in :attr:`graphs`, for inspection (count the fused ops, read the code).
    The families in ``force_fast`` count as faster than eager wherever they declare a kernel or rewrite.
    """

    def __init__(self, config: Optional[CompilationConfig] = None, *, keep_graphs: bool = False,
                 force_fast: Collection[str] = ()):
        if config is not None and not isinstance(config, CompilationConfig):
            raise TypeError(f"config must be a CompilationConfig, got {type(config).__name__}")
        self.config = config.copy() if config is not None else CompilationConfig.snapshot()
        self._report = CompileReport()
        self.keep_graphs = keep_graphs
        self.force_fast = frozenset(force_fast)
        for name in self.force_fast:
            family(name)  # an unknown name fails here, not at the first compile
        self.graphs: List[GraphModule] = []
        self.runners: List[DeviceGraphRunner] = []  # one per compiled graph when capture is on

    def report(self) -> CompileReport:
        """Matches per family, graphs compiled and compile seconds, for this backend."""
        return self._report

    def __call__(self, gm: GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        record = GraphRecord(graph_id=next(_graph_ids), nodes_before=_node_count(gm))
        start = time.perf_counter()
        graph_log = GraphLog(resolve_log_dir(self.config.graph_log_url), record.graph_id)
        frozen: List[FrozenGraph] = []
        try:
            slot = self._cache_slot(gm, example_inputs, record)
            compiled = self._load(slot, record, graph_log, frozen)
            if compiled is None:
                compiled = self._compile(gm, example_inputs, record, graph_log, frozen, slot)
            compiled = _FallbackOnError(compiled, gm.forward, record, self.config.strict)
        except _DYNAMO_CONTROL_FLOW:
            raise  # Dynamo's own signals (restart the analysis, skip the frame): not failures
        except Exception as exc:
            if self.config.strict:
                raise
            record.fallback = f"{type(exc).__name__}: {exc}"
            _warn_fallback(f"compiling graph {record.graph_id} failed ({record.fallback})")
            compiled = gm.forward
        compiled = wrap_for_capture(
            compiled, self.config, example_inputs, [i for i, t in enumerate(example_inputs) if _is_weight(t)],
            label=f"graph {record.graph_id}", reads=_folded_reader(frozen[0]) if frozen else None,
        )
        if isinstance(compiled, DeviceGraphRunner):
            self.runners.append(compiled)
        record.seconds = time.perf_counter() - start
        self._finish(record, graph_log)
        return compiled

    def _families(self) -> tuple:
        return self.config.fusion_patterns.enabled_families() if self.config.fuse else ()

    def _cache_slot(self, gm: GraphModule, example_inputs: List[Any], record: GraphRecord) -> "_CacheSlot":
        """Where this graph's cache entry lives, or why it has none."""
        if not self.config.cache_dir:
            return _CacheSlot(None, None)
        reason = graph_cache.uncacheable_inputs(example_inputs)
        if reason is None and _training(example_inputs):
            reason = "training graph"
        if reason is not None:
            record.cache = f"not cached: {reason}"
            return _CacheSlot(None, None)
        device = _device_of(example_inputs)
        device_type = device.type if device is not None else None
        skipped = {f: why for f in self._families() if (why := skip_reason(f, device_type, self.force_fast)) is not None}
        weights = [i for i, t in enumerate(example_inputs) if _is_weight(t)]
        settings = graph_cache.settings_for_key(self.config.to_dict())
        key = graph_cache.graph_key(gm, example_inputs, weights, settings, device, skipped)
        return _CacheSlot(graph_cache.GraphCache(self.config.cache_dir), key)

    def _load(self, slot: "_CacheSlot", record: GraphRecord, graph_log: GraphLog,
              frozen_out: List[FrozenGraph]) -> Optional[Callable[..., Any]]:
        """The compiled graph from the cache, or None on a miss."""
        if slot.cache is None or slot.key is None:
            return None
        entry = slot.cache.load(slot.key)
        if entry is None:
            return None
        run = graph_cache.runnable(entry)
        if run.frozen is not None:
            frozen_out.append(run.frozen)
        record.cache = "hit"
        record.matches, record.rules, record.skipped = dict(entry.matches), dict(entry.rules), dict(entry.skipped)
        record.folded_constants, record.nodes_after = entry.n_folded, entry.nodes_after
        graph_log.graph("cached", entry.main)
        if self.keep_graphs:
            self.graphs.append(entry.main)
        return run

    def _compile(self, gm: GraphModule, example_inputs: List[Any], record: GraphRecord, graph_log: GraphLog,
                 frozen_out: List[FrozenGraph], slot: "_CacheSlot"):
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

        config = self.config
        families = self._families()
        weights = [i for i, t in enumerate(example_inputs) if _is_weight(t)]
        adapters = _adapter_weights(gm)
        device = _device_of(example_inputs)
        training = _training(example_inputs)

        def inference_compiler(aten_gm: GraphModule, aten_inputs: Sequence[Any]):
            graph_log.graph("aten", aten_gm)
            frozen = None
            freezable = config.enable_freezing and not training and len(aten_inputs) == len(example_inputs)
            passes = PassManager(families, device.type if device is not None else None, self.force_fast)
            rewrites: Dict[str, int] = {}
            for fusion in passes.freeze_passes:  # rewrites whose weight-only part freezing folds
                if not freezable:
                    passes.skipped[fusion.family] = ("needs enable_freezing" if not config.enable_freezing
                                                     else "no freezing for this graph (training or input mutation)")
                rewrites[fusion.family] = 0
            if freezable and passes.freeze_passes:
                rewritable = [i for i in weights if i not in adapters]
                rewrites = passes.run_freeze(aten_gm, constant_inputs(aten_gm, rewritable), graph_log)
            if freezable:
                frozen = split_constants(aten_gm, weights)
            target = frozen.main if frozen is not None else aten_gm
            if frozen is not None:
                frozen_out.append(frozen)
                record.folded_constants = frozen.n_folded
                graph_log.graph("freezing", target)
            record.skipped = dict(passes.skipped)
            record.matches = {**rewrites, **passes.run(target, graph_log)}
            record.rules = passes.rule_hits()
            target.graph.eliminate_dead_code()
            target.recompile()
            record.nodes_after = _node_count(target) + (_node_count(frozen.fold) if frozen is not None else 0)
            if self.keep_graphs:
                self.graphs.append(target)
            if slot.key is not None:
                slot.reason = graph_cache.calling_convention_problem(aten_gm, len(example_inputs))
                if slot.reason is None:
                    slot.entry = graph_cache.CachedGraph(
                        main=target, fold=frozen.fold if frozen is not None else None,
                        fold_inputs=list(frozen.fold_inputs) if frozen is not None else [],
                        main_inputs=list(frozen.main_inputs) if frozen is not None else [],
                        n_folded=frozen.n_folded if frozen is not None else 0, matches=dict(record.matches),
                        rules=dict(record.rules), skipped=dict(record.skipped), nodes_after=record.nodes_after,
                    )
            return make_boxed_func(frozen.bind(target.forward) if frozen is not None else target.forward)

        def backward_compiler(aten_gm: GraphModule, aten_inputs: Sequence[Any]):
            return make_boxed_func(aten_gm.forward)

        compiled = aot_module_simplified(
            gm, example_inputs, fw_compiler=inference_compiler, bw_compiler=backward_compiler,
            keep_inference_input_mutations=True,
        )
        if slot.cache is not None and slot.key is not None:
            if slot.entry is None:
                record.cache = f"not cached: {slot.reason or 'no inference graph'}"
            else:
                record.cache = "stored" if slot.cache.store(slot.key, slot.entry) is not None else "store failed"
        return compiled

    def _finish(self, record: GraphRecord, graph_log: GraphLog) -> None:
        self._report.add(record)
        fusion_report().add(record)
        fused = " ".join(f"{k}={v}" for k, v in record.matches.items()) or "no fusion"
        line = (f"graph {record.graph_id}: {fused}; nodes {record.nodes_before} -> {record.nodes_after}; "
                f"{record.folded_constants} folded; {record.seconds:.2f} s; cache {record.cache}"
                + "".join(f"; {family} not fused: {why}" for family, why in record.skipped.items())
                + (f"; FALLBACK {record.fallback}" if record.fallback else ""))
        log.info("%s", line)
        graph_log.summary(record.to_dict(), line)


class _CacheSlot:
    """One graph's place in the persistent cache: the store, the key, and what the compile leaves to store."""

    __slots__ = ("cache", "key", "entry", "reason")

    def __init__(self, cache: Optional["graph_cache.GraphCache"], key: Optional[str]):
        self.cache, self.key = cache, key
        self.entry: Optional[graph_cache.CachedGraph] = None
        self.reason: Optional[str] = None


def _training(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _adapter_weights(gm: GraphModule) -> set:
    """Indices of the inputs that are LoRA adapter weights (PEFT's ``lora_A`` / ``lora_B`` / ...; diffusers'
    LoRA layers are PEFT's). A hot-swap writes them in place through ``.data``, which no version counter sees, so
    the freeze-stage rewrites never fold them into a new tensor: they stay read where they are."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return {i for i, name in enumerate(names) if "lora_" in name.lower()}


def _folded_reader(frozen: FrozenGraph) -> Callable[..., Sequence[torch.Tensor]]:
    """What a capture of the graph reads besides its arguments: the folded constants of these weights."""

    def reads(*args: Any) -> Sequence[torch.Tensor]:
        try:
            return frozen.folded_for(args)
        except Exception:  # the graph itself raises (and falls back) on the same call
            return ()

    return reads


def _warn_fallback(message: str) -> None:
    warnings.warn(f"mindiesd: {message}; running the unfused graph", MindieSDFallbackWarning, stacklevel=3)


class _FallbackOnError:
    """Runs the optimised graph; if it raises where the unfused graph does not, switches to the unfused one."""

    def __init__(self, optimised: Callable[..., Any], unfused: Callable[..., Any], record: GraphRecord, strict: bool):
        self.optimised, self.unfused, self.record, self.strict = optimised, unfused, record, strict
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        if self.failed:
            return self.unfused(*args)
        try:
            return self.optimised(*args)
        except Exception as exc:
            if self.strict:
                raise
            result = self.unfused(*args)  # a genuine input error raises here, as eager would
            self.failed = True
            self.record.fallback = f"run time {type(exc).__name__}: {exc}"
            _warn_fallback(f"graph {self.record.graph_id} failed at run time ({type(exc).__name__}: {exc})")
            return result
