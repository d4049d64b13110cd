"""Command line entry point: ``python -m mindiesd <command>`` or ``mindiesd <command>``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-command per tool."""
    from . import bench, bench_ops

    parser = argparse.ArgumentParser(
        prog="mindiesd",
        description="Tools for the MindieSD torch.compile backend.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    bench_parser = commands.add_parser(
        "bench",
        help="compile registry models with the MindieSD backend and time them ('bench ops': the fused operators alone)",
        description=(
            "Build a small diffusers transformer of the registry (mindiesd.zoo) with random weights, compile it with "
            "torch.compile(backend=MindieSDBackend()) and print fused-op counts, error "
            "vs eager, compile time and eager/compiled latency (medians of interleaved runs)."
        ),
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(handler=bench.run)
    bench_commands = bench_parser.add_subparsers(
        dest="bench_command",
        title="sub-command",
        metavar="ops",
        description="'mindiesd bench ops [options]': the fused operators alone (its options follow 'ops')",
    )
    ops_parser = bench_commands.add_parser(
        "ops",
        help="time the fused operators alone: eager's op sequence vs the kernel vs Inductor vs a copy",
        description=(
            "Time each fused operator against the eager op sequence its pass replaces, Inductor's compile of that "
            "sequence and a copy (the bandwidth floor), interleaved in one process; one row per op and dtype."
        ),
    )
    bench_ops.add_arguments(ops_parser)
    ops_parser.set_defaults(handler=bench_ops.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen command."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
