"""Each family and each form: the fused op is in the graph (counted) and the output matches eager."""

import math

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import assert_close, only, run_compiled

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = [1e-6, 1e-5]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", EPS)
@pytest.mark.parametrize("shape", [(4, 40), (2, 5, 3, 48)])
def test_rms_norm_torch_module(dtype, eps, shape):
    norm = torch.nn.RMSNorm(shape[-1], eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = rand(*shape, dtype=dtype)
    out, ref, counts, _ = run_compiled(norm, x)
    assert counts == only("rms_norm", 1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-6, 1e-3])
@pytest.mark.parametrize("elementwise_affine", [True, False])
@pytest.mark.parametrize("shape", [(3, 64), (1, 4, 7, 64)])
def test_rms_norm_diffusers_class(dtype, eps, elementwise_affine, shape):
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(shape[-1], eps=eps, elementwise_affine=elementwise_affine).to(dtype)
    if elementwise_affine:
        with torch.no_grad():
            norm.weight.normal_()
    x = rand(*shape, dtype=dtype)
    out, ref, counts, _ = run_compiled(norm, x)
    assert counts == only("rms_norm", 1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "form",
    ["functional_no_weight", "torch_rms_norm", "explicit_rsqrt", "explicit_square_mul", "explicit_div_sqrt"],
)
def test_rms_norm_other_forms(dtype, form):
    d = 24
    w = rand(d, dtype=dtype, seed=1)
    eps = 1e-5

    def fn(x):
        if form == "functional_no_weight":
            return F.rms_norm(x, [d], eps=eps)
        if form == "torch_rms_norm":
            return torch.rms_norm(x, [d], w, eps)
        xf = x.float()
        if form == "explicit_rsqrt":
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        elif form == "explicit_square_mul":
            y = xf * torch.rsqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
        else:
            y = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * w.float()).to(x.dtype)

    x = rand(2, 6, d, dtype=dtype)
    out, ref, counts, _ = run_compiled(fn, x)
    assert counts == only("rms_norm", 1)
    assert_close(out, ref)


def test_rms_norm_over_a_middle_dim_is_left_alone():
    def fn(x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)

    x = rand(2, 6, 8)
    out, ref, counts, _ = run_compiled(fn, x)
    assert counts["rms_norm"] == 0
    assert_close(out, ref)


def test_rms_norm_whose_intermediate_is_reused_is_left_alone():
    def fn(x):
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * inv, inv

    x = rand(3, 16)
    out, ref, counts, _ = run_compiled(fn, x)
    assert counts["rms_norm"] == 0
    assert_close(out, ref)


# ---------------------------------------------------------------------------------------------- rope
def _cos_sin(seq, dim, dtype=torch.float32, repeat_interleave=True):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cos, sin = get_1d_rotary_pos_embed(dim, torch.arange(seq).float(), use_real=True,
                                       repeat_interleave_real=repeat_interleave)
    return cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_rope_interleaved_flux(dtype, layout):
    from diffusers.models.embeddings import apply_rotary_emb

    b, h, s, d = 2, 3, 10, 32
    cos, sin = _cos_sin(s, d)
    if layout == "bhsd":
        x = rand(b, h, s, d, dtype=dtype)
        fn = lambda x, cos, sin: apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1)
    else:
        x = rand(b, s, h, d, dtype=dtype)
        fn = lambda x, cos, sin: apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1, sequence_dim=1)
    out, ref, counts, _ = run_compiled(fn, x, cos, sin)
    assert counts == only("rope", 1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_half_rotated_unbind(dtype):
    from diffusers.models.embeddings import apply_rotary_emb

    cos, sin = _cos_sin(12, 64, repeat_interleave=False)
    x = rand(1, 2, 12, 64, dtype=dtype)
    fn = lambda x, cos, sin: apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-2)
    out, ref, counts, _ = run_compiled(fn, x, cos, sin)
    assert counts == only("rope", 1)
    assert_close(out, ref)


@pytest.mark.parametrize("split", ["slice", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotate_half(split, dtype):
    def rotate_half(x):
        if split == "slice":
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def fn(x, cos, sin):
        return x * cos + rotate_half(x) * sin

    cos, sin = _cos_sin(9, 40, dtype=dtype, repeat_interleave=False)
    x = rand(2, 9, 40, dtype=dtype)
    out, ref, counts, _ = run_compiled(fn, x, cos, sin)
    assert counts == only("rope", 1)
    assert_close(out, ref)


def _wan_rope(hidden_states, freqs_cos, freqs_sin):
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_wan_strided(dtype):
    s, d = 14, 32
    cos, sin = _cos_sin(s, d)
    x = rand(1, s, 4, d, dtype=dtype)
    out, ref, counts, _ = run_compiled(_wan_rope, x, cos.view(1, s, 1, d), sin.view(1, s, 1, d))
    assert counts == only("rope", 1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_complex(dtype):
    from diffusers.models.embeddings import apply_rotary_emb

    s, d = 11, 48
    freqs = torch.polar(torch.ones(1, s, d // 2), rand(1, s, d // 2, seed=3))
    x = rand(2, s, 3, d, dtype=dtype)
    fn = lambda x, f: apply_rotary_emb(x, f, use_real=False)
    out, ref, counts, _ = run_compiled(fn, x, freqs)
    assert counts == only("rope", 1)
    assert_close(out, ref)


def test_rope_with_the_wrong_sign_is_left_alone():
    def fn(x, cos, sin):  # rotates the other way: not the function the fused op computes
        x_even, x_odd = x.unflatten(-1, (-1, 2)).unbind(-1)
        rot = torch.stack([x_odd, -x_even], -1).flatten(-2)
        return x * cos + rot * sin

    cos, sin = _cos_sin(5, 16)
    x = rand(5, 16)
    out, ref, counts, _ = run_compiled(fn, x, cos, sin)
    assert counts["rope"] == 0
    assert_close(out, ref)


# ---------------------------------------------------------------------------------------------- adalayernorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", EPS)
def test_adalayernorm_zero(dtype, eps):
    from diffusers.models.normalization import AdaLayerNormZero

    d = 48
    norm = AdaLayerNormZero(d).to(dtype)
    norm.norm.eps = eps
    x, emb = rand(2, 7, d, dtype=dtype), rand(2, d, dtype=dtype, seed=1)
    out, ref, counts, _ = run_compiled(lambda x, emb: norm(x, emb=emb), x, emb)
    assert counts == only("adalayernorm", 1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", EPS)
def test_adalayernorm_continuous(dtype, eps):
    from diffusers.models.normalization import AdaLayerNormContinuous

    d = 40
    norm = AdaLayerNormContinuous(d, 24, elementwise_affine=False, eps=eps).to(dtype)
    x, cond = rand(2, 9, d, dtype=dtype), rand(2, 24, dtype=dtype, seed=1)
    out, ref, counts, _ = run_compiled(norm, x, cond)
    assert counts == only("adalayernorm", 1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", EPS)
@pytest.mark.parametrize("rank", [3, 4])
def test_adalayernorm_wan_fp32(dtype, eps, rank):
    d = 32
    norm = torch.nn.LayerNorm(d, eps=eps, elementwise_affine=False)
    shape = (2, 6, d) if rank == 3 else (2, 3, 6, d)
    mod_shape = (2, 1, d) if rank == 3 else (2, 1, 1, d)

    def fn(x, shift, scale):
        return (norm(x.float()) * (1 + scale) + shift).type_as(x)

    x = rand(*shape, dtype=dtype)
    out, ref, counts, _ = run_compiled(fn, x, rand(*mod_shape, seed=1), rand(*mod_shape, seed=2))
    assert counts == only("adalayernorm", 1)
    assert_close(out, ref)


def test_adalayernorm_addcmul():
    def fn(x, shift, scale):
        return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=1e-6), 1 + scale)

    x = rand(2, 5, 16)
    out, ref, counts, _ = run_compiled(fn, x, rand(2, 1, 16, seed=1), rand(2, 1, 16, seed=2))
    assert counts == only("adalayernorm", 1)
    assert_close(out, ref)


def test_adalayernorm_with_affine_norm_is_left_alone():
    norm = torch.nn.LayerNorm(16)
    with torch.no_grad():
        norm.weight.normal_()

    def fn(x, shift, scale):
        return norm(x) * (1 + scale) + shift

    x = rand(2, 5, 16)
    out, ref, counts, _ = run_compiled(fn, x, rand(2, 1, 16, seed=1), rand(2, 1, 16, seed=2))
    assert counts["adalayernorm"] == 0
    assert_close(out, ref)


# ---------------------------------------------------------------------------------------------- fast_gelu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [2, 4])
def test_fast_gelu_aten(dtype, rank):
    x = rand(*((6, 33) if rank == 2 else (2, 3, 4, 33)), dtype=dtype)
    out, ref, counts, _ = run_compiled(torch.nn.GELU(approximate="tanh"), x)
    assert counts == only("fast_gelu", 1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["pow", "cube_by_mul", "factored_half", "coefficients_first"])
def test_fast_gelu_explicit_formula(dtype, form):
    c = math.sqrt(2.0 / math.pi)

    def fn(x):
        if form == "pow":
            return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))
        if form == "cube_by_mul":
            return x * 0.5 * (1 + torch.tanh(c * (x + 0.044715 * x * x * x)))
        if form == "factored_half":
            return 0.5 * (x * (1.0 + torch.tanh((x + 0.044715 * x.pow(3)) * c)))
        return (torch.tanh(0.7978845608 * (0.044715 * x ** 3 + x)) + 1.0) * x * 0.5

    x = rand(4, 50, dtype=dtype)
    out, ref, counts, _ = run_compiled(fn, x)
    assert counts == only("fast_gelu", 1)
    assert_close(out, ref)


def test_exact_gelu_and_sigmoid_gelu_are_left_alone():
    def fn(x):
        return F.gelu(x) + x * torch.sigmoid(1.702 * x)

    x = rand(4, 10)
    out, ref, counts, _ = run_compiled(fn, x)
    assert counts["fast_gelu"] == 0
    assert_close(out, ref)


# ---------------------------------------------------------------------------------------------- mul_add
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ["xy_plus_z", "z_plus_xy"])
def test_mul_add_broadcast(dtype, order):
    def fn(x, gate, residual):
        return x * gate + residual if order == "xy_plus_z" else residual + gate * x

    x, gate, residual = rand(2, 9, 16, dtype=dtype), rand(2, 1, 16, dtype=dtype, seed=1), rand(2, 9, 16, dtype=dtype, seed=2)
    out, ref, counts, _ = run_compiled(fn, x, gate, residual)
    assert counts == only("mul_add", 1)
    assert_close(out, ref)


def test_mul_add_with_upcast_product_fuses():
    def fn(x, gate, residual):  # Wan: bf16 * fp32 gate gives fp32, residual fp32
        return residual + x * gate

    x = rand(2, 5, 8, dtype=torch.bfloat16)
    out, ref, counts, _ = run_compiled(fn, x, rand(2, 1, 8, seed=1), rand(2, 5, 8, seed=2))
    assert counts == only("mul_add", 1)
    assert_close(out, ref, torch.float32)


def test_mul_add_where_the_sum_promotes_is_left_alone():
    def fn(x, y, z):  # eager rounds x*y to bf16 before the fp32 add: fusing would change the result
        return x * y + z

    x, y = rand(4, 8, dtype=torch.bfloat16), rand(4, 8, dtype=torch.bfloat16, seed=1)
    out, ref, counts, _ = run_compiled(fn, x, y, rand(4, 8, seed=2))
    assert counts["mul_add"] == 0
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_mul_add_with_a_scalar_or_reused_product_is_left_alone():
    def fn(x, z):
        p = x * z
        return x * 0.5 + z, p + z, p

    x, z = rand(4, 8), rand(4, 8, seed=1)
    out, ref, counts, _ = run_compiled(fn, x, z)
    assert counts["mul_add"] == 0
    assert_close(out, ref)


# ---------------------------------------------------------------------------------------------- glu
def _gated_ffn_counts(n=1):
    return only("glu", n)


def _rule_hits(backend):
    """Rule name -> rewrites of the glu pass, read from the fused nodes of the final graphs."""
    hits = {}
    for gm in backend.graphs:
        for node in gm.graph.nodes:
            rule = node.meta.get("mindiesd_rule", "")
            if rule.startswith("glu:"):
                hits[rule.split(":", 1)[1]] = hits.get(rule.split(":", 1)[1], 0) + 1
    return hits


def _seeded(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


class LlamaFeedForward(torch.nn.Module):
    """``w2(act(w1(x)) * w3(x))`` (HiDream, AuraFlow; PRX with tanh-GELU; Lumina2 with the SiLU in fp32)."""

    def __init__(self, d=32, hidden=48, activation="silu", order="gate_first"):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(d, hidden, bias=False), torch.nn.Linear(d, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, d, bias=False)
        self.activation, self.order = activation, order

    def act(self, t):
        if self.activation == "silu":
            return F.silu(t)
        if self.activation == "fp32_silu":
            return F.silu(t.float()).to(t.dtype)
        if self.activation == "gelu":
            return F.gelu(t)
        return F.gelu(t, approximate="tanh")

    def forward(self, x):
        gate, value = self.act(self.w1(x)), self.w3(x)
        return self.w2(gate * value if self.order == "gate_first" else value * gate)


class SlicedSwiGLU(torch.nn.Module):
    """Flux2's feed-forward: one projection, ``silu(x[..., :h]) * x[..., h:]``."""

    def __init__(self, d=32, hidden=48):
        super().__init__()
        self.linear_in = torch.nn.Linear(d, 2 * hidden, bias=False)
        self.linear_out = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        x = self.linear_in(x)
        half = x.shape[-1] // 2
        return self.linear_out(F.silu(x[..., :half]) * x[..., half:])


class FusedProjectionMLP(torch.nn.Module):
    """Flux2's single blocks: one projection for attention and MLP, split; the MLP part is gated by halves."""

    def __init__(self, d=32, hidden=48):
        super().__init__()
        self.hidden = hidden
        self.proj = torch.nn.Linear(d, 3 * d + 2 * hidden, bias=False)

    def forward(self, x):
        qkv, mlp = torch.split(self.proj(x), [3 * x.shape[-1], 2 * self.hidden], dim=-1)
        gate, value = mlp.chunk(2, dim=-1)
        return qkv.sum(-1, keepdim=True) + F.silu(gate) * value


class OmniGenFeedForward(torch.nn.Module):
    """``gate, up = gate_up_proj(x).chunk(2, -1); down_proj(up * silu(gate))``: the first half gated."""

    def __init__(self, d=32, hidden=48):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(d, 2 * hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["geglu", "swiglu"])
@pytest.mark.parametrize("shape", [(3, 32), (2, 7, 32)])
def test_glu_diffusers_activations(dtype, activation, shape):
    from diffusers.models.activations import GEGLU, SwiGLU

    module = _seeded((GEGLU if activation == "geglu" else SwiGLU)(32, 48)).to(dtype)
    out, ref, counts, backend = run_compiled(module, rand(*shape, dtype=dtype))
    assert counts == _gated_ffn_counts(1)
    assert _rule_hits(backend) == {"split_halves": 1}
    assert out.shape == (*shape[:-1], 48)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation_fn", ["geglu", "swiglu"])
def test_glu_diffusers_feed_forward(dtype, activation_fn):
    from diffusers.models.attention import FeedForward

    module = _seeded(FeedForward(32, activation_fn=activation_fn, inner_dim=64)).to(dtype).eval()
    out, ref, counts, _ = run_compiled(module, rand(2, 5, 32, dtype=dtype))
    assert counts == _gated_ffn_counts(1)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module", ["sliced", "fused_projection", "omnigen"])
def test_glu_halves_of_one_projection(dtype, module):
    model = _seeded({"sliced": SlicedSwiGLU, "fused_projection": FusedProjectionMLP,
                     "omnigen": OmniGenFeedForward}[module]()).to(dtype)
    out, ref, counts, backend = run_compiled(model, rand(2, 6, 32, dtype=dtype))
    assert counts == _gated_ffn_counts(1)
    assert _rule_hits(backend) == {"slice_halves" if module == "sliced" else "split_halves": 1}
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "fp32_silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("order", ["gate_first", "value_first"])
def test_glu_two_projections(dtype, activation, order):
    model = _seeded(LlamaFeedForward(activation=activation, order=order)).to(dtype)
    out, ref, counts, backend = run_compiled(model, rand(2, 6, 32, dtype=dtype))
    assert counts == _gated_ffn_counts(1), "the gate's GELU goes into glu, not to fast_gelu"
    assert _rule_hits(backend) == {"two_tensors": 1}
    assert_close(out, ref)


def test_glu_switch_off_leaves_it_unfused():
    from mindiesd.compilation import CompilationConfig

    config = CompilationConfig(fusion_patterns={"enable_glu": False})
    for model, fused_instead in ((SlicedSwiGLU(), {}), (LlamaFeedForward(activation="gelu_tanh"), {"fast_gelu": 1})):
        out, ref, counts, _ = run_compiled(_seeded(model), rand(2, 6, 32), config=config)
        assert counts == {**only("glu", 0), **fused_instead}
        assert_close(out, ref)


def test_glu_forms_left_alone():
    a, b = rand(2, 6, 32), rand(1, 6, 32, seed=1)
    # a broadcast value
    _, _, counts, _ = run_compiled(lambda a, b: F.silu(a) * b, a, b)
    assert counts["glu"] == 0
    # the activation is used elsewhere as well
    def reused(a, b):
        gate = F.silu(a)
        return gate * b, gate.sum()

    out, ref, counts, _ = run_compiled(reused, a, a.cos())
    assert counts["glu"] == 0
    assert_close(out, ref)
    # an fp32 activation multiplied by a bf16 value promotes the product: eager rounds the value's way twice
    low = rand(2, 6, 32, dtype=torch.bfloat16)
    _, _, counts, _ = run_compiled(lambda a, b: F.silu(a.float()) * b, low, low.cos())
    assert counts["glu"] == 0
    # a sigmoid gate (F.glu) is another function
    _, _, counts, _ = run_compiled(lambda x: F.glu(x, dim=-1), a)
    assert counts["glu"] == 0
    # unequal pieces of one projection: fused as two tensors only when they have one shape
    x = rand(2, 6, 48)
    out, ref, counts, _ = run_compiled(lambda x: F.silu(x[..., :16]) * x[..., 16:32] + x[..., 32:], x)
    assert counts["glu"] == 1
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_halves_along_another_dim_fuse_as_two_tensors(dtype):
    # Sana's GLUMBConv: `x, gate = chunk(2, dim=1)` of an NCHW tensor, `x * silu(gate)`
    x = rand(2, 16, 4, 5, dtype=dtype)

    def glumbconv(x):
        value, gate = torch.chunk(x, 2, dim=1)
        return value * F.silu(gate)

    out, ref, counts, backend = run_compiled(glumbconv, x)
    assert counts == _gated_ffn_counts(1)
    assert _rule_hits(backend) == {"two_tensors": 1}
    assert_close(out, ref)
