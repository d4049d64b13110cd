"""Command line entry point: ``python -m mindiesd <command>`` or ``mindiesd <command>``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-command per tool."""
    from . import bench

    parser = argparse.ArgumentParser(
        prog="mindiesd",
        description="Tools for the MindieSD torch.compile backend.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    bench_parser = commands.add_parser(
        "bench",
        help="compile zoo models with the MindieSD backend and time them",
        description=(
            "Build a small diffusers transformer with random weights, compile it with "
            "torch.compile(backend=MindieSDBackend()) and print fused-op counts, error "
            "vs eager, compile time and eager/compiled latency (medians of interleaved runs)."
        ),
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(handler=bench.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen command."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
