"""``mindiesd bench host``: what a forward costs the host, per backend.

On an accelerator without device-graph capture, every op of a forward is a launch from the host, so a backend that
runs fewer and cheaper calls frees the device sooner. That cost can be measured on a CPU: with tensors so small
that the kernels take no time (the registry's ``host`` and ``host-deep`` sizes of Flux), a forward's wall time is
what the host spends on it (Python, dispatch, launches). For each model the bench reports

* ``ops``: the ops one forward executes (the top-level aten and mindiesd ops the profiler records), GEMMs and
  attention apart (``gemm_ops``) from the others (``other_ops``); views and allocations, which compute nothing,
  are not counted. Inductor's own kernels are not aten ops, so its column counts only its library calls;
* ``*_ms``: milliseconds per forward of eager, mindiesd and, with ``--vs``, Inductor (``inductor``: its default
  mode; ``inductor-ro``: ``mode="reduce-overhead"``), interleaved in one process, medians; on one thread unless
  ``--threads`` says otherwise; ``spread``: the interquartile range of the timed forwards over their median;
* ``host_vs_inductor``: mindiesd's time over Inductor's default (below 1: mindiesd costs the host less).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable, Sequence, TextIO

import torch

from .. import zoo
from ..compilation.report import plural
from .common import (
    DEFAULT_ITERS, DEFAULT_WARMUP, DTYPES, MODEL_CHOICES, complain, environment, footer, make_backend,
    max_relative_error, positive_int, profile_cpu, non_negative_int, session, warn_if_busy, write_json,
)
from .table import format_rows
from .timing import interleaved_medians

#: The ops that multiply matrices or attend: the same in every backend's forward.
GEMM_OPS = frozenset({
    "aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul", "aten::conv2d",
    "aten::conv3d", "aten::convolution", "aten::_convolution", "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "mindiesd::linear_gelu", "mindiesd::cat_linear",
})

#: The ops that compute nothing: views of their input, and allocations.
FREE_OPS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::t",
    "aten::transpose", "aten::permute", "aten::expand", "aten::select", "aten::slice", "aten::split",
    "aten::split_with_sizes", "aten::unbind", "aten::chunk", "aten::narrow", "aten::as_strided", "aten::alias",
    "aten::detach", "aten::view_as_real", "aten::view_as_complex", "aten::unflatten", "aten::flatten",
    "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::empty_permuted",
    "aten::resolve_conj", "aten::resolve_neg", "aten::_reshape_alias", "aten::contiguous",
})

BACKENDS = ("eager", "mindiesd", "inductor", "inductor-ro")
#: How the compiled backends see sizes (``--shapes``).
SHAPES = ("static", "dynamic", "auto")
COLUMNS = ("model", "size", "backend", "shapes", "gemm_ops", "other_ops", "host_ms", "spread", "vs_eager",
           "max_rel_err")
#: Columns of ratios, printed with an x.
RATIOS = ("vs_eager", "host_vs_inductor", "host_vs_inductor_ro", "vs_static")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODEL_CHOICES, default="flux", metavar="MODEL",
                        help="a registry model, 'core' or 'all' (default: flux)")
    parser.add_argument("--size", choices=zoo.SIZES, nargs="+", default=None,
                        help="sizes (default: host and host-deep for flux, else tiny; a model without a size is "
                             "measured at tiny)")
    parser.add_argument("--vs", choices=("inductor", "inductor-ro"), nargs="*", default=(),
                        help="also Inductor's default mode and/or mode='reduce-overhead', in the same run")
    parser.add_argument("--shapes", choices=SHAPES, nargs="+", default=("static",),
                        help="how the compiled backends see sizes: 'static' (one size), 'dynamic' "
                             "(torch.compile(dynamic=True)), 'auto' (Dynamo's automatic dynamic after a second size "
                             "was seen; timed at the first); several are timed interleaved (default: static)")
    parser.add_argument("--iters", type=positive_int, default=None, help="timed forwards per backend")
    parser.add_argument("--warmup", type=non_negative_int, default=None, help="untimed forwards per backend first")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch.set_num_threads (default: 1)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="model and input dtype (default: fp32)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default: 0)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows (and environment) as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def count_ops(fn: Callable[[], Any]) -> tuple[int, int]:
    """(GEMM and attention ops, other ops) one call of ``fn`` executes: the profiler's top-level aten and mindiesd
    ops, views and allocations not counted (the profiler's own log lines kept out of the output)."""
    gemm = other = 0
    for event in profile_cpu(fn).events():
        if not _is_op(event.name) or event.name in FREE_OPS:
            continue
        parent = event.cpu_parent
        while parent is not None and not _is_op(parent.name):
            parent = parent.cpu_parent
        if parent is not None:
            continue  # called by another op: part of that one
        if event.name in GEMM_OPS:
            gemm += 1
        else:
            other += 1
    return gemm, other


def _is_op(name: str) -> bool:
    return name.startswith("aten::") or name.startswith("mindiesd::")


def _sizes(name: str, requested: Sequence[str] | None) -> list[str]:
    sizes = requested or (("host", "host-deep") if name == "flux" else ("tiny",))
    available = zoo.entry(name).sizes
    return list(dict.fromkeys(size if size in available else "tiny" for size in sizes))


def _key(backend: str, shapes: str) -> str:
    return backend if shapes == "static" else f"{backend} {shapes}"


def _backends(model: torch.nn.Module, vs: Sequence[str], shapes: Sequence[str]) -> dict[str, Callable[..., Any]]:
    """Eager and, per mode of ``shapes``, mindiesd and the Inductor modes of ``vs`` (keys: ``_key``)."""
    compiled: dict[str, Callable[..., Any]] = {"eager": model}
    for mode in shapes:
        dynamic = True if mode == "dynamic" else None
        compiled[_key("mindiesd", mode)] = torch.compile(model, backend=make_backend(None), dynamic=dynamic)
        if "inductor" in vs:
            compiled[_key("inductor", mode)] = torch.compile(model, dynamic=dynamic)
        if "inductor-ro" in vs:
            compiled[_key("inductor-ro", mode)] = torch.compile(model, mode="reduce-overhead", dynamic=dynamic)
    return compiled


def _second_inputs(case: zoo.Case, seed: int) -> dict[str, Any]:
    """The inputs of ``case``'s model at another resolution (what makes Dynamo's automatic dynamic recompile)."""
    other = zoo.build(case.name, case.size, dtype=next(p.dtype for p in case.model.parameters()), seed=seed,
                      shapes=zoo.other_resolution(case.name, case.size))
    return other.inputs


def measure(case: zoo.Case, vs: Sequence[str], iters: int, warmup: int, progress: Any,
            shapes: Sequence[str] = ("static",), seed: int = 0) -> list[dict[str, Any]]:
    """One row per backend (and mode of ``shapes``) of ``case``: ops per forward, ms per forward at the case's size,
    error against eager. ``auto`` backends are called at a second size before anything is measured."""
    torch._dynamo.reset()
    shapes = [mode for mode in SHAPES if mode in shapes]  # the static graphs first: automatic dynamic is per frame
    backends = _backends(case.model, vs, shapes)
    second = _second_inputs(case, seed) if "auto" in shapes else None
    with torch.no_grad(), torch._dynamo.config.patch(cache_size_limit=max(8, 4 * len(backends))):
        expected = case.model(**case.inputs)
        outputs = {}
        for name, fn in backends.items():
            with progress.step(f"first call of {case.name}/{case.size} under {name}"):
                outputs[name] = fn(**case.inputs)
                if name.endswith(" auto"):
                    fn(**second)
                    outputs[name] = fn(**case.inputs)
        counts = {name: count_ops(lambda fn=fn: fn(**case.inputs)) for name, fn in backends.items()}
        with progress.step(f"timing {case.name}/{case.size}: {plural(iters, 'interleaved forward')} per backend"):
            medians = interleaved_medians({name: (lambda fn=fn: fn(**case.inputs)) for name, fn in backends.items()},
                                          iters, warmup)
    rows = []
    for name in backends:
        gemm, other = counts[name]
        backend, _, mode = name.partition(" ")
        row = {
            "model": case.name, "size": case.size, "backend": backend,
            "shapes": None if name == "eager" else mode or "static",
            "gemm_ops": gemm, "other_ops": other if not name.startswith("inductor") else None,
            "host_ms": medians[name], "spread": medians.spreads[name], "vs_eager": medians["eager"] / medians[name],
            "max_rel_err": max_relative_error(outputs[name], expected) if name != "eager" else None,
        }
        if backend == "mindiesd":
            mode = mode or "static"
            for other_backend, column in (("inductor", "host_vs_inductor"), ("inductor-ro", "host_vs_inductor_ro")):
                if _key(other_backend, mode) in medians:
                    row[column] = medians[name] / medians[_key(other_backend, mode)]
            if mode != "static" and "mindiesd" in medians:
                row["vs_static"] = medians[name] / medians["mindiesd"]
        rows.append(row)
    return rows


def run(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Execute a parsed ``bench host`` command; returns the process exit status."""
    stdout, stderr, progress = session(args, stdout, stderr)
    names = zoo.names(group="core" if args.model == "core" else None) if args.model in ("core", "all") \
        else (args.model,)
    names = tuple(n for n in names if zoo.available(n))
    if not names:
        complain(stderr, "no model of the selection can be built with the installed diffusers")
        return 2
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for name in names:
        for size in _sizes(name, args.size):
            with progress.step(f"building {name}/{size} ({args.dtype})"):
                case = zoo.build(name, size, dtype=DTYPES[args.dtype], seed=args.seed)
            iters = args.iters or DEFAULT_ITERS.get(size, DEFAULT_ITERS["tiny"])
            warmup = DEFAULT_WARMUP.get(size, 1) if args.warmup is None else args.warmup
            measured = measure(case, args.vs, iters, warmup, progress, args.shapes, args.seed)
            warn_if_busy(stderr, [row["spread"] for row in measured], f"{name}/{size}")
            rows.extend(measured)
    columns = COLUMNS + tuple(c for c in ("host_vs_inductor", "host_vs_inductor_ro", "vs_static")
                              if any(c in r for r in rows))
    env = environment("cpu")
    print(format_rows(rows, columns, left=("model", "size", "backend"), cell=_cell, markdown=args.markdown),
          file=stdout)
    print(f"\ntorch {env['torch']}, diffusers {env['diffusers']}, {plural(env['threads'], 'thread')}; medians of "
          "interleaved forwards; ops = top-level aten/mindiesd ops per forward (views and allocations not counted); "
          "spread = interquartile range of the timed forwards / their median; "
          "vs_eager = eager's ms / the backend's; host_vs_inductor = mindiesd's ms / Inductor's in the same shapes "
          "mode; vs_static = mindiesd's ms in this mode / its static graph's; shapes auto: timed at the first size "
          "after a second was seen\n"
          f"{footer(env)}", file=stdout)
    if args.json:
        write_json(args.json, {"rows": rows, "environment": env})
    return 0


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column in RATIOS:
        return f"{value:.2f}x"
    if column == "host_ms":
        return f"{value:.3f}"
    if column == "max_rel_err":
        return f"{value:.1e}"
    if column == "spread":
        return f"{value:.0%}"
    return str(value)
