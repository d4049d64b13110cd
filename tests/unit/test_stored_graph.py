"""Graph modules stored as data (``mindiesd.compilation.storage.stored_graph``): what is loaded runs as what was stored,
without re-tracing its code, and its graph is the stored one when read."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.testing import assert_close

from mindiesd.compilation.storage import stored_graph


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0))

    def forward(self, x, scale=2.0):
        y = self.inner(x) + self.table  # call_module + get_attr
        head, tail = y.split([3, 5], dim=-1)
        return torch.cat([tail[..., ::2], head * scale], dim=-1), y[:, 1:]


def _aten_graph(fn, *args) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def _round_trip(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    return stored_graph.graph_module(pickle.loads(pickle.dumps(stored_graph.state_of(gm))))


def test_an_aten_graph_runs_as_stored_and_its_graph_is_rebuilt_only_when_read():
    x, w = torch.randn(4, 8), torch.randn(8)
    gm = _aten_graph(lambda x, w: (torch.ops.mindiesd.rms_norm(x, w, 1e-5, None)[:, 2:6] * 3).sum(-1, keepdim=True),
                     x, w)
    loaded = _round_trip(gm)
    assert isinstance(loaded, stored_graph.StoredGraphModule)
    assert "_built_graph" not in loaded.__dict__
    assert_close(loaded(x, w), gm(x, w), rtol=0, atol=0)
    assert stored_graph.placeholders(loaded) == 2
    assert "_built_graph" not in loaded.__dict__  # running and counting inputs did not rebuild it
    def described(graph):
        return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in graph.nodes]

    assert described(loaded.graph) == described(gm.graph)
    assert loaded.code == gm.code


def test_attributes_submodules_slices_and_keywords_survive():
    block = _Block()
    gm = torch.fx.symbolic_trace(block)
    loaded = _round_trip(gm)
    assert isinstance(loaded, stored_graph.StoredGraphModule)
    x = torch.randn(4, 8)
    for got, want in zip(loaded(x), block(x)):
        assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(loaded.table, block.table) and isinstance(loaded.inner, torch.nn.Linear)
    assert [str(n.target) for n in loaded.graph.nodes] == [str(n.target) for n in gm.graph.nodes]


def test_a_loaded_graph_can_be_edited_copied_and_stored_again():
    x, w = torch.randn(4, 8), torch.randn(8)
    gm = _aten_graph(lambda x, w: torch.nn.functional.gelu(x * w, approximate="tanh"), x, w)
    loaded = _round_trip(gm)
    clone = copy.deepcopy(loaded)
    assert isinstance(clone, torch.fx.GraphModule) and clone.graph is not loaded.graph
    assert_close(clone(x, w), gm(x, w), rtol=0, atol=0)
    again = _round_trip(loaded)  # never opened: stored as loaded
    assert_close(again(x, w), gm(x, w), rtol=0, atol=0)
    # an edit (every gelu becomes relu) regenerates the code, and storing it stores the edit
    for node in loaded.graph.nodes:
        if node.target is torch.ops.aten.gelu.default:
            node.target, node.kwargs = torch.ops.aten.relu.default, {}
    loaded.recompile()
    assert_close(loaded(x, w), torch.relu(x * w))
    assert_close(_round_trip(loaded)(x, w), torch.relu(x * w))
    assert_close(pickle.loads(pickle.dumps(loaded))(x, w), torch.relu(x * w))  # GraphModule's own pickling


def test_a_graph_with_its_own_code_generator_is_rebuilt_eagerly():
    def f(inputs):
        return inputs["a"] + inputs["b"]

    gm = torch.fx.symbolic_trace(f, concrete_args={"inputs": {"a": torch.fx.PH, "b": torch.fx.PH}})
    loaded = _round_trip(gm)
    assert not isinstance(loaded, stored_graph.StoredGraphModule)
    a, b = torch.randn(3), torch.randn(3)
    assert_close(loaded({"a": a, "b": b}), a + b)


def test_what_is_not_a_stored_graph_is_refused():
    with pytest.raises(ValueError, match="not a stored graph"):
        stored_graph.graph_module({"something": 1})


def test_which_nodes_are_numbers_survives_the_round_trip():
    """A loaded graph's nodes carry no traced values; which of them compute numbers (the sizes of a graph with
    symbolic shapes, which the executor computes as numbers) is stored with the nodes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: x.view(x.shape[0] * 2, -1) * 3, tracing_mode="symbolic")(torch.randn(4, 6))
    numbers = {n.name for n in gm.graph.nodes if stored_graph.is_number(n)}
    assert numbers and all(n.startswith(("sym_size", "mul")) for n in numbers), numbers
    loaded = _round_trip(gm)
    assert all("val" not in n.meta for n in loaded.graph.nodes)
    assert {n.name for n in loaded.graph.nodes if stored_graph.is_number(n)} == numbers
    x = torch.randn(6, 10)
    assert_close(loaded(x), x.view(12, -1) * 3)
