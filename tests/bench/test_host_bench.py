"""``bench host``: ops per forward and host time, eager against mindiesd (and Inductor, not run here)."""

import argparse
import io
import json

import torch

from mindiesd.benchmarks import cli, host


def test_count_ops_counts_top_level_ops_views_and_allocations_apart():
    a, b = torch.randn(4, 8), torch.randn(8, 3)

    def fn():
        out = torch.empty(4, 3)
        torch.mm(a, b, out=out)
        return torch.nn.functional.linear(a, b.t()).view(-1).unsqueeze(0).sin() + out.view(1, -1)

    gemm, other = host.count_ops(fn)
    assert (gemm, other) == (2, 2)  # mm and linear (its addmm inside it not again); sin and add


def test_flux_at_host_size_runs_fewer_ops_than_eager(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_bench_command(parser.add_subparsers(dest="command"))
    report = tmp_path / "host.json"
    args = parser.parse_args(["bench", "host", "--size", "host", "--iters", "3", "--warmup", "1", "--quiet",
                              "--json", str(report)])
    out = io.StringIO()
    assert args.handler(args, stdout=out, stderr=io.StringIO()) == 0
    rows = {row["backend"]: row for row in json.loads(report.read_text())["rows"]}
    eager, fused = rows["eager"], rows["mindiesd"]
    assert fused["gemm_ops"] == eager["gemm_ops"] > 0
    assert fused["other_ops"] < eager["other_ops"] / 3
    assert fused["max_rel_err"] < 1e-5
    assert "host_ms" in out.getvalue() and fused["host_ms"] > 0
