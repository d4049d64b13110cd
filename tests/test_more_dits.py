"""End to end on tiny diffusers DiTs beyond Flux, SD3 and Wan: compiled output equals eager, no fallback, and every
fusible site of each family is fused.

"No fallback" is checked by the shared runner for every case: no ``MindieSDFallbackWarning`` while compiling or
running, and no record of ``backend.report()`` with a ``fallback``; either makes every test of the model fail.

Each model is a real diffusers class built from a shrunken config with seeded random weights, run at batch 2 so
that per-sample modulation tensors really broadcast. The expected counts are derived from the model's modules and
the forward code of its blocks (documented per model below), not copied from a run. The fused ops are counted at
run time (the ``mindiesd::*`` calls of one compiled forward, read with the profiler), since a graph that Dynamo
compiles once can serve several identical blocks after a graph break; where the model compiles to one graph the
ops in ``backend.graphs`` must give the same counts.

Where a family falls short of the sites the model contains, its case is ``xfail(strict=True)`` with the unfused
form named (see ``GAPS``), so the day the gap is closed the test says so.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from fusion_utils import FAMILIES, count_fused  # noqa: E402
from mindiesd.compilation import MindieSDBackend, MindieSDFallbackWarning  # noqa: E402

BATCH = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: max |compiled - eager| / max |eager| per dtype.
MAX_ERROR = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


# -- builders: (model, keyword inputs) at tiny size ------------------------------------------------------------


def _qwen_image():
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=64, axes_dims_rope=(8, 12, 12),
    )
    g = _gen()
    h = w = 4
    inputs = dict(
        hidden_states=_randn(BATCH, h * w, 16, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 0.5), img_shapes=[(1, h, w)] * BATCH,
    )
    return model, inputs


def _hunyuan_video():
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=32, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=64, pooled_projection_dim=32, rope_axes_dim=(8, 12, 12),
    )
    g = _gen()
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 2, 8, 8, g=g), timestep=torch.full((BATCH,), 500.0),
        encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        encoder_attention_mask=torch.ones(BATCH, 8, dtype=torch.long),
        pooled_projections=_randn(BATCH, 32, g=g), guidance=torch.full((BATCH,), 3500.0),
    )
    return model, inputs


def _cogvideox():
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    # norm_elementwise_affine=True as in the released CogVideoX checkpoints
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4, time_embed_dim=64,
        text_embed_dim=64, num_layers=2, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
        max_text_seq_length=8, use_rotary_positional_embeddings=True, norm_elementwise_affine=True,
    )
    g = _gen()
    frames, h, w = 2, 8, 8
    grid = (h // 2, w // 2)
    rotary = get_3d_rotary_pos_embed(embed_dim=32, crops_coords=((0, 0), grid), grid_size=grid, temporal_size=frames)
    inputs = dict(
        hidden_states=_randn(BATCH, frames, 4, h, w, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 500, dtype=torch.long), image_rotary_emb=rotary,
    )
    return model, inputs


def _ltx_video():
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=32, cross_attention_dim=128,
        num_layers=1, caption_channels=64,
    )
    g = _gen()
    frames, h, w = 2, 4, 4
    inputs = dict(
        hidden_states=_randn(BATCH, frames * h * w, 8, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 500, dtype=torch.long),
        encoder_attention_mask=torch.ones(BATCH, 8, dtype=torch.long),
        num_frames=frames, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32),
    )
    return model, inputs


def _sana():
    model = diffusers.SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=32, num_layers=1,
        num_cross_attention_heads=4, cross_attention_head_dim=32, cross_attention_dim=128, caption_channels=64,
        sample_size=8, patch_size=1, qk_norm="rms_norm_across_heads",
    )
    g = _gen()
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 8, 8, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 500, dtype=torch.long),
        encoder_attention_mask=torch.ones(BATCH, 8, dtype=torch.long),
    )
    return model, inputs


def _lumina2():
    model = diffusers.Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=128, num_layers=1, num_refiner_layers=1,
        num_attention_heads=4, num_kv_heads=2, multiple_of=16, axes_dim_rope=(8, 12, 12), axes_lens=(64, 32, 32),
        cap_feat_dim=64,
    )
    g = _gen()
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 8, 8, g=g), timestep=torch.full((BATCH,), 0.5),
        encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        encoder_attention_mask=torch.ones(BATCH, 8, dtype=torch.bool),
    )
    return model, inputs


def _pixart():
    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=8, num_layers=1,
        cross_attention_dim=128, sample_size=8, patch_size=2, caption_channels=64,
    )
    g = _gen()
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 8, 8, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 500, dtype=torch.long),
        encoder_attention_mask=torch.ones(BATCH, 8, dtype=torch.long),
    )
    return model, inputs


def _hidream(num_routed_experts: int):
    model = diffusers.HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=4, caption_channels=[64, 48], text_emb_dim=32, num_routed_experts=num_routed_experts,
        num_activated_experts=2, axes_dims_rope=(8, 12, 12), max_resolution=(16, 16), llama_layers=[0, 1],
    )
    g = _gen()
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 8, 8, g=g), timesteps=torch.full((BATCH,), 500, dtype=torch.long),
        encoder_hidden_states_t5=_randn(BATCH, 8, 64, g=g),
        encoder_hidden_states_llama3=_randn(2, BATCH, 8, 48, g=g), pooled_embeds=_randn(BATCH, 32, g=g),
    )
    return model, inputs


def _cogview4():
    model = diffusers.CogView4Transformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=32, num_attention_heads=4,
        text_embed_dim=64, time_embed_dim=64, condition_dim=16, pos_embed_max_size=16, sample_size=8,
    )
    g = _gen()
    size = torch.tensor([[64.0, 64.0]] * BATCH)
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 8, 8, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 500, dtype=torch.long), original_size=size, target_size=size.clone(),
        crop_coords=torch.zeros(BATCH, 2),
    )
    return model, inputs


def _auraflow():
    model = diffusers.AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128,
        out_channels=4, pos_embed_max_size=64,
    )
    g = _gen()
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 8, 8, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 0.5),
    )
    return model, inputs


def _grid_ids(rows: int, cols: int, axes: int) -> torch.Tensor:
    ids = torch.zeros(rows, cols, axes)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, axes)


def _chroma():
    model = diffusers.ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(8, 12, 12), approximator_num_channels=16,
        approximator_hidden_dim=64, approximator_layers=2,
    )
    g = _gen()
    inputs = dict(
        hidden_states=_randn(BATCH, 16, 16, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 0.5), img_ids=_grid_ids(4, 4, 3), txt_ids=torch.zeros(8, 3),
    )
    return model, inputs


def _skyreels_v2():
    model = diffusers.SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=64, freq_dim=32, ffn_dim=256, num_layers=1, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    )
    g = _gen()
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 2, 8, 8, g=g), timestep=torch.full((BATCH,), 500, dtype=torch.long),
        encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
    )
    return model, inputs


def _flux2():
    model = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=64, timestep_guidance_channels=64, axes_dims_rope=(8, 8, 8, 8),
    )
    g = _gen()
    txt_ids = torch.zeros(8, 4)
    txt_ids[:, 3] = torch.arange(8)
    inputs = dict(
        hidden_states=_randn(BATCH, 16, 16, g=g), encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
        timestep=torch.full((BATCH,), 0.5), img_ids=_grid_ids(4, 4, 4), txt_ids=txt_ids,
        guidance=torch.full((BATCH,), 3.5),
    )
    return model, inputs


def _omnigen():
    head_dim = 32
    model = diffusers.OmniGenTransformer2DModel(
        in_channels=4, patch_size=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=256, num_layers=2, pad_token_id=0, vocab_size=64, pos_embed_max_size=16,
        time_step_dim=64,
        rope_scaling={"short_factor": [1.0] * (head_dim // 2), "long_factor": [2.0] * (head_dim // 2)},
    )
    g = _gen()
    text, image = 8, (8 // 2) * (8 // 2)
    seq = text + 1 + image  # condition tokens, the time token, the output image's patches
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 8, 8, g=g), timestep=torch.full((BATCH,), 0.5),
        input_ids=torch.randint(1, 64, (BATCH, text), generator=g), input_img_latents=[], input_image_sizes={},
        attention_mask=torch.ones(BATCH, seq, seq), position_ids=torch.arange(seq).repeat(BATCH, 1),
    )
    return model, inputs


def _prx():
    model = diffusers.PRXTransformer2DModel(
        in_channels=4, patch_size=2, context_in_dim=64, hidden_size=128, mlp_ratio=2.0, num_heads=4, depth=2,
        axes_dim=[16, 16],
    )
    g = _gen()
    # Modulation starts at zero (every block an identity): random weights so that the blocks count
    for block in model.blocks:
        with torch.no_grad():
            block.modulation.lin.weight.copy_(_randn(*block.modulation.lin.weight.shape, g=g) * 0.05)
            block.modulation.lin.bias.copy_(_randn(*block.modulation.lin.bias.shape, g=g) * 0.05)
    mask = torch.ones(BATCH, 8, dtype=torch.bool)
    mask[1, 6:] = False
    inputs = dict(
        hidden_states=_randn(BATCH, 4, 8, 8, g=g), timestep=torch.full((BATCH,), 0.5),
        encoder_hidden_states=_randn(BATCH, 8, 64, g=g), attention_mask=mask,
    )
    return model, inputs


def _anyflow():
    model = diffusers.AnyFlowTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=64, freq_dim=32, ffn_dim=256, num_layers=2, rope_max_seq_len=64,
    )
    g = _gen()
    frames = 2
    inputs = dict(
        hidden_states=_randn(BATCH, frames, 4, 8, 8, g=g),  # (B, F, C, H, W)
        timestep=torch.full((BATCH, frames), 500.0), r_timestep=torch.full((BATCH, frames), 250.0),
        encoder_hidden_states=_randn(BATCH, 8, 64, g=g),
    )
    return model, inputs


# -- expected counts -------------------------------------------------------------------------------------------


def _modules(model, *names):
    return [m for m in model.modules() if type(m).__name__ in names]


def _rms_norms(model):
    from diffusers.models.normalization import RMSNorm

    return sum(isinstance(m, (torch.nn.RMSNorm, RMSNorm)) for m in model.modules())


def _tanh_gelus(model):
    from diffusers.models.activations import GELU

    return sum(isinstance(m, (torch.nn.GELU, GELU)) and m.approximate == "tanh" for m in model.modules())


def expected_qwen_image(model):
    n = len(model.transformer_blocks)
    # The model returns only the image stream: after the joint attention of the last block, its text stream
    # (gated attention residual, txt_norm2 modulation, txt_mlp, gated MLP residual) is dead code that aot drops.
    return {
        "rms_norm": _rms_norms(model),  # txt_norm, and norm_q/k, norm_added_q/k of every block
        "rope": 4 * n,  # image q, k and text q, k of every block (complex form)
        # img_norm1, img_norm2 and txt_norm1 of every block, txt_norm2 but in the last, the norm_out module
        "adalayernorm": 3 * n + (n - 1) + len(_modules(model, "AdaLayerNormContinuous")),
        "fast_gelu": n + (n - 1),  # img_mlp of every block, txt_mlp but in the last
        "mul_add": 2 * n + 2 * (n - 1),  # gated residuals: image attention and MLP; text where alive
    }


def expected_hunyuan_video(model):
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    refiner = len(model.context_embedder.token_refiner.refiner_blocks)
    return {
        "rms_norm": _rms_norms(model),  # q/k norms: 4 per double block (with the added ones), 2 per single
        "rope": 2 * (double + single),  # q and k of the image tokens, in every block (interleaved)
        # AdaLayerNormZero (image and text) per double block plus its two inline norm2 modulations,
        # AdaLayerNormZeroSingle per single block, the AdaLayerNormContinuous norm_out; the refiner's LayerNorms
        # are affine and unmodulated
        "adalayernorm": len(_modules(model, "AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous"))
        + 2 * double,
        "fast_gelu": _tanh_gelus(model),  # ff and ff_context per double block, act_mlp per single block
        # gated residuals: 4 per double block, 1 per single block, and the two `x + out * gate` per refiner block
        "mul_add": 4 * double + single + 2 * refiner,
    }


def expected_cogvideox(model):
    n = len(model.transformer_blocks)
    return {
        "rms_norm": 0,  # the q/k norms are LayerNorms
        "rope": 2 * n,  # q and k of the image tokens, written back in place (interleaved)
        # CogVideoXLayerNormZero norm1 and norm2 each modulate the image and the text stream, plus the AdaLayerNorm
        # norm_out: `norm(x) * (1 + scale) + shift`
        "adalayernorm": 4 * n + 1,
        "fast_gelu": _tanh_gelus(model),  # one FeedForward per block (on the concatenated streams)
        # gated residuals of attention and FF for both streams; the last block's text FF residual is dead code
        "mul_add": 4 * n - 1,
    }


def expected_ltx_video(model):
    n = len(model.transformer_blocks)
    return {
        # norm1 and norm2 (diffusers RMSNorm without weight), norm_q and norm_k of attn1 and attn2 (torch RMSNorm).
        # norm1/norm2 are modulated `rms(x) * (1 + scale) + shift`: the rms_norm rule takes `(1 + scale)` as its
        # weight and leaves `+ shift` a plain add, so those modulations are no mul_add site.
        "rms_norm": _rms_norms(model),
        "rope": 2 * n,  # q and k of attn1, rotated across heads (interleaved)
        "adalayernorm": 1,  # norm_out: LayerNorm without affine, modulated by scale_shift_table + temb
        "fast_gelu": _tanh_gelus(model),  # ff of every block and the caption projection
        "mul_add": 2 * n,  # gated residuals of attn1 and ff; the attn2 residual is a plain add
    }


def expected_sana(model):
    n = len(model.transformer_blocks)
    return {
        "rms_norm": _rms_norms(model),  # caption_norm, and norm_q/k of attn1 and attn2 (rms_norm_across_heads)
        "rope": 0,
        "adalayernorm": 2 * n + len(_modules(model, "SanaModulatedNorm")),  # norm1, norm2 per block; norm_out
        "fast_gelu": _tanh_gelus(model),  # the caption projection (the blocks use GLUMBConv with SiLU)
        "mul_add": 2 * n,  # gated residuals of attn1 and ff; the cross-attention residual is a plain add
    }


def expected_lumina2(model):
    blocks = [*model.context_refiner, *model.noise_refiner, *model.layers]
    modulated = [b for b in blocks if b.modulation]
    return {
        # caption RMSNorm, and per block norm_q, norm_k, norm1 (or LuminaRMSNormZero's), norm2, ffn_norm1/2
        "rms_norm": _rms_norms(model),
        "rope": 2 * len(blocks),  # q and k of every block (complex form, float64 tables)
        # LuminaLayerNormContinuous norm_out: `layer_norm(x) * (1 + scale)` (adaLN without shift)
        "adalayernorm": len(_modules(model, "LuminaLayerNormContinuous")),
        "fast_gelu": 0,  # SwiGLU feed-forward
        "mul_add": 2 * len(modulated),  # `x + tanh(gate) * norm(out)` for attention and FFN of modulated blocks
    }


def expected_pixart(model):
    n = len(model.transformer_blocks)
    return {
        "rms_norm": 0,
        "rope": 0,
        "adalayernorm": 2 * n + 1,  # ada_norm_single norm1 and norm2 of every block, and norm_out
        "fast_gelu": _tanh_gelus(model),  # ff of every block and the caption projection
        "mul_add": 2 * n,  # gated residuals of attn1 and ff; the cross-attention residual is a plain add
    }


def expected_hidream(model):
    double, single = len(model.double_stream_blocks), len(model.single_stream_blocks)
    return {
        "rms_norm": _rms_norms(model),  # q/k norms: image and text stream per double block, one pair per single
        "rope": 2 * (double + single),  # q and k in every block (2x2 rotation-matrix form)
        # norm1_i, norm1_t, norm3_i, norm3_t per double block, norm1_i, norm3_i per single block, final_layer
        "adalayernorm": 4 * double + 2 * single + 1,
        "fast_gelu": 0,  # SwiGLU experts
        "mul_add": 4 * double + 2 * single,  # gated residuals
    }


def expected_cogview4(model):
    n = len(model.transformer_blocks)
    # Only the image stream leaves the last block: its text stream after attention is dead code.
    return {
        "rms_norm": 0,  # the q/k norms are LayerNorms
        "rope": 2 * n,  # q and k of the image tokens, half-rotated, written back in place
        # image norm1, norm2 and text norm1 of every block, text norm2 but in the last, CogView4 norm_out
        "adalayernorm": 3 * n + (n - 1) + 1,
        "fast_gelu": n + (n - 1),  # `self.ff` runs on the image stream, and on the text stream where alive
        "mul_add": 2 * n + 2 * (n - 1),  # gated residuals of attention and FF, text ones where alive
    }


def expected_auraflow(model):
    joint, single = len(model.joint_transformer_blocks), len(model.single_transformer_blocks)
    return {
        "rms_norm": 0,  # fp32 LayerNorm q/k norms
        "rope": 0,
        # AdaLayerNormZero (image and text) and the inline norm2 modulations per joint block, AdaLayerNormZero and
        # its norm2 modulation per single block
        "adalayernorm": len(_modules(model, "AdaLayerNormZero")) + 2 * joint + single,
        "fast_gelu": 0,  # SwiGLU feed-forward
        # gated residuals (attention and FF of both streams per joint block, two per single block) and the
        # AuraFlowPreFinalBlock `x * (1 + scale) + shift`, which has no norm
        "mul_add": 4 * joint + 2 * single + 1,
    }


def expected_chroma(model):
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    return {
        "rms_norm": _rms_norms(model),  # the approximator's norms and the q/k norms
        "rope": 2 * (double + single),
        "adalayernorm": len(
            _modules(
                model,
                "ChromaAdaLayerNormZeroPruned",
                "ChromaAdaLayerNormZeroSinglePruned",
                "ChromaAdaLayerNormContinuousPruned",
            )
        )
        + 2 * double,  # the pruned adaLN modules, and the two inline norm2 modulations per double block
        "fast_gelu": _tanh_gelus(model),
        "mul_add": 4 * double + single,  # gated residuals
    }


def expected_skyreels_v2(model):
    n = len(model.blocks)
    return {
        "rms_norm": _rms_norms(model),  # norm_q and norm_k of attn1 and attn2
        "rope": 2 * n,  # q and k of attn1 (Wan's strided form)
        "adalayernorm": 2 * n + 1,  # norm1 and norm3 of every block, and the final norm_out modulation
        "fast_gelu": _tanh_gelus(model),  # ffn of every block and the text embedder
        "mul_add": 2 * n,  # gated residuals of attn1 and ffn
    }


def expected_flux2(model):
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    return {
        "rms_norm": _rms_norms(model),  # q/k norms: 4 per double block, 2 per single block
        "rope": 2 * (double + single),
        # inline `(1 + scale) * norm(x) + shift`: 4 per double block, 1 per single block; the norm_out module
        "adalayernorm": 4 * double + single + len(_modules(model, "AdaLayerNormContinuous")),
        "fast_gelu": 0,  # SwiGLU feed-forward
        "mul_add": 4 * double + single,  # gated residuals
    }


def expected_omnigen(model):
    n = len(model.layers)
    return {
        "rms_norm": _rms_norms(model),  # input_layernorm and post_attention_layernorm per block, the final norm
        "rope": 2 * n,  # q and k of every block (half-rotated, use_real_unbind_dim=-2)
        "adalayernorm": len(_modules(model, "AdaLayerNorm")),  # norm_out: LayerNorm without affine, chunk_dim=1
        "fast_gelu": 0,  # SiLU-gated feed-forward
        "mul_add": 0,  # the blocks are unmodulated: plain residual adds
    }


def expected_prx(model):
    n = len(model.blocks)
    return {
        "rms_norm": _rms_norms(model),  # norm_q, norm_k of the image tokens and norm_added_k of the text, per block
        "rope": 2 * n,  # image q and k of every block (a 2x2 matrix per pair)
        # `(1 + scale) * norm(x) + shift`: img_pre_norm and post_attention_layernorm per block, the FinalLayer's
        "adalayernorm": 2 * n + len(_modules(model, "FinalLayer")),
        "fast_gelu": _tanh_gelus(model),  # mlp_act of every block (gated MLP)
        "mul_add": 2 * n,  # gated residuals of attention and MLP
    }


def expected_anyflow(model):
    n = len(model.blocks)
    return {
        "rms_norm": _rms_norms(model),  # norm_q and norm_k (across heads) of attn1 and attn2
        "rope": 2 * n,  # q and k of attn1 (complex form, float64 table)
        # fp32 norm1 and norm3 of every block with per-token modulation, and norm_out; norm2 is affine, unmodulated
        "adalayernorm": 2 * n + 1,
        "fast_gelu": _tanh_gelus(model),  # ffn of every block and the text embedder
        # gated residuals of attn1 and ffn (the cross-attention residual is a plain add), and the condition
        # embedder's timestep mix `(1 - gate) * temb + gate * delta_emb`
        "mul_add": 2 * n + 1,
    }


@dataclass(frozen=True)
class Spec:
    cls: str  # the diffusers class; the model's cases are skipped where this diffusers lacks it
    build: Callable[[], Any]
    expected: Callable[[Any], Dict[str, int]]
    dtypes: tuple = tuple(DTYPES)


MODELS: Dict[str, Spec] = {
    "qwen_image": Spec("QwenImageTransformer2DModel", _qwen_image, expected_qwen_image),
    "hunyuan_video": Spec("HunyuanVideoTransformer3DModel", _hunyuan_video, expected_hunyuan_video),
    "cogvideox": Spec("CogVideoXTransformer3DModel", _cogvideox, expected_cogvideox),
    "ltx_video": Spec("LTXVideoTransformer3DModel", _ltx_video, expected_ltx_video),
    "sana": Spec("SanaTransformer2DModel", _sana, expected_sana),
    "lumina2": Spec("Lumina2Transformer2DModel", _lumina2, expected_lumina2),
    "pixart": Spec("PixArtTransformer2DModel", _pixart, expected_pixart),
    "hidream": Spec("HiDreamImageTransformer2DModel", lambda: _hidream(0), expected_hidream),
    # the released config routes tokens to experts with data-dependent control flow: Dynamo breaks the graph in
    # every MoE layer and reuses the graphs of the first blocks for the later ones (fp32 only, to save time)
    "hidream_moe": Spec("HiDreamImageTransformer2DModel", lambda: _hidream(4), expected_hidream, dtypes=("fp32",)),
    "cogview4": Spec("CogView4Transformer2DModel", _cogview4, expected_cogview4),
    "auraflow": Spec("AuraFlowTransformer2DModel", _auraflow, expected_auraflow),
    "chroma": Spec("ChromaTransformer2DModel", _chroma, expected_chroma),
    "skyreels_v2": Spec("SkyReelsV2Transformer3DModel", _skyreels_v2, expected_skyreels_v2),
    "flux2": Spec("Flux2Transformer2DModel", _flux2, expected_flux2),
    "omnigen": Spec("OmniGenTransformer2DModel", _omnigen, expected_omnigen),
    "prx": Spec("PRXTransformer2DModel", _prx, expected_prx),
    "anyflow": Spec("AnyFlowTransformer3DModel", _anyflow, expected_anyflow),
}

_AFFINE_ADALN = (
    "CogVideoXLayerNormZero and AdaLayerNorm modulate an affine LayerNorm, native_layer_norm(x, [D], weight, bias) "
    "* (1 + scale) + shift; the adalayernorm rule requires a LayerNorm without weight and bias"
)
#: (model, family) -> the unfused form behind the shortfall.
GAPS: Dict[tuple, str] = {
    ("cogvideox", "adalayernorm"): _AFFINE_ADALN,
    ("cogvideox", "mul_add"): "mul_add fuses the unfused affine-LayerNorm modulations instead: " + _AFFINE_ADALN,
    ("lumina2", "adalayernorm"): (
        "LuminaLayerNormContinuous norm_out is native_layer_norm(x) * (1 + scale) without a shift; the "
        "adalayernorm rule requires the `+ shift`"
    ),
}


# -- one compiled run per (model, dtype), shared by the tests ----------------------------------------------------


@dataclass
class Run:
    error: float = 0.0
    expected: Dict[str, int] = field(default_factory=dict)
    at_run_time: Dict[str, int] = field(default_factory=dict)
    in_graphs: Dict[str, int] = field(default_factory=dict)
    graphs: int = 0
    fallbacks: List[str] = field(default_factory=list)  # the report's records that ran the unfused graph
    fallback_warnings: List[str] = field(default_factory=list)  # MindieSDFallbackWarnings at compile or run time
    failure: Optional[BaseException] = None


_RUNS: Dict[tuple, Run] = {}


def _cast(inputs: Dict[str, Any], dtype: torch.dtype) -> Dict[str, Any]:
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()
    }


def _fused_calls(fn: Callable[[], Any]) -> tuple:
    """fn's result, and the mindiesd ops that the call executed, per family."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    calls = Counter(e.name.split("::", 1)[1] for e in prof.events() if e.name.startswith("mindiesd::"))
    return result, {family: calls.get(family, 0) for family in FAMILIES}


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output.sample


def _run(name: str, dtype: torch.dtype) -> Run:
    if not hasattr(diffusers, MODELS[name].cls):
        pytest.skip(f"diffusers {diffusers.__version__} has no {MODELS[name].cls}")
    key = (name, dtype)
    if key not in _RUNS:
        run = Run()
        try:
            spec = MODELS[name]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model, inputs = spec.build()
            model = model.to(dtype).eval()
            inputs = _cast(inputs, dtype)
            run.expected = spec.expected(model)
            backend = MindieSDBackend(keep_graphs=True)
            compiled = torch.compile(model, backend=backend)
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                reference = _first(model(**inputs, return_dict=False))
                actual = _first(compiled(**inputs, return_dict=False))  # compiles, then runs
                second, run.at_run_time = _fused_calls(lambda: _first(compiled(**inputs, return_dict=False)))
            run.fallback_warnings = [str(w.message) for w in caught if issubclass(w.category, MindieSDFallbackWarning)]
            run.fallbacks = [record.fallback for record in backend.report().records if record.fallback]
            # a fallback runs the unfused graph: every count and comparison below would describe that graph
            assert run.fallback_warnings == [], run.fallback_warnings
            assert run.fallbacks == [], run.fallbacks
            assert actual.shape == reference.shape and actual.dtype == reference.dtype
            torch.testing.assert_close(second, actual, rtol=0, atol=0)  # the second call reruns the same graphs
            run.error = ((actual.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
            run.in_graphs = count_fused(backend)
            run.graphs = backend.report().graphs
        except Exception as exc:  # reported by every test of this model and dtype
            run.failure = RuntimeError(f"{name} {dtype}: {type(exc).__name__}: {exc}")
            run.failure.__cause__ = exc
        _RUNS[key] = run
    run = _RUNS[key]
    if run.failure is not None:
        raise run.failure
    return run


def _cases(with_families: bool):
    for name, spec in MODELS.items():
        for dtype_id in spec.dtypes:
            if not with_families:
                yield pytest.param(name, DTYPES[dtype_id], id=f"{name}-{dtype_id}")
                continue
            for family in FAMILIES:
                marks = []
                if (name, family) in GAPS:
                    marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=GAPS[(name, family)]))
                yield pytest.param(name, DTYPES[dtype_id], family, marks=marks, id=f"{name}-{dtype_id}-{family}")


@pytest.mark.parametrize("name,dtype", list(_cases(with_families=False)))
def test_compiled_matches_eager_without_fallback(name, dtype):
    run = _run(name, dtype)
    assert run.fallbacks == [] and run.fallback_warnings == []
    assert run.error <= MAX_ERROR[dtype], run.error


@pytest.mark.parametrize("name,dtype,family", list(_cases(with_families=True)))
def test_every_site_is_fused(name, dtype, family):
    run = _run(name, dtype)
    assert run.at_run_time[family] == run.expected[family], (run.at_run_time, run.expected)
    if run.graphs == 1:
        assert run.in_graphs[family] == run.expected[family], (run.in_graphs, run.expected)
