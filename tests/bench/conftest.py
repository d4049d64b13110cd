"""Shared by the bench tests: a ``bench`` command run in this process."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from mindiesd.benchmarks import cli


@pytest.fixture
def run_bench(tmp_path):
    """``run_bench(*argv)``: ``bench`` run in this process with ``argv`` (its JSON report read back) -> (report,
    printed table); the command must succeed."""

    def run(*argv):
        parser = argparse.ArgumentParser()
        cli.add_bench_command(parser.add_subparsers(dest="command"))
        report = tmp_path / "report.json"
        args = parser.parse_args(["bench", *argv, "--quiet", "--json", str(report)])
        out = io.StringIO()
        assert args.handler(args, stdout=out, stderr=io.StringIO()) == 0
        return json.loads(report.read_text()), out.getvalue()

    return run
