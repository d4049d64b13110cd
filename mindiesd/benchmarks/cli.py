"""``mindiesd bench``: one sub-command per mode, each with only its own options.

``bench model`` (the default), ``bench ops``, ``bench host``, ``bench sweep``, ``bench pipeline NAME``,
``bench vae`` and ``bench distributed``. The forms of
earlier releases keep working: ``bench [options]`` is ``bench model [options]``, ``bench --pipeline NAME
[options]`` is ``bench pipeline NAME [options]`` and ``bench --world-size N [options]`` is ``bench distributed
--world-size N [options]``.
"""

from __future__ import annotations

from typing import Any, Sequence

from . import distributed, host, models, ops, pipeline, sweep, vae

#: Sub-command -> (module with ``add_arguments`` and ``run``, one-line help, description).
MODES = {
    "model": (
        models,
        "compile registry models with the MindieSD backend and time them (the default mode)",
        "Build a small diffusers transformer of the registry (mindiesd.zoo) with random weights, compile it with "
        "torch.compile(backend=MindieSDBackend()) and print fused-op counts, error vs eager, compile time and "
        "eager/compiled latency (medians of interleaved runs).",
    ),
    "ops": (
        ops,
        "time the fused operators alone: eager's op sequence vs the kernel vs Inductor vs a copy",
        "Time each fused operator against the eager op sequence its pass replaces, Inductor's compile of that "
        "sequence and a copy (the bandwidth floor), interleaved in one process; one row per op and dtype.",
    ),
    "host": (
        host,
        "what a forward costs the host: ops per forward and ms at negligible tensor sizes, vs eager and Inductor",
        "Count the ops one forward executes (GEMM and attention apart, views and allocations not counted) and time "
        "forwards whose tensors take no time to compute (Flux's host and host-deep sizes; other models at tiny), "
        "eager against mindiesd and optionally Inductor, interleaved in one process, on one thread by default.",
    ),
    "sweep": (
        sweep,
        "one compiled model at many resolutions in turn: first-call and steady-state cost per size, vs Inductor",
        "Compile a registry model once per backend, call it at --sizes resolutions (then the first two again), as "
        "a server meeting several image sizes does, and print per size and backend the first call's seconds "
        "(compiles included), the steady-state ms and the error against eager, with each backend's total.",
    ),
    "pipeline": (
        pipeline,
        "a whole diffusers pipeline (flux, sd3, wan), eager against compiled, step by step",
        "Run a diffusers pipeline (registry transformer, small VAE, no text encoders) eager and compiled, "
        "optionally with diffusers' FirstBlockCache, and print per-variant seconds, step ms, errors and "
        "recompilations.",
    ),
    "vae": (
        vae,
        "a pipeline's VAE decode (AutoencoderKL, AutoencoderKLWan), eager against compiled, with the fused ops",
        "Build a VAE from a config (Flux's AutoencoderKL geometry, Wan's AutoencoderKLWan) with random weights, "
        "compile its decode with mindiesd (and Inductor with --vs inductor) and print per backend the first call's "
        "seconds, the steady ms (interleaved), the speed-up over eager, the error and the fused ops.",
    ),
    "distributed": (
        distributed,
        "a registry model under diffusers' context parallelism on N ranks (spawned here, or under torchrun)",
        "Run the model on N ranks under diffusers' context parallelism (gloo on CPU, nccl on CUDA, hccl on "
        "Ascend): spawned here, or one rank per process under torchrun (RANK and WORLD_SIZE set); --threads is "
        "per rank (default on CPU: the cores shared out); compiles without the persistent cache.",
    ),
}

_PIPELINE_FLAG = "--pipeline"
_WORLD_SIZE_FLAG = "--world-size"


def add_bench_command(commands: Any) -> None:
    """Add ``bench`` and its sub-commands to the root parser's ``commands``."""
    bench = commands.add_parser(
        "bench",
        help="measure the MindieSD backend: " + ", ".join(MODES) + " (default: model)",
        description="Measure the MindieSD backend. Without a sub-command, 'bench [options]' is 'bench model "
        "[options]'; 'bench --pipeline NAME' is 'bench pipeline NAME' and 'bench --world-size N' is 'bench "
        "distributed --world-size N'.",
    )
    modes = bench.add_subparsers(dest="bench_command", metavar="MODE", title="modes")
    modes.required = True
    for name, (module, summary, description) in MODES.items():
        parser = modes.add_parser(name, help=summary, description=description)
        module.add_arguments(parser)
        parser.set_defaults(handler=module.run)


def _pipeline_alias(argv: Sequence[str]) -> list[str] | None:
    """``pipeline NAME rest...`` for ``argv`` holding ``--pipeline NAME`` (or ``--pipeline=NAME``), else None."""
    for index, token in enumerate(argv):
        if token == _PIPELINE_FLAG:
            return ["pipeline", *argv[index + 1:index + 2], *argv[:index], *argv[index + 2:]]
        if token.startswith(_PIPELINE_FLAG + "="):
            return ["pipeline", token.split("=", 1)[1], *argv[:index], *argv[index + 1:]]
    return None


def with_mode(argv: Sequence[str]) -> list[str]:
    """The root CLI's ``argv`` with the bench mode named where an earlier form left it out (module docstring)."""
    argv = list(argv)
    if not argv or argv[0] != "bench":
        return argv
    rest = argv[1:]
    if rest and (rest[0] in MODES or rest[0] in ("-h", "--help")):
        return argv
    aliased = _pipeline_alias(rest)
    if aliased is not None:
        return ["bench", *aliased]
    if any(token == _WORLD_SIZE_FLAG or token.startswith(_WORLD_SIZE_FLAG + "=") for token in rest):
        return ["bench", "distributed", *rest]
    return ["bench", "model", *rest]
