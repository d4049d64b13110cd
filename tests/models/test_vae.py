"""Tiny diffusers VAEs compiled whole: encode and decode equal eager's and nothing falls back.

One case per VAE class of diffusers 0.42.1 that runs on the CPU, each built from a shrunken config with seeded
random weights: two levels, the fewest channels its norms take, inputs 16 pixels wide, so that a case compiles in
a few seconds. The video VAEs get frames enough for one causal step after the first frame (Wan: 1 + 4 frames,
decoded from 1 + 1 latent frames), so their causal convolutions read the frames they cached as well as write them.
AutoencoderKL's attention block leaves a view whose traced strides differ from the real ones in the batch dim, the
case that ``compilation/cleanup/layout_checks.py`` exists for; it is decoded from a channels-last latent too.
Each case counts the group_norm_silu ops against the group norms that feed a SiLU in an eager run, and the
channel_rms_norm ops against the calls of Wan's and Qwen-Image's channel-wise RMS norms (module hooks), and aten's
nearest-upsampling kernels against the 4-D nearest F.interpolate calls (upsample_nearest).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

from fusion_utils import assert_close, run_compiled
from mindiesd.compilation import CompilationConfig

diffusers = pytest.importorskip("diffusers")

pytestmark = [
    pytest.mark.slow,  # whole models: the quick subset is `pytest -m "not slow"`
    pytest.mark.filterwarnings("error::mindiesd.compilation.MindieSDFallbackWarning"),
]


@dataclass(frozen=True)
class Vae:
    """A tiny configuration of a VAE class, with the shapes of the sample it encodes and the latent it decodes."""

    config: Dict[str, Any]
    sample: Tuple[int, ...]
    latent: Tuple[int, ...]


_WAN_LIKE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1)

VAES = {
    "AutoencoderKL": Vae(
        dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(32, 32),
             norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 2,
             up_block_types=("UpDecoderBlock2D",) * 2),
        sample=(1, 3, 16, 16), latent=(1, 4, 8, 8)),
    "AutoencoderKLWan": Vae(dict(_WAN_LIKE, temperal_downsample=[True]),
                            sample=(1, 3, 5, 16, 16), latent=(1, 4, 2, 8, 8)),
    "AutoencoderKLQwenImage": Vae(dict(_WAN_LIKE, temperal_downsample=[False]),
                                  sample=(1, 3, 1, 16, 16), latent=(1, 4, 1, 8, 8)),
    "AutoencoderKLHunyuanVideo": Vae(
        dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(32, 32),
             norm_num_groups=32, down_block_types=("HunyuanVideoDownBlock3D",) * 2,
             up_block_types=("HunyuanVideoUpBlock3D",) * 2, spatial_compression_ratio=2),
        sample=(1, 3, 3, 16, 16), latent=(1, 4, 2, 8, 8)),
    "AutoencoderKLLTXVideo": Vae(
        dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 16),
             decoder_block_out_channels=(8, 16), down_block_types=("LTXVideoDownBlock3D",) * 2,
             layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
             spatio_temporal_scaling=(True, False), decoder_spatio_temporal_scaling=(True, False),
             decoder_inject_noise=(False, False, False), downsample_type=("conv", "conv"),
             upsample_residual=(False, False), upsample_factor=(1, 1), patch_size=1, patch_size_t=1),
        sample=(1, 3, 3, 16, 16), latent=(1, 8, 2, 8, 8)),
    "AutoencoderDC": Vae(
        dict(in_channels=3, latent_channels=4, attention_head_dim=8,
             encoder_block_types=("ResBlock", "EfficientViTBlock"),
             decoder_block_types=("ResBlock", "EfficientViTBlock"),
             encoder_block_out_channels=(8, 16), decoder_block_out_channels=(8, 16),
             encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
             encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,))),
        sample=(1, 3, 16, 16), latent=(1, 4, 8, 8)),
}

_BUILT: Dict[str, Any] = {}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _vae(name: str) -> Any:
    """The tiny VAE of class ``name``, built once with seeded weights (skipped where diffusers lacks the class)."""
    cls = getattr(diffusers, name, None)
    if cls is None:
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")
    if name not in _BUILT:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            _BUILT[name] = cls(**VAES[name].config).eval()
    return _BUILT[name]


def _encode(vae: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What encode computes: a KL VAE's moments (mean and log-variance, before sampling), or the latent."""

    def encode(sample: torch.Tensor) -> torch.Tensor:
        (encoded,) = vae.encode(sample, return_dict=False)
        return getattr(encoded, "parameters", encoded)

    return encode


def _decode(vae: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda latent: vae.decode(latent, return_dict=False)[0]


def _sites(vae: Any, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Tuple[int, int, int, int]:
    """The convolutional families' sites in an eager run of ``fn(x)``, found by module hooks: the group norms whose
    output an nn.SiLU then takes (group_norm_silu), and the calls of a channel-first ``WanRMS_norm`` or
    ``QwenImageRMS_norm`` (channel_rms_norm; each call of a module unrolled by Dynamo is a site of its own); and
    the 4-D nearest upsamplings (``F.interpolate`` calls: upsample_nearest); and the float32 2-D and 3-D
    convolutions of more than one input channel and position (conv_channels_last)."""
    outputs, counts = set(), [0, 0, 0, 0]
    interpolate = torch.nn.functional.interpolate
    convolutions = {name: getattr(torch.nn.functional, name) for name in ("conv2d", "conv3d")}

    def counting(name):
        def convolution(input, weight, *args, **kwargs):
            counts[3] += input.dtype == torch.float32 and input.shape[1] > 1 and input[0, 0].numel() > 1
            return convolutions[name](input, weight, *args, **kwargs)

        return convolution

    def counting_interpolate(input, *args, **kwargs):
        mode = kwargs.get("mode", args[2] if len(args) > 2 else "nearest")
        counts[2] += input.dim() == 4 and mode in ("nearest", "nearest-exact")
        return interpolate(input, *args, **kwargs)

    def norm_ran(module, args, output):
        outputs.add(id(output))

    def silu_runs(module, args):
        counts[0] += id(args[0]) in outputs

    def channel_norm_runs(module, args):
        counts[1] += 1

    hooks = []
    for m in vae.modules():
        if isinstance(m, torch.nn.GroupNorm):
            hooks.append(m.register_forward_hook(norm_ran))
        elif isinstance(m, torch.nn.SiLU):
            hooks.append(m.register_forward_pre_hook(silu_runs))
        elif type(m).__name__ in ("WanRMS_norm", "QwenImageRMS_norm") and m.channel_first:
            hooks.append(m.register_forward_pre_hook(channel_norm_runs))
    torch.nn.functional.interpolate = counting_interpolate
    for name in convolutions:
        setattr(torch.nn.functional, name, counting(name))
    try:
        with torch.no_grad():
            fn(x)
    finally:
        torch.nn.functional.interpolate = interpolate
        for name, convolution in convolutions.items():
            setattr(torch.nn.functional, name, convolution)
        for hook in hooks:
            hook.remove()
    return counts[0], counts[1], counts[2], counts[3]


def _fused(backend: Any, op: Any) -> int:
    return sum(1 for gm in backend.graphs for node in gm.graph.nodes
               if node.op == "call_function" and node.target is op)


def _check(vae: Any, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    group_norms, channel_norms, upsamplings, convolutions = _sites(vae, fn, x)
    actual, expected, _, backend = run_compiled(fn, x, config=CompilationConfig(strict=True))
    assert_close(actual, expected)
    assert not backend.report().fallbacks
    # every group norm that feeds a SiLU is fused (contiguous or channels-last: CPU convolutions return either),
    # and every channel-wise RMS norm
    assert _fused(backend, torch.ops.mindiesd.group_norm_silu.default) == group_norms
    assert _fused(backend, torch.ops.mindiesd.channel_rms_norm.default) == channel_norms
    # every 4-D nearest upsampling runs aten's kernel, not the gather aot decomposes it into
    kernels = (torch.ops.aten.upsample_nearest2d.vec, torch.ops.aten._upsample_nearest_exact2d.vec)
    assert sum(_fused(backend, kernel) for kernel in kernels) == upsamplings
    # every float32 convolution (but those of one input channel, whose layout oneDNN does not follow) runs on
    # oneDNN in channels-last, with no convolution left to aten's choice
    assert _fused(backend, torch.ops.aten.mkldnn_convolution.default) == convolutions
    assert backend.report().matches["conv_channels_last"] == convolutions


@pytest.mark.parametrize("part", ["encode", "decode"])
@pytest.mark.parametrize("name", list(VAES))
def test_tiny_vae_matches_eager(name, part):
    vae, spec = _vae(name), VAES[name]
    if part == "encode":
        _check(vae, _encode(vae), _randn(*spec.sample))
    else:
        _check(vae, _decode(vae), _randn(*spec.latent))


def test_autoencoder_kl_decodes_a_channels_last_latent():
    latent = _randn(*VAES["AutoencoderKL"].latent).contiguous(memory_format=torch.channels_last)
    _check(_vae("AutoencoderKL"), _decode(_vae("AutoencoderKL")), latent)


def test_bench_wan_vae_decode_matches_eager():
    """The Wan decode ``bench vae`` times (larger than the tiny one above: its convolutions' layout change meets
    kernels whose output layout at run time differs from the traced one, which must not reach a kernel that trusts
    the traced strides: found at this size, not at the tiny one), fused and equal to eager."""
    from mindiesd.benchmarks import vae as bench_vae

    vae, latent = bench_vae.build("wan", torch.float32, seed=0)
    _check(vae, _decode(vae), latent)
