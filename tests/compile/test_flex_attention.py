"""flex_attention lowered (family ``flex_attention``): a call that is plain attention (diffusers' ``flex`` backend
without a mask, flex's default block mask, grouped-query heads) becomes ``aten.scaled_dot_product_attention``; any
other (a mask function, a score function, a read log-sum-exp) becomes a region that Inductor compiles with its flex
lowering. Either way no flex_attention call is left on its unfused path (but one whose log-sum-exp is read on the
CPU, which Inductor's CPU lowering does not give: the report says why), the output equals eager's, the other families
still fuse, and the switch leaves the call as it was."""

import pytest
import torch
from torch.fx import Graph
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from fusion_utils import assert_close
from mindiesd import zoo
from mindiesd.compilation import CompilationConfig, MindieSDBackend, MindieSDFallbackWarning
from mindiesd.compilation.passes.flex_attention import FLEX_ATTENTION, FlexRegion, _covers_all_blocks

pytestmark = [pytest.mark.filterwarnings("error::mindiesd.compilation.MindieSDFallbackWarning"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

aten = torch.ops.aten


def _targets(backend):
    return [n.target for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function"]


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_diffusers_flex_backend_becomes_sdpa():
    case = zoo.build("flux", "tiny")
    case.model.set_attention_backend("flex")
    with torch.no_grad():
        expected = case.model(**case.inputs)[0]
    backend = MindieSDBackend(CompilationConfig(strict=True), keep_graphs=True)
    with torch.no_grad():
        actual = torch.compile(case.model, backend=backend)(**case.inputs)[0]
    blocks = case.model.config.num_layers + case.model.config.num_single_layers
    targets = _targets(backend)
    assert targets.count(aten.scaled_dot_product_attention.default) == blocks
    assert FLEX_ATTENTION not in targets
    report = backend.report()
    assert report.rule_hits.get("flex_attention:sdpa") == blocks
    assert report.matches["norm_rope"] > 0 and report.matches["adalayernorm"] > 0  # the rest still fuses
    assert_close(actual, expected, torch.float32)


def _plain(q, k, v):
    return flex_attention(q * 2.0, k, v) + 1.0


def _gqa(q, k, v):
    return flex_attention(q, k, v, enable_gqa=True, scale=0.3)


def _lse(q, k, v):
    out, lse = flex_attention(q, k, v, return_lse=True)
    return out * lse.unsqueeze(-1).sigmoid()


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _masked(q, k, v):  # a block mask built in the graph, and a score function reading a tensor
    mask = create_block_mask(_causal, None, None, q.shape[-2], k.shape[-2], device=q.device)
    bias = torch.linspace(-1.0, 1.0, q.shape[1], device=q.device)
    return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h], block_mask=mask)


def _score_only(q, k, v):  # diffusers' flex backend with a float mask: a score function, flex's default block mask
    bias = torch.linspace(-1.0, 1.0, k.shape[-2], device=q.device)
    return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[ki])


@pytest.mark.parametrize("fn,heads,rule,dtype", [
    (_plain, (2, 2), "sdpa", torch.float32),
    (_plain, (2, 2), "sdpa", torch.bfloat16),
    (_gqa, (4, 2), "sdpa", torch.float32),
    (_lse, (2, 2), None, torch.float32),  # Inductor's CPU flex lowering gives no log-sum-exp: left as traced
    (_masked, (2, 2), "inductor", torch.float32),
], ids=["plain", "plain_bf16", "gqa", "lse_read", "mask_and_score"])
def test_flex_forms(fn, heads, rule, dtype):
    q = _randn(1, heads[0], 136, 16, dtype=dtype)  # 136: two blocks of 128, the second partial
    k, v = (_randn(1, heads[1], 136, 16, dtype=dtype, seed=s) for s in (1, 2))
    backend = MindieSDBackend(CompilationConfig(strict=True), keep_graphs=True)
    with torch.no_grad():
        actual = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v)
        expected = fn(q, k, v)
    record = backend.report().records[0]
    assert backend.report().rule_hits == ({f"flex_attention:{rule}": 1} if rule else {})
    targets = _targets(backend)
    assert (FLEX_ATTENTION in targets) == (rule is None)
    if rule is None:
        assert "log-sum-exp" in record.skipped["flex_attention"]
    assert sum(isinstance(t, FlexRegion) for t in targets) == (rule == "inductor")
    if rule == "inductor":
        assert record.cache.startswith(("off", "not cached: a flex_attention region"))
    assert_close(actual, expected, dtype)


def test_symbolic_lengths_with_the_default_mask_become_sdpa():
    backend = MindieSDBackend(CompilationConfig(strict=True), keep_graphs=True)
    compiled = torch.compile(_plain, backend=backend, fullgraph=True, dynamic=True)
    for length in (40, 72):
        q, k, v = (_randn(1, 2, length, 16, seed=s) for s in range(3))
        with torch.no_grad():
            assert_close(compiled(q, k, v), _plain(q, k, v), torch.float32)
    assert backend.report().graphs == 1 and backend.report().rule_hits == {"flex_attention:sdpa": 1}
    assert FLEX_ATTENTION not in _targets(backend)


@pytest.mark.filterwarnings("default::mindiesd.compilation.MindieSDFallbackWarning")
def test_a_region_inductor_cannot_lower_runs_the_reference_with_a_warning():
    # a score function over flex's default mask: Inductor's CPU lowering cannot take its mask function
    q, k, v = (_randn(1, 2, 136, 16, seed=s) for s in range(3))
    backend = MindieSDBackend(CompilationConfig(strict=True), keep_graphs=True)
    compiled = torch.compile(_score_only, backend=backend, fullgraph=True)
    with torch.no_grad(), pytest.warns(MindieSDFallbackWarning, match="Inductor cannot lower flex_attention"):
        actual = compiled(q, k, v)
    with torch.no_grad():
        again = compiled(q, k, v)
    assert backend.report().rule_hits == {"flex_attention:inductor": 1}
    assert_close(actual, _score_only(q, k, v), torch.float32)
    assert_close(again, actual, torch.float32)


def test_switch_off_leaves_the_call():
    q, k, v = (_randn(1, 2, 40, 16, seed=s) for s in range(3))
    backend = MindieSDBackend(CompilationConfig(strict=True, fusion_patterns={"enable_flex_attention": False}),
                              keep_graphs=True)
    with torch.no_grad():
        actual = torch.compile(_plain, backend=backend, fullgraph=True)(q, k, v)
    assert FLEX_ATTENTION in _targets(backend)
    assert backend.report().matches["flex_attention"] == 0
    assert_close(actual, _plain(q, k, v), torch.float32)


def _tables(num, idx, full_num=None, full_idx=None, q_block=128, kv_block=128):
    """A block mask tuple whose tables are computed in a graph from literals (as flex's default mask is)."""
    graph = Graph()

    def table(values):
        if values is None:
            return None
        t = torch.tensor(values, dtype=torch.int32)
        zeros = graph.call_function(aten.full.default, (list(t.shape), 0), {"dtype": torch.int32})
        return graph.call_function(aten.add.Tensor, (zeros, t))

    return (256, 256, table(num), table(idx), table(full_num), table(full_idx), *(None,) * 8, q_block, kv_block, None)


@pytest.mark.parametrize("num,idx,full_num,full_idx,covers", [
    ([[[2, 2]]], [[[[0, 1], [1, 0]]]], None, None, True),  # every block listed, partial
    ([[[1, 0]]], [[[[0, 0], [0, 0]]]], [[[1, 2]]], [[[[1, 0], [0, 1]]]], True),  # partial and full together
    ([[[1, 1]]], [[[[0, 0], [1, 0]]]], None, None, False),  # a block left out: the kernels skip it
])
def test_block_tables_must_list_every_block(num, idx, full_num, full_idx, covers):
    assert _covers_all_blocks(_tables(num, idx, full_num, full_idx), 256, 256, {}) is covers
