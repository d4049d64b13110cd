"""``mindiesd bench pipeline``: whole diffusers pipelines (Flux, SD3, Wan) eager against compiled.

What a user checks: the compiled pipeline runs fused (the fused ops the registry expects per forward), without a
``MindieSDFallbackWarning``, ends in the latents and the image eager ends in, and compiles nothing after the
first step; with FirstBlockCache the compiled pipeline equals the eager one with the same cache. The quick tests
(argument parsing, the missing-matplotlib error, the table, JSON and plot wiring) build no model.
"""

from __future__ import annotations

import builtins
import io
import json
import statistics
import warnings

import pytest
import torch

pytest.importorskip("diffusers")

from mindiesd import zoo  # noqa: E402
from mindiesd.benchmarks import pipeline as bench_pipeline  # noqa: E402
from mindiesd.__main__ import build_parser, main  # noqa: E402
from mindiesd.compilation.families import SPEC_FAMILIES as FAMILIES  # noqa: E402
from mindiesd.compilation import MindieSDFallbackWarning  # noqa: E402
from mindiesd.ops.kernels.cpp import cpu_kernel_implementation  # noqa: E402

#: fp32: max |compiled - eager| / max |eager| of the final latents and of the decoded output.
MAX_ERROR = 1e-5
STEPS = 3

slow = pytest.mark.slow  # whole pipelines: the quick subset is `pytest -m "not slow"`


def _bench(name: str, **options):
    """The rows of ``run_pipeline_bench`` by variant, and the fallback warnings raised while it ran."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = bench_pipeline.run_pipeline_bench(name, "tiny", steps=STEPS, **options)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)]
    return {row["variant"]: row for row in rows}, fallbacks


def _assert_compiled_like_eager(rows, fallbacks, name, steps=STEPS):
    """The compiled variant fused what one forward holds, fell back nowhere, matched eager, never recompiled."""
    compiled = rows["mindiesd"]
    expected = zoo.build(name, "tiny").expected()
    assert fallbacks == [] and compiled["fallbacks"] == 0, (fallbacks, compiled["fallback_reasons"])
    assert {family: compiled[family] for family in FAMILIES} == expected
    assert sum(expected.values()) > 0 and compiled["expected_per_forward"] == expected
    assert compiled["graphs"] == 1 and compiled["recompiles"] == 0 and compiled["warm_recompiles"] == 0
    assert compiled["warm_latent_err"] <= MAX_ERROR
    assert compiled["vs"] == "eager"
    assert compiled["latent_err"] <= MAX_ERROR, compiled["latent_err"]
    assert compiled["decoded_err"] <= MAX_ERROR, compiled["decoded_err"]
    for row in rows.values():
        assert row["steps"] == steps and len(row["step_ms_all"]) == steps
        assert row["total_s"] > 0 and row["step_ms"] > 0 and row["first_step_s"] > 0
        assert 0 < row["decode_s"] < row["warm_s"] and row["decode_share"] == row["decode_s"] / row["warm_s"]
    assert compiled["steady_steps"] == list(range(2, steps + 1)) and compiled["graphs_per_step"] == [1] * steps
    ratios = [e / c for e, c in zip(rows["eager"]["step_ms_all"][1:], compiled["step_ms_all"][1:])]
    assert compiled["speedup"] == pytest.approx(statistics.median(ratios))


@pytest.fixture(scope="module")
def wan_with_cache():
    """Wan eager, compiled, and both with FirstBlockCache (one run serves the tests of both)."""
    return _bench("wan", step_cache=True)


# ---------------------------------------------------------------- whole pipelines


@slow
def test_cli_flux_pipeline_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "flux.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = main(["bench", "--pipeline", "flux", "--steps", "2", "--quiet", "--json", str(path)])
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)]
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "step 1/" not in out.err and "building" not in out.err  # --quiet: no progress lines
    lines = out.out.splitlines()
    assert lines[0].split()[:5] == ["pipeline", "size", "dtype", "variant", "vs"]
    assert [line.split()[:4] for line in lines[2:4]] == [["flux", "tiny", "fp32", "eager"],
                                                         ["flux", "tiny", "fp32", "mindiesd"]]
    assert "recompiles: graphs the backend compiled after step 1" in out.out
    saved = json.loads(path.read_text())
    assert saved["environment"]["torch"] == torch.__version__
    implementation = cpu_kernel_implementation()
    assert saved["environment"]["cpu_kernels"] == implementation
    assert f"CPU kernels: {implementation}" in out.out
    rows = {row["variant"]: row for row in saved["rows"]}
    assert list(rows) == ["eager", "mindiesd"]
    _assert_compiled_like_eager(rows, fallbacks, "flux", steps=2)


@slow
def test_sd3_pipeline_compiled_matches_eager():
    rows, fallbacks = _bench("sd3")
    assert list(rows) == ["eager", "mindiesd"]
    _assert_compiled_like_eager(rows, fallbacks, "sd3")


@slow
def test_wan_pipeline_compiled_matches_eager(wan_with_cache):
    rows, fallbacks = wan_with_cache
    _assert_compiled_like_eager(rows, fallbacks, "wan")


@slow
def test_wan_step_cache_compiled_equals_eager_with_the_same_cache(wan_with_cache):
    rows, fallbacks = wan_with_cache
    assert list(rows) == ["eager", "mindiesd", "eager+cache", "mindiesd+cache"]
    eager, compiled = rows["eager+cache"], rows["mindiesd+cache"]
    assert (eager["vs"], compiled["vs"]) == ("eager", "eager+cache")
    # two forwards per step (classifier-free guidance); the cache skips some of them, the same ones compiled
    reused, forwards = map(int, compiled["reused"].split("/"))
    assert forwards == 2 * STEPS and 0 < reused < forwards
    assert eager["reused"] == compiled["reused"]
    assert eager["latent_err"] > MAX_ERROR  # skipping blocks changes the result: the cache did act
    assert compiled["latent_err"] <= MAX_ERROR and compiled["decoded_err"] <= MAX_ERROR
    assert fallbacks == [] and compiled["fallbacks"] == 0
    # the cache's decision breaks the graph, and the path that skips the blocks compiles when first taken
    assert compiled["graphs"] > rows["mindiesd"]["graphs"]
    counts = compiled["graphs_per_step"]
    assert compiled["recompiles"] == counts[-1] - counts[0]
    assert counts[-1] + compiled["warm_recompiles"] == compiled["graphs"]
    # the second call may still compile (Dynamo guards on the cache's state); it ends as the first did, and its
    # steady steps are those after its last compile
    steady = compiled["steady_steps"]
    assert steady and steady == list(range(STEPS + 1 - len(steady), STEPS + 1)) and 1 not in steady
    assert compiled["warm_latent_err"] <= MAX_ERROR
    expected = zoo.build("wan", "tiny").expected()
    assert all(compiled[family] >= expected[family] for family in FAMILIES)


# ---------------------------------------------------------------- quick: options and output wiring


def _stub_rows(name="flux", step_cache=False):
    """Rows of the shape ``run_pipeline_bench`` returns, without running anything."""
    variants = ["eager", "mindiesd"] + (["eager+cache", "mindiesd+cache"] if step_cache else [])
    rows = []
    for variant in variants:
        compiled = variant.startswith("mindiesd")
        rows.append({
            "pipeline": name, "size": "tiny", "dtype": "fp32", "variant": variant,
            "vs": bench_pipeline._VERSUS.get(variant), "steps": 3, "total_s": 1.5, "first_step_s": 1.0,
            "step_ms": 20.0, "step_ms_all": [1000.0, 21.0, 19.0], "decode_s": 0.3, "decode_share": 0.2,
            "speedup": 1.0 if variant != "eager" else None,
            "latent_err": 1e-7 if variant != "eager" else None, "decoded_err": None,
            "reused": "2/3" if "cache" in variant else None, "recompiles": 0 if compiled else None,
            "graphs": 1 if compiled else None, "fallbacks": 0 if compiled else None,
            **{family: (2 if compiled else None) for family in FAMILIES},
        })
    return rows


@pytest.fixture
def stub_bench(monkeypatch):
    """Replace the pipeline run by one returning stub rows; the keyword arguments it got are recorded."""
    calls = []

    def fake(name, size="tiny", **options):
        calls.append(dict(name=name, size=size, **options))
        return _stub_rows(name, options.get("step_cache", False))

    monkeypatch.setattr(bench_pipeline, "run_pipeline_bench", fake)
    return calls


def _run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["bench", *argv])
    return args.handler(args, stdout=out, stderr=err), out.getvalue(), err.getvalue()


def test_pipeline_options_parse():
    assert getattr(build_parser().parse_args(["bench"]), "pipeline", None) is None
    args = build_parser().parse_args(["bench", "pipeline", "flux"])
    assert (args.pipeline, args.steps, args.step_cache, args.plot) == ("flux", None, False, None)
    assert args.cache_threshold == bench_pipeline.DEFAULT_CACHE_THRESHOLD
    args = build_parser().parse_args(["bench", "--pipeline", "wan", "--size", "mid", "--steps", "8",
                                      "--step-cache", "--cache-threshold", "0.2", "--plot", "steps.png"])
    assert (args.pipeline, args.size, args.steps, args.step_cache, args.cache_threshold, args.plot) == (
        "wan", "mid", 8, True, 0.2, "steps.png")
    for bad in (["--pipeline", "unet"], ["--pipeline", "flux", "--steps", "1"], ["--cache-threshold", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["bench", *bad])
        assert exit_info.value.code == 2


def test_plot_without_matplotlib_exits_2_naming_the_extra(monkeypatch, stub_bench):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    status, out, err = _run_cli(["--pipeline", "flux", "--plot", "steps.png"])
    assert status == 2 and out == ""
    assert "pip install 'mindiesd[plot]'" in err
    assert stub_bench == []  # nothing ran
    with pytest.raises(ImportError, match=r"mindiesd\[plot\]"):
        bench_pipeline.plot_steps(_stub_rows(), "steps.png")


def test_cli_pipeline_passes_its_options_and_prints_markdown(tmp_path, stub_bench):
    path = tmp_path / "rows.json"
    status, out, err = _run_cli(["--pipeline", "wan", "--size", "mid", "--steps", "5", "--step-cache",
                                 "--seed", "3", "--markdown", "--json", str(path), "--quiet"])
    assert status == 0, err
    (call,) = stub_bench
    assert (call["name"], call["size"], call["steps"], call["step_cache"], call["seed"]) == ("wan", "mid", 5, True, 3)
    assert call["dtype"] is torch.float32 and call["device"] == "cpu"
    table = out.split("\n\n")[0].splitlines()
    assert all(line.startswith("| ") and line.endswith(" |") for line in table)
    assert [cell.strip() for cell in table[0].strip("|").split("|")][:5] == ["pipeline", "size", "dtype",
                                                                          "variant", "vs"]
    assert "reused" in table[0] and len(table) == 2 + 4
    assert [row["variant"] for row in json.loads(path.read_text())["rows"]] == [
        "eager", "mindiesd", "eager+cache", "mindiesd+cache"]


def test_step_cache_is_left_out_where_diffusers_has_none(stub_bench):
    reason = bench_pipeline.step_cache_unsupported("sd3")
    assert "SD3Transformer2DModel" in reason and "enable_cache" in reason
    assert bench_pipeline.step_cache_unsupported("flux") is None
    assert bench_pipeline.step_cache_unsupported("wan") is None
    status, out, err = _run_cli(["--pipeline", "sd3", "--step-cache"])
    assert status == 0 and "--step-cache left out for sd3" in err
    assert stub_bench[0]["step_cache"] is False
    assert "reused" not in out.splitlines()[0]


def test_run_pipeline_bench_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="no step cache for sd3"):
        bench_pipeline.run_pipeline_bench("sd3", step_cache=True)
    with pytest.raises(ValueError, match="at least 2"):
        bench_pipeline.run_pipeline_bench("flux", steps=1)
    with pytest.raises(ValueError, match="unknown pipeline 'unet'"):
        bench_pipeline.run_pipeline_bench("unet")


def test_plot_writes_a_png(tmp_path, stub_bench):
    pytest.importorskip("matplotlib")
    path = tmp_path / "steps.png"
    status, _, err = _run_cli(["--pipeline", "flux", "--step-cache", "--plot", str(path), "--quiet"])
    assert status == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
