"""Command line entry point: ``python -m mindiesd <command>`` or ``mindiesd <command>``."""

from __future__ import annotations

import argparse
import os
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
    cache_parser = commands.add_parser(
        "cache",
        help="the persistent compile cache: 'cache' prints its folder and size, 'cache clear' empties it",
        description="Print where the persistent compile cache lives and what it holds, or empty it.",
    )
    cache_parser.add_argument("action", nargs="?", choices=("info", "clear"), default="info")
    cache_parser.add_argument(
        "--cache-dir", default=None, help="the folder (default: CompilationConfig.cache_dir, from $MINDIESD_CACHE_DIR)"
    )
    cache_parser.set_defaults(handler=_cache_command)
    return parser


def _cache_command(args: argparse.Namespace) -> int:
    from .compilation import cache, config

    chosen = args.cache_dir if args.cache_dir is not None else config.CompilationConfig.cache_dir
    folder, entries, size = cache.describe(chosen)
    if folder is None:
        print(f"the compile cache is off ({config.ENV_VAR}={os.environ.get(config.ENV_VAR, '')!r})")
        return 0
    if args.action == "clear":
        print(f"removed {cache.clear_cache(chosen)} entries from {folder}")
    else:
        print(f"{folder}: {entries} {'entry' if entries == 1 else 'entries'}, {size / 2**20:.1f} MiB")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen command."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
