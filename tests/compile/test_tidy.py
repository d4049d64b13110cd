"""After fusion, fewer calls for the same values (``compilation/cleanup/tidy.py``): a pure op computed twice on the same
arguments runs once, a linear layer is one call, a chain of reshapes is one view; outputs equal eager's, layouts
the traced ones."""

from collections import Counter

import torch

from fusion_utils import assert_close, compile_zoo_model, run_compiled
from mindiesd.compilation import CompilationConfig, MindieSDBackend
from mindiesd.compilation import backend as backend_module

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten.unsqueeze.default, aten._unsafe_view.default)


def _calls(gm):
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _compile_flux(monkeypatch, tidy_on):
    if not tidy_on:
        monkeypatch.setattr(backend_module, "AFTER_FUSION",
                            tuple(step for step in backend_module.AFTER_FUSION if step.name != "tidy"))
    return compile_zoo_model("flux", "host")


def test_flux_takes_silu_of_the_embedding_once_and_reshapes_in_one_view(monkeypatch):
    actual, expected, gm = _compile_flux(monkeypatch, tidy_on=True)
    assert_close(actual, expected)
    _, _, untidy = _compile_flux(monkeypatch, tidy_on=False)
    calls, before = _calls(gm), _calls(untidy)
    adaln = 2 * 2 + 4 + 1  # the double blocks' two adaLNs (image, text), the single blocks' one, norm_out
    # silu(temb) once for all adaLN modulations; the time and text embedders' own two SiLUs stay
    assert before[aten.silu.default] == adaln + 2 and calls[aten.silu.default] == 3
    # no reshape reads a reshape: the matmul's [B, S, N] and the heads' [B, S, H, D] are one view
    chained = [n for n in gm.graph.nodes if n.target in _RESHAPES and getattr(n.args[0], "target", None) in _RESHAPES]
    assert chained == []
    # one unsqueeze per adaLN modulation split (9), not one per chunk (36)
    assert before[aten.unsqueeze.default] > 40 and calls[aten.unsqueeze.default] < 15
    assert sum(calls.values()) < sum(before.values()) - 150
    # every linear layer is one linear call again (its views and transposed weight made inside it); none lost:
    # 60 linear layers, of which the 4 single blocks' proj_out are cat_linear calls (which have no addmm left)
    cat_linear = torch.ops.mindiesd.cat_linear.default
    assert calls[cat_linear] == before[cat_linear] == 4
    # (the double blocks' value projections write into joint attention's concatenation: compilation/cleanup/write_into.py)
    assert calls[aten.linear.default] + calls[aten.linear.out] == 60 - 4 and calls[aten.linear.out] == 4
    assert before[aten.addmm.default] + before[aten.addmm.out] == 60 - 4
    assert calls[aten.addmm.default] == calls[aten.t.default] == 0


def test_identical_calls_run_once_but_outputs_stay_apart():
    def fn(x, w):
        a = torch.sigmoid(x) * w
        b = torch.sigmoid(x) * w  # the same values: computed once
        return a + b, torch.cos(x), torch.cos(x)  # two outputs stay two tensors

    x, w = _randn(4, 8, seed=1), _randn(8, seed=2)
    actual, expected, _, backend = run_compiled(fn, x, w, config=CompilationConfig(cache_dir=None))
    calls = _calls(backend.graphs[0])
    assert calls[aten.sigmoid.default] == 1 and calls[aten.mul.Tensor] == 1
    assert calls[aten.cos.default] == 2
    assert_close(actual, expected)
    assert actual[1].data_ptr() != actual[2].data_ptr()


def test_random_ops_are_never_merged():
    def fn(x):
        return torch.rand_like(x) - torch.rand_like(x)

    x = _randn(64, seed=3)
    actual, _, _, backend = run_compiled(fn, x, config=CompilationConfig(cache_dir=None))
    assert _calls(backend.graphs[0])[aten.rand_like.default] == 2
    assert actual.abs().max() > 0  # two draws, not one draw twice


def test_a_chain_of_reshapes_keeps_the_traced_strides():
    """A transposed tensor reshaped twice: where one view of the base gives other strides, the chain stays."""

    def fn(x):
        t = x.t()
        flat = t.unsqueeze(0).view(1, 4, 6)  # not contiguous: unsqueeze then view
        grouped = (x * 2).view(24).view(4, 3, 2).unsqueeze(0)  # contiguous: one view
        return flat * 3, grouped + 1

    x = _randn(6, 4, seed=4)
    actual, expected, _, backend = run_compiled(fn, x, config=CompilationConfig(cache_dir=None))
    gm = backend.graphs[0]
    chained = [n for n in gm.graph.nodes if n.target in _RESHAPES and getattr(n.args[0], "target", None) in _RESHAPES]
    assert chained == []
    assert_close(actual, expected)
    for a, e in zip(actual, expected):
        assert a.stride() == e.stride()


def test_a_linear_layer_is_one_call_with_eager_bits():
    """2-D and contiguous 3-D inputs become linear(x, w, b), bit for bit eager's; a transposed input or a matmul
    without bias keeps its decomposition."""
    lin = torch.nn.Linear(16, 24)

    def fn(x, y):
        return lin(x), lin(x[0]), lin(y.transpose(0, 1)), torch.nn.functional.linear(x, lin.weight)

    x, y = _randn(2, 5, 16, seed=5), _randn(5, 2, 16, seed=6)
    actual, expected, _, backend = run_compiled(fn, x, y, config=CompilationConfig(cache_dir=None))
    calls = _calls(backend.graphs[0])
    assert calls[aten.linear.default] == 2
    for a, e in zip(actual, expected):
        assert torch.equal(a, e) and a.stride() == e.stride()


def test_with_symbolic_sizes_a_linear_layer_is_one_call_and_reshapes_one_view():
    """Under dynamic=True the rows' count is a size the graph computes: the linear layer is still one call (the row
    view proven at every size from the size expressions) and a chain of reshapes one view; every size matches
    eager bit for bit."""
    lin = torch.nn.Linear(16, 24)

    def fn(x):
        return (lin(x).view(x.shape[0], x.shape[1], 4, 6) * 2).view(x.shape[0], -1, 24)

    backend = MindieSDBackend(CompilationConfig(cache_dir=None), keep_graphs=True)
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    with torch.no_grad():
        for rows in (5, 7, 12):
            x = _randn(2, rows, 16, seed=rows)
            assert torch.equal(compiled(x), fn(x))
    calls = _calls(backend.graphs[0])
    assert calls[aten.linear.default] == 1 and calls[aten.addmm.default] == calls[aten.t.default] == 0
    chained = [n for n in backend.graphs[0].graph.nodes
               if n.target in _RESHAPES and getattr(n.args[0], "target", None) in _RESHAPES]
    assert chained == []


def test_flux_rotary_tables_take_one_cos_one_sin_and_equal_eager_bit_for_bit():
    """diffusers' FluxPosEmbed: cos, repeat-interleave and cast per axis, then concatenated; compiled, one of each
    on the concatenated angles, with exactly eager's values."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    embed = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])
    ids = torch.cat([torch.zeros(8, 3), torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                                                   indexing="ij"), -1).reshape(-1, 3)])
    actual, expected, _, backend = run_compiled(embed, ids, config=CompilationConfig(cache_dir=None))
    calls = _calls(backend.graphs[0])
    assert calls[aten.cos.default] == calls[aten.sin.default] == 1
    assert calls[aten.clone.default] == calls[aten._to_copy.default] == 2
    for a, e in zip(actual, expected):
        assert torch.equal(a, e) and a.stride() == e.stride()


def test_a_concatenation_of_parts_read_elsewhere_is_left_alone():
    def fn(x, y):
        a, b = torch.cos(x), torch.cos(y)
        return torch.cat([a, b], -1), a * 2  # a is read again: the parts stay

    x, y = _randn(3, 4, seed=7), _randn(3, 5, seed=8)
    actual, expected, _, backend = run_compiled(fn, x, y, config=CompilationConfig(cache_dir=None))
    assert _calls(backend.graphs[0])[aten.cos.default] == 2
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def test_a_modulation_is_unsqueezed_once_before_its_chunks():
    """adaLN's ``emb.chunk(n, dim=1)`` then ``[:, None]`` of each chunk: one unsqueeze before the split; where a chunk
    is also read as it is, every chunk keeps its own."""

    def fn(x, emb):
        shift, scale, gate = emb.chunk(3, dim=1)
        return x * (1 + scale[:, None]) + shift[:, None] * gate[:, None]

    def reads_a_chunk(x, emb):
        shift, scale, gate = emb.chunk(3, dim=1)
        return x * scale[:, None] + shift[:, None], gate

    x, emb = _randn(2, 5, 8, seed=9), _randn(2, 24, seed=10)
    for function, unsqueezes in ((fn, 1), (reads_a_chunk, 2)):
        actual, expected, _, backend = run_compiled(function, x, emb, config=CompilationConfig(cache_dir=None))
        assert _calls(backend.graphs[0])[aten.unsqueeze.default] == unsqueezes, function.__name__
        assert_close(actual, expected)


def test_a_flipped_sinusoidal_embedding_concatenates_once_and_a_product_with_one_goes():
    """diffusers' Timesteps(flip_sin_to_cos=True): cat([sin, cos]) then its halves swapped is cat([cos, sin]); its
    ``* scale`` with scale 1 is the tensor itself. Bit for bit eager's."""
    from diffusers.models.embeddings import Timesteps

    embed = Timesteps(64, flip_sin_to_cos=True, downscale_freq_shift=0)
    t = torch.tensor([0.5, 10.0]) * 1000
    actual, expected, _, backend = run_compiled(embed, t, config=CompilationConfig(cache_dir=None))
    calls = _calls(backend.graphs[0])
    assert calls[aten.cat.default] == 1 and calls[aten.slice.Tensor] == 0
    assert torch.equal(actual, expected)

    def scaled(x):
        return torch.sin(x * 1 / 1) + 1, (x.long() * 1.0)  # the last changes the dtype: it stays

    x = _randn(4, seed=11)
    actual, expected, _, backend = run_compiled(scaled, x, config=CompilationConfig(cache_dir=None))
    calls = _calls(backend.graphs[0])
    assert calls[aten.mul.Tensor] == 1 and calls[aten.div.Tensor] == 0
    for a, e in zip(actual, expected):
        assert torch.equal(a, e) and a.dtype == e.dtype


def _rotations(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", "") == "mindiesd"
            and n.target._schema.name in ("mindiesd::rope", "mindiesd::norm_rope")]


def _tables(node):
    first = 6 if node.target._schema.name == "mindiesd::norm_rope" else 1
    return node.args[first].meta["val"], node.args[first + 1].meta["val"]


def test_flux_rotations_read_per_pair_tables_and_repeat_nothing(monkeypatch):
    """Flux's tables are repeat-interleaved per pair for an interleaved rotation: the compiled graph hands
    norm_rope the per-pair tables, so no repeat (clone) runs and the casts cast half the values."""
    actual, expected, gm = _compile_flux(monkeypatch, tidy_on=True)
    assert_close(actual, expected)
    _, _, untidy = _compile_flux(monkeypatch, tidy_on=False)
    calls, before = _calls(gm), _calls(untidy)
    assert before[aten.clone.default] >= 2 and calls[aten.clone.default] == 0
    rotations = _rotations(gm)
    assert len(rotations) == 12  # q and k of 2 double and 4 single blocks
    for node in rotations:
        head_dim, (cos, sin) = node.args[5], _tables(node)
        assert cos.shape[-1] == sin.shape[-1] == head_dim // 2 and cos.dtype == torch.float32
    # cos and sin round to float32 as they store (compilation/cleanup/write_into.py), half the values: Flux host's head_dim is 16
    casts = [n for n in gm.graph.nodes if n.target in (aten._to_copy.default, aten.cos.out, aten.sin.out)]
    casts = [n for n in casts if n.meta["val"].dim() == 2 and n.meta["val"].shape[0] > 1]  # not the timestep's
    assert len(casts) == 2 and all(n.meta["val"].shape[-1] == 8 and n.meta["val"].dtype == torch.float32
                                   for n in casts)


def _halves_rotation(x, w, angles):
    """RMSNorm, then diffusers' rotation of halves with tables made full width by ``cat([t, t], -1)``."""
    from diffusers.models.embeddings import apply_rotary_emb

    cos, sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([angles.sin(), angles.sin()], -1)
    normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)
    return apply_rotary_emb(normed, (cos, sin), use_real_unbind_dim=-2)


def test_a_rotation_of_halves_reads_the_half_table():
    x, w, angles = _randn(1, 2, 6, 16, seed=11), _randn(16, seed=12), _randn(6, 8, seed=13)
    actual, expected, counts, backend = run_compiled(_halves_rotation, x, w, angles,
                                                     config=CompilationConfig(cache_dir=None))
    assert counts["norm_rope"] + counts["rope"] >= 1
    rotations = _rotations(backend.graphs[0])
    assert rotations and all(t.shape[-1] == 8 for n in rotations for t in _tables(n))  # head_dim 16: 8 pairs
    assert _calls(backend.graphs[0])[aten.cat.default] == 0
    assert_close(actual, expected)


def test_a_repeated_table_read_elsewhere_is_left_alone():
    def fn(x, w, angles):
        cos = torch.cat([angles.cos(), angles.cos()], -1)
        return _halves_rotation(x, w, angles), cos * 2  # the full table is read again: it stays

    x, w, angles = _randn(1, 2, 6, 16, seed=14), _randn(16, seed=15), _randn(6, 8, seed=16)
    actual, expected, _, backend = run_compiled(fn, x, w, angles, config=CompilationConfig(cache_dir=None))
    rotations = _rotations(backend.graphs[0])
    assert rotations and all(t.shape[-1] == 16 for n in rotations for t in _tables(n))
    assert_close(actual, expected)
