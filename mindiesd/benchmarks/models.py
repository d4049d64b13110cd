"""``mindiesd bench model``: compile models of the registry (``mindiesd.zoo``) with the MindieSD backend and measure
them.

For each model the bench reports how many fused ops of each family the backend
inserted, the numerical error against eager, the cold compile time and the
steady-state latency of eager and compiled forwards (optionally also Inductor's).
Eager and compiled calls are interleaved in one timing loop (``benchmarks.timing``, shared with
``mindiesd bench ops``) and medians are reported, because CPU timings drift by tens of percent over a run, with
their spread; a run on a busy machine (load average above the cores, or a wide spread) gets a warning on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence, TextIO

import torch
import torch._dynamo

from .. import zoo
from ..compilation.families import GEMM_FAMILIES
from ..compilation.report import plural
from .common import (
    DEFAULT_ITERS, DEFAULT_WARMUP, DTYPE_NAMES, DTYPES, FAMILIES, USER_CACHE, Progress,
    add_cache_options, add_model_option, add_run_options, add_timing_options, complain, environment, footer,
    make_backend, max_relative_error, profile_cpu, resolve_cache_dir, select_models, session, warn_if_busy,
    write_json,
)
from .quant import QUANT_CONFIGS, quantize
from .table import format_rows
from .timing import Medians, interleaved_medians
from .timing import synchronize as _synchronize

BASE_COLUMNS = (
    "model",
    "size",
    "dtype",
    "quant",
    *FAMILIES,
    "graphs",
    "fallbacks",
    "max_rel_err",
    "compile_s",
    "backend_s",
    "cache",
    "eager_ms",
    "mindiesd_ms",
    "speedup",
    "spread",
)
INDUCTOR_COLUMNS = (
    "inductor_max_rel_err",
    "inductor_compile_s",
    "inductor_ms",
    "compile_vs_inductor",
    "speed_vs_inductor",
)

#: With ``--vs inductor-ro``: Inductor's ``mode="reduce-overhead"`` (CUDA graphs on a GPU).
INDUCTOR_RO_COLUMNS = ("inductor_ro_compile_s", "inductor_ro_ms")

CAPTURE_COLUMNS = ("capture_first_s", "capture_ms", "capture_speedup")

#: With ``--ablate``: per GEMM rewrite, the steady ms with that switch off / the ms with it on (above 1: it gains).
ABLATE_COLUMNS = tuple(f"gain_{family}" for family in GEMM_FAMILIES)

REGIONAL_COLUMNS = ("regional_graphs", "regional_fused", "regional_max_rel_err", "regional_compile_s",
                    "regional_ms", "regional_speedup")


def _case_device(case: zoo.Case) -> torch.device:
    return next(case.model.parameters()).device


@contextlib.contextmanager
def _fresh_inductor_cache() -> Iterator[None]:
    """Point Inductor at an empty cache directory so its compile time is a cold one."""
    with tempfile.TemporaryDirectory(prefix="mindiesd-bench-inductor-") as directory:
        try:
            from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
        except ImportError:
            temporary_cache_dir = None
        if temporary_cache_dir is None:
            previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
            try:
                yield
            finally:
                if previous is None:
                    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
                else:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
        else:
            with temporary_cache_dir(directory):
                yield


def _timed_first_call(fn: Callable[[], Any], progress: Progress, label: str) -> tuple[Any, float]:
    with progress.step(label):
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    return out, seconds



def _cache_state(records: Sequence[Any]) -> str:
    """One word for the persistent cache over a compile's graphs: hit, stored, off, or a tally of the outcomes."""
    states = [str(getattr(record, "cache", "off")) for record in records]
    states = ["not cached" if state.startswith("not cached") else state for state in states]
    return _tally(states)


def _tally(states: Sequence[str]) -> str:
    """``-`` for none, the word where all agree, else ``2 hit/1 stored``."""
    if not states:
        return "-"
    if len(set(states)) == 1:
        return states[0]
    tally: dict[str, int] = {}
    for state in states:
        tally[state] = tally.get(state, 0) + 1
    return "/".join(f"{n} {state}" for state, n in tally.items())


def _report_fields(backend: Any) -> dict[str, Any]:
    report_fn = getattr(backend, "report", None)
    report = report_fn() if callable(report_fn) else None
    matches = dict(getattr(report, "matches", {}) or {})
    fields: dict[str, Any] = {family: int(matches.get(family, 0)) for family in FAMILIES}
    fields["graphs"] = int(getattr(report, "graphs", 0) or 0)
    reasons = [str(reason) for reason in (getattr(report, "fallbacks", None) or [])]
    fields["fallbacks"] = len(reasons)
    fields["fallback_reasons"] = reasons
    backend_seconds = getattr(report, "compile_seconds", None)
    fields["backend_s"] = float(backend_seconds) if backend_seconds is not None else None
    fields["cache"] = _cache_state(getattr(report, "records", None) or [])
    return fields


def _aot_fields(model: torch.nn.Module, backend: Any) -> dict[str, Any]:
    """The row's fusion and cache columns for a model compiled by ``aot_compile``: counts as the artifacts
    recorded them (a loaded artifact was not compiled here), ``graphs`` = artifacts, ``cache`` = how they came."""
    from ..compilation.ahead_of_time import aot_forwards

    forwards = aot_forwards(model)
    fields = _report_fields(backend)
    matches: dict[str, int] = {}
    for forward in forwards:
        for family, count in forward.matches().items():
            matches[family] = matches.get(family, 0) + count
    fields.update({family: int(matches.get(family, 0)) for family in FAMILIES})
    outcomes = [o for forward in forwards for o in forward.outcomes.values() if o != "shared"]
    fields["graphs"] = len(outcomes)
    words = ["aot hit" if o == "loaded" else f"aot {o}" if o in ("stored", "compiled") else "no aot" for o in outcomes]
    fields["cache"] = _tally(words)
    return fields


def fused_ops_run(fn: Callable[[], Any]) -> int:
    """How many fused ``mindiesd::`` ops one call of ``fn`` runs (counted by the profiler, so what really ran)."""
    return sum(1 for event in profile_cpu(fn).events() if event.name.startswith("mindiesd::"))


def _regional_variant(model: torch.nn.Module, inputs: dict, reference: Any, backend: Any, progress: Progress,
                      tag: str, row: dict[str, Any], aot: bool = False) -> Callable[[], Any] | None:
    """Compile a copy of ``model`` with diffusers' ``compile_repeated_blocks`` (``aot``: ``aot_compile(...,
    regional=True)``); fill the regional columns."""
    classes = zoo.repeated_blocks(model)
    if not classes or not hasattr(model, "compile_repeated_blocks"):
        progress.note(f"{tag} has no repeated blocks: regional columns left empty")
        return None
    blocks_model = copy.deepcopy(model)
    blocks_model._repeated_blocks = list(classes)  # what the class declares, or its ModuleList's block class
    if aot:
        from ..compilation.ahead_of_time import aot_compile

        aot_compile(blocks_model, backend, regional=True)
    else:
        blocks_model.compile_repeated_blocks(backend=backend)
    out, row["regional_compile_s"] = _timed_first_call(
        lambda: blocks_model(**inputs), progress, f"compiling the repeated blocks of {tag} with mindiesd"
    )
    row["regional_max_rel_err"] = max_relative_error(out, reference)
    if aot:
        aot_row = _aot_fields(blocks_model, backend)
        row["regional_graphs"], row["regional_cache"] = aot_row["graphs"], aot_row["cache"]
    else:
        row["regional_graphs"] = backend.report().graphs
    row["regional_fused"] = fused_ops_run(lambda: blocks_model(**inputs))
    return lambda: blocks_model(**inputs)


def run_case(
    case: zoo.Case,
    *,
    iters: int | None = None,
    warmup: int | None = None,
    vs_inductor: bool = False,
    inductor_cold_cache: bool = True,
    vs_inductor_ro: bool = False,
    backend: Any = None,
    progress: Progress | None = None,
    capture: bool = False,
    cache_dir: Any = USER_CACHE,
    regional: bool = False,
    ablate: bool = False,
    force: Sequence[str] = (),
    aot: bool = False,
    quant: str | None = None,
) -> dict[str, Any]:
    """Compile ``case`` with the MindieSD backend (and optionally Inductor) and measure it.

    Returns one row: model, size, dtype, fused-op counts per family, graphs,
    max relative error vs eager, compile seconds (wall time of the first
    compiled call), median eager and compiled ms per forward, the speedup and ``spread`` (the widest
    interquartile range of a runner's timed calls over its median: above 0.2 the ratios are unsteady);
    with ``vs_inductor`` also Inductor's error, compile seconds and ms, and the
    ratios ``compile_vs_inductor`` (mindiesd compile / Inductor compile) and
    ``speed_vs_inductor`` (Inductor ms / mindiesd ms, above 1 means mindiesd is
    faster). With ``capture`` also the first-call seconds and steady ms of a second compile with
    ``aclgraph_with_compile`` on (``None`` where the device has no device graph, e.g. CPU). Resets Dynamo
    before and after so each compile starts from nothing in this process; ``cache_dir`` is the persistent cache
    the backends use (default: ``CompilationConfig.cache_dir``; ``None``: none). ``backend_s`` is the backend's
    share of ``compile_s`` (the rest is Dynamo's trace and the first run); ``cache`` says whether the graphs
    were loaded from the persistent cache (``hit``) or compiled and stored (``stored``). With ``regional`` also
    a copy compiled with diffusers' ``compile_repeated_blocks``: its graphs, fused ops run per forward (beside
    ``fused``, the whole-model compile's), error, first-call seconds and steady ms. With ``ablate``, per GEMM
    rewrite that the compile made, a copy compiled with its switch off, timed in the same interleaved runs:
    ``gain_<family>`` = its ms / the ms with every rewrite on. ``force``: families every backend runs on the
    device even where mindiesd declares them not faster there. With ``aot``, the mindiesd variants are compiled
    by ``aot_compile`` on a copy (an artifact in ``cache_dir`` loaded, or compiled and stored): ``cache`` says
    ``aot hit`` / ``aot stored`` and the fused counts are those the artifacts recorded. ``quant`` names the
    quantization the caller applied to the model (``bench model --quant``), for the row's ``quant`` column.
    """
    iters = DEFAULT_ITERS.get(case.size, 10) if iters is None else iters
    warmup = DEFAULT_WARMUP.get(case.size, 1) if warmup is None else warmup
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be non-negative, got {warmup}")
    progress = progress if progress is not None else Progress()
    model, inputs = case.model, case.inputs
    device = _case_device(case)

    def backend_with(**settings: Any) -> Any:
        return make_backend(cache_dir, force=force, device=device, **settings)

    backend = backend if backend is not None else backend_with()
    tag = f"{case.name}/{case.size}"

    row: dict[str, Any] = {
        "model": case.name,
        "size": case.size,
        "dtype": DTYPE_NAMES.get(case.dtype, str(case.dtype).replace("torch.", "")),
        "quant": quant,
    }
    torch._dynamo.reset()
    try:
        with torch.no_grad(), contextlib.ExitStack() as keep_alive:
            reference = model(**inputs)
            _synchronize(device)

            if aot:
                from ..compilation.ahead_of_time import aot_compile

                compiled = aot_compile(copy.deepcopy(model), backend)
            else:
                compiled = torch.compile(model, backend=backend)
            out, compile_s = _timed_first_call(
                lambda: compiled(**inputs), progress, f"compiling {tag} with mindiesd"
            )
            row.update(_aot_fields(compiled, backend) if aot else _report_fields(backend))
            row["max_rel_err"] = max_relative_error(out, reference)
            row["compile_s"] = compile_s
            if regional:
                row["fused"] = fused_ops_run(lambda: compiled(**inputs))

            runners = {"eager": lambda: model(**inputs), "mindiesd": lambda: compiled(**inputs)}
            if vs_inductor:
                row.update(dict.fromkeys(INDUCTOR_COLUMNS))
                if inductor_cold_cache:
                    keep_alive.enter_context(_fresh_inductor_cache())
                inductor = torch.compile(model)
                try:
                    ind_out, ind_compile_s = _timed_first_call(
                        lambda: inductor(**inputs), progress, f"compiling {tag} with inductor"
                    )
                except Exception as exc:  # e.g. no C++ compiler: keep the mindiesd numbers
                    progress.note(f"inductor failed on {tag}: {type(exc).__name__}: {exc}")
                else:
                    row["inductor_max_rel_err"] = max_relative_error(ind_out, reference)
                    row["inductor_compile_s"] = ind_compile_s
                    runners["inductor"] = lambda: inductor(**inputs)
            if vs_inductor_ro:
                row.update(dict.fromkeys(INDUCTOR_RO_COLUMNS))
                if inductor_cold_cache and not vs_inductor:
                    keep_alive.enter_context(_fresh_inductor_cache())
                reduce_overhead = torch.compile(model, mode="reduce-overhead")
                try:
                    _, row["inductor_ro_compile_s"] = _timed_first_call(
                        lambda: reduce_overhead(**inputs), progress, f"compiling {tag} with inductor reduce-overhead"
                    )
                except Exception as exc:  # noqa: BLE001  (keep the other columns)
                    progress.note(f"inductor reduce-overhead failed on {tag}: {type(exc).__name__}: {exc}")
                else:
                    runners["inductor-ro"] = lambda: reduce_overhead(**inputs)
            if capture:
                row.update(dict.fromkeys(CAPTURE_COLUMNS))
                from ..compilation.runtime.device_graph import adapter_for

                if adapter_for(device) is None:
                    progress.note(f"no device graph on {device.type}: capture columns left empty")
                else:
                    graphed = torch.compile(model, backend=backend_with(aclgraph_with_compile=True))
                    _, row["capture_first_s"] = _timed_first_call(
                        lambda: graphed(**inputs), progress, f"compiling and capturing {tag}"
                    )
                    runners["captured"] = lambda: graphed(**inputs)
            if ablate:
                row.update(dict.fromkeys(ABLATE_COLUMNS))
                for family in GEMM_FAMILIES:
                    if row.get(family):
                        without = torch.compile(model, backend=backend_with(
                            fusion_patterns={f"enable_{family}": False}))
                        _timed_first_call(lambda: without(**inputs), progress, f"compiling {tag} without {family}")
                        runners[f"no_{family}"] = lambda without=without: without(**inputs)
            if regional:
                row.update(dict.fromkeys(REGIONAL_COLUMNS))
                run_regional = _regional_variant(model, inputs, reference, backend_with(), progress, tag, row, aot)
                if run_regional is not None:
                    runners["regional"] = run_regional
            medians = _time(runners, iters, warmup, device, progress, tag)
    finally:
        torch._dynamo.reset()

    row["eager_ms"] = medians["eager"]
    row["mindiesd_ms"] = medians["mindiesd"]
    row["speedup"] = medians["eager"] / medians["mindiesd"]
    row["spread"] = medians.spread
    if "inductor" in medians:
        row["inductor_ms"] = medians["inductor"]
        row["compile_vs_inductor"] = row["compile_s"] / row["inductor_compile_s"]
        row["speed_vs_inductor"] = medians["inductor"] / medians["mindiesd"]
    if "regional" in medians:
        row["regional_ms"] = medians["regional"]
        row["regional_speedup"] = medians["eager"] / medians["regional"]
    for family in GEMM_FAMILIES:
        if f"no_{family}" in medians:
            row[f"gain_{family}"] = medians[f"no_{family}"] / medians["mindiesd"]
    if "inductor-ro" in medians:
        row["inductor_ro_ms"] = medians["inductor-ro"]
    if "captured" in medians:
        row["capture_ms"] = medians["captured"]
        row["capture_speedup"] = medians["eager"] / medians["captured"]
    row["iters"] = iters
    return row


def _time(runners, iters, warmup, device, progress: Progress, tag: str) -> Medians:
    with progress.step(f"timing {tag}: {plural(iters, 'interleaved iter')} of {', '.join(runners)}"):
        return interleaved_medians(runners, iters=iters, warmup=warmup, device=device)




def table_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The base columns, plus Inductor's, capture's and regional compilation's when any row has them."""
    columns = list(BASE_COLUMNS)
    if any("fused" in row for row in rows):
        columns.insert(columns.index("graphs"), "fused")
    for extra in (INDUCTOR_COLUMNS, INDUCTOR_RO_COLUMNS, CAPTURE_COLUMNS, REGIONAL_COLUMNS, ABLATE_COLUMNS):
        if any(column in row for row in rows for column in extra):
            columns += extra
    return columns


def format_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """Rows as an aligned plain-text table, or as a Markdown table."""
    columns = table_columns(rows)
    if not any(row.get("quant") for row in rows):
        columns.remove("quant")
    return format_rows(rows, columns, ("model", "size", "dtype", "quant"), markdown=markdown)


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``bench model`` on ``parser``."""
    add_model_option(parser)
    add_run_options(parser)
    add_timing_options(parser)
    add_cache_options(parser)
    parser.add_argument(
        "--vs",
        choices=("inductor", "inductor-ro"),
        action="append",
        default=[],
        help="also compile with this backend and compare: Inductor's default mode, or mode='reduce-overhead' "
        "(repeat --vs for both; Inductor can take minutes to compile); all compile from empty caches unless "
        "--inductor-cache or --cache-dir is given",
    )
    parser.add_argument(
        "--inductor-cache",
        action="store_true",
        help="with --vs inductor: let Inductor and mindiesd reuse their on-disk caches (default: empty ones, so "
        "both compile times are cold)",
    )
    parser.add_argument(
        "--regional",
        action="store_true",
        help="also compile a copy with diffusers' compile_repeated_blocks (regional compilation): its graphs, "
        "fused ops run per forward, error, compile seconds and steady ms beside the whole-model figures",
    )
    parser.add_argument(
        "--aot",
        action="store_true",
        help="compile with mindiesd.compilation.aot_compile: the artifact in the cache folder is loaded without "
        "Dynamo's trace, or compiled and stored (cache: aot hit / aot stored); with --regional, one artifact per "
        "repeated block class",
    )
    parser.add_argument(
        "--capture",
        action="store_true",
        help="also compile with aclgraph_with_compile=True: first-call seconds and steady ms of replay "
        "(needs a device with device graphs: --device cuda, or an Ascend NPU)",
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="also compile, per GEMM rewrite the compile made (" + ", ".join(GEMM_FAMILIES) + "), a copy with its "
        "switch off, timed in the same runs: <rewrite>_gain = ms without it / ms with it (above 1: it gains)",
    )
    parser.add_argument(
        "--attention",
        default=None,
        metavar="BACKEND",
        help="set this diffusers attention backend on the model first (model.set_attention_backend: flex, native, "
        "_native_math, ...), so eager and every backend run it",
    )
    parser.add_argument(
        "--quant",
        choices=tuple(QUANT_CONFIGS),
        default=None,
        help="quantize every linear layer with torchao first (int8-weight: int8 weights; int8-dynamic: int8 weights "
        "and per-row int8 activations; float8-weight: float8 weights), so eager and every backend run the "
        "quantized model; needs torchao",
    )
    parser.add_argument(
        "--force",
        action="append",
        default=[],
        choices=FAMILIES,
        metavar="FAMILY",
        help="run FAMILY on --device even where mindiesd declares it not faster there (the GEMM rewrites are off "
        "on CPU by default): to measure it; repeatable",
    )


def run(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Execute a parsed ``bench model`` command; returns the process exit status."""
    stdout, stderr, progress = session(args, stdout, stderr)
    names = select_models(args.model, args.size, stderr)
    if not names:
        return 2
    for family in args.force:
        try:
            make_backend(None, force=(family,), device=args.device)
        except ValueError as exc:
            complain(stderr, f"--force {family}: {exc}")
            return 2
    dtype = DTYPES[args.dtype]
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    with contextlib.ExitStack() as stack:
        cache_dir = resolve_cache_dir(args, stack)
        status = _run_models(args, names, dtype, cache_dir, rows, failures, progress, stderr)
    if status is not None:
        return status
    _print_results(args, rows, failures, stdout)
    return 1 if failures else 0



def _run_models(args, names, dtype, cache_dir, rows, failures, progress, stderr) -> int | None:
    for name in names:
        try:
            with progress.step(f"building {name}/{args.size} ({args.dtype})"):
                case = zoo.build(name, args.size, dtype=dtype, seed=args.seed, device=args.device)
            if args.attention:
                set_attention_backend(case.model, args.attention)
            if args.quant:
                with progress.step(f"quantizing {name}/{args.size} ({args.quant})"):
                    quantize(case.model, args.quant)
            rows.append(
                run_case(
                    case,
                    iters=args.iters,
                    warmup=args.warmup,
                    vs_inductor="inductor" in args.vs,
                    vs_inductor_ro="inductor-ro" in args.vs,
                    inductor_cold_cache=args.cold or not args.inductor_cache,
                    progress=progress,
                    capture=args.capture,
                    cache_dir=cache_dir,
                    regional=args.regional,
                    ablate=args.ablate,
                    force=args.force,
                    aot=args.aot,
                    quant=args.quant,
                )
            )
            warn_if_busy(stderr, [rows[-1]["spread"]], f"{name}/{args.size}")
        except ImportError as exc:
            complain(stderr, str(exc))
            return 2
        except Exception as exc:  # one failing model should not hide the others' results
            failures.append(name)
            complain(stderr, f"{name}/{args.size} failed: {type(exc).__name__}: {exc}")
        finally:
            case = None
    return None


def set_attention_backend(model: Any, backend: str) -> None:
    """``model.set_attention_backend(backend)`` (diffusers' attention dispatch); ValueError naming the backends
    where it has none of that name or the model no such method."""
    setter = getattr(model, "set_attention_backend", None)
    if setter is None:
        raise ValueError(f"{type(model).__name__} has no set_attention_backend (diffusers' attention dispatch)")
    try:
        setter(backend)
    except ValueError as exc:
        raise ValueError(f"--attention {backend}: {exc}") from None


def _print_results(args, rows, failures, stdout) -> None:
    env = environment(args.device)
    if rows:
        stdout.write(format_table(rows, markdown=args.markdown) + "\n")
        iters = sorted({row["iters"] for row in rows})
        stdout.write(
            f"\ntorch {env['torch']}, diffusers {env['diffusers']}, {plural(env['threads'], 'thread')}; "
            f"medians of {plural('/'.join(map(str, iters)), 'interleaved iter')}; "
            "spread = the widest interquartile range of a row's timed calls over their median; "
            "compile_s = wall time of the first compiled call, backend_s = the backend's share of it; "
            "cache = persistent compile cache (stored: compiled and written; hit: loaded)\n"
            f"{footer(env)}\n"
        )
        if any("regional_ms" in row for row in rows):
            stdout.write(
                "fused / reg_fused = fused ops run in one forward, whole model / repeated blocks compiled "
                "(compile_repeated_blocks); reg/eager = eager_ms / regional_ms\n"
            )
        if any("speed_vs_inductor" in row for row in rows):
            stdout.write(
                "compile/ind = mindiesd compile_s / inductor compile_s; "
                "speed/ind = inductor_ms / mindiesd_ms (above 1: mindiesd is faster)\n"
            )
        stdout.flush()
    if args.json:
        write_json(args.json, {"environment": env, "rows": rows, "failed": failures})
