"""The wider suite: tiny diffusers DiTs beyond Flux, SD3 and Wan, at batch 2.

Batch 2, so that per-sample modulation tensors really broadcast. Each model is a real diffusers class built from a
shrunken config; the expected counts below are derived from the model's modules and the forward code of its
blocks (documented per model), not copied from a run.
"""

from __future__ import annotations

import torch

from ._base import Entry, Spec, grid_ids, modules_named, rms_norms, tanh_gelus

BATCH = 2


def _tiny(config, **shapes):
    return {"tiny": Spec(config=config, shapes=dict(batch=BATCH, **shapes))}


def _randn(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


# -- builders ----------------------------------------------------------------------------------------------------


def _qwen_image(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    h, w = spec.shapes["grid"]
    text = spec.shapes["text_tokens"]
    model = d.QwenImageTransformer2DModel(**cfg)
    inputs = dict(
        hidden_states=_randn(b, h * w, cfg["in_channels"], g=g),
        encoder_hidden_states=_randn(b, text, cfg["joint_attention_dim"], g=g),
        timestep=torch.full((b,), 0.5), img_shapes=[(1, h, w)] * b,
    )
    return model, inputs


def _hunyuan_video(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    text = spec.shapes["text_tokens"]
    model = d.HunyuanVideoTransformer3DModel(**cfg)
    inputs = dict(
        hidden_states=_randn(b, cfg["in_channels"], *spec.shapes["latent"], g=g),  # (B, C, F, H, W)
        timestep=torch.full((b,), 500.0),
        encoder_hidden_states=_randn(b, text, cfg["text_embed_dim"], g=g),
        encoder_attention_mask=torch.ones(b, text, dtype=torch.long),
        pooled_projections=_randn(b, cfg["pooled_projection_dim"], g=g), guidance=torch.full((b,), 3500.0),
    )
    return model, inputs


def _cogvideox(d, spec, g):
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    cfg, b = spec.config, spec.shapes["batch"]
    frames, h, w = spec.shapes["latent"]
    text = spec.shapes["text_tokens"]
    model = d.CogVideoXTransformer3DModel(**cfg)
    grid = (h // cfg["patch_size"], w // cfg["patch_size"])
    rotary = get_3d_rotary_pos_embed(
        embed_dim=cfg["attention_head_dim"], crops_coords=((0, 0), grid), grid_size=grid, temporal_size=frames
    )
    inputs = dict(
        hidden_states=_randn(b, frames, cfg["in_channels"], h, w, g=g),
        encoder_hidden_states=_randn(b, text, cfg["text_embed_dim"], g=g),
        timestep=torch.full((b,), 500, dtype=torch.long), image_rotary_emb=rotary,
    )
    return model, inputs


def _ltx_video(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    frames, h, w = spec.shapes["latent"]
    text = spec.shapes["text_tokens"]
    model = d.LTXVideoTransformer3DModel(**cfg)
    inputs = dict(
        hidden_states=_randn(b, frames * h * w, cfg["in_channels"], g=g),
        encoder_hidden_states=_randn(b, text, cfg["caption_channels"], g=g),
        timestep=torch.full((b,), 500, dtype=torch.long),
        encoder_attention_mask=torch.ones(b, text, dtype=torch.long),
        num_frames=frames, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32),
    )
    return model, inputs


def _image_with_caption(cls_name, mask_dtype=torch.long, timestep=None):
    """Builder of a model taking a (B, C, H, W) latent, a caption and a timestep (and a caption mask)."""

    def build(d, spec, g):
        cfg, b = spec.config, spec.shapes["batch"]
        text, caption = spec.shapes["text_tokens"], spec.shapes["caption_dim"]
        model = getattr(d, cls_name)(**cfg)
        inputs = dict(
            hidden_states=_randn(b, cfg["in_channels"], *spec.shapes["sample"], g=g),
            encoder_hidden_states=_randn(b, text, caption, g=g),
            timestep=torch.full((b,), 500, dtype=torch.long) if timestep is None else torch.full((b,), timestep),
        )
        if mask_dtype is not None:
            inputs["encoder_attention_mask"] = torch.ones(b, text, dtype=mask_dtype)
        return model, inputs

    return build


def _lumina2(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    text = spec.shapes["text_tokens"]
    model = d.Lumina2Transformer2DModel(**cfg)
    inputs = dict(
        hidden_states=_randn(b, cfg["in_channels"], *spec.shapes["sample"], g=g), timestep=torch.full((b,), 0.5),
        encoder_hidden_states=_randn(b, text, cfg["cap_feat_dim"], g=g),
        encoder_attention_mask=torch.ones(b, text, dtype=torch.bool),
    )
    return model, inputs


def _hidream(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    text = spec.shapes["text_tokens"]
    t5, llama = cfg["caption_channels"]
    model = d.HiDreamImageTransformer2DModel(**cfg)
    inputs = dict(
        hidden_states=_randn(b, cfg["in_channels"], *spec.shapes["sample"], g=g),
        timesteps=torch.full((b,), 500, dtype=torch.long),
        encoder_hidden_states_t5=_randn(b, text, t5, g=g),
        encoder_hidden_states_llama3=_randn(len(cfg["llama_layers"]), b, text, llama, g=g),
        pooled_embeds=_randn(b, cfg["text_emb_dim"], g=g),
    )
    return model, inputs


def _cogview4(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    text = spec.shapes["text_tokens"]
    model = d.CogView4Transformer2DModel(**cfg)
    size = torch.tensor([[64.0, 64.0]] * b)
    inputs = dict(
        hidden_states=_randn(b, cfg["in_channels"], *spec.shapes["sample"], g=g),
        encoder_hidden_states=_randn(b, text, cfg["text_embed_dim"], g=g),
        timestep=torch.full((b,), 500, dtype=torch.long), original_size=size, target_size=size.clone(),
        crop_coords=torch.zeros(b, 2),
    )
    return model, inputs


def _chroma(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    rows, cols = spec.shapes["grid"]
    text = spec.shapes["text_tokens"]
    model = d.ChromaTransformer2DModel(**cfg)
    inputs = dict(
        hidden_states=_randn(b, rows * cols, cfg["in_channels"], g=g),
        encoder_hidden_states=_randn(b, text, cfg["joint_attention_dim"], g=g),
        timestep=torch.full((b,), 0.5), img_ids=grid_ids(rows, cols, 3), txt_ids=torch.zeros(text, 3),
    )
    return model, inputs


def _skyreels_v2(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    text = spec.shapes["text_tokens"]
    model = d.SkyReelsV2Transformer3DModel(**cfg)
    inputs = dict(
        hidden_states=_randn(b, cfg["in_channels"], *spec.shapes["latent"], g=g),  # (B, C, F, H, W)
        timestep=torch.full((b,), 500, dtype=torch.long),
        encoder_hidden_states=_randn(b, text, cfg["text_dim"], g=g),
    )
    return model, inputs


def _flux2(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    rows, cols = spec.shapes["grid"]
    text = spec.shapes["text_tokens"]
    model = d.Flux2Transformer2DModel(**cfg)
    axes = len(cfg["axes_dims_rope"])
    txt_ids = torch.zeros(text, axes)
    txt_ids[:, 3] = torch.arange(text)
    inputs = dict(
        hidden_states=_randn(b, rows * cols, cfg["in_channels"], g=g),
        encoder_hidden_states=_randn(b, text, cfg["joint_attention_dim"], g=g),
        timestep=torch.full((b,), 0.5), img_ids=grid_ids(rows, cols, axes), txt_ids=txt_ids,
        guidance=torch.full((b,), 3.5),
    )
    return model, inputs


def _omnigen(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    text = spec.shapes["text_tokens"]
    h, w = spec.shapes["sample"]
    model = d.OmniGenTransformer2DModel(**cfg)
    patch = cfg["patch_size"]
    image = (h // patch) * (w // patch)
    seq = text + 1 + image  # condition tokens, the time token, the output image's patches
    inputs = dict(
        hidden_states=_randn(b, cfg["in_channels"], h, w, g=g), timestep=torch.full((b,), 0.5),
        input_ids=torch.randint(1, cfg["vocab_size"], (b, text), generator=g), input_img_latents=[],
        input_image_sizes={}, attention_mask=torch.ones(b, seq, seq), position_ids=torch.arange(seq).repeat(b, 1),
    )
    return model, inputs


def _prx(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    text = spec.shapes["text_tokens"]
    model = d.PRXTransformer2DModel(**cfg)
    # Modulation starts at zero (every block an identity): random weights so that the blocks count
    for block in model.blocks:
        with torch.no_grad():
            block.modulation.lin.weight.copy_(_randn(*block.modulation.lin.weight.shape, g=g) * 0.05)
            block.modulation.lin.bias.copy_(_randn(*block.modulation.lin.bias.shape, g=g) * 0.05)
    mask = torch.ones(b, text, dtype=torch.bool)
    mask[1, spec.shapes["text_valid"]:] = False  # the second sample's caption is shorter
    inputs = dict(
        hidden_states=_randn(b, cfg["in_channels"], *spec.shapes["sample"], g=g), timestep=torch.full((b,), 0.5),
        encoder_hidden_states=_randn(b, text, cfg["context_in_dim"], g=g), attention_mask=mask,
    )
    return model, inputs


def _anyflow(d, spec, g):
    cfg, b = spec.config, spec.shapes["batch"]
    frames, h, w = spec.shapes["latent"]
    text = spec.shapes["text_tokens"]
    model = d.AnyFlowTransformer3DModel(**cfg)
    inputs = dict(
        hidden_states=_randn(b, frames, cfg["in_channels"], h, w, g=g),  # (B, F, C, H, W)
        timestep=torch.full((b, frames), 500.0), r_timestep=torch.full((b, frames), 250.0),
        encoder_hidden_states=_randn(b, text, cfg["text_dim"], g=g),
    )
    return model, inputs


# -- expected counts ---------------------------------------------------------------------------------------------


def expected_qwen_image(model):
    n = len(model.transformer_blocks)
    # The model returns only the image stream: after the joint attention of the last block, its text stream
    # (gated attention residual, txt_norm2 modulation, txt_mlp, gated MLP residual) is dead code that aot drops.
    return {
        # txt_norm, and norm_q/k, norm_added_q/k of every block: the q/k norms are joined with the rotation after them
        "rms_norm": rms_norms(model) - 4 * n,
        "rope": 0,
        "norm_rope": 4 * n,  # image q, k and text q, k of every block, each rotated after its norm (complex form)
        # img_norm1, img_norm2 and txt_norm1 of every block, txt_norm2 but in the last, the norm_out module
        "adalayernorm": 3 * n + (n - 1) + len(modules_named(model, "AdaLayerNormContinuous")),
        "glu": 0,  # the MLPs are tanh-GELU FeedForwards
        "fast_gelu": n + (n - 1),  # img_mlp of every block, txt_mlp but in the last
        "mul_add": 2 * n + 2 * (n - 1),  # gated residuals: image attention and MLP; text where alive
    }


def expected_hunyuan_video(model):
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    refiner = len(model.context_embedder.token_refiner.refiner_blocks)
    return {
        # q/k norms: 4 per double block (with the added ones), 2 per single; the image q/k norms of the double
        # blocks are joined with the rotation after them
        "rms_norm": rms_norms(model) - 2 * double,
        # q and k of the image tokens, in every block (interleaved): in the single blocks only the image slice of
        # the normalised stream is rotated, which leaves norm and rope apart
        "rope": 2 * single,
        "norm_rope": 2 * double,
        # AdaLayerNormZero (image and text) per double block plus its two inline norm2 modulations,
        # AdaLayerNormZeroSingle per single block, the AdaLayerNormContinuous norm_out; the refiner's LayerNorms
        # are affine and unmodulated
        "adalayernorm": len(
            modules_named(model, "AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous")
        )
        + 2 * double,
        "glu": 0,  # tanh-GELU feed-forwards
        "fast_gelu": tanh_gelus(model),  # ff and ff_context per double block, act_mlp per single block
        # gated residuals: 4 per double block, 1 per single block, and the two `x + out * gate` per refiner block
        "mul_add": 4 * double + single + 2 * refiner,
    }


def expected_cogvideox(model):
    n = len(model.transformer_blocks)
    return {
        "rms_norm": 0,  # the q/k norms are LayerNorms
        "rope": 2 * n,  # q and k of the image tokens, written back in place (interleaved)
        "norm_rope": 0,  # the q/k norms are LayerNorms
        # CogVideoXLayerNormZero norm1 and norm2 each modulate the image and the text stream, plus the AdaLayerNorm
        # norm_out: `norm(x) * (1 + scale) + shift`
        "adalayernorm": 4 * n + 1,
        "glu": 0,  # tanh-GELU feed-forward
        "fast_gelu": tanh_gelus(model),  # one FeedForward per block (on the concatenated streams)
        # gated residuals of attention and FF for both streams; the last block's text FF residual is dead code
        "mul_add": 4 * n - 1,
    }


def expected_ltx_video(model):
    n = len(model.transformer_blocks)
    return {
        # norm1 and norm2 (diffusers RMSNorm without weight), norm_q and norm_k of attn1 and attn2 (torch RMSNorm).
        # norm1/norm2 are modulated `rms(x) * (1 + scale) + shift`: the rms_norm rule takes `(1 + scale)` as its
        # weight and leaves `+ shift` a plain add, so those modulations are no mul_add site.
        "rms_norm": rms_norms(model) - 2 * n,  # less attn1's norm_q and norm_k, joined with the rotation after them
        "rope": 0,
        "norm_rope": 2 * n,  # q and k of attn1, normalised and rotated across heads (interleaved)
        "adalayernorm": 1,  # norm_out: LayerNorm without affine, modulated by scale_shift_table + temb
        "glu": 0,  # tanh-GELU feed-forwards
        "fast_gelu": tanh_gelus(model),  # ff of every block and the caption projection
        "mul_add": 2 * n,  # gated residuals of attn1 and ff; the attn2 residual is a plain add
    }


def expected_sana(model):
    n = len(model.transformer_blocks)
    return {
        "rms_norm": rms_norms(model),  # caption_norm, and norm_q/k of attn1 and attn2 (rms_norm_across_heads)
        "rope": 0,
        "norm_rope": 0,  # no rotary embedding
        "adalayernorm": 2 * n + len(modules_named(model, "SanaModulatedNorm")),  # norm1, norm2 per block; norm_out
        # `x * silu(gate)` of GLUMBConv: halves split along channels, fused as two tensors
        "glu": len(modules_named(model, "GLUMBConv")),
        "fast_gelu": tanh_gelus(model),  # the caption projection (the blocks use GLUMBConv with SiLU)
        "mul_add": 2 * n,  # gated residuals of attn1 and ff; the cross-attention residual is a plain add
    }


def expected_lumina2(model):
    blocks = [*model.context_refiner, *model.noise_refiner, *model.layers]
    modulated = [b for b in blocks if b.modulation]
    return {
        # caption RMSNorm, and per block norm_q, norm_k, norm1 (or LuminaRMSNormZero's), norm2, ffn_norm1/2
        # (the norm_q and norm_k joined with the rotation after them)
        "rms_norm": rms_norms(model) - 2 * len(blocks),
        "rope": 0,
        "norm_rope": 2 * len(blocks),  # q and k of every block (complex form, float64 tables)
        # LuminaLayerNormContinuous norm_out: `layer_norm(x) * (1 + scale)` (adaLN without shift)
        "adalayernorm": len(modules_named(model, "LuminaLayerNormContinuous")),
        # `silu(linear_1(x)) * linear_3(x)`, SiLU in fp32 (FP32SiLU)
        "glu": len(modules_named(model, "LuminaFeedForward")),
        "fast_gelu": 0,  # SwiGLU feed-forward
        "mul_add": 2 * len(modulated),  # `x + tanh(gate) * norm(out)` for attention and FFN of modulated blocks
    }


def expected_pixart(model):
    n = len(model.transformer_blocks)
    return {
        "rms_norm": 0,
        "rope": 0,
        "norm_rope": 0,  # no rotary embedding
        "adalayernorm": 2 * n + 1,  # ada_norm_single norm1 and norm2 of every block, and norm_out
        "glu": 0,  # tanh-GELU feed-forwards
        "fast_gelu": tanh_gelus(model),  # ff of every block and the caption projection
        "mul_add": 2 * n,  # gated residuals of attn1 and ff; the cross-attention residual is a plain add
    }


def expected_hidream(model):
    double, single = len(model.double_stream_blocks), len(model.single_stream_blocks)
    return {
        # q/k norms: image and text stream per double block, one pair per single, all joined with the rotation
        "rms_norm": rms_norms(model) - 4 * double - 2 * single,
        "rope": 0,
        # q and k in every block (2x2 rotation-matrix form): each stream normalised over all heads and split into
        # heads, the double blocks' streams then joined along the sequence
        "norm_rope": 2 * (double + single),
        # norm1_i, norm1_t, norm3_i, norm3_t per double block, norm1_i, norm3_i per single block, final_layer
        "adalayernorm": 4 * double + 2 * single + 1,
        # `silu(w1(x)) * w3(x)`: ff_i, ff_t, and in MoE layers the shared and every routed expert (at the registry's
        # inputs every expert receives tokens; one without tokens is not called)
        "glu": len(modules_named(model, "HiDreamImageFeedForwardSwiGLU")),
        "fast_gelu": 0,  # SwiGLU experts
        "mul_add": 4 * double + 2 * single,  # gated residuals
    }


def expected_cogview4(model):
    n = len(model.transformer_blocks)
    # Only the image stream leaves the last block: its text stream after attention is dead code.
    return {
        "rms_norm": 0,  # the q/k norms are LayerNorms
        "rope": 2 * n,  # q and k of the image tokens, half-rotated, written back in place
        "norm_rope": 0,  # the q/k norms are LayerNorms
        # image norm1, norm2 and text norm1 of every block, text norm2 but in the last, CogView4 norm_out
        "adalayernorm": 3 * n + (n - 1) + 1,
        "glu": 0,  # tanh-GELU feed-forwards
        "fast_gelu": n + (n - 1),  # `self.ff` runs on the image stream, and on the text stream where alive
        "mul_add": 2 * n + 2 * (n - 1),  # gated residuals of attention and FF, text ones where alive
    }


def expected_auraflow(model):
    joint, single = len(model.joint_transformer_blocks), len(model.single_transformer_blocks)
    return {
        "rms_norm": 0,  # fp32 LayerNorm q/k norms
        "rope": 0,
        "norm_rope": 0,  # no rotary embedding
        # AdaLayerNormZero (image and text) and the inline norm2 modulations per joint block, AdaLayerNormZero and
        # its norm2 modulation per single block
        "adalayernorm": len(modules_named(model, "AdaLayerNormZero")) + 2 * joint + single,
        "glu": len(modules_named(model, "AuraFlowFeedForward")),  # `silu(linear_1(x)) * linear_2(x)`
        "fast_gelu": 0,  # SwiGLU feed-forward
        # gated residuals (attention and FF of both streams per joint block, two per single block) and the
        # AuraFlowPreFinalBlock `x * (1 + scale) + shift`, which has no norm
        "mul_add": 4 * joint + 2 * single + 1,
    }


def expected_chroma(model):
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    return {
        # the approximator's norms; the q/k norms are joined with the rotation after them, as in Flux
        "rms_norm": rms_norms(model) - 4 * double - 2 * single,
        "rope": 0,
        "norm_rope": 2 * (double + single),
        "adalayernorm": len(
            modules_named(
                model,
                "ChromaAdaLayerNormZeroPruned",
                "ChromaAdaLayerNormZeroSinglePruned",
                "ChromaAdaLayerNormContinuousPruned",
            )
        )
        + 2 * double,  # the pruned adaLN modules, and the two inline norm2 modulations per double block
        "glu": 0,  # tanh-GELU feed-forwards
        "fast_gelu": tanh_gelus(model),
        "mul_add": 4 * double + single,  # gated residuals
    }


def expected_skyreels_v2(model):
    n = len(model.blocks)
    return {
        "rms_norm": rms_norms(model) - 2 * n,  # norm_q and norm_k of attn1 and attn2, less attn1's (joined)
        "rope": 0,
        "norm_rope": 2 * n,  # q and k of attn1 (Wan's strided form), normalised over all heads as in Wan
        "adalayernorm": 2 * n + 1,  # norm1 and norm3 of every block, and the final norm_out modulation
        "glu": 0,  # tanh-GELU feed-forwards
        "fast_gelu": tanh_gelus(model),  # ffn of every block and the text embedder
        "mul_add": 2 * n,  # gated residuals of attn1 and ffn
    }


def expected_flux2(model):
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    return {
        # q/k norms: 4 per double block, 2 per single block, all joined with the rotation after them, as in Flux
        "rms_norm": rms_norms(model) - 4 * double - 2 * single,
        "rope": 0,
        "norm_rope": 2 * (double + single),
        # inline `(1 + scale) * norm(x) + shift`: 4 per double block, 1 per single block; the norm_out module
        "adalayernorm": 4 * double + single + len(modules_named(model, "AdaLayerNormContinuous")),
        # `silu(x[..., :h]) * x[..., h:]`: ff, ff_context, and the single blocks' MLP
        "glu": len(modules_named(model, "Flux2SwiGLU")),
        "fast_gelu": 0,  # SwiGLU feed-forward
        "mul_add": 4 * double + single,  # gated residuals
    }


def expected_omnigen(model):
    n = len(model.layers)
    return {
        "rms_norm": rms_norms(model),  # input_layernorm and post_attention_layernorm per block, the final norm
        "rope": 2 * n,  # q and k of every block (half-rotated, use_real_unbind_dim=-2)
        "norm_rope": 0,  # no q/k norm
        "adalayernorm": len(modules_named(model, "AdaLayerNorm")),  # norm_out: LayerNorm without affine, chunk_dim=1
        "glu": len(modules_named(model, "OmniGenFeedForward")),  # `up * silu(gate)` of `gate_up_proj(x).chunk(2, -1)`
        "fast_gelu": 0,  # SiLU-gated feed-forward
        "mul_add": 0,  # the blocks are unmodulated: plain residual adds
    }


def expected_prx(model):
    n = len(model.blocks)
    return {
        "rms_norm": rms_norms(model),  # norm_q, norm_k of the image tokens and norm_added_k of the text, per block
        "rope": 2 * n,  # image q and k of every block (a 2x2 matrix per pair)
        "norm_rope": 0,  # the rotated q/k are heads-first views, not the contiguous rows the op writes
        # `(1 + scale) * norm(x) + shift`: img_pre_norm and post_attention_layernorm per block, the FinalLayer's
        "adalayernorm": 2 * n + len(modules_named(model, "FinalLayer")),
        # `mlp_act(gate_proj(x)) * up_proj(x)`, tanh-GELU, of every block
        "glu": len(modules_named(model, "PRXBlock")),
        "fast_gelu": 0,  # mlp_act of every block is the gate's GELU, fused into glu
        "mul_add": 2 * n,  # gated residuals of attention and MLP
    }


def expected_anyflow(model):
    n = len(model.blocks)
    return {
        "rms_norm": rms_norms(model),  # norm_q and norm_k (across heads) of attn1 and attn2
        "rope": 2 * n,  # q and k of attn1 (complex form, float64 table)
        "norm_rope": 0,  # the rotation reads heads-first [B, H, S, D] views (transposed), not the norm's rows
        # fp32 norm1 and norm3 of every block with per-token modulation, and norm_out; norm2 is affine, unmodulated
        "adalayernorm": 2 * n + 1,
        "glu": 0,  # tanh-GELU feed-forwards
        "fast_gelu": tanh_gelus(model),  # ffn of every block and the text embedder
        # gated residuals of attn1 and ffn (the cross-attention residual is a plain add), and the condition
        # embedder's timestep mix `(1 - gate) * temb + gate * delta_emb`
        "mul_add": 2 * n + 1,
    }


# -- known gaps: family -> the unfused form behind the shortfall -------------------------------------------------

_AFFINE_ADALN = (
    "CogVideoXLayerNormZero and AdaLayerNorm modulate an affine LayerNorm, native_layer_norm(x, [D], weight, bias) "
    "* (1 + scale) + shift; the adalayernorm rule requires a LayerNorm without weight and bias"
)
_COGVIDEOX_GAPS = {
    "adalayernorm": _AFFINE_ADALN,
    "mul_add": "mul_add fuses the unfused affine-LayerNorm modulations instead: " + _AFFINE_ADALN,
}
_LUMINA2_GAPS = {
    "adalayernorm": (
        "LuminaLayerNormContinuous norm_out is native_layer_norm(x) * (1 + scale) without a shift; the "
        "adalayernorm rule requires the `+ shift`"
    ),
}


def _hidream_config(num_routed_experts):
    return dict(
        patch_size=2, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=4, caption_channels=[64, 48], text_emb_dim=32, num_routed_experts=num_routed_experts,
        num_activated_experts=2, axes_dims_rope=(8, 12, 12), max_resolution=(16, 16), llama_layers=[0, 1],
    )


_OMNIGEN_HEAD_DIM = 32

ENTRIES = (
    Entry("qwen_image", "QwenImageTransformer2DModel", "dits", _tiny(
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32,
             num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(8, 12, 12)),
        grid=(4, 4), text_tokens=8), _qwen_image, expected_qwen_image),
    Entry("hunyuan_video", "HunyuanVideoTransformer3DModel", "dits", _tiny(
        dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=32, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
             text_embed_dim=64, pooled_projection_dim=32, rope_axes_dim=(8, 12, 12)),
        latent=(2, 8, 8), text_tokens=8), _hunyuan_video, expected_hunyuan_video),
    Entry("cogvideox", "CogVideoXTransformer3DModel", "dits", _tiny(
        # norm_elementwise_affine=True as in the released CogVideoX checkpoints
        dict(num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4, time_embed_dim=64,
             text_embed_dim=64, num_layers=2, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
             max_text_seq_length=8, use_rotary_positional_embeddings=True, norm_elementwise_affine=True),
        latent=(2, 8, 8), text_tokens=8), _cogvideox, expected_cogvideox, gaps=_COGVIDEOX_GAPS),
    Entry("ltx_video", "LTXVideoTransformer3DModel", "dits", _tiny(
        dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=32, cross_attention_dim=128,
             num_layers=1, caption_channels=64),
        latent=(2, 4, 4), text_tokens=8), _ltx_video, expected_ltx_video),
    Entry("sana", "SanaTransformer2DModel", "dits", _tiny(
        dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=32, num_layers=1,
             num_cross_attention_heads=4, cross_attention_head_dim=32, cross_attention_dim=128, caption_channels=64,
             sample_size=8, patch_size=1, qk_norm="rms_norm_across_heads"),
        sample=(8, 8), text_tokens=8, caption_dim=64), _image_with_caption("SanaTransformer2DModel"),
        expected_sana),
    Entry("lumina2", "Lumina2Transformer2DModel", "dits", _tiny(
        dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=128, num_layers=1, num_refiner_layers=1,
             num_attention_heads=4, num_kv_heads=2, multiple_of=16, axes_dim_rope=(8, 12, 12),
             axes_lens=(64, 32, 32), cap_feat_dim=64),
        sample=(8, 8), text_tokens=8), _lumina2, expected_lumina2, gaps=_LUMINA2_GAPS),
    Entry("pixart", "PixArtTransformer2DModel", "dits", _tiny(
        dict(num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=8, num_layers=1,
             cross_attention_dim=128, sample_size=8, patch_size=2, caption_channels=64),
        sample=(8, 8), text_tokens=8, caption_dim=64), _image_with_caption("PixArtTransformer2DModel"),
        expected_pixart),
    Entry("hidream", "HiDreamImageTransformer2DModel", "dits", _tiny(
        _hidream_config(0), sample=(8, 8), text_tokens=8), _hidream, expected_hidream),
    Entry("hidream_moe", "HiDreamImageTransformer2DModel", "dits", _tiny(
        _hidream_config(4), sample=(8, 8), text_tokens=8), _hidream, expected_hidream,
        # fp32 only, to save time
        checked_dtypes=("fp32",),
        graph_breaks="the released config routes tokens to experts with data-dependent control flow: Dynamo "
                     "breaks the graph in every MoE layer and reuses the graphs of the first blocks for the later "
                     "ones"),
    Entry("cogview4", "CogView4Transformer2DModel", "dits", _tiny(
        dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=32,
             num_attention_heads=4, text_embed_dim=64, time_embed_dim=64, condition_dim=16, pos_embed_max_size=16,
             sample_size=8),
        sample=(8, 8), text_tokens=8), _cogview4, expected_cogview4),
    Entry("auraflow", "AuraFlowTransformer2DModel", "dits", _tiny(
        dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
             attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128,
             out_channels=4, pos_embed_max_size=64),
        sample=(8, 8), text_tokens=8, caption_dim=64),
        _image_with_caption("AuraFlowTransformer2DModel", mask_dtype=None, timestep=0.5), expected_auraflow),
    Entry("chroma", "ChromaTransformer2DModel", "dits", _tiny(
        dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
             num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(8, 12, 12),
             approximator_num_channels=16, approximator_hidden_dim=64, approximator_layers=2),
        grid=(4, 4), text_tokens=8), _chroma, expected_chroma),
    Entry("skyreels_v2", "SkyReelsV2Transformer3DModel", "dits", _tiny(
        dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
             text_dim=64, freq_dim=32, ffn_dim=256, num_layers=1, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", rope_max_seq_len=64),
        latent=(2, 8, 8), text_tokens=8), _skyreels_v2, expected_skyreels_v2),
    Entry("flux2", "Flux2Transformer2DModel", "dits", _tiny(
        dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
             num_attention_heads=4, joint_attention_dim=64, timestep_guidance_channels=64,
             axes_dims_rope=(8, 8, 8, 8)),
        grid=(4, 4), text_tokens=8), _flux2, expected_flux2),
    Entry("omnigen", "OmniGenTransformer2DModel", "dits", _tiny(
        dict(in_channels=4, patch_size=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=256, num_layers=2, pad_token_id=0, vocab_size=64, pos_embed_max_size=16,
             time_step_dim=64,
             rope_scaling={"short_factor": [1.0] * (_OMNIGEN_HEAD_DIM // 2),
                           "long_factor": [2.0] * (_OMNIGEN_HEAD_DIM // 2)}),
        sample=(8, 8), text_tokens=8), _omnigen, expected_omnigen),
    Entry("prx", "PRXTransformer2DModel", "dits", _tiny(
        dict(in_channels=4, patch_size=2, context_in_dim=64, hidden_size=128, mlp_ratio=2.0, num_heads=4, depth=2,
             axes_dim=[16, 16]),
        sample=(8, 8), text_tokens=8, text_valid=6), _prx, expected_prx),
    Entry("anyflow", "AnyFlowTransformer3DModel", "dits", _tiny(
        dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
             text_dim=64, freq_dim=32, ffn_dim=256, num_layers=2, rope_max_seq_len=64),
        latent=(2, 8, 8), text_tokens=8), _anyflow, expected_anyflow),
)
