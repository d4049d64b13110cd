"""The core models: Flux, SD3 and Wan, at tiny and mid size (batch 1); Flux also deep, host, host-deep and wide."""

from __future__ import annotations

import torch

from ._base import Entry, Spec, grid_ids, modules_named, rms_norms, tanh_gelus

def _sized(tiny: Spec, shapes: dict, **grown) -> dict:
    """The tiny spec and a mid one that differs from it in ``grown`` config values and its ``shapes``."""
    return {"tiny": tiny, "mid": Spec(config={**tiny.config, **grown}, shapes=shapes)}


_FLUX = _sized(
    Spec(
        config=dict(
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=64,
            num_attention_heads=4,
            joint_attention_dim=256,
            pooled_projection_dim=128,
            in_channels=16,
            axes_dims_rope=(16, 24, 24),
        ),
        shapes=dict(grid=(16, 16), text_tokens=32),
    ),
    shapes=dict(grid=(32, 24), text_tokens=64),
    num_single_layers=2, num_attention_heads=8, joint_attention_dim=512, pooled_projection_dim=256,
)
#: Flux at its real depth (19 double-stream + 38 single-stream blocks), narrow and with few tokens: what makes a
#: real model slow to trace is its depth, which this keeps at a CPU's cost.
_FLUX["deep"] = Spec(config={**_FLUX["tiny"].config, "num_layers": 19, "num_single_layers": 38},
                     shapes=dict(grid=(16, 16), text_tokens=32))

#: Flux whose tensors take no time to compute (width 32, 16 image + 8 text tokens): a forward costs what the host
#: spends on it (Python, dispatch, launches), the share of a forward that an accelerator without device-graph
#: capture waits on. ``host-deep`` has Flux's real depth.
_FLUX["host"] = Spec(config={**_FLUX["tiny"].config, "attention_head_dim": 16, "num_attention_heads": 2,
                             "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": (4, 6, 6)},
                     shapes=dict(grid=(4, 4), text_tokens=8))
_FLUX["host-deep"] = Spec(config={**_FLUX["host"].config, "num_layers": 19, "num_single_layers": 38},
                          shapes=dict(_FLUX["host"].shapes))

#: Flux at its real width and a real image's tokens (24 heads x 128 = 3072 wide, T5's 4096-wide text, a 1024x1024
#: image: 64 x 64 = 4096 image + 512 text tokens, rotary axes 16/56/56), with 2 double and 2 single blocks: the
#: shapes a GPU's kernels meet in FLUX.1, in one call (about 1.02 G parameters: 2 GB in bf16).
_FLUX["wide"] = Spec(config={**_FLUX["tiny"].config, "num_layers": 2, "num_single_layers": 2,
                             "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                             "pooled_projection_dim": 768, "in_channels": 64, "axes_dims_rope": (16, 56, 56)},
                     shapes=dict(grid=(64, 64), text_tokens=512))

_SD3 = _sized(
    Spec(
        config=dict(
            sample_size=32,
            patch_size=2,
            num_layers=2,
            attention_head_dim=64,
            num_attention_heads=4,
            joint_attention_dim=256,
            caption_projection_dim=256,
            pooled_projection_dim=128,
            pos_embed_max_size=32,
            qk_norm="rms_norm",
        ),
        shapes=dict(sample=32, text_tokens=32),
    ),
    shapes=dict(sample=64, text_tokens=64),
    sample_size=64, num_attention_heads=8, joint_attention_dim=512, caption_projection_dim=512,
    pooled_projection_dim=256,
)

_WAN = _sized(
    Spec(
        config=dict(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=64,
            text_dim=256,
            freq_dim=256,
            ffn_dim=1024,
            num_layers=2,
            qk_norm="rms_norm_across_heads",
        ),
        shapes=dict(latent=(16, 3, 16, 16), text_tokens=32),
    ),
    shapes=dict(latent=(16, 3, 32, 32), text_tokens=64),
    num_attention_heads=8, text_dim=512, ffn_dim=2048,
)


def _build_flux(diffusers, spec: Spec, gen: torch.Generator):
    cfg = spec.config
    rows, cols = spec.shapes["grid"]
    text = spec.shapes["text_tokens"]
    model = diffusers.FluxTransformer2DModel(**cfg)
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, cfg["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(1, text, cfg["joint_attention_dim"], generator=gen),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=gen),
        timestep=torch.tensor([0.5]),
        # as the Flux pipeline lays them out: text all zeros, image a (row, col) grid
        img_ids=grid_ids(rows, cols, 3),
        txt_ids=torch.zeros(text, 3),
    )
    return model, inputs


def _build_sd3(diffusers, spec: Spec, gen: torch.Generator):
    cfg = spec.config
    sample = spec.shapes["sample"]
    text = spec.shapes["text_tokens"]
    model = diffusers.SD3Transformer2DModel(**cfg)
    in_channels = model.config.in_channels
    inputs = dict(
        hidden_states=torch.randn(1, in_channels, sample, sample, generator=gen),
        encoder_hidden_states=torch.randn(1, text, cfg["joint_attention_dim"], generator=gen),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=gen),
        timestep=torch.tensor([500.0]),
    )
    return model, inputs


def _build_wan(diffusers, spec: Spec, gen: torch.Generator):
    cfg = spec.config
    text = spec.shapes["text_tokens"]
    model = diffusers.WanTransformer3DModel(**cfg)
    inputs = dict(
        hidden_states=torch.randn(1, *spec.shapes["latent"], generator=gen),
        timestep=torch.tensor([500], dtype=torch.long),
        encoder_hidden_states=torch.randn(1, text, cfg["text_dim"], generator=gen),
    )
    return model, inputs


def expected_flux(model):
    double = model.transformer_blocks
    single = model.single_transformer_blocks
    return {
        # every RMSNorm is a q/k norm (4 per double block with the added ones, 2 per single block): norm_rope joins
        # them with the rotation of the q and k they normalise
        "rms_norm": rms_norms(model) - 4 * len(double) - 2 * len(single),
        "rope": 0,
        # q and k are rotated in every attention: in the double blocks after the text and image streams are joined
        # (one op per q and k reads both streams' norms), in the single blocks right after the norm
        "norm_rope": 2 * (len(double) + len(single)),
        # AdaLayerNormZero (image and text), the two inline `norm2 * (1 + scale) + shift` per double block,
        # AdaLayerNormZeroSingle per single block, AdaLayerNormContinuous norm_out
        "adalayernorm": len(
            modules_named(model, "AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous")
        )
        + 2 * len(double),
        "glu": 0,  # tanh-GELU feed-forwards, no gated activation
        "fast_gelu": tanh_gelus(model),
        # double block: gated residuals of attention and MLP for image and text; single block: one gated residual
        "mul_add": 4 * len(double) + len(single),
    }


def expected_sd3(model):
    blocks = model.transformer_blocks
    full = [b for b in blocks if not b.context_pre_only]
    return {
        "rms_norm": rms_norms(model),
        "rope": 0,
        "norm_rope": 0,  # no rotary embedding
        # norm1 / norm1_context modules (AdaLayerNormZero or, in the last block, AdaLayerNormContinuous), the
        # inline MLP modulation of the image stream in every block and of the text stream where it continues
        "adalayernorm": len(modules_named(model, "AdaLayerNormZero", "AdaLayerNormContinuous"))
        + len(blocks)
        + len(full),
        "glu": 0,  # tanh-GELU feed-forwards, no gated activation
        "fast_gelu": tanh_gelus(model),
        # gated residuals: attention and MLP of the image stream, and of the text stream where it continues
        "mul_add": 2 * len(blocks) + 2 * len(full),
    }


def expected_wan(model):
    blocks = model.blocks
    return {
        # norm_q and norm_k of attn1 and attn2 (over all heads' values); attn1's are joined with its rotation
        "rms_norm": rms_norms(model) - 2 * len(blocks),
        "rope": 0,
        # q and k of the self-attention (attn1): normalised over all heads, split into heads, each head rotated
        "norm_rope": 2 * len(blocks),
        # norm1 and norm3 are modulated in every block, plus the final norm_out modulation
        "adalayernorm": 2 * len(blocks) + 1,
        "glu": 0,  # tanh-GELU feed-forwards, no gated activation
        "fast_gelu": tanh_gelus(model),
        "mul_add": 2 * len(blocks),  # gated residuals of self-attention and FFN
    }


ENTRIES = (
    Entry("flux", "FluxTransformer2DModel", "core", _FLUX, _build_flux, expected_flux),
    Entry("sd3", "SD3Transformer2DModel", "core", _SD3, _build_sd3, expected_sd3),
    Entry("wan", "WanTransformer3DModel", "core", _WAN, _build_wan, expected_wan),
)
