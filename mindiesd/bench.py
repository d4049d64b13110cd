"""``mindiesd bench``: compile models of the registry (``mindiesd.zoo``) with the MindieSD backend and measure them.

For each model the bench reports how many fused ops of each family the backend
inserted, the numerical error against eager, the cold compile time and the
steady-state latency of eager and compiled forwards (optionally also Inductor's).
Eager and compiled calls are interleaved in one timing loop (``mindiesd.timing``, shared with
``mindiesd bench ops``) and medians are reported, because CPU timings drift by tens of percent over a run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Sequence, TextIO

import torch
import torch._dynamo

from . import zoo
from .compilation.families import FAMILIES as _FAMILIES
from .compilation.families import GEMM_FAMILIES, forced
from .timing import interleaved_medians
from .timing import synchronize as _synchronize

FAMILIES = tuple(_FAMILIES)
_FORCED: set = set()  # the families --force counts as fast in this run's backends
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_ITERS = {"tiny": 20, "mid": 5}
DEFAULT_WARMUP = {"tiny": 3, "mid": 1}

BASE_COLUMNS = (
    "model",
    "size",
    "dtype",
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
)
INDUCTOR_COLUMNS = (
    "inductor_max_rel_err",
    "inductor_compile_s",
    "inductor_ms",
    "compile_vs_inductor",
    "speed_vs_inductor",
)

CAPTURE_COLUMNS = ("capture_first_s", "capture_ms", "capture_speedup")

#: With ``--ablate``: per GEMM rewrite, the steady ms with that switch off / the ms with it on (above 1: it gains).
ABLATE_COLUMNS = tuple(f"gain_{family}" for family in GEMM_FAMILIES)

REGIONAL_COLUMNS = ("regional_graphs", "regional_fused", "regional_max_rel_err", "regional_compile_s",
                    "regional_ms", "regional_speedup")

_HEADERS = {
    "capture_first_s": "capture_first_s",
    "capture_ms": "captured_ms",
    "capture_speedup": "capt/eager",
    "regional_graphs": "reg_graphs",
    "regional_fused": "reg_fused",
    "regional_max_rel_err": "reg_rel_err",
    "regional_compile_s": "reg_compile_s",
    "regional_ms": "regional_ms",
    "regional_speedup": "reg/eager",
    "adalayernorm": "adaln",
    "fast_gelu": "gelu",
    "merge_projections": "merged",
    "linear_gelu": "lin_gelu",
    "gain_merge_projections": "merge_gain",
    "gain_linear_gelu": "lin_gelu_gain",
    "fallbacks": "fallback",
    "max_rel_err": "max_rel_err",
    "compile_s": "compile_s",
    "inductor_max_rel_err": "ind_rel_err",
    "inductor_compile_s": "ind_compile_s",
    "inductor_ms": "inductor_ms",
    "compile_vs_inductor": "compile/ind",
    "speed_vs_inductor": "speed/ind",
}


# ---------------------------------------------------------------- progress


class Progress:
    """Reports long steps on a stream: a live seconds ticker on a TTY, plain lines otherwise."""

    def __init__(self, stream: TextIO | None = None, live: bool | None = None, interval: float = 1.0):
        self.stream = stream if stream is not None else sys.stderr
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty())
        self.live = live
        self.interval = interval

    def note(self, message: str) -> None:
        self.stream.write(message + "\n")
        self.stream.flush()

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Announce ``label``, tick while it runs, and finish with its elapsed time."""
        start = time.perf_counter()
        stop = threading.Event()
        ticker = None
        if self.live:
            self.stream.write(f"{label} ...")
            self.stream.flush()

            def tick() -> None:
                while not stop.wait(self.interval):
                    self.stream.write(f"\r{label} ... {time.perf_counter() - start:.0f} s")
                    self.stream.flush()

            ticker = threading.Thread(target=tick, name="mindiesd-bench-ticker", daemon=True)
            ticker.start()
        else:
            self.note(f"{label} ...")
        outcome = "done in"
        try:
            yield
        except BaseException:
            outcome = "failed after"
            raise
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            elapsed = time.perf_counter() - start
            if self.live:
                self.stream.write(f"\r{label} ... {outcome} {elapsed:.1f} s\n")
                self.stream.flush()
            else:
                self.note(f"  {outcome} {elapsed:.1f} s")


class QuietProgress(Progress):
    """A :class:`Progress` that reports nothing (for tests and library callers)."""

    def __init__(self) -> None:
        super().__init__(stream=io.StringIO(), live=False)

    def note(self, message: str) -> None:
        pass


# ---------------------------------------------------------------- measuring


def _first_tensor(output: Any) -> torch.Tensor:
    while isinstance(output, (tuple, list)):
        output = output[0]
    if hasattr(output, "sample"):
        output = output.sample
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"model output has no leading tensor: {type(output).__name__}")
    return output


def max_relative_error(actual: Any, expected: Any) -> float:
    """``max |actual - expected| / max |expected|`` over the first output tensor, in fp32."""
    a = _first_tensor(actual).detach().float()
    e = _first_tensor(expected).detach().float()
    scale = e.abs().max().item()
    diff = (a - e).abs().max().item()
    return diff / scale if scale > 0 else diff


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


#: ``cache_dir`` argument meaning "whatever CompilationConfig.cache_dir says" (the user's persistent cache).
USER_CACHE = "user"


def _backend(cache_dir: Any = USER_CACHE, **settings: Any):
    try:
        from .compilation import CompilationConfig, MindieSDBackend
    except ImportError as exc:
        raise ImportError(f"the MindieSD backend could not be imported: {exc}") from exc
    if cache_dir != USER_CACHE:
        settings["cache_dir"] = cache_dir
    return MindieSDBackend(CompilationConfig(**settings), force_fast=_FORCED)


def _cache_state(records: Sequence[Any]) -> str:
    """One word for the persistent cache over a compile's graphs: hit, stored, off, or a tally of the outcomes."""
    states = [str(getattr(record, "cache", "off")) for record in records]
    states = ["not cached" if state.startswith("not cached") else state for state in states]
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


def fused_ops_run(fn: Callable[[], Any]) -> int:
    """How many fused ``mindiesd::`` ops one call of ``fn`` runs (counted by the profiler, so what really ran)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name.startswith("mindiesd::"))


def _regional_variant(model: torch.nn.Module, inputs: dict, reference: Any, cache_dir: Any, progress: Progress,
                      tag: str, row: dict[str, Any]) -> Callable[[], Any] | None:
    """Compile a copy of ``model`` with diffusers' ``compile_repeated_blocks``; fill the regional columns."""
    classes = zoo.repeated_blocks(model)
    if not classes or not hasattr(model, "compile_repeated_blocks"):
        progress.note(f"{tag} has no repeated blocks: regional columns left empty")
        return None
    blocks_model = copy.deepcopy(model)
    blocks_model._repeated_blocks = list(classes)  # what the class declares, or its ModuleList's block class
    backend = _backend(cache_dir)
    blocks_model.compile_repeated_blocks(backend=backend)
    out, row["regional_compile_s"] = _timed_first_call(
        lambda: blocks_model(**inputs), progress, f"compiling the repeated blocks of {tag} with mindiesd"
    )
    row["regional_max_rel_err"] = max_relative_error(out, reference)
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
    backend: Any = None,
    progress: Progress | None = None,
    capture: bool = False,
    cache_dir: Any = USER_CACHE,
    regional: bool = False,
    ablate: bool = False,
) -> dict[str, Any]:
    """Compile ``case`` with the MindieSD backend (and optionally Inductor) and measure it.

    Returns one row: model, size, dtype, fused-op counts per family, graphs,
    max relative error vs eager, compile seconds (wall time of the first
    compiled call), median eager and compiled ms per forward and the speedup;
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
    ``gain_<family>`` = its ms / the ms with every rewrite on.
    """
    iters = DEFAULT_ITERS.get(case.size, 10) if iters is None else iters
    warmup = DEFAULT_WARMUP.get(case.size, 1) if warmup is None else warmup
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be non-negative, got {warmup}")
    progress = progress if progress is not None else Progress()
    backend = backend if backend is not None else _backend(cache_dir)
    model, inputs = case.model, case.inputs
    device = _case_device(case)
    tag = f"{case.name}/{case.size}"

    row: dict[str, Any] = {
        "model": case.name,
        "size": case.size,
        "dtype": DTYPE_NAMES.get(case.dtype, str(case.dtype).replace("torch.", "")),
    }
    torch._dynamo.reset()
    try:
        with torch.no_grad(), contextlib.ExitStack() as keep_alive:
            reference = model(**inputs)
            _synchronize(device)

            compiled = torch.compile(model, backend=backend)
            out, compile_s = _timed_first_call(
                lambda: compiled(**inputs), progress, f"compiling {tag} with mindiesd"
            )
            row.update(_report_fields(backend))
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
            if capture:
                row.update(dict.fromkeys(CAPTURE_COLUMNS))
                from .compilation.device_graph import adapter_for

                if adapter_for(device) is None:
                    progress.note(f"no device graph on {device.type}: capture columns left empty")
                else:
                    graphed = torch.compile(model, backend=_backend(cache_dir, aclgraph_with_compile=True))
                    _, row["capture_first_s"] = _timed_first_call(
                        lambda: graphed(**inputs), progress, f"compiling and capturing {tag}"
                    )
                    runners["captured"] = lambda: graphed(**inputs)
            if ablate:
                row.update(dict.fromkeys(ABLATE_COLUMNS))
                for family in GEMM_FAMILIES:
                    if row.get(family):
                        without = torch.compile(model, backend=_backend(
                            cache_dir, fusion_patterns={f"enable_{family}": False}))
                        _timed_first_call(lambda: without(**inputs), progress, f"compiling {tag} without {family}")
                        runners[f"no_{family}"] = lambda without=without: without(**inputs)
            if regional:
                row.update(dict.fromkeys(REGIONAL_COLUMNS))
                run_regional = _regional_variant(model, inputs, reference, cache_dir, progress, tag, row)
                if run_regional is not None:
                    runners["regional"] = run_regional
            medians = _time(runners, iters, warmup, device, progress, tag)
    finally:
        torch._dynamo.reset()

    row["eager_ms"] = medians["eager"]
    row["mindiesd_ms"] = medians["mindiesd"]
    row["speedup"] = medians["eager"] / medians["mindiesd"]
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
    if "captured" in medians:
        row["capture_ms"] = medians["captured"]
        row["capture_speedup"] = medians["eager"] / medians["captured"]
    row["iters"] = iters
    return row


def _time(runners, iters, warmup, device, progress: Progress, tag: str) -> dict[str, float]:
    with progress.step(f"timing {tag}: {iters} interleaved iters of {', '.join(runners)}"):
        return interleaved_medians(runners, iters=iters, warmup=warmup, device=device)


# ---------------------------------------------------------------- output


def _format_value(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if column in FAMILIES or column in ("graphs", "fallbacks", "iters", "fused", "regional_graphs", "regional_fused"):
        return str(int(value))
    if column.endswith("rel_err"):
        return f"{value:.1e}"
    if column in ("speedup", "speed_vs_inductor", "capture_speedup", "regional_speedup", *ABLATE_COLUMNS):
        return f"{value:.2f}x"
    if column == "compile_vs_inductor":
        return f"{value:.3f}"
    if column.endswith("_s"):
        return f"{value:.2f}"
    if column.endswith("_ms") or column == "capture_ms":
        return f"{value:.2f}"
    return str(value)


def table_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The base columns, plus Inductor's, capture's and regional compilation's when any row has them."""
    columns = list(BASE_COLUMNS)
    if any("fused" in row for row in rows):
        columns.insert(columns.index("graphs"), "fused")
    for extra in (INDUCTOR_COLUMNS, CAPTURE_COLUMNS, REGIONAL_COLUMNS, ABLATE_COLUMNS):
        if any(column in row for row in rows for column in extra):
            columns += extra
    return columns


def format_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """Rows as an aligned plain-text table, or as a Markdown table."""
    columns = table_columns(rows)
    headers = [_HEADERS.get(c, c) for c in columns]
    cells = [[_format_value(c, row.get(c)) for c in columns] for row in rows]
    return render_table(headers, cells, [c in ("model", "size", "dtype") for c in columns], markdown)


def render_table(headers: Sequence[str], cells: Sequence[Sequence[str]], left: Sequence[bool],
                 markdown: bool = False) -> str:
    """Cells under headers, aligned (``left``: per column, text columns left, numbers right), or as Markdown."""
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = [v.ljust(w) if l else v.rjust(w) for v, w, l in zip(values, widths, left)]
        return ("| " + " | ".join(padded) + " |") if markdown else "  ".join(padded).rstrip()

    out = [line(headers)]
    if markdown:
        out.append("| " + " | ".join("-" * w if l else "-" * (w - 1) + ":" for w, l in zip(widths, left)) + " |")
    else:
        out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, threads, device."""
    info: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        info["diffusers"] = None
    return info


# ---------------------------------------------------------------- CLI


def bounded(kind: Callable[[str], Any], low: float, *, above: bool = False,
            reason: str = "") -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)``, at least ``low`` (``above``: more than ``low``), else a clear error."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < low or (above and value == low):
            bound = f"more than {low}" if above else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}{f' ({reason})' if reason else ''}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


_positive_int = bounded(int, 1)
_non_negative_int = bounded(int, 0)
positive_float = bounded(float, 0, above=True)


#: ``--model``: every registry name, and the groups ``core`` and ``all``.
MODEL_CHOICES = (*zoo.MODELS, "core", "all")


def select_models(choice: str, size: str, stderr: TextIO) -> tuple[str, ...]:
    """The registry names ``--model choice`` stands for at ``size`` (an empty tuple, reported, when none fits).

    ``core`` and ``all`` leave out, with a note on ``stderr``, the models without ``size`` and those the installed
    diffusers lacks; a single model without ``size`` is an error.
    """
    if choice not in ("core", "all"):
        if size not in zoo.entry(choice).sizes:
            sizes = ", ".join(zoo.entry(choice).sizes)
            stderr.write(f"mindiesd bench: {choice} has no size {size!r}; its sizes: {sizes}\n")
            return ()
        return (choice,)
    group = "core" if choice == "core" else None
    candidates = zoo.names(group=group)
    without_size = [n for n in candidates if size not in zoo.entry(n).sizes]
    unavailable = [n for n in candidates if n not in without_size and not zoo.available(n)]
    if without_size:
        stderr.write(f"mindiesd bench: no {size} size, left out: {', '.join(without_size)}\n")
    if unavailable:
        stderr.write(f"mindiesd bench: not in this diffusers (or no diffusers), left out: {', '.join(unavailable)}\n")
    names = tuple(n for n in candidates if n not in without_size and n not in unavailable)
    if not names:
        stderr.write(f"mindiesd bench: no model of {choice!r} can be built at size {size!r}\n")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``bench`` options on ``parser``."""
    parser.add_argument(
        "--model",
        choices=MODEL_CHOICES,
        default="flux",
        metavar="MODEL",
        help=f"a model of the registry (mindiesd.zoo): {', '.join(zoo.MODELS)}; or 'core' "
        f"({', '.join(zoo.names('core'))}) or 'all' (every registered model that has --size); default: flux",
    )
    parser.add_argument(
        "--size",
        choices=zoo.SIZES,
        default="tiny",
        help=f"model size (default: tiny; mid for {', '.join(zoo.names(size='mid'))})",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="model and input dtype (default: fp32)")
    parser.add_argument(
        "--iters",
        type=_positive_int,
        default=None,
        help=f"timed forwards per variant (default: {DEFAULT_ITERS['tiny']} tiny, {DEFAULT_ITERS['mid']} mid)",
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=None,
        help=f"untimed forwards per variant first (default: {DEFAULT_WARMUP['tiny']} tiny, {DEFAULT_WARMUP['mid']} mid)",
    )
    parser.add_argument(
        "--vs",
        choices=("inductor",),
        action="append",
        default=[],
        help="also compile with this backend and compare (Inductor can take minutes to compile); both compile "
        "from empty caches unless --inductor-cache or --cache-dir is given",
    )
    parser.add_argument(
        "--inductor-cache",
        action="store_true",
        help="with --vs inductor: let Inductor and mindiesd reuse their on-disk caches (default: empty ones, so "
        "both compile times are cold)",
    )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="the persistent compile cache to use ('off': none; default: CompilationConfig.cache_dir, i.e. "
        "$MINDIESD_CACHE_DIR or ~/.cache/mindiesd): a second run in a new process loads the compiled graphs",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="compile from an empty temporary cache (mindiesd's and Inductor's), so compile_s is a cold start",
    )
    parser.add_argument(
        "--regional",
        action="store_true",
        help="also compile a copy with diffusers' compile_repeated_blocks (regional compilation): its graphs, "
        "fused ops run per forward, error, compile seconds and steady ms beside the whole-model figures",
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
        "--force",
        action="append",
        default=[],
        choices=tuple(_FAMILIES),
        metavar="FAMILY",
        help="run FAMILY on --device even where mindiesd declares it not faster there (the GEMM rewrites are off "
        "on CPU by default): to measure it; repeatable",
    )
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu; e.g. cuda, npu)")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch.set_num_threads before running")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default: 0)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows (and environment) as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    from . import bench_distributed, bench_pipeline

    bench_pipeline.add_arguments(parser)
    bench_distributed.add_arguments(parser)


def run(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Execute a parsed ``bench`` command; returns the process exit status."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    progress = QuietProgress() if args.quiet else Progress(stderr)
    if getattr(args, "pipeline", None):
        from . import bench_pipeline

        return bench_pipeline.run(args, stdout, stderr, progress)
    if getattr(args, "world_size", None):
        from . import bench_distributed

        return bench_distributed.run(args, stdout, stderr, progress)
    names = select_models(args.model, args.size, stderr)
    if not names:
        return 2
    device_type = str(args.device).split(":")[0]
    for name in getattr(args, "force", None) or []:
        try:
            _FORCED.update(forced([name], device_type))
        except ValueError as exc:
            stderr.write(f"mindiesd bench: --force {name}: {exc}\n")
            return 2
    dtype = DTYPES[args.dtype]
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    if args.cold and args.cache_dir is not None:
        stderr.write("mindiesd bench: --cold and --cache-dir exclude each other\n")
        return 2
    with contextlib.ExitStack() as stack:
        cache_dir = resolve_cache_dir(args, stack)
        status = _run_models(args, names, dtype, cache_dir, rows, failures, progress, stderr)
    if status is not None:
        return status
    _print_results(args, rows, failures, stdout)
    return 1 if failures else 0


def resolve_cache_dir(args: argparse.Namespace, stack: contextlib.ExitStack) -> Any:
    """The persistent cache the bench's backends use: an empty temporary folder (removed when ``stack`` closes)
    with ``--cold``, the folder of ``--cache-dir`` (``off``: none), else the user's (``USER_CACHE``)."""
    # compile/ind compares cold compiles: with a cold Inductor, mindiesd starts cold too unless told otherwise
    vs_cold_inductor = "inductor" in (getattr(args, "vs", None) or []) and not getattr(args, "inductor_cache", False)
    if args.cold or (vs_cold_inductor and args.cache_dir is None):
        return stack.enter_context(tempfile.TemporaryDirectory(prefix="mindiesd-bench-cache-"))
    if args.cache_dir is None:
        return USER_CACHE
    return None if args.cache_dir.strip().lower() in ("off", "none", "") else args.cache_dir


def _run_models(args, names, dtype, cache_dir, rows, failures, progress, stderr) -> int | None:
    for name in names:
        try:
            with progress.step(f"building {name}/{args.size} ({args.dtype})"):
                case = zoo.build(name, args.size, dtype=dtype, seed=args.seed, device=args.device)
            rows.append(
                run_case(
                    case,
                    iters=args.iters,
                    warmup=args.warmup,
                    vs_inductor="inductor" in args.vs,
                    inductor_cold_cache=args.cold or not args.inductor_cache,
                    progress=progress,
                    capture=args.capture,
                    cache_dir=cache_dir,
                    regional=args.regional,
                    ablate=getattr(args, "ablate", False),
                )
            )
        except ImportError as exc:
            stderr.write(f"mindiesd bench: {exc}\n")
            return 2
        except Exception as exc:  # one failing model should not hide the others' results
            failures.append(name)
            stderr.write(f"mindiesd bench: {name}/{args.size} failed: {type(exc).__name__}: {exc}\n")
        finally:
            case = None
    return None


def _print_results(args, rows, failures, stdout) -> None:
    env = environment()
    if rows:
        stdout.write(format_table(rows, markdown=args.markdown) + "\n")
        iters = sorted({row["iters"] for row in rows})
        stdout.write(
            f"\ntorch {env['torch']}, diffusers {env['diffusers']}, {env['threads']} threads; "
            f"medians of {'/'.join(map(str, iters))} interleaved iters; "
            "compile_s = wall time of the first compiled call, backend_s = the backend's share of it; "
            "cache = persistent compile cache (stored: compiled and written; hit: loaded)\n"
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
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"environment": env, "rows": rows, "failed": failures}, fh, indent=2)
            fh.write("\n")
