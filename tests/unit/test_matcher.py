"""The matcher and the rewrite loop: rules indexed by root target, checks apart from builders, per-rule counts,
why a candidate did not fuse, and matched nodes erased by the rewrite itself."""

import logging

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import aten_graph, only, run_compiled
from mindiesd.compilation.passes.matcher import Alt, Lit, Op, Var, explain, match
from mindiesd.compilation.passes import PASSES
from mindiesd.compilation.passes.base import FusionPass, Rule

aten = torch.ops.aten


def nodes_of(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def test_rules_are_tried_only_on_nodes_their_root_can_be():
    gm = aten_graph(lambda x, w: F.rms_norm(x, [8], w) + 1.0, torch.randn(2, 8), torch.randn(8))
    rms = PASSES["rms_norm"]()
    (mul,) = [n for n in nodes_of(gm, aten.mul.Tensor) if any(u.target == aten.add.Tensor for u in n.users)]
    assert [r.name for r in rms.rules_for(mul)] == ["weighted", "unweighted"]
    (add,) = [n for n in gm.graph.nodes if n.target == aten.add.Tensor and n.args[1] == 1.0]
    assert rms.rules_for(add) == (), "an add can never be the root of an rms_norm form"
    rope = PASSES["rope"]()
    assert all(r.pattern.roots() for r in rope.rules), "every rule of rope says what its root is"


def test_alt_takes_the_first_branch_that_matches():
    gm = aten_graph(lambda x: x * 2.0, torch.randn(3))
    (mul,) = nodes_of(gm, aten.mul.Tensor)
    m = match(Alt(Op(aten.mul.Tensor, Var("a"), Lit("k")), Op(aten.mul.Tensor, Var("b"), Var("c"))), mul)
    assert set(m.bindings) == {"a", "k"} and m["k"] == 2.0


def test_explain_names_the_sub_pattern_that_failed():
    gm = aten_graph(lambda x: F.gelu(x), torch.randn(3))  # exact GELU, not the tanh form
    (gelu,) = nodes_of(gm, aten.gelu.default)
    tanh_rule = PASSES["fast_gelu"].rules[0]
    reason = explain(tanh_rule.pattern, gelu)
    assert reason is not None and "aten.gelu.default" in reason and "approximate" in reason
    ok = aten_graph(lambda x: F.gelu(x, approximate="tanh"), torch.randn(3))
    assert explain(tanh_rule.pattern, nodes_of(ok, aten.gelu.default)[0]) is None


def test_a_check_rejects_what_the_pattern_cannot_express_and_says_why(caplog):
    x, w = torch.randn(4, 8), torch.randn(8)

    def over_rows(x):  # the mean over dim 0: an RMSNorm shape, but not along the last dimension
        return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w[:4, None]

    with caplog.at_level(logging.DEBUG, logger="mindiesd.compilation.explain"):
        out, ref, counts, _ = run_compiled(over_rows, x)
    assert counts == only("rms_norm", 0)
    torch.testing.assert_close(out, ref)
    assert any("rms_norm:weighted not fused" in r.getMessage() and "not the last dimension alone" in r.getMessage()
               for r in caplog.records)


def test_the_explain_log_is_silent_unless_asked(caplog):
    with caplog.at_level(logging.INFO, logger="mindiesd.compilation.explain"):
        run_compiled(lambda x: F.gelu(x), torch.randn(3))
    assert not [r for r in caplog.records if r.name == "mindiesd.compilation.explain"]


def test_report_counts_rewrites_per_rule():
    def two_forms(x, w):
        a = F.rms_norm(x, [16], w)  # weighted
        b = F.rms_norm(x, [16])  # unweighted
        return F.gelu(a, approximate="tanh") + 0.5 * b * (1 + torch.tanh(0.7978845608 * (b + 0.044715 * b**3)))

    out, ref, counts, backend = run_compiled(two_forms, torch.randn(3, 16), torch.randn(16))
    assert counts["rms_norm"] == 2 and counts["fast_gelu"] == 2
    (record,) = backend.report().records
    assert record.rules == {"rms_norm:weighted": 1, "rms_norm:unweighted": 1, "fast_gelu:aten_gelu_tanh": 1,
                            "fast_gelu:explicit_formula": 1}
    assert backend.report().rule_hits == record.rules
    assert sum(v for k, v in record.rules.items() if k.startswith("rms_norm:")) == record.matches["rms_norm"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_rewrite_erases_what_it_replaced_without_a_dead_code_pass(monkeypatch):
    gm = aten_graph(lambda x, w: F.gelu(F.rms_norm(x, [8], w), approximate="tanh"), torch.randn(2, 8), torch.randn(8))
    monkeypatch.setattr(torch.fx.Graph, "eliminate_dead_code", lambda self, *a, **k: pytest.fail("DCE was run"))
    for family in ("rms_norm", "fast_gelu"):
        assert PASSES[family]()(gm) == 1
    dead = [n for n in gm.graph.nodes if n.op == "call_function" and not n.users]
    assert dead == [], f"left for dead: {[n.format_node() for n in dead]}"
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert targets == {torch.ops.mindiesd.rms_norm.default, torch.ops.mindiesd.fast_gelu.default}


def test_rule_without_check_accepts_every_match():
    class Doubling(FusionPass):
        family = "fast_gelu"
        rules = (Rule("double", Op(aten.mul.Tensor, Var("x"), Lit(check=lambda v: v == 2.0)),
                      lambda m, root, emit: emit(aten.add.Tensor, m["x"], m["x"])),)

    gm = aten_graph(lambda x: x * 2.0, torch.randn(3))
    p = Doubling()
    assert p(gm) == 1 and p.hits == {"double": 1}
    x = torch.randn(3)
    torch.testing.assert_close(gm(x)[0], x + x)
