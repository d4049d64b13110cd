"""norm_rope: a query/key RMSNorm and the RoPE after it, through joint attention's concatenation, as one op.

Counted in the final graph of diffusers' own blocks (Flux's double block joins the text and image streams, its
single block rotates right after the norm) and of the registry's models, in fp32, bf16 and fp16, against eager;
Wan's norm over all heads before they are split; with the family off, the rms_norm and rope ops it would join are
there instead; the forms it must leave alone stay unfused and correct.
"""

import pytest
import torch

from fusion_utils import assert_close, run_compiled
from mindiesd import ops, zoo
from mindiesd.compilation import CompilationConfig
from mindiesd.zoo._base import rms_norms

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OFF = CompilationConfig(fusion_patterns={"enable_norm_rope": False})


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def rotary(seq, head_dim, dtype=torch.float32):
    """Flux's (cos, sin) tables: one angle per pair, repeated for both of its elements."""
    angles = rand(seq, head_dim // 2, seed=9)
    return angles.cos().repeat_interleave(2, -1).to(dtype), angles.sin().repeat_interleave(2, -1).to(dtype)


def _randomized(block, dtype):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    return block.to(dtype).eval()


def _flux_block(cls_name, batch, dtype, heads=2, head_dim=32, text=5, image=12):
    from diffusers.models.transformers import transformer_flux

    dim = heads * head_dim
    block = _randomized(getattr(transformer_flux, cls_name)(dim, heads, head_dim), dtype)
    args = (rand(batch, image, dim, dtype=dtype, seed=1), rand(batch, text, dim, dtype=dtype, seed=2),
            rand(batch, dim, dtype=dtype, seed=3), rotary(text + image, head_dim))
    return block, args


def flux_double_block(dtype):
    return _flux_block("FluxTransformerBlock", 1, dtype)


def flux_single_block(dtype):
    return _flux_block("FluxSingleTransformerBlock", 2, dtype)


def _run(block, args, config=None):
    def forward(hidden, context, temb, rotary_emb):
        return block(hidden, context, temb, image_rotary_emb=rotary_emb)

    return run_compiled(forward, *args, config=config)


# ------------------------------------------------------------------------------------------------ diffusers blocks
@pytest.mark.parametrize("dtype", DTYPES)
def test_flux_double_block_joins_both_streams_norms_and_the_rotation(dtype):
    block, args = flux_double_block(dtype)
    out, ref, counts, backend = _run(block, args)
    # q and k: each one op over the text and image streams' norms (4 norms, 2 rotations, 2 concatenations)
    assert (counts["norm_rope"], counts["rms_norm"], counts["rope"]) == (2, 0, 0)
    assert backend.report().rule_hits["norm_rope:joint"] == 2
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flux_single_block_joins_the_norm_and_the_rotation(dtype):
    block, args = flux_single_block(dtype)
    out, ref, counts, _ = _run(block, args)
    assert (counts["norm_rope"], counts["rms_norm"], counts["rope"]) == (2, 0, 0)
    assert_close(out, ref)


@pytest.mark.parametrize("make", [flux_double_block, flux_single_block], ids=["double", "single"])
def test_switched_off_the_norms_and_rotations_are_fused_on_their_own(make):
    block, args = make(torch.float32)
    joined = 4 if make is flux_double_block else 2
    out, ref, counts, _ = _run(block, args, config=OFF)
    assert (counts["norm_rope"], counts["rms_norm"], counts["rope"]) == (0, joined, 2)
    assert_close(out, ref)


# ------------------------------------------------------------------------------------------------ left alone
def _tables(seq, d):
    cos, sin = rotary(seq, d)
    return cos[None, :, None], sin[None, :, None]


class JointQuery(torch.nn.Module):
    """norm(text) and norm(image) joined along the sequence and rotated, as Flux's attention does, with the
    variations that must not be joined."""

    def __init__(self, d=32, eps=(1e-6, 1e-6), return_normed=False, cat_dim=1):
        super().__init__()
        self.text = torch.nn.RMSNorm(d, eps=eps[0])
        self.image = torch.nn.RMSNorm(d, eps=eps[1])
        with torch.no_grad():
            self.text.weight.normal_()
            self.image.weight.normal_()
        self.return_normed, self.cat_dim = return_normed, cat_dim

    def forward(self, text, image, cos, sin):
        from diffusers.models.embeddings import apply_rotary_emb

        normed_text = self.text(text)
        joined = torch.cat([normed_text, self.image(image)], dim=self.cat_dim)
        rotated = apply_rotary_emb(joined, (cos, sin), sequence_dim=1)
        return (rotated, normed_text * 2) if self.return_normed else rotated


def _joint_inputs(d=32, heads=3, text=4, image=9):
    cos, sin = rotary(text + image, d)
    return rand(2, text, heads, d, seed=1), rand(2, image, heads, d, seed=2), cos, sin


def test_joint_query_module_is_joined():
    out, ref, counts, _ = run_compiled(JointQuery(), *_joint_inputs())
    assert (counts["norm_rope"], counts["rms_norm"], counts["rope"]) == (1, 0, 0)
    assert_close(out, ref)


@pytest.mark.parametrize(
    "module,why",
    [
        (JointQuery(return_normed=True), "a normalised stream is read elsewhere too"),
        (JointQuery(eps=(1e-6, 1e-5)), "the streams' norms have different eps"),
    ],
    ids=["normed_read_elsewhere", "different_eps"],
)
def test_forms_that_are_left_alone(module, why):
    out, ref, counts, _ = run_compiled(module, *_joint_inputs())
    assert counts["norm_rope"] == 0, why
    assert (counts["rms_norm"], counts["rope"]) == (2, 1), why
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_norm_over_all_heads_rotated_per_head_is_joined(dtype):
    """Wan's form: norm_q over all heads' H * D values, the heads split off by a view, each head rotated."""

    def forward(x, weight, cos, sin):
        from diffusers.models.embeddings import apply_rotary_emb

        normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-6)
        return apply_rotary_emb(normed.unflatten(-1, (3, 32)), (cos, sin), sequence_dim=1)

    cos, sin = rotary(9, 32)
    out, ref, counts, _ = run_compiled(forward, rand(2, 9, 96, dtype=dtype, seed=1), rand(96, dtype=dtype, seed=2),
                                       cos, sin)
    assert (counts["norm_rope"], counts["rms_norm"], counts["rope"]) == (1, 0, 0)
    assert_close(out, ref)


# ------------------------------------------------------------------------------------------------ the op
def test_op_equals_its_op_sequence_and_defaults_to_the_streams_dtype():
    x, y = rand(2, 3, 4, 32, dtype=torch.bfloat16, seed=1), rand(2, 5, 4, 32, dtype=torch.bfloat16, seed=2)
    w = rand(32, dtype=torch.bfloat16, seed=3)
    cos, sin = _tables(8, 32)
    joined = torch.cat([ops.rms_norm(x, w, 1e-6), ops.rms_norm(y, None, 1e-6)], 1)
    expected = ops.rope(joined, cos, sin, True, torch.bfloat16)
    fused = ops.norm_rope([x, y], 1, [w, None], 1e-6, None, 32, cos, sin, True, torch.bfloat16)
    assert fused.is_contiguous() and fused.shape == expected.shape
    torch.testing.assert_close(fused, expected, rtol=1.6e-2, atol=1e-2)
    named = ops.norm_rope([x, y], 1, [w, None], 1e-6, torch.bfloat16, 32, cos, sin, True, torch.bfloat16)
    assert torch.equal(named, fused)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x, c: ops.norm_rope([x], 1, [None, None], 1e-6, None, 32, c, c, True), "one weight"),
        (lambda x, c: ops.norm_rope([x], 3, [None], 1e-6, None, 32, c, c, True), "but the last"),
        (lambda x, c: ops.norm_rope([x, x[:, :, :2]], 1, [None, None], 1e-6, None, 32, c, c, True),
         "every dimension"),
        (lambda x, c: ops.norm_rope([x], 1, [None], 1e-6, None, 24, c, c, True), "must divide"),
        (lambda x, c: ops.norm_rope([x], 1, [torch.ones(16)], 1e-6, None, 32, c, c, True), "must be None or"),
        (lambda x, c: ops.norm_rope([x], 1, [None], -1.0, None, 32, c, c, True), "eps"),
        (lambda x, c: ops.norm_rope([x], 1, [None], 1e-6, torch.int32, 32, c, c, True), "norm_dtype"),
    ],
    ids=["weights_per_x", "last_dim", "shapes", "head_dim", "weight_width", "eps", "norm_dtype"],
)
def test_bad_input_is_named(call, message):
    cos, _ = _tables(5, 32)
    with pytest.raises(ValueError, match=message):
        call(rand(2, 5, 4, 32), cos)


# ------------------------------------------------------------------------------------------------ models
#: The registry's models with norm_rope sites (their expected counts say so, checked below).
JOINED_MODELS = ["flux", "wan", "qwen_image", "hunyuan_video", "ltx_video", "lumina2", "hidream", "chroma",
                 "skyreels_v2", "flux2"]


def _output(result):
    return result[0] if isinstance(result, tuple) else result.sample


@pytest.mark.slow
@pytest.mark.parametrize("name", JOINED_MODELS)
def test_model_with_norm_rope_off_fuses_the_norms_and_rotations_it_would_join(name):
    from fusion_utils import count_fused
    from mindiesd.compilation import MindieSDBackend

    case = zoo.build(name, "tiny")
    expected = case.expected()
    assert expected["norm_rope"] > 0
    backend = MindieSDBackend(OFF, keep_graphs=True)
    compiled = torch.compile(case.model, backend=backend)
    with torch.no_grad():
        reference, actual = case.model(**case.inputs), compiled(**case.inputs)
    counts = count_fused(backend)
    # every rotation norm_rope joins is one rope, every norm it joins one rms_norm (the registry's models fuse
    # all of their RMSNorms)
    assert counts["norm_rope"] == 0
    assert counts["rope"] == expected["rope"] + expected["norm_rope"]
    assert counts["rms_norm"] == rms_norms(case.model)
    assert_close(_output(actual), _output(reference))
