"""Command line entry point: ``python -m mindiesd <command>`` or ``mindiesd <command>``."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Any, Sequence


class _RootParser(argparse.ArgumentParser):
    """The root parser; names the bench mode where the command line uses an earlier form (``bench --model``), and
    answers a mistyped option with the options it may have meant."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        from .benchmarks.cli import with_mode

        return super().parse_known_args(with_mode(sys.argv[1:] if args is None else args), namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = _chosen(self, parsed)
            command.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(command, unknown)}")
        return parsed


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)command's parser that ``args`` was parsed by: the deepest sub-command chosen."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                return _chosen(chosen, args)
    return parser


def _did_you_mean(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """``"; did you mean --model?"`` for the options of ``parser`` close to the unknown options, else ``""``."""
    options = {option[2:]: option for action in parser._actions for option in action.option_strings
               if option.startswith("--")}
    hints = {}
    for token in unknown:
        name = token.split("=", 1)[0]
        if name.startswith("-"):
            matches = difflib.get_close_matches(name.lstrip("-"), options, n=1, cutoff=0.7)
            if matches:
                hints[name] = options[matches[0]]
    if not hints:
        return ""
    if len(hints) == 1:
        return f"; did you mean {next(iter(hints.values()))}?"
    return "; did you mean " + ", ".join(f"{match} for {name}" for name, match in hints.items()) + "?"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-command per tool."""
    from .benchmarks.cli import add_bench_command

    parser = _RootParser(
        prog="mindiesd",
        description="Tools for the MindieSD torch.compile backend.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    add_bench_command(commands)
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
    env_parser = commands.add_parser(
        "env",
        help="print the versions, devices, kernels and caches a bug report needs",
        description="Print what a bug report needs: the versions of mindiesd, Python, torch, diffusers, Triton and "
        "torch_npu; the devices torch sees; the CPU kernel implementation and the kernel each op has per device; "
        "Triton and device-graph availability; the compile cache's folder and size. It loads the prebuilt C++ "
        "CPU kernels of the package build or a cached build of them but never compiles one (then cpu_kernels "
        "says 'not built yet'), unless --build-cpu-kernels is given.",
    )
    env_parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    env_parser.add_argument(
        "--build-cpu-kernels",
        action="store_true",
        help="build the C++ CPU kernels first where neither prebuilt kernels nor a cached build load "
        "(one-time, a few minutes), so cpu_kernels "
        "names the implementation the ops will run, or the build's failure",
    )
    env_parser.set_defaults(handler=_env_command)
    return parser


def _cache_command(args: argparse.Namespace) -> int:
    from .compilation import config
    from .compilation.storage import cache
    from .compilation.report import plural

    chosen = args.cache_dir if args.cache_dir is not None else config.CompilationConfig.cache_dir
    folder, entries, size = cache.describe(chosen)
    if folder is None:
        print(f"the compile cache is off ({config.ENV_VAR}={os.environ.get(config.ENV_VAR, '')!r})")
        return 0
    if args.action == "clear":
        print(f"removed {plural(cache.clear_cache(chosen), 'entry', 'entries')} from {folder}")
    else:
        artifacts = len(cache.artifact_files(chosen))
        print(f"{folder}: {plural(entries, 'entry', 'entries')} ({plural(entries - artifacts, 'graph')}, "
              f"{plural(artifacts, 'ahead-of-time artifact')}), {size / 2**20:.1f} MiB of {_limit_text()}")
        refused = _untrusted(folder)
        if refused:
            print(f"not trusted, so neither read nor written: {refused}")
    return 0


def _limit_text() -> str:
    """The size limit of the cache as the cache command shows it."""
    from .compilation.config import CompilationConfig

    limit = CompilationConfig.cache_max_bytes
    return "no limit (cache_max_bytes=None)" if limit is None else f"{limit / 2**20:.1f} MiB (cache_max_bytes)"


def _untrusted(folder: Any) -> str | None:
    """Why the cache folder itself is not trusted, or None (also when it does not exist yet)."""
    from .compilation.storage import cache
    from .compilation.config import CompilationConfig

    if not folder.is_dir():
        return None
    return cache.untrusted_reason(folder, folder, CompilationConfig.cache_trust_foreign_owner)


def _env_command(args: argparse.Namespace) -> int:
    from .benchmarks import environment

    info = environment.report(build_cpu_kernels=args.build_cpu_kernels)
    print(json.dumps(info, indent=2) if args.json else environment.format_report(info))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen command."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
