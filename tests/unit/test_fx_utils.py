"""The FX toolkit: one definition of a foldable constant (freezing's split and merge_projections agree on it), the
layout comparison, nodes emitted with their fake values, and erasing what became unused."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mindiesd.compilation.freezing import split_constants
from mindiesd.compilation.cleanup.copies import drop_copies
from mindiesd.compilation.fx_utils import (
    Emitter, erase_unused, foldable_nodes, placeholders, same_layout, tensor_val,
)
from mindiesd.compilation.passes.merge_projections import MergeProjectionsPass

aten = torch.ops.aten


def traced(fn, *args):
    """An aten graph with a fake value on every node."""
    return make_fx(fn, tracing_mode="fake")(*args)


def targets(nodes):
    return {n.target for n in nodes if n.op == "call_function"}


def test_foldable_nodes_are_what_pure_aten_ops_compute_from_the_weights_alone():
    def fn(x, w):
        return x @ (w * 2.0).t() + torch.rand_like(w).sum()

    gm = traced(fn, torch.randn(3, 4), torch.randn(5, 4))
    x, w = placeholders(gm.graph)
    constant = foldable_nodes(gm.graph, {w})
    assert {aten.mul.Tensor, aten.t.default} <= targets(constant)
    assert aten.rand_like.default not in targets(constant), "a random op is computed at each call"
    assert not any(x in n.all_input_nodes for n in constant)


def test_a_broadcast_too_large_to_fold_is_not_a_constant():
    gm = traced(lambda x, w: x + w.expand(1024, 2048), torch.randn(1024, 2048), torch.randn(1, 2048))
    x, w = placeholders(gm.graph)
    assert foldable_nodes(gm.graph, {w}) == {w}


def _projections(weight_of):
    def fn(x, wq, wk, wv):
        weights = [weight_of(w) for w in (wq, wk, wv)]
        return sum((x @ w.t()).sum(-1) for w in weights)

    return fn


def test_merged_projections_are_folded_by_freezing():
    gm = traced(_projections(lambda w: w), torch.randn(3, 8), *(torch.randn(4, 8) for _ in range(3)))
    assert MergeProjectionsPass()(gm, set(placeholders(gm.graph)[1:])) == 1
    frozen = split_constants(gm, [1, 2, 3])
    assert frozen is not None and frozen.concatenations, "the concatenated weight is one of the folded values"


def test_the_fold_graph_takes_only_the_weights_its_values_are_computed_from():
    """Each fold input is checked on every call; a value folded from no weight (Flux's frequencies) needs none."""
    def fn(x, w1, w2, w3):
        freqs = torch.exp(torch.arange(4, dtype=torch.float32) * -0.5)  # from no weight
        return x @ (w2 * 2.0).t() + x @ w1.t() + w3 + freqs

    gm = traced(fn, torch.randn(3, 4), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    frozen = split_constants(gm, [1, 2, 3])
    assert frozen is not None and frozen.n_folded == 2  # w2 * 2.0 and the frequencies
    assert frozen.fold_inputs == [2], "only w2 feeds a folded value"
    assert len(placeholders(frozen.fold.graph)) == 1
    x, w1, w2, w3 = torch.randn(3, 4), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4)
    run = frozen.bind(frozen.main)
    torch.testing.assert_close(run(x, w1, w2, w3), fn(x, w1, w2, w3))
    w2.mul_(3.0)  # an in-place change of the weight that is folded refolds
    torch.testing.assert_close(run(x, w1, w2, w3), fn(x, w1, w2, w3))


def test_projections_of_weights_freezing_would_not_fold_are_not_merged():
    gm = traced(_projections(lambda w: w.expand(2048, 1024)), torch.randn(3, 1024),
                *(torch.randn(1, 1024) for _ in range(3)))
    assert MergeProjectionsPass()(gm, set(placeholders(gm.graph)[1:])) == 0


def test_same_layout_compares_dtype_shape_and_strides_through_tuples():
    a = torch.empty(4, 6)
    assert same_layout(a, torch.empty(4, 6)) and same_layout((a, 1), (torch.empty(4, 6), 2))
    assert not same_layout(a, torch.empty(6, 4).t()), "same shape, other strides"
    assert not same_layout(a, a.double()) and not same_layout(a, None)


def test_emitted_nodes_carry_fake_values_and_erase_unused_keeps_what_is_read_or_unlisted():
    gm = traced(lambda x: x.relu(), torch.randn(2, 3))
    (x,) = placeholders(gm.graph)
    relu = next(n for n in gm.graph.nodes if n.target == aten.relu.default)
    emit = Emitter(gm.graph, relu)
    sin = emit(aten.sin.default, emit(aten.t.default, x))
    assert tuple(tensor_val(sin).shape) == (3, 2) and tuple(tensor_val(sin).stride()) == (1, 3)
    kept = emit(aten.exp.default, x)
    erase_unused([sin, sin.args[0], relu])
    assert targets(gm.graph.nodes) == {aten.relu.default, aten.exp.default}, "relu is read by the output"
    emit.discard()
    assert targets(gm.graph.nodes) == {aten.relu.default} and kept not in gm.graph.nodes


def _clones(gm):
    return sum(1 for n in gm.graph.nodes if n.target == aten.clone.default)


def _dropout_block(x, w):
    h = (x @ w).clone()  # what an inference dropout becomes in aot's inference graph
    return torch.nn.functional.gelu(h) * 2


def _assert_one_copy_removed(fn, count, *args):
    """fn's graph has one copy (``count`` of them), drop_copies removes it, and the graph still computes fn."""
    gm = traced(fn, *args)
    assert count(gm) == 1
    assert drop_copies(gm.graph) == 1
    gm.recompile()
    assert count(gm) == 0
    torch.testing.assert_close(gm(*args), fn(*args), rtol=0, atol=0)


def test_the_copies_an_inference_dropout_leaves_are_removed():
    _assert_one_copy_removed(_dropout_block, _clones, torch.randn(4, 8), torch.randn(8, 8))


def test_copies_that_keep_outputs_apart_or_change_layout_stay():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    cases = {
        "an output": lambda x, w: ((x @ w).clone(), x @ w),
        "a view of it is an output": lambda x, w: (x @ w).clone().view(32),
        "of an input": lambda x, w: (x.clone() * w[0]),
        "an expanded value made contiguous": lambda x, w: (w[0].expand(4, 8).contiguous() * x),
        "a transposed value made contiguous": lambda x, w: ((x @ w).t().contiguous() * 2),
        "a graph that writes in place": lambda x, w: (x @ w).clone().mul_(2).add(w.add_(1)[0]),
    }
    for why, fn in cases.items():
        gm = traced(fn, x, w)
        before = _clones(gm)
        assert before >= 1, why
        assert drop_copies(gm.graph) == 0, why
        assert _clones(gm) == before, why


def test_a_copy_making_contiguous_what_already_is_is_removed():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    fn = lambda x, w: (x @ w).contiguous(memory_format=torch.contiguous_format).clone(  # noqa: E731
        memory_format=torch.contiguous_format) * 2
    gm = traced(fn, x, w)
    assert _clones(gm) == 1 and drop_copies(gm.graph) == 1
    gm.recompile()
    torch.testing.assert_close(gm(x, w), fn(x, w), rtol=0, atol=0)


def _cats(gm):
    return sum(1 for n in gm.graph.nodes if n.target == aten.cat.default)


def test_a_concatenation_of_a_tensors_own_consecutive_slices_is_that_tensor():
    """Flux's single blocks split text and image tokens after each block and concatenate them again."""
    x, w = torch.randn(2, 6, 8), torch.randn(8, 8)

    def fn(x, w):
        y = x @ w
        return torch.cat([y[:, :2], y[:, 2:5], y[:, 5:]], 1) * 2

    _assert_one_copy_removed(fn, _cats, x, w)


def test_concatenations_that_are_not_the_whole_tensor_stay():
    x, w = torch.randn(2, 6, 8), torch.randn(8, 8)
    cases = {
        "swapped halves": lambda x, w: torch.cat([(x @ w)[:, 3:], (x @ w)[:, :3]], 1) * 2,
        "a gap": lambda x, w: torch.cat([(x @ w)[:, :2], (x @ w)[:, 3:]], 1) * 2,
        "not to the end": lambda x, w: torch.cat([(x @ w)[:, :2], (x @ w)[:, 2:5]], 1) * 2,
        "a step": lambda x, w: torch.cat([(x @ w)[:, 0:6:2], (x @ w)[:, 1:6:2]], 1) * 2,
        "two tensors": lambda x, w: torch.cat([(x @ w)[:, :3], (x @ w + 1)[:, 3:]], 1) * 2,
        "another dim": lambda x, w: torch.cat([(x @ w)[:, :3], (x @ w)[:, 3:]], 2) * 2,
        "another layout": lambda x, w: torch.cat([(x @ w).transpose(1, 2)[:, :4], (x @ w).transpose(1, 2)[:, 4:]], 1) * 2,
        "an output": lambda x, w: torch.cat([(x @ w)[:, :3], (x @ w)[:, 3:]], 1),
    }
    for why, fn in cases.items():
        gm = traced(fn, x, w)
        assert _cats(gm) == 1, why
        assert drop_copies(gm.graph) == 0, why
        gm.recompile()
        torch.testing.assert_close(gm(x, w), fn(x, w), rtol=0, atol=0)
