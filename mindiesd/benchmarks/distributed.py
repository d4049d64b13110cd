"""``mindiesd bench distributed --world-size N``: a registry model under diffusers' context parallelism, compiled with
MindieSDBackend on every rank of a ``torch.distributed`` group.

Each rank builds the same model (same seed) and first runs it eagerly without parallelism: that output is the
single-process reference. Then diffusers' context parallelism is enabled (``ContextParallelConfig`` with
``ulysses_degree`` or ``ring_degree`` = N: the sequence is split over the ranks, attention exchanges it with
``all_to_all_single`` or ``all_gather``, the output is all-gathered), and the model runs eagerly and compiled
with ``torch.compile(model, backend=MindieSDBackend())``. Per rank the bench reports the fused ops, the
functional collectives in the compiled graphs, the error of the compiled output against the single-process
reference, the first compiled call and the median eager and compiled milliseconds; the ``all`` row gives the
end-to-end figures (per iteration the slowest rank, then the median).

Two ways to start it::

    python -m mindiesd bench distributed --model flux --world-size 2                      # spawns 2 processes
    torchrun --nproc-per-node 2 -m mindiesd bench distributed --model flux --world-size 2  # one process per rank

The process-group backend follows the device: gloo on CPU, nccl on CUDA, hccl on Ascend. :class:`World` (the
spawned processes, reused for several jobs) and :func:`enable_context_parallel` are also what the tests use.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import os
import queue
import statistics
import time
import traceback
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple
from unittest import mock

import torch
import torch.distributed as dist

from .. import zoo
from ..compilation.report import plural
from .common import (
    DEFAULT_ITERS, DEFAULT_WARMUP, DTYPES, FAMILIES, Progress, QuietProgress, add_model_option, add_run_options,
    add_timing_options, bounded, complain, environment, footer, make_backend, max_relative_error, positive_float,
    select_models, session, write_json,
)
from .table import HEADERS, format_rows, format_value
from .timing import synchronize

__all__ = [
    "CP_MODES", "World", "DistributedJobError", "add_arguments", "run", "process_group_backend",
    "attention_backend_for", "enable_context_parallel", "collectives_in", "launched_world", "bench_rank",
    "summarize", "format_table",
]

#: ``--cp`` choices: diffusers' two context-parallel attentions.
CP_MODES = ("ulysses", "ring")
#: Seconds a spawned run (and each collective) may take before it is stopped (``--dist-timeout``).
DEFAULT_TIMEOUT = 900.0
#: Seconds the other ranks get to answer once a job raised on one rank (they may wait on it in a collective).
ERROR_GRACE = 60.0
#: Short names of the functional collectives in the table's ``collectives`` column.
COLLECTIVE_ABBREVIATIONS = {
    "all_to_all_single": "a2a",
    "all_gather_into_tensor": "ag",
    "all_reduce": "ar",
    "reduce_scatter_tensor": "rs",
    "wait_tensor": "wait",
}

_PG_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


# ---------------------------------------------------------------- process group


def process_group_backend(device_type: str) -> str:
    """The ``torch.distributed`` backend for ``device_type``: gloo (cpu), nccl (cuda), hccl (npu)."""
    if device_type not in _PG_BACKENDS:
        raise ValueError(f"no process-group backend for device {device_type!r}; "
                         f"supported: {', '.join(f'{d} ({b})' for d, b in _PG_BACKENDS.items())}")
    return _PG_BACKENDS[device_type]


def _set_device(device_type: str, local_rank: int) -> torch.device:
    """This rank's device: the CPU, or accelerator number ``local_rank`` (made the current one)."""
    if device_type == "cpu":
        return torch.device("cpu")
    device = torch.device(device_type, local_rank)
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "set_device"):
        raise RuntimeError(f"torch has no {device_type} runtime here (is its extension installed?)")
    module.set_device(device)
    return device


def launched_world(environ: Optional[Dict[str, str]] = None) -> Optional[Tuple[int, int, int, int]]:
    """``(rank, world_size, local_rank, local_world_size)`` when a launcher (torchrun) started this process, from
    its ``RANK`` and ``WORLD_SIZE`` variables; None otherwise."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    return (rank, world_size, int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", world_size)))


class DistributedJobError(RuntimeError):
    """A job raised on a rank (the message holds that rank's traceback), or a rank died or ran out of time."""


def _worker(rank: int, world_size: int, port: int, device_type: str, threads: Optional[int], env: Dict[str, str],
            timeout: float, inbox: Any, outbox: Any) -> None:
    """The loop of one spawned rank: join the group, then run each ``(fn, args)`` from ``inbox`` until None. A rank
    that crashes (a signal such as SIGSEGV) writes its Python stack to its stderr first."""
    faulthandler.enable()
    os.environ.update(env)
    from ..compilation import CompilationConfig

    CompilationConfig.reset()  # the settings read from the environment (cache_dir) follow ``env``
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        _set_device(device_type, rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(process_group_backend(device_type), store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))
        return
    outbox.put((rank, True, None))
    try:
        for fn, args in iter(inbox.get, None):
            try:
                outbox.put((rank, True, fn(*args)))
            except Exception:
                outbox.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class World:
    """``world_size`` spawned processes joined in one process group (rendezvous through a TCP store on 127.0.0.1
    that this process serves on a free port), each running every job given to :meth:`run`.

    The processes start once and serve many jobs, so the cost of starting Python, importing torch and joining the
    group is paid once. ``env`` is set in each process before anything runs there (the ``MINDIESD_*`` settings);
    ``threads`` is each process's ``torch.set_num_threads``. A job that raises, a process that dies and a job that
    outlives its timeout all raise :class:`DistributedJobError`; after the last two the world is closed (a rank
    may be stuck in a collective). Once a job raised on one rank, the others have ``ERROR_GRACE`` seconds to
    answer.
    """

    def __init__(self, world_size: int, device_type: str = "cpu", *, threads: Optional[int] = None,
                 env: Optional[Dict[str, str]] = None, timeout: float = DEFAULT_TIMEOUT):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size, self.device_type, self.threads = world_size, device_type, threads
        self.env = dict(env or {})
        self.timeout = timeout
        self.backend = process_group_backend(device_type)
        self._processes: List[Any] = []
        self._inboxes: List[Any] = []
        self._outbox: Any = None
        self._store: Optional[dist.TCPStore] = None

    def __enter__(self) -> "World":
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether every process is running."""
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def start(self) -> None:
        """Spawn the processes and wait until each has joined the process group."""
        if self._processes:
            raise RuntimeError("this World is already started")
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.timeout))
        self._outbox = context.Queue()
        for rank in range(self.world_size):
            inbox = context.Queue()
            process = context.Process(
                target=_worker, name=f"mindiesd-rank-{rank}", daemon=True,
                args=(rank, self.world_size, self._store.port, self.device_type, self.threads, self.env,
                      self.timeout, inbox, self._outbox),
            )
            process.start()
            self._processes.append(process)
            self._inboxes.append(inbox)
        self._collect("joining the process group", self.timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: Optional[float] = None) -> List[Any]:
        """``fn(*args)`` on every rank; the results in rank order. ``fn`` and ``args`` must pickle (a function of
        a module, plain values)."""
        if not self.alive:
            raise DistributedJobError("the World is not running (not started, closed, or a rank died)")
        for inbox in self._inboxes:
            inbox.put((fn, args))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), self.timeout if timeout is None else timeout)

    def _collect(self, what: str, timeout: float) -> List[Any]:
        results: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            try:
                rank, ok, payload = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self._processes)
                        if not p.is_alive() and r not in results and r not in errors]
                late = time.monotonic() > deadline
                if dead or late:
                    waiting = [r for r in range(self.world_size) if r not in results and r not in errors]
                    self.close()
                    cause = (f"{', '.join(dead)} died (a crashed rank's Python stack is on its stderr)" if dead
                             else f"no answer within {timeout:.0f} s")
                    raise DistributedJobError(f"{what}: {cause}; waiting for ranks {waiting}"
                                              + "".join(f"\n--- rank {r} ---\n{t}" for r, t in errors.items()))
                continue
            (results if ok else errors)[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + ERROR_GRACE)
        if errors:
            raise DistributedJobError(f"{what} failed on ranks {sorted(errors)}"
                                      + "".join(f"\n--- rank {r} ---\n{t}" for r, t in sorted(errors.items())))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the processes (those that do not leave within a few seconds are killed)."""
        for inbox, process in zip(self._inboxes, self._processes):
            if process.is_alive():
                with contextlib.suppress(Exception):
                    inbox.put(None)
        deadline = time.monotonic() + 10.0
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self._processes, self._inboxes = [], []
        self._store = None


# ---------------------------------------------------------------- context parallelism


def attention_backend_for(cp: str, device_type: str, dtype: Optional[torch.dtype] = None) -> str:
    """The diffusers attention backend that runs ``cp`` attention on ``device_type`` (in ``dtype``, where given).

    Ulysses runs on diffusers' ``native`` backend (SDPA) everywhere. Ring attention merges partial results by
    their log-sum-exp, which ``native`` (and ``_native_npu``) do not return: on CUDA ``_native_flash`` (bf16 or
    fp16) does; on CPU and Ascend no diffusers backend does, and a ValueError says so.
    """
    if cp not in CP_MODES:
        raise ValueError(f"unknown context parallelism {cp!r}; choose one of: {', '.join(CP_MODES)}")
    if cp == "ulysses":
        return "native"
    if device_type == "cuda":
        if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"--cp ring on cuda runs on flash attention, which needs bf16 or fp16, not {dtype}")
        return "_native_flash"
    raise ValueError(
        f"--cp ring cannot run on {device_type}: diffusers' ring attention needs an attention backend that returns "
        "the log-sum-exp, and none of diffusers' backends does on this device (native SDPA does not); use --cp "
        "ulysses, or --device cuda with --dtype bf16 or fp16"
    )


@contextlib.contextmanager
def _cpu_counts_as_one_device() -> Iterator[None]:
    """diffusers' ``enable_parallelism`` takes the rank modulo ``torch.accelerator.device_count()`` as the device
    index, which divides by zero on a machine without an accelerator; there the CPU counts as one device."""
    if torch._C._get_accelerator().type != "cpu":
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def enable_context_parallel(model: torch.nn.Module, cp: str, degree: int, device_type: str = "cpu") -> None:
    """``model.enable_parallelism(config=ContextParallelConfig(<cp>_degree=degree))`` with the attention backend of
    :func:`attention_backend_for`; needs an initialised process group of ``degree`` ranks and a diffusers model
    class with a context-parallel plan (``_cp_plan``)."""
    from diffusers import ContextParallelConfig

    if not getattr(type(model), "_cp_plan", None):
        raise ValueError(f"{type(model).__name__} has no context-parallel plan (_cp_plan) in this diffusers")
    accelerator = torch._C._get_accelerator().type
    if device_type == "cpu" and accelerator != "cpu":
        raise ValueError(f"diffusers builds the context-parallel device mesh on the accelerator ({accelerator}); "
                         f"run the model there (--device {accelerator})")
    model.set_attention_backend(attention_backend_for(cp, device_type, next(model.parameters()).dtype))
    with _cpu_counts_as_one_device():
        model.enable_parallelism(config=ContextParallelConfig(**{f"{cp}_degree": degree}))


def collectives_in(graphs: Sequence[torch.fx.GraphModule]) -> Dict[str, int]:
    """Calls of each functional collective (``torch.ops._c10d_functional.*``) in ``graphs``, by op name."""
    counts: Counter = Counter()
    for gm in graphs:
        for node in gm.graph.nodes:
            target = node.target
            if node.op == "call_function" and getattr(target, "namespace", None) == "_c10d_functional":
                counts[target._opname] += 1
    return dict(sorted(counts.items()))


def _collectives_text(counts: Dict[str, int]) -> str:
    return " ".join(f"{COLLECTIVE_ABBREVIATIONS.get(name, name)}={n}" for name, n in counts.items()) or "none"


# ---------------------------------------------------------------- one rank


def _timed_samples(runners: Dict[str, Callable[[], Any]], iters: int, warmup: int,
                   device: torch.device) -> Dict[str, List[float]]:
    """Milliseconds of each call of each runner, interleaved as in :mod:`mindiesd.benchmarks.timing` (the starting
    runner rotates); every sample starts at a barrier, so that sample ``i`` is the same step on every rank."""
    for _ in range(warmup):
        for call in runners.values():
            call()
    names = list(runners)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for i in range(iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            runners[name]()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def bench_rank(spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    """On each rank of the current process group: the figures of every model of ``spec["models"]``.

    ``spec`` holds ``models``, ``size``, ``dtype`` (a bench dtype name), ``device`` (a device type), ``local_rank``
    (None: the rank), ``seed``, ``cp``, ``iters``, ``warmup`` and ``quiet``. One dict per model; a model that fails
    gives ``{"model", "rank", "error", "traceback"}``, the error naming the step that failed.
    """
    rank = dist.get_rank()
    local_rank = spec.get("local_rank")
    device = _set_device(spec["device"], rank if local_rank is None else local_rank)
    progress = QuietProgress() if spec["quiet"] or rank != 0 else Progress()
    return [_bench_model(name, spec, device, progress) for name in spec["models"]]


def _bench_model(name: str, spec: Dict[str, Any], device: torch.device, progress: Any) -> Dict[str, Any]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tag = f"{name}/{spec['size']} {spec['cp']} x{world_size}"
    row: Dict[str, Any] = {"rank": rank, "model": name, "size": spec["size"], "dtype": spec["dtype"],
                           "cp": spec["cp"], "threads": torch.get_num_threads()}
    step = "building the model"
    torch._dynamo.reset()
    try:
        case = zoo.build(name, spec["size"], dtype=DTYPES[spec["dtype"]], seed=spec["seed"], device=device)
        model, inputs = case.model, case.inputs
        with torch.no_grad():
            step = "the single-process eager run"
            with progress.step(f"{tag}: the single-process eager reference"):
                reference = model(**inputs)
            # before the compile, as it should be: on its first call diffusers' split hook reads the forward's
            # signature with inspect, where Dynamo breaks the graph (Wan: 7 graphs instead of 1)
            step = "the eager context-parallel run"
            enable_context_parallel(model, spec["cp"], world_size, device.type)
            row["eager_rel_err"] = max_relative_error(model(**inputs), reference)
            step = "the compiled context-parallel run"
            backend = make_backend(None, keep_graphs=True)
            compiled = torch.compile(model, backend=backend)
            dist.barrier()
            with progress.step(f"{tag}: compiling with mindiesd on every rank"):
                start = time.perf_counter()
                out = compiled(**inputs)
                row["compile_s"] = time.perf_counter() - start
            row["max_rel_err"] = max_relative_error(out, reference)
            report = backend.report()
            row.update({family: int(report.matches.get(family, 0)) for family in FAMILIES})
            row.update(graphs=report.graphs, fallbacks=len(report.fallbacks),
                       collectives=collectives_in(backend.graphs))
            step = "timing"
            with progress.step(f"{tag}: timing {plural(spec['iters'], 'interleaved iter')} of eager, mindiesd"):
                samples = _timed_samples({"eager": lambda: model(**inputs), "mindiesd": lambda: compiled(**inputs)},
                                         spec["iters"], spec["warmup"], device)
    except Exception as exc:
        return {"model": name, "rank": rank, "error": f"{step} failed: {type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()}
    finally:
        torch._dynamo.reset()
    row["samples"] = samples
    row["eager_ms"] = statistics.median(samples["eager"])
    row["mindiesd_ms"] = statistics.median(samples["mindiesd"])
    row["speedup"] = row["eager_ms"] / row["mindiesd_ms"]
    return row


# ---------------------------------------------------------------- all ranks


def summarize(per_rank: Sequence[Sequence[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """The rows of every rank, model by model, each model followed by its end-to-end row (``rank`` = ``all``):
    per timed iteration the slowest rank, then the median; the largest compile time and error; fused and
    collective counts where every rank has the same (else None)."""
    rows: List[Dict[str, Any]] = []
    for model_rows in zip(*per_rank):
        if any("error" in r for r in model_rows):
            rows.extend(model_rows)
            continue
        rows.extend({k: v for k, v in r.items() if k != "samples"} for r in model_rows)
        first = model_rows[0]
        total = {k: first[k] for k in ("model", "size", "dtype", "cp", "threads")}
        total["rank"] = "all"
        for variant in ("eager", "mindiesd"):
            steps = zip(*(r["samples"][variant] for r in model_rows))
            total[f"{variant}_ms"] = statistics.median(max(step) for step in steps)
        total["speedup"] = total["eager_ms"] / total["mindiesd_ms"]
        for key in ("compile_s", "max_rel_err", "eager_rel_err"):
            total[key] = max(r[key] for r in model_rows)
        for key in (*FAMILIES, "graphs", "collectives"):
            values = [r[key] for r in model_rows]
            total[key] = first[key] if all(v == values[0] for v in values) else None
        total["fallbacks"] = sum(r["fallbacks"] for r in model_rows)
        rows.append(total)
    return rows


def format_table(rows: Sequence[Dict[str, Any]], markdown: bool = False) -> str:
    """The rows (without failed ones) as an aligned plain-text table, or as a Markdown table."""
    columns = ("model", "size", "dtype", "cp", "rank", *FAMILIES, "collectives", "fallbacks", "eager_rel_err",
               "max_rel_err", "compile_s", "eager_ms", "mindiesd_ms", "speedup")
    left = ("model", "size", "dtype", "cp", "rank", "collectives")

    def cell(column: str, value: Any) -> str:
        if column == "collectives" and value is not None:
            return _collectives_text(value)
        return format_value(column, str(value) if column == "rank" else value)

    return format_rows([row for row in rows if "error" not in row], columns, left,
                       headers={**HEADERS, "eager_rel_err": "cp_eager_err"}, cell=cell, markdown=markdown)


def _legend(rows: Sequence[Dict[str, Any]], world_size: int, backend: str, env: Dict[str, Any]) -> str:
    threads = sorted({row["threads"] for row in rows if "threads" in row})
    iters = sorted({len(row["samples"]["eager"]) for row in rows if "samples" in row})
    return "\n".join([
        f"torch {env['torch']}, diffusers {env['diffusers']}; {plural(world_size, 'rank')} ({backend}), "
        f"{plural('/'.join(map(str, threads)), 'thread')} each; medians of "
        f"{plural('/'.join(map(str, iters)), 'interleaved iter')}, "
        "each started at a barrier",
        footer(env),
        "rank N: that rank's forward (its waits in collectives included); all: per iteration the slowest rank, then "
        "the median; compile_s: first compiled call (all: the slowest rank)",
        "max_rel_err: compiled output vs the single-process eager model (max |a-b| / max |b|); cp_eager_err: the same "
        "for the eager context-parallel model",
        "collectives: functional collectives in the compiled graphs (a2a all_to_all_single, ag "
        "all_gather_into_tensor, ar all_reduce, wait wait_tensor)",
    ])


def _report(per_rank: Sequence[Sequence[Dict[str, Any]]], args: argparse.Namespace, world_size: int,
            backend: str, stdout: TextIO, stderr: TextIO) -> int:
    """Print the table (and write the JSON) of every rank's rows; the exit status."""
    flat = [row for rows in per_rank for row in rows]
    failed = sorted({row["model"] for row in flat if "error" in row})
    shown = set()
    for row in flat:
        if "error" in row:
            complain(stderr, f"{row['model']} failed on rank {row['rank']}: {row['error']}")
            if row["model"] not in shown:  # the ranks run the same code: one traceback per model
                shown.add(row["model"])
                stderr.write(row["traceback"])
    rows = summarize(per_rank)
    env = environment(args.device)
    if any("error" not in row for row in rows):
        stdout.write(format_table(rows, markdown=args.markdown) + "\n\n" + _legend(flat, world_size, backend, env)
                     + "\n")
        stdout.flush()
    if args.json:
        env = {**env, "world_size": world_size, "process_group": backend, "cp": args.cp,
               "threads": sorted({row["threads"] for row in flat if "threads" in row})}  # per rank
        write_json(args.json, {"environment": env, "rows": [r for r in rows if "error" not in r], "failed": failed})
    return 1 if failed else 0


# ---------------------------------------------------------------- CLI


_world_size_arg = bounded(int, 2, reason="context parallelism needs 2 ranks or more")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``bench distributed`` on ``parser``."""
    parser.add_argument("--world-size", type=_world_size_arg, default=2, metavar="N",
                        help="ranks of the context-parallel group (at least 2; default: 2)")
    add_model_option(parser)
    add_run_options(parser)
    add_timing_options(parser)
    parser.add_argument("--cp", choices=CP_MODES, default="ulysses",
                        help="context-parallel attention: ulysses (all-to-all; default) or ring (all-gather of K/V; "
                        "needs --device cuda and bf16/fp16)")
    parser.add_argument("--dist-timeout", type=positive_float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds the run (and any collective) may take (default: {DEFAULT_TIMEOUT:.0f})")


def _cp_models(args: argparse.Namespace, stderr: TextIO) -> List[str]:
    """The models of ``--model`` whose diffusers class has a context-parallel plan (the others noted on stderr)."""
    import diffusers

    names = select_models(args.model, args.size, stderr)
    planned = [n for n in names if getattr(getattr(diffusers, zoo.entry(n).cls, None), "_cp_plan", None)]
    left_out = [n for n in names if n not in planned]
    if left_out:
        complain(stderr, f"no context-parallel plan in diffusers, left out: {', '.join(left_out)}")
    return planned


def run(args: argparse.Namespace, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
        progress: Optional[Progress] = None) -> int:
    """Execute ``bench distributed``; returns the exit status (2: unusable options or environment)."""
    stdout, stderr, own_progress = session(args, stdout, stderr)
    progress = progress if progress is not None else own_progress
    device_type = torch.device(args.device).type
    try:
        backend = process_group_backend(device_type)
        attention_backend_for(args.cp, device_type, DTYPES[args.dtype])
        models = _cp_models(args, stderr)
    except (ValueError, ImportError) as exc:
        complain(stderr, str(exc))
        return 2
    if not models:
        return 2
    spec = {
        "models": models, "size": args.size, "dtype": args.dtype, "device": device_type, "seed": args.seed,
        "cp": args.cp, "quiet": args.quiet, "local_rank": None,
        "iters": DEFAULT_ITERS.get(args.size, 10) if args.iters is None else args.iters,
        "warmup": DEFAULT_WARMUP.get(args.size, 1) if args.warmup is None else args.warmup,
    }
    launched = launched_world()
    if launched is not None:
        return _run_launched(launched, spec, args, backend, stdout, stderr)
    threads = args.threads
    if threads is None and device_type == "cpu":
        threads = max(1, (os.cpu_count() or 1) // args.world_size)
    with progress.step(f"starting {plural(args.world_size, 'process', 'processes')} ({backend})"):
        world = World(args.world_size, device_type, threads=threads, timeout=args.dist_timeout)
        world.start()
    try:
        per_rank = world.run(bench_rank, spec)
    except DistributedJobError as exc:
        complain(stderr, str(exc))
        return 1
    finally:
        world.close()
    return _report(per_rank, args, args.world_size, backend, stdout, stderr)


def _run_launched(launched: Tuple[int, int, int, int], spec: Dict[str, Any], args: argparse.Namespace,
                  backend: str, stdout: TextIO, stderr: TextIO) -> int:
    """This process is one rank of a launcher's group (torchrun): join it, bench, and print on rank 0."""
    rank, world_size, local_rank, local_world_size = launched
    if world_size != args.world_size:
        started = plural(world_size, "process", "processes")
        complain(stderr, f"--world-size {args.world_size}, but the launcher started {started} (WORLD_SIZE)")
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif spec["device"] == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=args.dist_timeout))
    try:
        rows = bench_rank({**spec, "local_rank": local_rank})
        gathered: Optional[List[Any]] = [None] * world_size if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 1 if any("error" in row for row in rows) else 0
    return _report(gathered, args, world_size, backend, stdout, stderr)
