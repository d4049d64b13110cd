"""RoPE written as a 2x2 matrix per pair (the original Flux code, diffusers' HiDream and PRX):
``freqs[..., 0] * x_[..., 0] + freqs[..., 1] * x_[..., 1]`` with ``x_ = x.float().reshape(..., D/2, 1, 2)``.

The rope pass maps any such matrix to the fused op's full-width tables, so it fuses whatever the table holds (a
rotation or not), and mul_add no longer takes the two-term sum apart. Each case checks the count, the value and
the strides eager returns.
"""

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.models.transformers.transformer_hidream_image import apply_rope as hidream_apply_rope  # noqa: E402
from diffusers.models.transformers.transformer_prx import PRXEmbedND  # noqa: E402
from diffusers.models.transformers.transformer_prx import apply_rope as prx_apply_rope  # noqa: E402
from fusion_utils import assert_close, only, run_compiled  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _rotation_table(batch, rows, cols, axes_dim):
    """PRX's table: [B, 1, L, D/2, 2, 2] rotation matrices over a (row, col) grid of positions."""
    ids = torch.zeros(rows, cols, 2)
    ids[..., 0] = torch.arange(rows)[:, None]
    ids[..., 1] = torch.arange(cols)[None, :]
    ids = ids.reshape(1, rows * cols, 2).repeat(batch, 1, 1)
    return PRXEmbedND(dim=sum(axes_dim), theta=10000, axes_dim=axes_dim)(ids)


def _assert_like_eager(out, ref):
    assert_close(out, ref)
    assert out.stride() == ref.stride(), (out.stride(), ref.stride())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matrix_prx(dtype):
    freqs = _rotation_table(2, 3, 4, [16, 16])
    x = rand(2, 4, 12, 32, dtype=dtype)
    out, ref, counts, _ = run_compiled(prx_apply_rope, x, freqs)
    assert counts == only("rope", 1)
    _assert_like_eager(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matrix_on_heads_selected_from_a_permuted_projection(dtype):
    """PRX's q and k: a select of a permuted [3, B, H, L, D] view, neither contiguous nor dense."""
    b, length, heads, d = 2, 12, 4, 32
    freqs = _rotation_table(b, 3, 4, [16, 16])

    def fn(qkv, freqs):
        q, k, _ = qkv.reshape(b, length, 3, heads, d).permute(2, 0, 3, 1, 4)
        return prx_apply_rope(q, freqs), prx_apply_rope(k, freqs)

    qkv = rand(b, length, 3 * heads * d, dtype=dtype)
    (out_q, out_k), (ref_q, ref_k), counts, _ = run_compiled(fn, qkv, freqs)
    assert counts == only("rope", 2)
    _assert_like_eager(out_q, ref_q)
    _assert_like_eager(out_k, ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matrix_hidream_q_and_k_share_the_table_columns(dtype):
    """HiDream rotates q and k with one table [B, L, 1, D/2, 2, 2]; its column selects may serve both."""
    s, d = 10, 32
    angles = rand(1, s, 1, d // 2, seed=1)
    cos, sin = angles.cos(), angles.sin()
    freqs = torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))
    q, k = rand(1, s, 3, d, dtype=dtype, seed=2), rand(1, s, 3, d, dtype=dtype, seed=3)
    out, ref, counts, _ = run_compiled(hidream_apply_rope, q, k, freqs)
    assert counts == only("rope", 2)
    for o, r in zip(out, ref):
        _assert_like_eager(o, r)


def test_rope_matrix_of_any_values_fuses_exactly():
    """Nothing about the values is assumed: a table of random matrices (no rotation), of lower rank than x."""
    s, d = 7, 24
    freqs = rand(s, d // 2, 2, 2, seed=4)
    x = rand(2, 3, s, d)
    out, ref, counts, _ = run_compiled(prx_apply_rope, x, freqs)
    assert counts == only("rope", 1)
    _assert_like_eager(out, ref)


class _ImageQueryWithRoPE(torch.nn.Module):
    """PRX's query path: a projection to heads, then RoPE over a table built in the graph from positions."""

    def __init__(self, dim=32, heads=2, axes_dim=(8, 8)):
        super().__init__()
        self.heads, self.head_dim = heads, sum(axes_dim)
        self.proj = torch.nn.Linear(dim, heads * self.head_dim)
        self.embed = PRXEmbedND(dim=self.head_dim, theta=10000, axes_dim=list(axes_dim))

    def forward(self, hidden_states, ids):
        q = self.proj(hidden_states).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        return prx_apply_rope(q, self.embed(ids))


def test_rope_matrix_under_dynamic_shapes():
    from fusion_utils import count_fused
    from mindiesd.compilation import MindieSDBackend

    model = _ImageQueryWithRoPE()
    backend = MindieSDBackend(keep_graphs=True)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for length in (6, 10, 13):
            ids = torch.stack([torch.arange(length) // 3, torch.arange(length) % 3], dim=-1).float()[None]
            hidden_states = rand(1, length, 32, seed=length)
            assert_close(compiled(hidden_states, ids), model(hidden_states, ids))
    assert backend.report().graphs == 1
    assert backend.report().fallbacks == []
    assert count_fused(backend) == only("rope", 1)


def test_rope_matrix_with_one_matrix_for_all_pairs_is_left_alone():
    """freqs [..., 1, 2, 2] broadcast over the pairs: not a per-pair table (no fused rope; value unchanged)."""
    x = rand(2, 5, 16)
    freqs = rand(5, 1, 2, 2, seed=5)
    out, ref, counts, _ = run_compiled(prx_apply_rope, x, freqs)
    assert counts["rope"] == 0
    assert_close(out, ref)


def test_rope_matrix_with_crossed_columns_is_left_alone():
    """Column 0 times element 1 (and 1 times 0) is another function than M @ pair: not matched."""
    def crossed(x, freqs):
        x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
        return (freqs[..., 0] * x_[..., 1] + freqs[..., 1] * x_[..., 0]).reshape(*x.shape).type_as(x)

    x = rand(2, 5, 16)
    freqs = rand(5, 8, 2, 2, seed=6)
    out, ref, counts, _ = run_compiled(crossed, x, freqs)
    assert counts["rope"] == 0
    assert_close(out, ref)
