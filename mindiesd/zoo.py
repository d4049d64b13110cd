"""Built-in model zoo: small diffusers transformers with random weights.

Each entry builds a real diffusers transformer class (Flux, SD3, Wan) from a
shrunken config, so the FX graphs contain the same RMSNorm / RoPE / adaLN /
GELU / mul+add structure as the full-size models while running in
milliseconds on a CPU. Nothing is downloaded: weights are random and seeded.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

MODELS = ("flux", "sd3", "wan")
SIZES = ("tiny", "mid")

_DIFFUSERS_HINT = (
    "the model zoo needs the optional 'diffusers' dependency; "
    "install it with: pip install 'mindiesd[diffusers]'"
)


@dataclass
class Case:
    """A ready-to-run model plus the keyword inputs for ``model(**inputs)``."""

    name: str
    size: str
    model: nn.Module
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def latent_shape(self) -> torch.Size:
        """Shape of the latent input, which is also the shape of the first output."""
        return self.inputs["hidden_states"].shape


@dataclass(frozen=True)
class _Spec:
    """Config and input geometry of one zoo entry at one size."""

    config: dict[str, Any]
    shapes: dict[str, Any]


_FLUX = {
    "tiny": _Spec(
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
    "mid": _Spec(
        config=dict(
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=64,
            num_attention_heads=8,
            joint_attention_dim=512,
            pooled_projection_dim=256,
            in_channels=16,
            axes_dims_rope=(16, 24, 24),
        ),
        shapes=dict(grid=(32, 24), text_tokens=64),
    ),
}

_SD3 = {
    "tiny": _Spec(
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
    "mid": _Spec(
        config=dict(
            sample_size=64,
            patch_size=2,
            num_layers=2,
            attention_head_dim=64,
            num_attention_heads=8,
            joint_attention_dim=512,
            caption_projection_dim=512,
            pooled_projection_dim=256,
            pos_embed_max_size=32,
            qk_norm="rms_norm",
        ),
        shapes=dict(sample=64, text_tokens=64),
    ),
}

_WAN = {
    "tiny": _Spec(
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
    "mid": _Spec(
        config=dict(
            patch_size=(1, 2, 2),
            num_attention_heads=8,
            attention_head_dim=64,
            text_dim=512,
            freq_dim=256,
            ffn_dim=2048,
            num_layers=2,
            qk_norm="rms_norm_across_heads",
        ),
        shapes=dict(latent=(16, 3, 32, 32), text_tokens=64),
    ),
}


def _flux_ids(grid: tuple[int, int], text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids laid out like the Flux pipeline: text all zeros, image a (row, col) grid."""
    rows, cols = grid
    img_ids = torch.zeros(rows, cols, 3)
    img_ids[..., 1] = torch.arange(rows)[:, None]
    img_ids[..., 2] = torch.arange(cols)[None, :]
    return img_ids.reshape(rows * cols, 3), torch.zeros(text_tokens, 3)


def _build_flux(diffusers, spec: _Spec, gen: torch.Generator):
    cfg = spec.config
    rows, cols = spec.shapes["grid"]
    text = spec.shapes["text_tokens"]
    model = diffusers.FluxTransformer2DModel(**cfg)
    img_ids, txt_ids = _flux_ids((rows, cols), text)
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, cfg["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(1, text, cfg["joint_attention_dim"], generator=gen),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=img_ids,
        txt_ids=txt_ids,
    )
    return model, inputs


def _build_sd3(diffusers, spec: _Spec, gen: torch.Generator):
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


def _build_wan(diffusers, spec: _Spec, gen: torch.Generator):
    cfg = spec.config
    text = spec.shapes["text_tokens"]
    model = diffusers.WanTransformer3DModel(**cfg)
    inputs = dict(
        hidden_states=torch.randn(1, *spec.shapes["latent"], generator=gen),
        timestep=torch.tensor([500], dtype=torch.long),
        encoder_hidden_states=torch.randn(1, text, cfg["text_dim"], generator=gen),
    )
    return model, inputs


_REGISTRY: dict[str, tuple[dict[str, _Spec], Callable]] = {
    "flux": (_FLUX, _build_flux),
    "sd3": (_SD3, _build_sd3),
    "wan": (_WAN, _build_wan),
}


def config_for(name: str, size: str = "tiny") -> dict[str, Any]:
    """The diffusers constructor kwargs used for ``name`` at ``size``."""
    _check(name, size)
    return dict(_REGISTRY[name][0][size].config)


def _check(name: str, size: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of: {', '.join(SIZES)}")


def _import_diffusers():
    try:
        import diffusers
    except ImportError as exc:
        raise ImportError(_DIFFUSERS_HINT) from exc
    return diffusers


class _DropFp32CastWarning(logging.Filter):
    """Drops diffusers' "modules that should be kept in float32" notice.

    It fires on every ``ModelMixin.to(dtype)``; the zoo casts on purpose, so the
    notice is expected noise.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32" not in record.getMessage()


@contextlib.contextmanager
def _quiet_fp32_cast_warning():
    logger = logging.getLogger("diffusers.models.modeling_utils")
    dropper = _DropFp32CastWarning()
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


def _cast_inputs(inputs: dict[str, Any], dtype: torch.dtype, device) -> dict[str, Any]:
    """Move tensors to ``device``; floating tensors also take the model dtype."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device=device, dtype=dtype) if value.is_floating_point() else value.to(device)
        out[key] = value
    return out


def build(
    name: str,
    size: str = "tiny",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Case:
    """Build zoo model ``name`` at ``size`` with seeded random weights and inputs.

    The module is in eval mode on ``device``/``dtype``; ``inputs`` holds keyword
    tensors plus ``return_dict=False`` so ``model(**inputs)`` returns a tuple.
    """
    _check(name, size)
    diffusers = _import_diffusers()
    specs, factory = _REGISTRY[name]
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, inputs = factory(diffusers, specs[size], gen)
    with _quiet_fp32_cast_warning():
        model = model.to(device=device, dtype=dtype)
    model.eval()
    inputs = _cast_inputs(inputs, dtype, device)
    inputs["return_dict"] = False
    return Case(name=name, size=size, model=model, inputs=inputs)
