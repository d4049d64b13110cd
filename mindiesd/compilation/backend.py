"""MindieSDBackend: the ``torch.compile`` backend.

The whole pipeline, per graph that Dynamo hands over (:meth:`MindieSDBackend.__call__`): the graph's
:class:`GraphContext` (weights, device, mode, families, cache key) is computed once, then

    load_cached (a cache entry for this graph? skip to the capture wrap)
    -> aot (functional aten, inference): its fw_compiler runs
           restore_layout_checks (what aot decided on fake strides is checked on the real ones)
           -> freeze (enable_freezing: freeze-stage rewrites, then weights-only computations folded)
           -> fuse (fusion_patterns.enable_*)
    -> store (cache_dir) -> wrap for capture (aclgraph_*) -> what Dynamo calls

Any failure on the way gives one warning naming the cause and the unfused Dynamo graph runs instead (``strict``
raises). The same holds at run time: if the optimised graph raises where the unfused one does not, the unfused
one is used from then on.
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.fx import GraphModule

import mindiesd.ops  # noqa: F401  (registers torch.ops.mindiesd.*)

from .families import check_known
from .storage import cache as graph_cache
from .runtime.kernel_choice import choose_kernels
from .runtime.lowering import traced_facts
from .runtime.python_runner import compiled_code
from .runtime.executor import runner
from .config import CompilationConfig
from .context import GraphContext
from .runtime.device_graph import DeviceGraphRunner, wrap_for_capture
from .freezing import FrozenGraph, constant_inputs, split_constants
from .graph_log import GraphLog, resolve_log_dir
from .cleanup import AFTER_FUSION, CleanupStep
from .cleanup.layout_checks import restore_layout_checks
from .pass_manager import PassManager
from .passes.flex_attention import FLEX_ATTENTION, FlexRegion
from .report import CompileReport, GraphRecord, MindieSDFallbackWarning, fusion_report

log = logging.getLogger("mindiesd.compilation")

__all__ = ["MindieSDBackend", "MindieSDFallbackWarning"]

_graph_ids = itertools.count()

try:
    from torch._dynamo.exc import RestartAnalysis, SkipFrame

    _DYNAMO_CONTROL_FLOW: tuple = (RestartAnalysis, SkipFrame)
except ImportError:  # pragma: no cover - other torch versions
    _DYNAMO_CONTROL_FLOW = ()


def _node_count(gm: GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


class MindieSDBackend:
    """Pass as ``torch.compile(model, backend=MindieSDBackend())``.

    The settings are a snapshot of :class:`CompilationConfig` taken here (or ``config``, copied), so later
    changes to the global settings affect only backends created later. With ``keep_graphs=True`` the final
    graph of every compile is kept in :attr:`graphs`, for inspection (count the fused ops, read the code).
    ``force_fast`` names families treated as faster than eager on the graph's device, to fuse (and measure) them
    where they are declared slower; a family with no kernel or rewrite on the device stays unfused.
    """

    def __init__(self, config: Optional[CompilationConfig] = None, *, keep_graphs: bool = False,
                 force_fast: Union[str, Iterable[str]] = ()):
        if config is not None and not isinstance(config, CompilationConfig):
            raise TypeError(f"config must be a CompilationConfig, got {type(config).__name__}")
        self.config = config.copy() if config is not None else CompilationConfig.snapshot()
        self.force_fast: FrozenSet[str] = _known_families(force_fast)
        self._report = CompileReport()
        self.keep_graphs = keep_graphs
        self.graphs: List[GraphModule] = []
        self.runners: List[DeviceGraphRunner] = []  # one per compiled graph when capture is on

    def report(self) -> CompileReport:
        """Matches per family, graphs compiled and compile seconds, for this backend."""
        return self._report

    def __call__(self, gm: GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        record = GraphRecord(graph_id=next(_graph_ids), nodes_before=_node_count(gm))
        start = time.perf_counter()
        graph_log = GraphLog(resolve_log_dir(self.config.graph_log_url), record.graph_id)
        context: Optional[GraphContext] = None
        result: Optional[CompiledGraph] = None
        try:
            context = GraphContext.build(gm, example_inputs, self.config, self.force_fast)
            result = load_cached(context, graph_log) or store(context, aot(gm, example_inputs, context, graph_log))
            compiled = _FallbackOnError(result.run, gm.forward, record, self.config.strict)
        except _DYNAMO_CONTROL_FLOW:
            raise  # Dynamo's own signals (restart the analysis, skip the frame): not failures
        except Exception as exc:
            if self.config.strict:
                raise
            record.fallback = f"{type(exc).__name__}: {exc}"
            _warn_fallback(f"compiling graph {record.graph_id} failed ({record.fallback})")
            compiled = gm.forward
            context = context or GraphContext.build(gm, example_inputs, self.config, self.force_fast, cached=False)
        if result is not None:
            self._fill_record(record, result)
        compiled = self._wrap_for_capture(compiled, context, result, record.graph_id)
        record.seconds = time.perf_counter() - start
        self._finish(record, graph_log)
        return compiled

    def compile_for_artifact(self, gm: GraphModule, example_inputs: List[Any]) -> graph_cache.CachedGraph:
        """The fused graph of ``gm`` as the persistent cache stores it, for an ahead-of-time artifact
        (:mod:`mindiesd.compilation.ahead_of_time`); ValueError saying why a graph cannot be stored (a training graph, or
        one whose calling convention aot changes). Recorded in :meth:`report` like any compile."""
        record = GraphRecord(graph_id=next(_graph_ids), nodes_before=_node_count(gm))
        start = time.perf_counter()
        graph_log = GraphLog(resolve_log_dir(self.config.graph_log_url), record.graph_id)
        context = GraphContext.build(gm, example_inputs, self.config, self.force_fast, cached=False)
        if context.training:
            raise ValueError("a training graph (inputs that require grad, with grad enabled)")
        result = aot(gm, example_inputs, context, graph_log)
        if result.not_cacheable is not None:
            raise ValueError(result.not_cacheable)
        self._fill_record(record, replace(result, cache="artifact"))
        record.seconds = time.perf_counter() - start
        self._finish(record, graph_log)
        return cached_entry(result)

    def _fill_record(self, record: GraphRecord, result: "CompiledGraph") -> None:
        """Copy what the stages made of the graph into its record (and :attr:`graphs`)."""
        record.matches, record.rules, record.skipped = dict(result.matches), dict(result.rules), dict(result.skipped)
        record.folded_constants, record.nodes_after, record.cache = result.n_folded, result.nodes_after, result.cache
        record.kernel_choices = list(result.kernel_choices)
        if self.keep_graphs and result.main is not None:
            self.graphs.append(result.main)

    def _wrap_for_capture(self, compiled: Callable[..., Any], context: GraphContext,
                          result: Optional["CompiledGraph"], graph_id: int) -> Callable[..., Any]:
        frozen = result.frozen if result is not None else None
        compiled = wrap_for_capture(compiled, self.config, context.device, context.weights, label=f"graph {graph_id}",
                                    reads=folded_reader(frozen) if frozen is not None else None)
        if isinstance(compiled, DeviceGraphRunner):
            self.runners.append(compiled)
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


def _known_families(names: Union[str, Iterable[str]]) -> FrozenSet[str]:
    try:
        return check_known((names,) if isinstance(names, str) else tuple(names))
    except ValueError as exc:
        raise ValueError(f"force_fast: {exc}") from None


# ------------------------------------------------------------------------------------------------- the stages


@dataclass(frozen=True)
class CompiledGraph:
    """What the stages made of one graph: the callable Dynamo gets, and what its record reports."""

    run: Callable[..., Any]
    main: Optional[GraphModule] = None
    frozen: Optional[FrozenGraph] = None
    n_folded: int = 0
    matches: Mapping[str, int] = field(default_factory=dict)
    rules: Mapping[str, int] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)
    nodes_after: int = 0
    #: The persistent cache's word on it: ``hit``, ``stored``, ``store failed``, ``off`` or ``not cached: <why>``.
    cache: str = "off"
    #: Why it cannot be stored (aot's runtime wrapper does more than call it, or it calls code the cache does not
    #: keep), or None.
    not_cacheable: Optional[str] = None
    #: Why aot's runtime wrapper must run around it (it does more than call the graph), or None.
    needs_wrapper: Optional[str] = None
    #: The runner of ``main`` (``executor.runner``), whose generated code a stored entry keeps.
    code: Optional[Callable[..., Any]] = None
    #: What each measured fused op site runs, with the candidates' times (``kernel_choice``; empty: not measured).
    kernel_choices: Tuple[str, ...] = ()


@dataclass(frozen=True)
class FreezeResult:
    """The freeze stage's result: the fold/main split (None: nothing folded or not frozen), the freeze-stage
    rewrites per family, and the freeze-stage families not run, with why."""

    graph: Optional[FrozenGraph]
    rewrites: Dict[str, int]
    skipped: Dict[str, str]


def load_cached(context: GraphContext, graph_log: GraphLog) -> Optional[CompiledGraph]:
    """The compiled graph from the persistent cache, or None on a miss (or without a key)."""
    entry = context.cache.load(context.key) if context.cache is not None and context.key is not None else None
    if entry is None:
        return None
    if entry.guards and (context.sizes is None or not context.sizes.replay(entry.guards)):
        log.debug("cache entry %s: its shape guards fail for these sizes; compiling", context.key)
        return None
    run = graph_cache.runnable(entry)
    graph_log.graph("cached", entry.main)
    return CompiledGraph(run, entry.main, run.frozen, entry.n_folded, dict(entry.matches), dict(entry.rules),
                         dict(entry.skipped), entry.nodes_after, cache="hit",
                         kernel_choices=tuple(entry.kernel_choices))


def aot(gm: GraphModule, example_inputs: List[Any], context: GraphContext, graph_log: GraphLog) -> CompiledGraph:
    """aot's functional aten graph, frozen and fused by :class:`_FreezeAndFuse`. ``run`` is the fused graph itself
    where aot's runtime wrapper would only call it (an inference graph whose inputs and outputs aot leaves as they
    are: :attr:`~CompiledGraph.needs_wrapper` is None), else aot's callable."""
    from torch._functorch.aot_autograd import aot_module_simplified

    compiler = _FreezeAndFuse(context, graph_log)
    run = aot_module_simplified(gm, example_inputs, fw_compiler=compiler, bw_compiler=_as_traced,
                                keep_inference_input_mutations=True)
    result = compiler.result
    if result is None:
        return CompiledGraph(run, not_cacheable="no inference graph", needs_wrapper="no inference graph")
    if result.needs_wrapper is None and not context.training:  # the graph alone is the whole call: no wrapper
        return replace(result, run=graph_cache.inference_call(result.run))
    return replace(result, run=run)


class _FreezeAndFuse:
    """aot's fw_compiler: the freeze and fuse stages on the aten graph; what they made is :attr:`result`, with
    whether aot's runtime wrapper does more than call it (``not_cacheable``)."""

    def __init__(self, context: GraphContext, graph_log: GraphLog):
        self.context, self.graph_log = context, graph_log
        self.result: Optional[CompiledGraph] = None

    def __call__(self, aten_gm: GraphModule, aten_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import make_boxed_func

        context = self.context
        self.graph_log.graph("aten", aten_gm)
        restored = restore_layout_checks(aten_gm.graph)
        if restored:
            log.debug("layout checks restored at run time: %d", restored)
        passes = PassManager(context.families, context.device_type, force=context.force)
        lowered = passes.run_lower(aten_gm, self.graph_log, training=context.training,
                                   inductor=context.device_type in ("cpu", "cuda") and not context.training)
        fused = fuse(context, freeze(context, aten_gm, len(aten_inputs), passes, self.graph_log), aten_gm, passes,
                     self.graph_log)
        kept = {p.family: p.why_not for p in passes.lower_passes if getattr(p, "why_not", None)}  # calls left as traced
        fused = replace(fused, matches={**lowered, **fused.matches}, skipped={**fused.skipped, **kept})
        # aot's metadata of this trace says whether the graph alone is the whole call
        wrapper = graph_cache.calling_convention_problem(aten_gm, context.n_inputs)
        self.result = replace(fused, not_cacheable=_unstorable(fused.main) or wrapper, needs_wrapper=wrapper)
        return make_boxed_func(fused.run)


def _unstorable(gm: Optional[GraphModule]) -> Optional[str]:
    """Why the cache cannot store the fused graph ``gm`` (a call of code it does not keep), or None."""
    if gm is None:
        return None
    for node in gm.graph.nodes:
        if isinstance(node.target, FlexRegion):
            return "a flex_attention region compiled by Inductor (Inductor caches its own code)"
        if FLEX_ATTENTION is not None and node.target is FLEX_ATTENTION:
            return "a flex_attention call left as traced (its score and mask subgraphs are not stored)"
    return None


def _as_traced(aten_gm: GraphModule, aten_inputs: Sequence[Any]) -> Callable[..., Any]:
    """aot's bw_compiler: the backward graph runs as traced."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(aten_gm.forward)


def freeze(context: GraphContext, aten_gm: GraphModule, aten_inputs: int, passes: PassManager,
           graph_log: GraphLog) -> FreezeResult:
    """The freeze-stage rewrites on the whole aten graph, then its split into a fold graph (what depends on weights
    alone) and the main graph."""
    rewrites = {fusion.family: 0 for fusion in passes.freeze_passes}
    why_not = context.why_not_frozen(aten_inputs)
    if why_not is not None:
        return FreezeResult(None, rewrites, dict.fromkeys(rewrites, why_not))
    if passes.freeze_passes:  # rewrites whose weight-only part the split folds (LoRA adapters stay unfolded)
        rewrites = passes.run_freeze(aten_gm, constant_inputs(aten_gm, context.rewritable_weights), graph_log)
    # a freeze pass that rewrote nothing says why where it knows (linear layers over quantized weights)
    skipped = {p.family: p.why_not for p in passes.freeze_passes
               if getattr(p, "why_not", None) and not rewrites.get(p.family)}
    frozen = split_constants(aten_gm, context.weights)
    if frozen is not None:
        graph_log.graph("freezing", frozen.main)
    return FreezeResult(frozen, rewrites, skipped)


def fuse(context: GraphContext, frozen: FreezeResult, aten_gm: GraphModule, passes: PassManager,
         graph_log: GraphLog) -> CompiledGraph:
    """The fusion-stage passes on the main graph (the aten graph where nothing was folded)."""
    split = frozen.graph
    target = split.main if split is not None else aten_gm
    matches = {**frozen.rewrites, **passes.run(target, graph_log)}
    steps = list(AFTER_FUSION)
    chosen: List[Any] = []
    if context.measuring and context.device is not None:  # first, each fused site keeps its op only where it wins
        steps.insert(0, _kernel_choice(context.device, chosen))
    changed = passes.run_steps(steps, target, graph_log)
    log.debug("after fusion: %s", changed)
    choices = tuple(c.describe() for c in chosen)
    for line in choices:
        log.info("graph kernel choice: %s", line)
    target.recompile()
    forward = runner(target)
    return CompiledGraph(
        run=split.bind(forward) if split is not None else forward, main=target, frozen=split, code=forward,
        n_folded=split.n_folded if split is not None else 0, matches=matches, rules=passes.rule_hits(),
        skipped={**context.skipped, **frozen.skipped},
        nodes_after=_node_count(target) + (_node_count(split.fold) if split is not None else 0),
        kernel_choices=choices,
    )


def _kernel_choice(device: torch.device, chosen: List[Any]) -> CleanupStep:
    """The step that keeps each fused site's op only where it is faster on ``device`` (it measures); what it
    chose is added to ``chosen``."""

    def choose(gm: GraphModule) -> int:
        chosen.extend(choose_kernels(gm, device))
        return len(chosen)

    return CleanupStep("kernel_choice", choose)


def store(context: GraphContext, compiled: CompiledGraph) -> CompiledGraph:
    """Writes the compiled graph to the persistent cache; the result's :attr:`~CompiledGraph.cache` says how it went."""
    if context.cache is None or context.key is None:
        return replace(compiled, cache=context.uncached)
    if compiled.not_cacheable is not None:
        return replace(compiled, cache=f"not cached: {compiled.not_cacheable}")
    guards = context.sizes.added_guards() if context.sizes is not None else []
    if guards is None:
        return replace(compiled, cache="not cached: a guard on a size computed in the graph")
    entry = cached_entry(compiled)
    entry.guards = guards
    return replace(compiled, cache="stored" if context.cache.store(context.key, entry) is not None else "store failed")


def cached_entry(compiled: CompiledGraph) -> graph_cache.CachedGraph:
    """What is stored of a compiled graph: its fused main graph, its fold graph and what the record reports."""
    split = compiled.frozen
    return graph_cache.CachedGraph(
        main=compiled.main, fold=split.fold if split is not None else None,
        fold_inputs=list(split.fold_inputs) if split is not None else [],
        main_inputs=list(split.main_inputs) if split is not None else [], n_folded=compiled.n_folded,
        matches=dict(compiled.matches), rules=dict(compiled.rules), skipped=dict(compiled.skipped),
        nodes_after=compiled.nodes_after, facts=traced_facts(compiled.main),
        runner_code=compiled_code(compiled.code) if compiled.code is not None else None,
        kernel_choices=list(compiled.kernel_choices),
    )


# ------------------------------------------------------------------------------------------------- run time


def folded_reader(frozen: FrozenGraph) -> Callable[..., Sequence[torch.Tensor]]:
    """What a capture of the graph reads besides its arguments: the folded constants of these weights."""

    def reads(*args: Any) -> Sequence[torch.Tensor]:
        try:
            return frozen.folded_for_inputs(args)  # Dynamo's inputs: a quantized weight is one, not its parts
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
