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
SPEC_SWITCHES = ["enable_rms_norm", "enable_rope", "enable_adalayernorm", "enable_fast_gelu", "enable_mul_add"]


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
    with pytest.raises(UnknownSettingError) as info:
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
    with pytest.raises(AttributeError):
        CompilationConfig.fusion_patterns.enable_gelu
    with pytest.raises(AttributeError):
        CompilationConfig().no_such_setting


@pytest.mark.parametrize("name,value", [("aclgraph_only", 1), ("enable_freezing", "yes"), ("graph_log_url", 3)])
def test_wrong_type_raises(name, value):
    with pytest.raises(SettingTypeError, match=name):
        setattr(CompilationConfig, name, value)
    with pytest.raises(SettingTypeError):
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
    with pytest.raises(TypeError):
        MindieSDBackend(config={"enable_freezing": False})


def test_enabled_families_in_pass_order():
    fp = FusionPatterns(enable_rope=False)
    assert fp.enabled_families() == ("rms_norm", "adalayernorm", "fast_gelu", "mul_add")


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
