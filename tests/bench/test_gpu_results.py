"""The GPU check's record (``mindiesd.benchmarks.gpu_results``), the op bench's JSON rows it reads, and the
script that runs them (``bench/gpu_check.sh``, checked with ``--dry-run`` here: the CPU has no GPU to run it on)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from mindiesd.benchmarks import gpu_results
from mindiesd.benchmarks import ops as op_bench
from mindiesd.benchmarks.timing import Medians

ROOT = Path(__file__).resolve().parents[2]

OPS = {"device": "NVIDIA H200", "rows": [
    {"op": "rms_norm", "shape": "x[2,4096,1024] w[1024]", "dtype": "bf16", "kernel": "triton.rms_norm",
     "enabled": False, "eager_ms": 0.05, "fused_ms": 0.04, "inductor_ms": None, "copy_ms": 0.02,
     "copy_gbps": 3000.0, "fused_gbps": 2100.0, "pct_copy_bw": 70.0, "max_abs_diff": 0.0},
    {"op": "mul_add", "shape": "x[2,4096,1024] y[2,1,1024] z", "dtype": "bf16", "kernel": "triton.mul_add",
     "enabled": True, "eager_ms": 0.06, "fused_ms": 0.03, "inductor_ms": None, "copy_ms": 0.02,
     "copy_gbps": 3200.0, "fused_gbps": 2500.0, "pct_copy_bw": 78.0, "max_abs_diff": 0.0},
]}
MODEL = {"environment": {}, "failed": [], "rows": [
    {"model": "flux", "size": "wide", "dtype": "bf16", "eager_ms": 180.0, "mindiesd_ms": 150.0, "capture_ms": 140.0,
     "inductor_ms": 155.0, "inductor_ro_ms": 145.0, "compile_s": 20.0, "inductor_compile_s": 90.0, "speedup": 1.2},
]}


def test_the_record_has_the_fields_the_check_promises():
    record = gpu_results.record(OPS, [MODEL, {"rows": [{"model": "flux", "size": "mid", "dtype": "bf16",
                                                        "eager_ms": 9.0, "mindiesd_ms": 7.0}]}],
                                device="NVIDIA H200", commit="abc", date="2026-12-05T00:00:00Z")
    assert set(record) == {"device", "torch", "triton", "commit", "date", "copy_gbps", "ops", "models"}
    assert record["device"] == "NVIDIA H200" and record["commit"] == "abc" and record["torch"] == torch.__version__
    assert record["copy_gbps"] == 3100.0  # the median of the rows' copies
    assert [op["op"] for op in record["ops"]] == ["rms_norm", "mul_add"]
    assert set(record["ops"][0]) >= {"op", "shape", "dtype", "kernel", "enabled", "eager_ms", "fused_ms"}
    wide, mid = record["models"]
    assert set(wide) == {"model", "size", "dtype", "eager_ms", "mindiesd_ms", "captured_ms", "inductor_ms",
                         "inductor_ro_ms", "compile_s", "inductor_compile_s"}
    assert wide["captured_ms"] == 140.0 and wide["inductor_ro_ms"] == 145.0 and wide["inductor_compile_s"] == 90.0
    assert mid["captured_ms"] is None and mid["mindiesd_ms"] == 7.0  # not measured: None, never a made-up figure


def test_the_record_is_written_from_the_files_a_check_left(tmp_path, capsys):
    ops, wide = tmp_path / "ops.json", tmp_path / "wide.json"
    ops.write_text(json.dumps(OPS))
    wide.write_text(json.dumps(MODEL))
    out = tmp_path / "gpu-results.json"
    assert gpu_results.main(["--ops", str(ops), "--models", str(wide), str(tmp_path / "mid.json"),
                             "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert len(record["ops"]) == 2 and len(record["models"]) == 1
    assert "mid.json is missing" in capsys.readouterr().err


def test_the_op_benchs_json_rows_measure_bytes_against_a_copy():
    x, y, z = torch.randn(4, 64), torch.randn(1, 64), torch.randn(4, 64)
    case = op_bench.Case("mul_add", "x[4,64] y[1,64] z", op_bench.eager_mul_add,
                         lambda x, y, z: torch.ops.mindiesd.mul_add.default(x, y, z), (x, y, z), x)
    timing = Medians({"eager": 2.0, "mindiesd": 1.0, "clone": 0.5, "copy_": 0.5}, None)
    row, = op_bench.json_rows([(case, "fp32", timing, 0.0)], torch.device("cpu"))
    moved = (4 * 64 + 64 + 4 * 64 + 4 * 64) * 4  # x, y and z read, the output written
    assert row["fused_gbps"] == moved / 1e6 and row["copy_gbps"] == 2 * 4 * 64 * 4 / (0.5 * 1e6)
    assert abs(row["pct_copy_bw"] - 100 * row["fused_gbps"] / row["copy_gbps"]) < 1e-9
    assert row["enabled"] is True and row["kernel"].endswith("mul_add") and row["inductor_ms"] is None


def test_the_gpu_check_lists_its_steps_without_a_gpu():
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=60, check=True)
    steps = [line.split(",")[0].lstrip("[") for line in done.stdout.splitlines()]
    assert steps == ["tests", "ops_cuda_bf16", "flux_wide_bf16", "flux_mid_bf16", "results"]
    wide = next(line for line in done.stdout.splitlines() if line.startswith("[flux_wide_bf16"))
    assert all(flag in wide for flag in ("--size wide", "--dtype bf16", "--capture", "--vs inductor ",
                                          "--vs inductor-ro", "--json"))
    limits = [int(line.split(", ")[1].split("s]")[0]) for line in done.stdout.splitlines()]
    assert sum(limits) <= 480  # one call of at most 8 minutes
    more = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--more"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert len(more.stdout.splitlines()) > len(done.stdout.splitlines())
