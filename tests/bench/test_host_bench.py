"""``bench host``: ops per forward and host time, eager against mindiesd (and Inductor, not run here)."""

import os
import subprocess
import sys

import torch

from mindiesd.benchmarks import common, host

PROFILER_START = b"USDT:2026-12-05 18:09:58 3367:3367 SyncActivityProfilerHandler.cpp:52] profiler_start\n"


def test_count_ops_counts_top_level_ops_views_and_allocations_apart():
    a, b = torch.randn(4, 8), torch.randn(8, 3)

    def fn():
        out = torch.empty(4, 3)
        torch.mm(a, b, out=out)
        return torch.nn.functional.linear(a, b.t()).view(-1).unsqueeze(0).sin() + out.view(1, -1)

    gemm, other = host.count_ops(fn)
    assert (gemm, other) == (2, 2)  # mm and linear (its addmm inside it not again); sin and add


def test_the_profilers_lines_written_to_the_file_descriptors_are_kept_out(capfd):
    with common.without_profiler_lines():
        os.write(1, PROFILER_START + b"the function's own line\n")
        os.write(2, PROFILER_START.replace(b"start", b"stop") + b"a warning of its own\n")
    out, err = capfd.readouterr()
    assert (out, err) == ("the function's own line\n", "a warning of its own\n")
    os.write(1, b"after\n")
    assert capfd.readouterr().out == "after\n"  # the descriptors point where they did before


def test_count_ops_prints_none_of_the_profilers_lines():
    """In a new process, where the profiler's C++ layer announces its start and stop on the process's stderr."""
    code = ("import torch; from mindiesd.benchmarks import host; "
            "print(host.count_ops(lambda: torch.ones(3) + 1))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "(0, 2)\n"
    assert "profiler_start" not in done.stderr and "USDT" not in done.stderr, done.stderr


def test_flux_at_host_size_runs_fewer_ops_than_eager(run_bench):
    data, out = run_bench("host", "--size", "host", "--iters", "3", "--warmup", "1")
    rows = {row["backend"]: row for row in data["rows"]}
    eager, fused = rows["eager"], rows["mindiesd"]
    assert fused["gemm_ops"] == eager["gemm_ops"] > 0
    assert fused["other_ops"] < eager["other_ops"] / 3
    assert fused["max_rel_err"] < 1e-5
    assert "host_ms" in out and fused["host_ms"] > 0 and fused["spread"] >= 0
    assert "spread" in out.splitlines()[0]


def test_shapes_modes_time_static_dynamic_and_automatic_dynamic_graphs_interleaved(run_bench):
    """``--shapes static dynamic auto``: one mindiesd row per mode, each equal to eager; the dynamic and auto rows
    say their cost against the static graph's."""
    data, out = run_bench("host", "--size", "host", "--shapes", "static", "dynamic", "auto", "--iters", "3",
                       "--warmup", "1")
    rows = {(row["backend"], row["shapes"]): row for row in data["rows"]}
    assert set(rows) == {("eager", None), ("mindiesd", "static"), ("mindiesd", "dynamic"), ("mindiesd", "auto")}
    for mode in ("static", "dynamic", "auto"):
        assert rows["mindiesd", mode]["max_rel_err"] < 1e-5
    for mode in ("dynamic", "auto"):
        assert rows["mindiesd", mode]["vs_static"] > 0
    assert "vs_static" in out.splitlines()[0]


def test_sweep_serves_each_resolution_and_the_first_again_without_another_compile(run_bench):
    """``bench sweep``: one row per resolution in turn (the first two again at the end), each equal to eager; the
    sizes seen before cost a forward, not a compile, on their second visit."""
    data, out = run_bench("sweep", "--size", "host", "--sizes", "3", "--iters", "2")
    rows = data["rows"]
    assert [row["shape"] for row in rows] == ["grid=4x4", "grid=4x6", "grid=4x8", "grid=4x4", "grid=4x6"]
    assert all(row["max_rel_err"] < 1e-5 for row in rows)
    assert rows[3]["first_s"] < rows[0]["first_s"] / 4  # the first size again: the graph is there
    assert data["totals"]["mindiesd"] > 0 and "total over the sweep" in out
    assert [row["cache"] for row in rows] == ["off", "off", "-", "-", "-"]  # no cache folder by default


def test_a_second_sweep_with_the_same_cache_folder_loads_the_static_and_the_symbolic_graph(tmp_path, run_bench):
    """``--cache-dir``: the first process stores the first size's static graph and the symbolic one automatic
    dynamic makes at the second size; a second process loads both and compiles nothing."""
    folder = str(tmp_path / "cache")
    first, _ = run_bench("sweep", "--size", "host", "--sizes", "2", "--iters", "1", "--cache-dir", folder)
    second, out = run_bench("sweep", "--size", "host", "--sizes", "2", "--iters", "1", "--cache-dir", folder)
    assert [row["cache"] for row in first["rows"]] == ["stored", "stored", "-", "-"]
    assert [row["cache"] for row in second["rows"]] == ["hit", "hit", "-", "-"]
    assert all(row["max_rel_err"] < 1e-5 for row in second["rows"])
    assert "cache" in out.splitlines()[0]
