"""Tests of the model registry (``mindiesd.zoo``), the ``bench`` and ``bench ops`` measurement code and the
``mindiesd`` CLI."""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("diffusers")

from mindiesd import zoo  # noqa: E402
from mindiesd.benchmarks import common, models, timing  # noqa: E402
from mindiesd.benchmarks import ops as op_bench  # noqa: E402
from mindiesd.compilation.families import GEMM_FAMILIES, SPEC_FAMILIES  # noqa: E402
from mindiesd.__main__ import build_parser, main  # noqa: E402


@pytest.mark.parametrize("name", zoo.names(group="core"))
def test_zoo_tiny_forward_returns_latent_shaped_tuple(name):
    case = zoo.build(name, "tiny")
    assert not case.model.training
    assert case.inputs["return_dict"] is False
    with torch.no_grad():
        out = case.model(**case.inputs)
    assert isinstance(out, tuple)
    assert out[0].shape == case.inputs["hidden_states"].shape
    assert torch.isfinite(out[0]).all()


def test_zoo_inputs_follow_the_dtype_and_timestep_conventions():
    flux = zoo.build("flux", dtype=torch.bfloat16)
    assert next(flux.model.parameters()).dtype == torch.bfloat16
    assert flux.inputs["hidden_states"].dtype == torch.bfloat16
    assert flux.inputs["timestep"].dtype == torch.bfloat16
    assert flux.inputs["txt_ids"].abs().sum() == 0
    assert flux.inputs["img_ids"][:, 0].abs().sum() == 0
    assert flux.inputs["img_ids"][:, 1:].amax().item() == 15

    wan = zoo.build("wan")
    assert wan.inputs["timestep"].dtype == torch.long
    sd3 = zoo.build("sd3")
    assert sd3.inputs["timestep"].is_floating_point()


def test_zoo_is_seeded():
    a, b = zoo.build("wan", seed=3), zoo.build("wan", seed=3)
    torch.testing.assert_close(a.inputs["hidden_states"], b.inputs["hidden_states"], rtol=0, atol=0)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    c = zoo.build("wan", seed=4)
    assert not torch.equal(a.inputs["hidden_states"], c.inputs["hidden_states"])


def test_zoo_rejects_unknown_names_and_sizes():
    with pytest.raises(ValueError, match="unknown model 'unet'") as err:
        zoo.build("unet")
    assert all(name in str(err.value) for name in zoo.MODELS)
    with pytest.raises(ValueError, match="unknown size 'huge'") as err:
        zoo.build("flux", size="huge")
    assert all(size in str(err.value) for size in zoo.SIZES)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_every_registry_model_builds_and_runs_at_tiny_size(name):
    case = zoo.build(name, "tiny")
    assert case.entry is zoo.entry(name) and case.entry.cls == type(case.model).__name__
    assert not case.model.training and case.inputs["return_dict"] is False
    with torch.no_grad():
        out = case.model(**case.inputs)
    assert isinstance(out, tuple)
    # the batch and rank of the latent (PixArt's learned sigma doubles the channels)
    assert out[0].shape[0] == case.latent_shape()[0] and out[0].ndim == len(case.latent_shape())
    assert torch.isfinite(out[0]).all()
    expected = case.expected()
    assert set(expected) == set(SPEC_FAMILIES) and all(type(v) is int and v >= 0 for v in expected.values())
    assert sum(expected.values()) > 0
    assert set(zoo.gaps(name)) <= set(SPEC_FAMILIES)


def test_registry_names_groups_and_sizes():
    assert zoo.MODELS == tuple(zoo.REGISTRY) and len(set(zoo.MODELS)) == len(zoo.MODELS)
    assert zoo.names(group="core") == ("flux", "sd3", "wan")
    assert set(zoo.names(group="core")) | set(zoo.names(group="dits")) == set(zoo.MODELS)
    assert zoo.names(size="mid") == ("flux", "sd3", "wan")
    assert zoo.names(size="tiny") == zoo.MODELS
    with pytest.raises(ValueError, match="has no size 'mid'"):
        zoo.build("qwen_image", "mid")
    with pytest.raises(ValueError, match="unknown group"):
        zoo.names(group="unets")
    assert zoo.config_for("hidream_moe")["num_routed_experts"] == 4 and zoo.entry("hidream_moe").graph_breaks


def test_bench_model_choices_are_the_registry_names():
    parser = build_parser()
    bench_parser = parser._subparsers._group_actions[0].choices["bench"]
    model_parser = bench_parser._subparsers._group_actions[0].choices["model"]
    (model_action,) = [a for a in model_parser._actions if "--model" in a.option_strings]
    assert tuple(c for c in model_action.choices if c not in ("core", "all")) == zoo.MODELS
    assert common.MODEL_CHOICES == (*zoo.MODELS, "core", "all")
    for name in zoo.MODELS:
        assert build_parser().parse_args(["bench", "--model", name]).model == name


def test_bench_model_groups_select_the_registry():
    err = io.StringIO()
    assert common.select_models("all", "tiny", err) == zoo.MODELS and err.getvalue() == ""
    assert common.select_models("core", "mid", err) == ("flux", "sd3", "wan")
    assert common.select_models("all", "mid", err) == ("flux", "sd3", "wan")
    assert "no mid size, left out: qwen_image" in err.getvalue()
    err = io.StringIO()
    assert common.select_models("prx", "mid", err) == ()
    assert "prx has no size 'mid'" in err.getvalue()
    args = build_parser().parse_args(["bench", "--model", "prx", "--size", "mid"])
    assert models.run(args, stdout=io.StringIO(), stderr=io.StringIO()) == 2


def test_cli_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "model", "--help"])
    assert exit_info.value.code == 0
    assert "--vs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0


def test_cli_rejects_a_bad_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--model", "unet"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "--model" in err and "invalid choice" in err


def test_cli_defaults():
    args = build_parser().parse_args(["bench"])
    assert (args.model, args.size, args.dtype, args.vs, args.iters) == ("flux", "tiny", "fp32", [], None)


def test_bench_model_attention_option_sets_the_backend_or_says_why_not():
    from mindiesd.benchmarks.models import set_attention_backend

    args = build_parser().parse_args(["bench", "model", "--attention", "flex"])
    assert args.attention == "flex"
    model = zoo.build("flux", "tiny").model
    set_attention_backend(model, "flex")
    with pytest.raises(ValueError, match="--attention no_such_backend"):
        set_attention_backend(model, "no_such_backend")
    with pytest.raises(ValueError, match="Linear has no set_attention_backend"):
        set_attention_backend(torch.nn.Linear(2, 2), "flex")


def test_interleaved_medians_calls_each_runner_equally():
    calls = {"a": 0, "b": 0}

    def make(name, seconds=0.0):
        def runner():
            calls[name] += 1
            time.sleep(seconds)

        return runner

    medians = models.interleaved_medians({"a": make("a"), "b": make("b", seconds=0.005)}, iters=5, warmup=2)
    assert calls == {"a": 7, "b": 7}
    assert set(medians) == {"a", "b"}
    assert medians["b"] >= 5.0, medians  # milliseconds: each call of b sleeps 5 ms
    assert medians["a"] < medians["b"], medians


def test_interleaved_medians_rounds_rotation_and_calls_per_sample(monkeypatch):
    order = []
    runners = {name: (lambda name=name: order.append(name)) for name in "abc"}
    medians = timing.interleaved_medians(runners, iters=3, warmup=0)
    assert order == list("abcbcacab")  # the starting runner rotates
    assert isinstance(medians, timing.Medians) and medians.rounds == 1

    order.clear()
    medians = timing.interleaved_medians(runners, iters=2, warmup=1, rounds=2, calls_per_sample=3)
    assert order.count("a") == 1 + 2 * 2 * 3 and medians.rounds == 2

    # every round disturbed: more rounds, up to max_rounds; a quiet round ends them
    loads = iter([0.0, 1.0, 2.0, 3.0, 4.0, 4.0, 4.0, 4.0])  # cumulative foreign CPU seconds: 1 core busy
    monkeypatch.setattr(timing, "foreign_cpu_seconds", lambda: next(loads))
    medians = timing.interleaved_medians({"a": lambda: time.sleep(0.001)}, iters=1, warmup=0, rounds=1,
                                         max_rounds=3)
    assert medians.rounds == 3 and medians.foreign_load is not None
    loads = iter([0.0, 0.0])
    medians = timing.interleaved_medians({"a": lambda: None}, iters=1, warmup=0, rounds=1, max_rounds=12)
    assert medians.rounds == 1 and medians.foreign_load == 0.0
    with pytest.raises(ValueError):
        timing.interleaved_medians({"a": lambda: None}, iters=0, warmup=0)


def test_interleaved_medians_report_the_spread_of_each_runner():
    medians = timing.interleaved_medians({"a": lambda: None, "b": lambda: time.sleep(0.001)}, iters=4, warmup=0)
    assert set(medians.spreads) == {"a", "b"} and all(spread >= 0 for spread in medians.spreads.values())
    assert medians.spread == max(medians.spreads.values())
    assert timing.Medians({"a": 1.0}, None).spread == 0.0


def test_spread_and_load_make_the_timings_unreliable():
    assert timing.relative_spread([2.0]) == 0.0 and timing.relative_spread([3.0, 3.0, 3.0]) == 0.0
    assert timing.relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    assert timing.unreliable(0.1, load=1.5, cpus=2) is None
    assert timing.unreliable(0.35, load=1.0, cpus=2) == "timings spread 35% around the median"
    assert timing.unreliable(0.0, load=3.1, cpus=2) == "load average 3.1 on 2 cores"
    assert timing.unreliable(0.5, load=1.2, cpus=1) == \
        "load average 1.2 on 1 core and timings spread 50% around the median"


def test_a_busy_run_section_gets_one_warning_line(monkeypatch):
    monkeypatch.setattr(timing, "cores", lambda: 2)
    monkeypatch.setattr(timing, "load_average", lambda: 0.5)
    err = io.StringIO()
    common.warn_if_busy(err, [0.05, 0.1], "flux/tiny")
    assert err.getvalue() == ""
    common.warn_if_busy(err, [0.05, 0.35], "flux/tiny")
    monkeypatch.setattr(timing, "load_average", lambda: 3.14)
    common.warn_if_busy(err, [])
    assert err.getvalue().splitlines() == [
        "mindiesd bench: flux/tiny: timings spread 35% around the median; the timings and their ratios may be "
        "unreliable",
        "mindiesd bench: load average 3.1 on 2 cores; the timings and their ratios may be unreliable",
    ]


def test_bench_uses_the_shared_timing_loop():
    assert models.interleaved_medians is timing.interleaved_medians
    assert op_bench.interleaved_medians is timing.interleaved_medians


def test_cli_bench_ops_parses_its_own_options():
    args = build_parser().parse_args(["bench", "ops", "--quick", "--device", "cpu", "--ops", "rope"])
    assert args.handler is op_bench.run and args.quick and args.ops == "rope" and args.device == "cpu"
    args = build_parser().parse_args(["bench", "ops"])
    assert (args.dtype, args.reps, args.rounds, args.no_inductor, args.markdown) == (None, 20, None, False, False)
    assert build_parser().parse_args(["bench"]).handler is models.run


def test_bench_ops_cases_agree_with_eager():
    names = list(op_bench.OP_NAMES)
    cases = op_bench.build_cases(torch.float32, names, variants=True)
    assert [c.op for c in op_bench.build_cases(torch.float32, names)] == names
    assert {c.op for c in cases} >= {"rope:rotate_half", "rope:general_tables", "adalayernorm:1d_mod",
                                     "fast_gelu:formula", "mul_add:full_y", "glu:gelu", "glu:two_tensors",
                                     "glu:gelu_tanh"}
    with torch.no_grad():
        for case in cases:
            assert op_bench.check_agreement(case) < 1e-4, case.op


def test_cli_bench_ops_quick_prints_its_table():
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(
        ["bench", "ops", "--quick", "--ops", "fast_gelu,mul_add", "--reps", "2", "--prefault-mib", "0"]
    )
    assert op_bench.run(args, stdout=out, stderr=err) == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    assert "inductor ms" not in lines[header] and "eager/kernel" in lines[header] and "spread" in lines[header]
    rows = [line.split()[0] for line in lines[header + 1:]]
    assert rows == ["fast_gelu", "fast_gelu:formula", "mul_add", "mul_add:full_y"]
    args = build_parser().parse_args(["bench", "ops", "--ops", "conv"])
    assert op_bench.run(args, stdout=io.StringIO(), stderr=err) == 2 and "unknown op" in err.getvalue()


def test_progress_plain_lines():
    stream = io.StringIO()
    with common.Progress(stream, live=False).step("compiling x/tiny with mindiesd"):
        pass
    lines = stream.getvalue().splitlines()
    assert lines[0] == "compiling x/tiny with mindiesd ..."
    assert lines[1].strip().startswith("done in")


def test_progress_live_ticker_ends_with_elapsed():
    stream = io.StringIO()
    with pytest.raises(RuntimeError, match="^boom$"):  # the step's own error, not wrapped
        with common.Progress(stream, live=True, interval=0.01).step("compiling"):
            raise RuntimeError("boom")
    assert stream.getvalue().endswith("s\n")
    assert "failed after" in stream.getvalue()


@dataclass
class _Report:
    matches: dict = field(default_factory=dict)
    graphs: int = 0
    compile_seconds: float = 0.0


class _PassThroughBackend:
    """A backend that runs the captured graph unchanged and reports no fusions."""

    def __init__(self):
        self._report = _Report()

    def __call__(self, gm, example_inputs):
        self._report.graphs += 1
        return gm.forward

    def report(self):
        return self._report


def _assert_complete_row(row, backend, vs_inductor=False):
    columns = models.BASE_COLUMNS + (models.INDUCTOR_COLUMNS if vs_inductor else ())
    missing = [c for c in columns if c not in row]
    assert not missing, missing
    matches = backend.report().matches
    assert {f: row[f] for f in common.FAMILIES} == {f: matches.get(f, 0) for f in common.FAMILIES}
    assert all(type(row[f]) is int for f in common.FAMILIES)
    assert row["compile_s"] > 0 and row["eager_ms"] > 0 and row["mindiesd_ms"] > 0
    assert row["speedup"] == pytest.approx(row["eager_ms"] / row["mindiesd_ms"])


def test_run_case_and_table_with_a_pass_through_backend():
    case = zoo.build("wan")
    backend = _PassThroughBackend()
    row = models.run_case(case, iters=2, warmup=0, backend=backend, progress=common.QuietProgress())
    _assert_complete_row(row, backend)
    assert all(row[f] == 0 for f in common.FAMILIES)
    assert row["max_rel_err"] == 0.0 and row["graphs"] >= 1
    table = models.format_table([row])
    header, rule, body = table.splitlines()
    assert header.split()[:3] == ["model", "size", "dtype"] and body.split()[:3] == ["wan", "tiny", "fp32"]
    assert len(header) == len(rule)
    markdown = models.format_table([row], markdown=True).splitlines()
    assert all(line.startswith("|") and line.endswith("|") for line in markdown)


def test_cli_bench_prints_table_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "make_backend", lambda *args, **settings: _PassThroughBackend())
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "rows.json"
    args = build_parser().parse_args(
        ["bench", "--model", "sd3", "--iters", "1", "--warmup", "0", "--json", str(path)]
    )
    assert models.run(args, stdout=out, stderr=err) == 0
    assert out.getvalue().splitlines()[2].split()[:3] == ["sd3", "tiny", "fp32"]
    assert "compiling sd3/tiny with mindiesd ..." in err.getvalue()
    saved = json.loads(path.read_text())
    assert saved["rows"][0]["model"] == "sd3" and saved["environment"]["torch"] == torch.__version__


def test_run_case_flux_with_the_mindiesd_backend():
    try:
        from mindiesd.compilation import MindieSDBackend
    except ImportError as exc:
        pytest.skip(f"mindiesd.compilation is not importable yet: {exc}")
    case = zoo.build("flux", "tiny", dtype=torch.float32)
    backend = MindieSDBackend()
    row = models.run_case(case, iters=2, warmup=0, backend=backend, progress=common.QuietProgress())
    _assert_complete_row(row, backend)
    expected = case.expected()
    assert all(row[f] == expected[f] for f in SPEC_FAMILIES), (row, expected)
    # tiny Flux has sites of every family but glu; norm_rope joins all of its RMSNorms and RoPEs
    assert {f for f in SPEC_FAMILIES if row[f] == 0} == {"glu", "rms_norm", "rope"}, row
    # of the GEMM rewrites only cat_linear is on on CPU by default: each single block's proj_out(cat([attn, mlp]))
    assert row["cat_linear"] == len(case.model.single_transformer_blocks), row
    assert all(row[f] == 0 for f in GEMM_FAMILIES if f != "cat_linear"), "the other GEMM rewrites are off on CPU"
    assert row["graphs"] >= 1
    assert row["max_rel_err"] < 1e-4


def test_run_case_keeps_its_row_when_inductor_fails(monkeypatch):
    real_compile = torch.compile

    def compile_without_inductor(model, backend="inductor", **kwargs):
        if backend == "inductor":
            def broken(*args, **kw):
                raise RuntimeError("no C++ compiler")

            return broken
        return real_compile(model, backend=backend, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_without_inductor)
    progress = common.Progress(io.StringIO(), live=False)
    backend = _PassThroughBackend()
    row = models.run_case(
        zoo.build("wan"), iters=1, warmup=0, vs_inductor=True, backend=backend, progress=progress
    )
    _assert_complete_row(row, backend, vs_inductor=True)
    assert row["inductor_ms"] is None and row["speed_vs_inductor"] is None
    assert "inductor failed on wan/tiny" in progress.stream.getvalue()
    assert "-" in models.format_table([row]).splitlines()[2].split()


def test_cli_bench_second_run_loads_from_the_cache_dir(tmp_path):
    """Two runs on one cache folder: the first compiles and stores, the second loads, with the same fusions."""
    rows = []
    for _ in range(2):
        path = tmp_path / f"run{len(rows)}.json"
        args = build_parser().parse_args(["bench", "--model", "wan", "--iters", "1", "--warmup", "0", "--quiet",
                                          "--cache-dir", str(tmp_path / "cache"), "--json", str(path)])
        assert models.run(args, stdout=io.StringIO(), stderr=io.StringIO()) == 0
        rows.append(json.loads(path.read_text())["rows"][0])
    first, second = rows
    assert (first["cache"], second["cache"]) == ("stored", "hit")
    assert {f: second[f] for f in common.FAMILIES} == {f: first[f] for f in common.FAMILIES}
    assert sum(first[f] for f in common.FAMILIES) > 0
    assert 0 < second["backend_s"] < first["backend_s"]
    assert second["max_rel_err"] < 1e-5


@pytest.mark.parametrize("regional", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["whole", "regional"])
def test_cli_bench_aot_stores_then_loads_the_artifact(tmp_path, regional):
    """--aot: the first run compiles and stores the artifact, the second loads it (no backend work), with the
    counts the artifact recorded."""
    rows = []
    for _ in range(2):
        path = tmp_path / f"run{len(rows)}.json"
        args = build_parser().parse_args(["bench", "--model", "flux", "--iters", "1", "--warmup", "0", "--quiet",
                                          "--aot", "--cache-dir", str(tmp_path / "cache"), "--json", str(path)]
                                         + ["--regional"] * regional)
        assert models.run(args, stdout=io.StringIO(), stderr=io.StringIO()) == 0
        rows.append(json.loads(path.read_text())["rows"][0])
    first, second = rows
    assert (first["cache"], second["cache"]) == ("aot stored", "aot hit")
    assert {f: second[f] for f in common.FAMILIES} == {f: first[f] for f in common.FAMILIES}
    assert first["rms_norm"] == zoo.build("flux", "tiny").expected()["rms_norm"] and first["fallbacks"] == 0
    assert second["backend_s"] == 0 and second["compile_s"] < first["compile_s"]
    assert second["max_rel_err"] < 1e-5
    if regional:
        assert (first["regional_cache"], second["regional_cache"]) == ("aot stored", "aot hit")
        assert first["regional_graphs"] == second["regional_graphs"] == 3


def test_cli_bench_cold_uses_an_empty_cache_and_excludes_cache_dir(tmp_path, monkeypatch, capsys):
    from mindiesd.compilation import CompilationConfig

    monkeypatch.setattr(CompilationConfig, "cache_dir", str(tmp_path / "user"))  # the user's cache: left alone
    out = io.StringIO()
    args = build_parser().parse_args(["bench", "--model", "wan", "--iters", "1", "--warmup", "0", "--quiet", "--cold"])
    assert models.run(args, stdout=out, stderr=io.StringIO()) == 0
    header, _, row = out.getvalue().splitlines()[:3]
    assert row.split()[header.split().index("cache")] == "stored"
    assert not (tmp_path / "user").exists(), "--cold must leave the user's cache alone"
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--cold", "--cache-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--cache-dir: not allowed with argument --cold" in capsys.readouterr().err


def test_cli_bench_regional_reports_the_repeated_blocks_compile_beside_the_whole_model(tmp_path):
    path = tmp_path / "rows.json"
    out = io.StringIO()
    args = build_parser().parse_args(["bench", "--model", "wan", "--iters", "1", "--warmup", "0", "--quiet",
                                      "--cache-dir", "off", "--regional", "--json", str(path)])
    assert models.run(args, stdout=out, stderr=io.StringIO()) == 0
    row = json.loads(path.read_text())["rows"][0]
    assert all(row[c] is not None for c in models.REGIONAL_COLUMNS), row
    # tiny Wan: one block class; outside the blocks only norm_out's modulation and the text embedder's GELU fuse
    # (and the patch embedding's convolution runs on oneDNN: conv_channels_last, a rewrite without an op of its own)
    assert row["regional_graphs"] == 1 and row["regional_fused"] == row["fused"] - 2 and row["conv_channels_last"] == 1
    from mindiesd.compilation.families import FAMILIES

    assert row["fused"] == sum(row[f] for f in common.FAMILIES if FAMILIES[f].op is not None)
    assert row["regional_max_rel_err"] < 1e-5 and row["regional_compile_s"] > 0 and row["regional_ms"] > 0
    assert "reg_compile_s" in out.getvalue().splitlines()[0]


@pytest.mark.slow
def test_bench_force_and_ablate_measure_each_gemm_rewrite(tmp_path):
    """--force runs a rewrite declared not faster on the device; --ablate times a copy with each one off."""
    from mindiesd.compilation.families import skip_reason

    path = tmp_path / "rows.json"
    args = build_parser().parse_args(["bench", "--model", "flux", "--force", "merge_projections", "--force",
                                      "linear_gelu", "--force", "cat_linear", "--ablate", "--iters", "2", "--warmup", "0", "--cache-dir",
                                      "off", "--json", str(path), "--quiet"])
    out = io.StringIO()
    assert models.run(args, stdout=out, stderr=io.StringIO()) == 0
    (row,) = json.loads(path.read_text())["rows"]
    # tiny Flux: 8 merged groups, 4 GELUs after a linear layer, and the 4 single blocks' proj_out(cat([attn, mlp]))
    assert row["merge_projections"] == 8 and row["linear_gelu"] == 4 and row["cat_linear"] == 4
    assert row["fallbacks"] == 0
    assert row["max_rel_err"] <= 1e-5
    assert all(type(row[f"gain_{f}"]) is float and row[f"gain_{f}"] > 0 for f in GEMM_FAMILIES)
    assert all(name in out.getvalue() for name in ("merge_gain", "lin_gelu_gain", "cat_lin_gain"))
    assert skip_reason("merge_projections", "cpu") is not None  # the declaration itself is unchanged


def test_bench_force_refuses_a_family_without_a_kernel_on_the_device():
    args = build_parser().parse_args(["bench", "--force", "linear_gelu", "--device", "npu"])
    err = io.StringIO()
    assert models.run(args, stdout=io.StringIO(), stderr=err) == 2
    assert "declares no kernel for 'npu'" in err.getvalue()


@pytest.mark.parametrize("argv, mode, names", [
    (["bench"], "model", {"model": "flux"}),
    (["bench", "--model", "all"], "model", {"model": "all"}),
    (["bench", "--model", "flux", "--size", "mid", "--vs", "inductor"], "model", {"size": "mid", "vs": ["inductor"]}),
    (["bench", "--pipeline", "wan", "--steps", "3"], "pipeline", {"pipeline": "wan", "steps": 3}),
    (["bench", "--size", "mid", "--pipeline=sd3"], "pipeline", {"pipeline": "sd3", "size": "mid"}),
    (["bench", "--model", "flux", "--world-size", "2"], "distributed", {"world_size": 2, "model": "flux"}),
    (["bench", "ops", "--quick"], "ops", {"quick": True}),
])
def test_the_earlier_command_lines_name_their_mode(argv, mode, names):
    from mindiesd.benchmarks import cli

    args = build_parser().parse_args(argv)
    assert args.handler is cli.MODES[mode][0].run and args.bench_command == mode
    assert {name: getattr(args, name) for name in names} == names


@pytest.mark.parametrize("argv, unknown", [
    (["bench", "ops", "--model", "flux"], "--model"),
    (["bench", "pipeline", "flux", "--vs", "inductor"], "--vs"),
    (["bench", "distributed", "--cache-dir", "off"], "--cache-dir"),
    (["bench", "model", "--steps", "3"], "--steps"),
])
def test_each_mode_refuses_the_options_of_the_others(argv, unknown, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2 and f"unrecognized arguments: {unknown}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--modle", "flux"], "unrecognized arguments: --modle flux; did you mean --model?"),
    (["bench", "host", "--szie=host"], "unrecognized arguments: --szie=host; did you mean --size?"),
    (["bench", "--modle", "flux", "--wramup", "1"],
     "unrecognized arguments: --modle flux --wramup 1; did you mean --model for --modle, --warmup for --wramup?"),
    (["bench", "ops", "--model", "flux"], "unrecognized arguments: --model flux\n"),  # no close option: no hint
])
def test_a_mistyped_option_gets_the_options_it_may_mean(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err
    assert err.startswith(f"usage: mindiesd bench {'ops' if 'ops' in argv else 'host' if 'host' in argv else 'model'}")


def test_the_product_never_imports_the_benchmarks_and_the_modes_import_down_only():
    import ast
    from pathlib import Path

    import mindiesd

    package = Path(mindiesd.__file__).parent

    def imports(path, level=None):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and level in (None, node.level):
                found |= {node.module} if node.module else {alias.name for alias in node.names}
            elif isinstance(node, ast.Import) and level is None:
                found |= {alias.name for alias in node.names}
        return found

    for path in [*package.glob("compilation/**/*.py"), *package.glob("ops/**/*.py")]:
        assert not any("benchmarks" in name for name in imports(path)), path
    floors = {"cli": 4, "models": 3, "ops": 3, "pipeline": 3, "distributed": 3, "host": 3, "sweep": 3, "vae": 3,
              "table": 2, "common": 1, "timing": 0, "quant": 0, "environment": 0}
    for name, floor in floors.items():
        below = imports(package / "benchmarks" / f"{name}.py", level=1)
        assert below <= set(floors) and all(floors[module] < floor for module in below), (name, below)


def test_wide_flux_has_flux_1s_width_and_a_1024px_images_tokens():
    """The registry's real-size Flux: FLUX.1's layer shapes (built on the meta device here: about 1.02 G
    parameters), a 1024x1024 image's 4096 latent tokens and 512 text tokens."""
    from diffusers import FluxTransformer2DModel

    config = zoo.config_for("flux", "wide")
    spec = zoo.entry("flux").sizes["wide"]
    assert config["num_attention_heads"] * config["attention_head_dim"] == 3072
    assert config["joint_attention_dim"] == 4096 and tuple(config["axes_dims_rope"]) == (16, 56, 56)
    assert sum(config["axes_dims_rope"]) == config["attention_head_dim"]
    assert spec.shapes["grid"][0] * spec.shapes["grid"][1] == 4096 and spec.shapes["text_tokens"] == 512
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    block = model.transformer_blocks[0]
    assert block.attn.to_q.weight.shape == (3072, 3072) and block.ff.net[2].weight.shape == (3072, 12288)
    assert 1.0e9 < sum(p.numel() for p in model.parameters()) < 1.03e9
    assert zoo.names(size="wide") == ("flux",)


def test_bench_vae_decodes_fused_and_close_to_eager(monkeypatch):
    from mindiesd.benchmarks import vae

    pytest.importorskip("diffusers")
    # the kl VAE at two levels and an 8 x 8 latent: the mode's rows, not its figures
    cls, config, _ = vae.VAES["kl"]
    small = dict(config, block_out_channels=(32, 32), down_block_types=config["down_block_types"][:2],
                 up_block_types=config["up_block_types"][:2])
    monkeypatch.setitem(vae.VAES, "kl", (cls, small, (1, 16, 8, 8)))
    args = build_parser().parse_args(["bench", "vae", "--vae", "kl", "--iters", "2", "--warmup", "0", "--quiet"])
    out = io.StringIO()
    assert vae.run(args, stdout=out, stderr=io.StringIO()) == 0
    text = out.getvalue()
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("kl ")}
    assert set(rows) == {"eager", "mindiesd"}, text
    # the decoder's 2 x 3 ResNet blocks (2 norms into a SiLU each) and conv_norm_out
    assert "group_norm_silu=13" in rows["mindiesd"], text
    assert float(rows["mindiesd"].split()[5]) < 1e-4, text  # the error column
