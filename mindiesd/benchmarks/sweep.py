"""``mindiesd bench sweep``: a model served at many resolutions, one after another.

What a server meets when requests come in several image sizes: the model is compiled once per backend, then called
at ``--sizes`` resolutions (the registry size's own, then ones 2, 4, ... wider in their last spatial dimension,
:func:`mindiesd.zoo.other_resolution`), then at the first two again. With Dynamo's automatic dynamic the second
size recompiles the frame with symbolic sizes and every later size, the first included, runs that graph. Per size
and backend the table gives

* ``first_s``: the first call at that size, compiles included (a size that needs none costs a forward);
* ``ms``: the steady state there, the median of ``--iters`` forwards, the backends interleaved;
* ``max_rel_err``: against eager at that size;
* ``cache``: what mindiesd's persistent cache did for the graphs that first call compiled (``hit``, ``stored``;
  ``-`` where it compiled none). ``--cache-dir DIR`` run twice shows a warm start: the second process loads the
  static graph of the first size and the symbolic one of the second, and compiles nothing.

The footer gives each backend's total seconds (every first call plus the timed forwards) and mindiesd's share of
Inductor's.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, TextIO

import torch

from .. import zoo
from ..compilation.report import plural
from .common import (
    DTYPES, add_comparison_options, complain, environment, footer, make_backend, max_relative_error, positive_int,
    session, warn_if_busy, write_json,
)
from .table import format_rows, format_value
from .timing import interleaved_medians

COLUMNS = ("model", "size", "shape", "backend", "first_s", "ms", "spread", "max_rel_err", "cache")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=zoo.MODELS, default="flux", metavar="MODEL",
                        help="a registry model (default: flux)")
    parser.add_argument("--size", choices=zoo.SIZES, default="tiny", help="the registry size (default: tiny)")
    parser.add_argument("--sizes", type=positive_int, default=6,
                        help="resolutions, before the first two are called again (default: 6)")
    add_comparison_options(parser, calls="forwards", per="size and backend", subject="model and input")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows (and environment) as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--cache-dir", metavar="DIR", default=None,
                        help="mindiesd's persistent compile cache (default: none, so every compile is cold); a second "
                             "run with the same DIR in a new process loads the graphs the first stored")


def _shape_text(shapes: dict[str, Any]) -> str:
    return " ".join(f"{key}={'x'.join(map(str, v)) if isinstance(v, tuple) else v}" for key, v in shapes.items())


def sweep(name: str, size: str, steps: list[int], backends: dict[str, Callable[..., Any]], model: torch.nn.Module,
          dtype: torch.dtype, seed: int, iters: int, warmup: int, progress: Any,
          records: Callable[[], list[Any]] = list) -> list[dict[str, Any]]:
    """One row per step (a resolution) and backend; ``records()`` gives mindiesd's compile records so far."""
    rows = []
    for step in steps:
        shapes = zoo.other_resolution(name, size, step)
        inputs = zoo.build(name, size, dtype=dtype, seed=seed, shapes=shapes).inputs
        with torch.no_grad():
            expected = model(**inputs)
            firsts, outputs, caches = {}, {}, {}
            for backend, fn in backends.items():
                with progress.step(f"{name}/{size} {_shape_text(shapes)}: first call under {backend}"):
                    before = len(records())
                    start = time.perf_counter()
                    outputs[backend] = fn(**inputs)
                    firsts[backend] = time.perf_counter() - start
                    if backend == "mindiesd":
                        caches[backend] = " ".join(r.cache for r in records()[before:]) or "-"
            medians = interleaved_medians({b: (lambda fn=fn: fn(**inputs)) for b, fn in backends.items()}, iters,
                                          warmup)
        for backend in backends:
            rows.append({"model": name, "size": size, "shape": _shape_text(shapes), "backend": backend,
                         "first_s": firsts[backend], "ms": medians[backend], "spread": medians.spreads[backend],
                         "iters": iters + warmup,
                         "max_rel_err": max_relative_error(outputs[backend], expected),
                         "cache": caches.get(backend)})
    return rows


def totals(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per backend over the sweep: first calls plus the timed and warm-up forwards."""
    seconds: dict[str, float] = {}
    for row in rows:
        seconds[row["backend"]] = seconds.get(row["backend"], 0.0) + row["first_s"] + row["iters"] * row["ms"] / 1e3
    return seconds


def run(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Execute a parsed ``bench sweep`` command; returns the process exit status."""
    stdout, stderr, progress = session(args, stdout, stderr)
    if not zoo.available(args.model):
        complain(stderr, f"the installed diffusers cannot build {args.model}")
        return 2
    if args.size not in zoo.entry(args.model).sizes:
        complain(stderr, f"{args.model} has no size {args.size!r} (its sizes: {', '.join(zoo.entry(args.model).sizes)})")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    with progress.step(f"building {args.model}/{args.size} ({args.dtype})"):
        model = zoo.build(args.model, args.size, dtype=dtype, seed=args.seed).model
    torch._dynamo.reset()
    cache_dir = None if args.cache_dir is None or args.cache_dir.strip().lower() in ("off", "none", "") \
        else args.cache_dir
    mindiesd = make_backend(cache_dir)
    backends: dict[str, Callable[..., Any]] = {"mindiesd": torch.compile(model, backend=mindiesd)}
    if "inductor" in args.vs:
        backends["inductor"] = torch.compile(model)
    steps = list(range(args.sizes)) + list(range(min(2, args.sizes)))
    with torch._dynamo.config.patch(cache_size_limit=max(8, 4 * len(backends))):
        rows = sweep(args.model, args.size, steps, backends, model, dtype, args.seed, args.iters, args.warmup,
                     progress, records=lambda: mindiesd.report().records)
    warn_if_busy(stderr, [row["spread"] for row in rows], f"{args.model}/{args.size} sweep")
    seconds = totals(rows)
    env = environment("cpu")
    print(format_rows(rows, COLUMNS, left=("model", "size", "shape", "backend"), cell=_cell,
                      markdown=args.markdown), file=stdout)
    summary = ", ".join(f"{backend} {value:.1f} s" for backend, value in seconds.items())
    if "inductor" in seconds:
        summary += f"; mindiesd / inductor {seconds['mindiesd'] / seconds['inductor']:.2f}"
    print(f"\ntotal over the sweep ({plural(len(steps), 'resolution')} in turn, first calls and timed forwards): "
          f"{summary}\ntorch {env['torch']}, diffusers {env['diffusers']}, {plural(env['threads'], 'thread')}; "
          "first_s = the first call at that size (compiles included); ms = median of the interleaved forwards "
          "there; spread = their interquartile range / median\n"
          f"{footer(env)}", file=stdout)
    if args.json:
        write_json(args.json, {"rows": rows, "totals": seconds, "environment": env})
    return 0



def _cell(column: str, value: Any) -> str:
    return f"{value:.3f}" if column == "ms" and value is not None else format_value(column, value)
