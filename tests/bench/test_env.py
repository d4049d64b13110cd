"""Tests of the environment report: ``python -m mindiesd env`` and the bench's ``environment`` (footer and JSON)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

import mindiesd  # noqa: E402
from mindiesd.__main__ import build_parser, main  # noqa: E402
from mindiesd.benchmarks import environment, models  # noqa: E402
from mindiesd.compilation import CompilationConfig  # noqa: E402
from mindiesd.compilation.runtime import device_graph as _device_graph  # noqa: E402
from mindiesd.ops import registry  # noqa: E402
from mindiesd.ops.kernels import cpp as _cpp_kernels  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
REPORT_KEYS = {"mindiesd", "python", "platform", "torch", "diffusers", "triton", "torch_npu", "threads", "devices",
               "cpu_kernels", "triton_kernels", "device_graphs", "kernels", "compile_cache", "cpu_kernel_cache"}


def _listing(text: str) -> dict:
    """The aligned listing as {key: first value}; the value column starts at the same place on every line."""
    lines = text.splitlines()
    column = len(lines[0]) - len(lines[0].split("  ", 1)[1].lstrip())
    assert all(line[column - 2:column] == "  " and line[column] != " " for line in lines), text
    facts = {}
    for line in lines:
        key = line[:column].strip()
        if key:
            facts[key] = line[column:]
    return facts


def _run_env(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mindiesd", "env", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=240, env={**os.environ, **env})


def test_python_m_mindiesd_env_names_the_versions_and_the_cpu_kernels():
    result = _run_env()
    assert result.returncode == 0, result.stderr
    facts = _listing(result.stdout)
    assert facts["mindiesd"] == mindiesd.__version__
    assert facts["torch"] == torch.__version__
    # the session fixture built (or loaded) the kernels into the cache this process shares: env loads that build
    assert facts["cpu_kernels"] == _cpp_kernels.cpu_kernel_implementation()
    assert "building" not in result.stderr


def test_env_json_has_every_key_with_this_process_values(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == REPORT_KEYS
    assert info["mindiesd"] == mindiesd.__version__ and info["torch"] == torch.__version__
    assert info["threads"] == torch.get_num_threads()
    assert info["cpu_kernels"] == _cpp_kernels.cpu_kernel_implementation()
    assert set(info["kernels"]) == set(registry.DEVICE_KERNELS)
    assert list(info["kernels"]["cpu"]) == list(registry.DEVICE_KERNELS["cpu"])
    assert info["devices"][0].startswith("cpu: ")
    cuda_lines = [line for line in info["devices"] if line.startswith("cuda")]
    assert len(cuda_lines) == (torch.cuda.device_count() if torch.cuda.is_available() else 1)
    assert info["compile_cache"] == {"folder": None, "entries": 0, "bytes": 0}  # the suite turns the cache off
    assert info["cpu_kernel_cache"] == str(_cpp_kernels.cache_root())


def test_env_listing_matches_the_report(capsys):
    assert main(["env"]) == 0
    facts = _listing(capsys.readouterr().out)
    info = environment.report()
    assert facts["cpu_kernels"] == info["cpu_kernels"]
    assert facts["triton"] == (info["triton"] or "not installed")
    assert facts["triton_kernels"] == info["triton_kernels"]
    assert facts["device graph cuda"] == info["device_graphs"]["cuda"]
    first_op, first_text = next(iter(info["kernels"]["cpu"].items()))
    assert facts["kernels cpu"] == f"{first_op}: {first_text}"
    assert facts["compile cache"] == "off (MINDIESD_CACHE_DIR='off')"


def test_env_reports_the_compile_cache_folder_and_size(tmp_path, monkeypatch, capsys):
    entry = tmp_path / "ab" / "abcdef.graph"
    entry.parent.mkdir()
    entry.write_bytes(b"x" * 3000)
    monkeypatch.setattr(CompilationConfig, "cache_dir", str(tmp_path))
    assert environment.compile_cache() == {"folder": str(tmp_path), "entries": 1, "bytes": 3000}
    assert main(["env"]) == 0
    assert _listing(capsys.readouterr().out)["compile cache"] == f"{tmp_path}: 1 entry, 0.0 MiB"


def test_env_compiles_no_cpu_kernels(tmp_path):
    if not _cpp_kernels.enabled():
        pytest.skip("the C++ CPU kernels are disabled")
    result = _run_env("--json", MINDIESD_CPP_CACHE=str(tmp_path))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    if _cpp_kernels.cpu_kernel_implementation().startswith("C++ prebuilt"):  # the package build's: no build needed
        assert info["cpu_kernels"] == _cpp_kernels.cpu_kernel_implementation()
    else:
        assert info["cpu_kernels"].startswith("not built yet (the C++ kernels for ")
    assert info["cpu_kernel_cache"] == str(tmp_path)
    assert list(tmp_path.iterdir()) == [] and "building" not in result.stderr


def test_env_help_says_what_it_loads_and_builds(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["env", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "never compiles" in help_text and "--build-cpu-kernels" in help_text


def test_user_kernels_are_named_and_slow_kernels_marked():
    def my_rms_norm(*args):
        return args[0]

    assert environment._kernel_text("rms_norm", "cpu", my_rms_norm) == (
        f"user kernel {__name__}.test_user_kernels_are_named_and_slow_kernels_marked.<locals>.my_rms_norm"
    )
    slow = [(name, device_type) for name, op in registry.OPS.items() for device_type, declared in op.kernels.items()
            if not declared.fast and name in registry.DEVICE_KERNELS.get(device_type, {})]
    for name, device_type in slow:
        text = environment.kernels()[device_type][name]
        assert text.endswith("[not faster than eager: runs only when forced]"), text


def test_bench_environment_names_triton_and_device_graphs_where_they_apply():
    cpu = environment.environment("cpu")
    assert cpu["cpu_kernels"] == _cpp_kernels.cpu_kernel_implementation()
    assert "triton" not in cpu and "device_graph" not in cpu
    cuda = environment.environment("cuda:0")
    assert cuda["triton_kernels"] == environment.triton_kernels()
    assert cuda["device_graph"] == environment.device_graph("cuda")
    assert environment.environment("npu")["device_graph"] == environment.device_graph("npu")
    footer = environment.footer(cuda)
    assert f"CPU kernels: {cuda['cpu_kernels']}" in footer and f"device graph: {cuda['device_graph']}" in footer


def test_device_graph_follows_the_adapter():
    _device_graph.register_adapter("cuda", lambda device: object())
    try:
        assert environment.device_graph("cuda") == "CUDA graphs available"
    finally:
        _device_graph.register_adapter("cuda", None)
    if not torch.cuda.is_available():
        assert environment.device_graph("cuda") == "CUDA graphs unavailable: no CUDA device visible to torch"
    assert environment.device_graph("cpu") is None


class _PassThroughBackend:
    """A backend that runs the captured graph unchanged and reports no fusions."""

    def __init__(self):
        self._report = types.SimpleNamespace(matches={}, graphs=0, compile_seconds=0.0)

    def __call__(self, gm, example_inputs):
        self._report.graphs += 1
        return gm.forward

    def report(self):
        return self._report


def test_bench_model_json_and_footer_name_the_cpu_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "make_backend", lambda *args, **settings: _PassThroughBackend())
    out, path = io.StringIO(), tmp_path / "rows.json"
    args = build_parser().parse_args(
        ["bench", "model", "--model", "sd3", "--iters", "1", "--warmup", "0", "--quiet", "--json", str(path)]
    )
    assert models.run(args, stdout=out, stderr=io.StringIO()) == 0
    implementation = _cpp_kernels.cpu_kernel_implementation()
    saved = json.loads(path.read_text())["environment"]
    assert saved["cpu_kernels"] == implementation
    assert saved["mindiesd"] == mindiesd.__version__ and saved["torch"] == torch.__version__
    assert "triton_kernels" not in saved and "device_graph" not in saved  # a CPU run
    assert saved["cpu"] == environment.cpu_description(), "a figure names the processor's features"
    assert all(f in saved["cpu"] for f in ("amx_tile", "avx512_vnni", "avx512_bf16"))
    footer = f"mindiesd {mindiesd.__version__}; CPU: {saved['cpu']}; CPU kernels: {implementation}"
    assert footer in out.getvalue().splitlines()
