import pytest
import torch

from mindiesd.compilation import (
    CompilationConfig,
    FusionPatterns,
    MindieSDBackend,
    SettingTypeError,
    UnknownSettingError,
)

SPEC_DEFAULTS = {
    "aclgraph_only": False,
    "aclgraph_with_compile": False,
    "enable_freezing": True,
    "safe_output_mode": True,
    "graph_log_url": None,
}
SPEC_SWITCHES = ["enable_rms_norm", "enable_rope", "enable_norm_rope", "enable_adalayernorm", "enable_glu",
                 "enable_fast_gelu", "enable_mul_add"]


def test_spec_defaults_at_class_level():
    for name, default in SPEC_DEFAULTS.items():
        assert getattr(CompilationConfig, name) == default
    for name in SPEC_SWITCHES:
        assert getattr(CompilationConfig.fusion_patterns, name) is True
    assert CompilationConfig.strict is False


def test_class_level_assignment_as_in_the_spec():
    CompilationConfig.fusion_patterns.enable_rope = False
    CompilationConfig.aclgraph_with_compile = True
    assert CompilationConfig.fusion_patterns.enable_rope is False
    assert CompilationConfig.aclgraph_with_compile is True
    snap = CompilationConfig.snapshot()
    assert snap.fusion_patterns.enable_rope is False and snap.aclgraph_with_compile is True


@pytest.mark.parametrize("target", ["class", "fusion", "instance"])
def test_misspelled_setting_lists_valid_names(target):
    with pytest.raises(UnknownSettingError, match="has no setting") as info:
        if target == "class":
            CompilationConfig.enable_freezeing = False
        elif target == "fusion":
            CompilationConfig.fusion_patterns.enable_rmsnorm = False
        else:
            CompilationConfig().aclgraph = True
    message = str(info.value)
    assert "Valid settings" in message
    if target == "fusion":
        assert "enable_rms_norm" in message and "Did you mean 'enable_rms_norm'" in message
    else:
        assert "enable_freezing" in message


def test_reading_unknown_setting_raises():
    with pytest.raises(UnknownSettingError, match="fusion_patterns has no setting 'enable_gelu'"):
        CompilationConfig.fusion_patterns.enable_gelu
    with pytest.raises(UnknownSettingError, match="CompilationConfig has no setting 'no_such_setting'"):
        CompilationConfig().no_such_setting
    # an AttributeError too, so the usual probe with a default keeps working
    assert getattr(CompilationConfig(), "no_such_setting", "fallback") == "fallback"


@pytest.mark.parametrize("name,value", [("aclgraph_only", 1), ("enable_freezing", "yes"), ("graph_log_url", 3)])
def test_wrong_type_raises(name, value):
    with pytest.raises(SettingTypeError, match=name):
        setattr(CompilationConfig, name, value)
    with pytest.raises(SettingTypeError, match=f"CompilationConfig.{name} must be"):
        CompilationConfig(**{name: value})


def test_wrong_type_for_fusion_switch():
    with pytest.raises(SettingTypeError, match="enable_rope"):
        CompilationConfig.fusion_patterns.enable_rope = 0


def test_backend_snapshot_is_isolated_from_later_changes():
    backend = MindieSDBackend()
    CompilationConfig.fusion_patterns.enable_rms_norm = False
    CompilationConfig.enable_freezing = False
    assert backend.config.fusion_patterns.enable_rms_norm is True
    assert backend.config.enable_freezing is True
    later = MindieSDBackend()
    assert later.config.fusion_patterns.enable_rms_norm is False


def test_per_backend_config_leaves_globals_alone():
    cfg = CompilationConfig(enable_freezing=False, fusion_patterns={"enable_mul_add": False})
    backend = MindieSDBackend(config=cfg)
    assert backend.config.enable_freezing is False
    assert backend.config.fusion_patterns.enable_mul_add is False
    assert CompilationConfig.enable_freezing is True
    assert CompilationConfig.fusion_patterns.enable_mul_add is True
    cfg.enable_freezing = True  # the backend copied it
    assert backend.config.enable_freezing is False


def test_reset_restores_defaults():
    CompilationConfig.aclgraph_only = True
    CompilationConfig.fusion_patterns.enable_fast_gelu = False
    CompilationConfig.graph_log_url = "/tmp/x"
    CompilationConfig.reset()
    assert CompilationConfig.aclgraph_only is False
    assert CompilationConfig.fusion_patterns.enable_fast_gelu is True
    assert CompilationConfig.graph_log_url is None


def test_priority_rule_aclgraph_with_compile_wins():
    assert CompilationConfig(aclgraph_only=True).fuse is False
    both = CompilationConfig(aclgraph_only=True, aclgraph_with_compile=True)
    assert both.fuse is True and both.capture is True
    assert CompilationConfig().capture is False


def test_backend_rejects_non_config():
    with pytest.raises(TypeError, match="config must be a CompilationConfig, got dict"):
        MindieSDBackend(config={"enable_freezing": False})


def test_enabled_families_in_pass_order():
    fp = FusionPatterns(enable_rope=False)
    assert fp.enabled_families() == ("flex_attention", "upsample_nearest", "conv_channels_last", "merge_projections", "int8_linear", "dequant_linear", "rms_norm", "norm_rope",
                                     "adalayernorm", "group_norm_silu", "channel_rms_norm", "glu", "linear_gelu",
                                     "fast_gelu", "mul_add", "cat_linear")
    fp = FusionPatterns(enable_merge_projections=False, enable_int8_linear=False, enable_dequant_linear=False,
                        enable_linear_gelu=False, enable_cat_linear=False, enable_group_norm_silu=False,
                        enable_channel_rms_norm=False, enable_flex_attention=False,
                        enable_upsample_nearest=False, enable_conv_channels_last=False)
    assert fp.enabled_families() == ("rms_norm", "rope", "norm_rope", "adalayernorm", "glu", "fast_gelu", "mul_add")


def test_registered_by_name():
    from torch._dynamo.backends.registry import list_backends

    assert "mindiesd" in list_backends()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(approximate="tanh"))
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="mindiesd")(x), model(x))


def test_settings_table_lists_every_setting():
    names = [name for name, _, _ in CompilationConfig.settings()]
    assert set(SPEC_DEFAULTS) <= set(names)
    assert {f"fusion_patterns.{s}" for s in SPEC_SWITCHES} <= set(names)


def test_docs_settings_table_is_generated_from_the_declarations():
    from pathlib import Path

    from mindiesd.compilation.config import settings_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "settings.md").read_text()
    begin, end = "<!-- settings-table:begin -->\n", "<!-- settings-table:end -->"
    assert begin in text and end in text, "docs/settings.md lost its settings-table markers"
    documented = text.split(begin, 1)[1].split(end, 1)[0]
    assert documented == settings_table(), (
        "docs/settings.md's settings table is out of date: replace the lines between the markers with the output of "
        "python -c \"from mindiesd.compilation.config import settings_table; print(settings_table(), end='')\"")
    for name, _, _ in CompilationConfig.settings():
        assert f"| `{name}` |" in documented


def test_class_attributes_and_docstring_come_from_the_one_declaration():
    from mindiesd.compilation import config

    for name, field in config._FIELDS.items():
        assert f"``{name}``" in CompilationConfig.__doc__ and field.doc in CompilationConfig.__doc__
        if name != "fusion_patterns":
            assert getattr(CompilationConfig, name) == field.current_default()
    assert CompilationConfig.fusion_patterns == FusionPatterns()


def test_config_and_cache_do_not_import_each_other():
    import ast
    from pathlib import Path

    import mindiesd.compilation as compilation

    folder = Path(compilation.__file__).parent

    def imported(module):
        """Every dotted name a module imports, split into its parts (``from . import cache`` gives ``cache``)."""
        tree = ast.parse((folder / module).read_text())
        parts = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    parts.update(f"{getattr(node, 'module', None) or ''}.{alias.name}".split("."))
        return parts

    assert "cache" not in imported("config.py") and "config" not in imported("storage/cache.py")


# ---------------------------------------------------------------------------------------------- family registry
def test_switches_and_passes_come_from_the_family_registry():
    from mindiesd.compilation import families
    from mindiesd.compilation.config import FAMILY_SWITCHES
    from mindiesd.compilation.passes import PASSES
    from mindiesd.ops import registry

    assert list(families.FAMILIES) == list(PASSES) == list(FAMILY_SWITCHES)
    assert list(registry.SCHEMAS) == list(families.OP_FAMILIES) == [n for n in families.FAMILIES
                                                                           if n not in ("merge_projections", "flex_attention",
                                                                                        "upsample_nearest",
                                                                                        "conv_channels_last")]
    assert [families.FAMILIES[n].switch for n in families.SPEC_FAMILIES] == SPEC_SWITCHES
    assert families.GEMM_FAMILIES == ("merge_projections", "linear_gelu", "cat_linear")
    assert families.QUANTIZED_FAMILIES == ("int8_linear", "dequant_linear")
    settings = {name: (default, doc) for name, default, doc in CompilationConfig.settings()}
    for name, fam in families.FAMILIES.items():
        assert PASSES[name].family == name
        assert settings[f"fusion_patterns.{fam.switch}"] == (True, fam.doc)
        if fam.has_op:
            assert registry.SCHEMAS[name].startswith(f"{name}(")
            assert str(getattr(torch.ops.mindiesd, name).default._schema) == f"mindiesd::{fam.schema}"
        else:
            assert not hasattr(torch.ops.mindiesd, name) and fam.stage in ("lower", "freeze")
    assert families.ATTENTION_FAMILIES == ("flex_attention",)


def test_family_skipped_where_its_kernel_is_not_faster_than_eager(monkeypatch):
    from mindiesd.compilation.pass_manager import PassManager, skip_reason
    from mindiesd.ops import registry
    from mindiesd.ops.kernels import npu as _npu

    monkeypatch.setitem(registry.DEVICE_KERNELS, "npu", dict(_npu.KERNELS))
    manager = PassManager(list(FAMILY_SWITCHES_ORDER), "npu")
    assert sorted(manager.skipped) == ["adalayernorm", "fast_gelu", "mul_add"]
    assert "reference composition" in manager.skipped["adalayernorm"]
    assert [p.family for p in manager.passes] == ["rms_norm", "rope"]
    # a kernel the user registers in place of the declared one counts as fast
    monkeypatch.setitem(registry.DEVICE_KERNELS["npu"], "mul_add", lambda x, y, z: x * y + z)
    assert skip_reason("mul_add", "npu") is None
    monkeypatch.setitem(registry.DEVICE_KERNELS, "cuda", {})
    assert "not registered" in skip_reason("rope", "cuda")
    assert "no rope kernel for mps" in skip_reason("rope", "mps")
    assert all(skip_reason(name, "cpu") is None for name in FAMILY_SWITCHES_ORDER)


def test_force_counts_a_family_as_fast_only_where_it_declares_something(monkeypatch):
    from mindiesd.compilation.pass_manager import PassManager, skip_reason
    from mindiesd.ops import registry
    from mindiesd.ops.kernels import npu as _npu

    monkeypatch.setitem(registry.DEVICE_KERNELS, "npu", dict(_npu.KERNELS))
    manager = PassManager(list(FAMILY_SWITCHES_ORDER), "npu", force={"mul_add"})
    assert sorted(manager.skipped) == ["adalayernorm", "fast_gelu"]
    assert skip_reason("merge_projections", "cpu", force={"merge_projections"}) is None
    assert "no rope kernel for mps" in skip_reason("rope", "mps", force={"rope"})
    with pytest.raises(ValueError, match="unknown fusion families"):
        skip_reason("rope", "cpu", force={"no_such_family"})


def test_ops_never_import_compilation():
    import ast
    import pathlib

    import mindiesd.ops

    root = pathlib.Path(mindiesd.ops.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert "compilation" not in name and "bench" not in name, f"{path.relative_to(root)} imports {name}"


def test_compile_report_names_the_families_skipped_on_the_device(monkeypatch):
    import torch.nn.functional as F

    from mindiesd.compilation import MindieSDBackend
    from mindiesd.ops.defs import FAST_GELU
    from mindiesd.ops.registry import DeviceKernel

    slow = DeviceKernel(fast=False, note="too slow", fns=(_cpu_composition("fast_gelu"),))
    monkeypatch.setitem(FAST_GELU.kernels, "cpu", slow)
    monkeypatch.setitem(_cpu_registry(), "fast_gelu", _cpu_composition("fast_gelu"))
    backend = MindieSDBackend(keep_graphs=True)
    compiled = torch.compile(lambda x: F.gelu(F.rms_norm(x, [8]), approximate="tanh"), backend=backend)
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x), F.gelu(F.rms_norm(x, [8]), approximate="tanh"))
    (record,) = backend.report().records
    assert record.skipped["fast_gelu"] == "the cpu kernel is too slow"
    assert set(record.skipped) == {"fast_gelu", "merge_projections", "linear_gelu"}  # GEMM: CPU default
    assert record.matches == {"int8_linear": 0, "dequant_linear": 0, "rms_norm": 1, "rope": 0, "norm_rope": 0, "adalayernorm": 0,
                              "group_norm_silu": 0, "channel_rms_norm": 0, "glu": 0, "mul_add": 0, "cat_linear": 0,
                              "flex_attention": 0, "upsample_nearest": 0, "conv_channels_last": 0}
    assert record.fallback is None


FAMILY_SWITCHES_ORDER = ("rms_norm", "rope", "adalayernorm", "fast_gelu", "mul_add")


def _cpu_registry():
    from mindiesd.ops import registry

    return registry.DEVICE_KERNELS["cpu"]


def _cpu_composition(name):
    from mindiesd.ops.kernels import cpu as _cpu

    return _cpu.KERNELS[name]
