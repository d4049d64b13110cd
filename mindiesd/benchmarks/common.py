"""The floor every bench mode stands on: dtype and family tables, progress lines, the backend the benches compile
with, the persistent-cache choice, the environment, model selection and the options the modes share."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence, TextIO

import torch

from .. import zoo
from ..compilation.families import FAMILIES as _FAMILIES
from ..compilation.families import forced
from .environment import environment, footer  # noqa: F401  (the modes take the environment from here)
from .timing import unreliable

FAMILIES = tuple(_FAMILIES)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_ITERS = {"tiny": 20, "mid": 5, "deep": 5, "host": 200, "host-deep": 50, "wide": 5}
DEFAULT_WARMUP = {"tiny": 3, "mid": 1, "deep": 1, "host": 10, "host-deep": 3, "wide": 1}


def complain(stderr: TextIO, message: str) -> None:
    """Write ``message`` on ``stderr`` as the bench's error or note line."""
    stderr.write(f"mindiesd bench: {message}\n")


def warn_if_busy(stderr: TextIO, spreads: Iterable[float], where: str = "") -> None:
    """One line on ``stderr`` where the timings just taken (of ``where``, with the relative ``spreads`` of their
    runners) may be unreliable: the machine's load average above its cores, or a spread above the limit
    (:func:`timing.unreliable`)."""
    reason = unreliable(max(spreads, default=0.0))
    if reason:
        complain(stderr, f"{where + ': ' if where else ''}{reason}; the timings and their ratios may be unreliable")


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



#: A line of the profiler's C++ layer (Kineto) on the process's stdout or stderr, such as
#: ``USDT:2026-12-05 18:09:58 3367:3367 SyncActivityProfilerHandler.cpp:52] profiler_start``.
PROFILER_LINE = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def without_profiler_lines() -> Iterator[None]:
    """Keep the profiler's own log lines out of the bench's output: they are written by C++ straight to file
    descriptors 1 and 2, so while the block runs both point at temporary files; afterwards every other line
    written there is passed on to where they pointed before."""
    redirected = []
    _flush_standard_streams()
    for fd in (1, 2):
        try:
            saved = os.dup(fd)
        except OSError:  # closed: nothing to keep out
            continue
        sink = tempfile.TemporaryFile()
        os.dup2(sink.fileno(), fd)
        redirected.append((fd, saved, sink))
    try:
        yield
    finally:
        _flush_standard_streams()
        for fd, saved, sink in redirected:
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            kept = b"".join(line for line in sink if not PROFILER_LINE.match(line))
            sink.close()
            while kept:
                kept = kept[os.write(fd, kept):]


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()


def profile_cpu(fn: Callable[[], Any]) -> torch.profiler.profile:
    """The CPU profile of one call of ``fn``, without the profiler's log lines in the output."""
    with without_profiler_lines(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof


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



def session(args: argparse.Namespace, stdout: TextIO | None, stderr: TextIO | None) -> tuple[TextIO, TextIO, Progress]:
    """The output streams of a parsed bench command (default: the process's) and its progress reporter (quiet
    with ``--quiet``); applies ``--threads``."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return stdout, stderr, QuietProgress() if args.quiet else Progress(stderr)


#: ``cache_dir`` argument meaning "whatever CompilationConfig.cache_dir says" (the user's persistent cache).
USER_CACHE = "user"


def make_backend(cache_dir: Any = USER_CACHE, *, force: Sequence[str] = (), device: Any = "cpu",
                 keep_graphs: bool = False, **settings: Any):
    """A ``MindieSDBackend`` with ``settings`` and the persistent cache ``cache_dir`` (``keep_graphs``: it keeps
    the fused graphs); the families of ``force`` run on ``device`` even where mindiesd declares them not faster
    there (ValueError where no kernel exists)."""
    try:
        from ..compilation import CompilationConfig, MindieSDBackend
    except ImportError as exc:
        raise ImportError(f"the MindieSD backend could not be imported: {exc}") from exc
    force_fast = forced(force, str(device).split(":")[0])
    if cache_dir != USER_CACHE:
        settings["cache_dir"] = cache_dir
    return MindieSDBackend(CompilationConfig(**settings), keep_graphs=keep_graphs, force_fast=force_fast)


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



def write_json(path: str, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON in ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2)
        fh.write("\n")


# ---------------------------------------------------------------- options


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



positive_int = bounded(int, 1)
non_negative_int = bounded(int, 0)
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
            complain(stderr, f"{choice} has no size {size!r}; its sizes: {sizes}")
            return ()
        return (choice,)
    group = "core" if choice == "core" else None
    candidates = zoo.names(group=group)
    without_size = [n for n in candidates if size not in zoo.entry(n).sizes]
    unavailable = [n for n in candidates if n not in without_size and not zoo.available(n)]
    if without_size:
        complain(stderr, f"no {size} size, left out: {', '.join(without_size)}")
    if unavailable:
        complain(stderr, f"not in this diffusers (or no diffusers), left out: {', '.join(unavailable)}")
    names = tuple(n for n in candidates if n not in without_size and n not in unavailable)
    if not names:
        complain(stderr, f"no model of {choice!r} can be built at size {size!r}")
    return names



def add_model_option(parser: argparse.ArgumentParser) -> None:
    """``--model``: a registry name or a group of them."""
    parser.add_argument(
        "--model",
        choices=MODEL_CHOICES,
        default="flux",
        metavar="MODEL",
        help=f"a model of the registry (mindiesd.zoo): {', '.join(zoo.MODELS)}; or 'core' "
        f"({', '.join(zoo.names('core'))}) or 'all' (every registered model that has --size); default: flux",
    )


def add_timing_options(parser: argparse.ArgumentParser) -> None:
    """``--iters`` and ``--warmup``: the interleaved timing of eager and compiled forwards."""
    parser.add_argument(
        "--iters",
        type=positive_int,
        default=None,
        help=f"timed forwards per variant (default: {DEFAULT_ITERS['tiny']} tiny, {DEFAULT_ITERS['mid']} mid)",
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=None,
        help=f"untimed forwards per variant first (default: {DEFAULT_WARMUP['tiny']} tiny, "
        f"{DEFAULT_WARMUP['mid']} mid)",
    )


def add_comparison_options(parser: argparse.ArgumentParser, *, calls: str, per: str, subject: str,
                           inductor_note: str = "") -> None:
    """The options of a mode that compares one workload's backends in one process (``bench sweep``, ``bench
    vae``): ``--vs inductor``, ``--iters``/``--warmup`` (``calls`` per ``per``), ``--threads``, ``--dtype`` (of
    ``subject``) and ``--seed``."""
    parser.add_argument("--vs", choices=("inductor",), nargs="*", default=(),
                        help=f"also Inductor's default mode, in the same run{inductor_note}")
    parser.add_argument("--iters", type=positive_int, default=10, help=f"timed {calls} per {per} (default: 10)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help=f"untimed {calls} per {per} first")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help=f"{subject} dtype (default: fp32)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default: 0)")


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir`` and ``--cold``: which persistent compile cache the compiles use (exclusive)."""
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="the persistent compile cache to use ('off': none; default: CompilationConfig.cache_dir, i.e. "
        "$MINDIESD_CACHE_DIR or ~/.cache/mindiesd): a second run in a new process loads the compiled graphs",
    )
    choice.add_argument(
        "--cold",
        action="store_true",
        help="compile from an empty temporary cache (mindiesd's and Inductor's), so compile_s is a cold start",
    )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of every model and pipeline mode: size, dtype, device, threads, seed and the output."""
    parser.add_argument(
        "--size",
        choices=zoo.SIZES,
        default="tiny",
        help=f"model size (default: tiny; mid for {', '.join(zoo.names(size='mid'))})",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="model and input dtype (default: fp32)")
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu; e.g. cuda, npu)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads before running")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default: 0)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows (and environment) as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
