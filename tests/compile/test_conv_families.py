"""The convolutional families on small blocks. group_norm_silu: each group norm whose output feeds a SiLU becomes one
``mindiesd.group_norm_silu`` (counted in the final graph), for 2-D and 3-D convolutions, with and without the affine
parameters, any eps and group count, in fp32 and bf16, contiguous and channels-last; the output equals eager's, in
eager's layout. A norm without a SiLU after it stays aten's; the switch turns the family off. channel_rms_norm: diffusers'
own WanRMS_norm (Wan's and Qwen-Image's VAEs), with and without bias and SiLU, images and video, fp32 and bf16,
contiguous and channels-last. upsample_nearest: F.interpolate's nearest and nearest-exact modes, which aot decomposes
into a gather, call aten's upsampling kernel again (counted; no gather left), at integer scales and at sizes that are
none, contiguous and channels-last; the switch leaves the gather."""

import pytest
import torch
import torch.nn.functional as F

from fusion_utils import assert_close
from mindiesd.compilation import CompilationConfig, MindieSDBackend

pytestmark = pytest.mark.filterwarnings("error::mindiesd.compilation.MindieSDFallbackWarning")


class ResnetBlock(torch.nn.Module):
    """AutoencoderKL's ResNet block in miniature: norm, SiLU, conv, norm, SiLU, conv, residual add; a norm without
    an activation (an attention block's) at the end."""

    def __init__(self, channels=8, groups=4, eps=1e-6, affine=True, dims=2):
        super().__init__()
        conv = torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d
        self.norm1 = torch.nn.GroupNorm(groups, channels, eps=eps, affine=affine)
        self.conv1 = conv(channels, channels, 3, padding=1)
        self.norm2 = torch.nn.GroupNorm(groups, channels, eps=eps, affine=affine)
        self.conv2 = conv(channels, channels, 3, padding=1)
        self.norm_out = torch.nn.GroupNorm(groups, channels, eps=eps, affine=affine)
        with torch.no_grad():
            for norm in (self.norm1, self.norm2, self.norm_out):
                if affine:  # not the identity affine of a fresh module
                    norm.weight.uniform_(0.5, 1.5)
                    norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.norm_out(x + h)


def _compile(module, x, **config):
    backend = MindieSDBackend(CompilationConfig(**config), keep_graphs=True)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        actual, expected = compiled(x), module(x)
    fused = sum(1 for gm in backend.graphs for n in gm.graph.nodes
                if n.op == "call_function" and n.target is torch.ops.mindiesd.group_norm_silu.default)
    return actual, expected, fused, backend


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dims,groups,eps,affine", [(2, 4, 1e-6, True), (3, 2, 1e-5, False), (2, 8, 1e-3, True)],
                         ids=["nchw", "ncdhw_no_affine", "nchw_group_per_channel"])
def test_group_norm_and_silu_fuse(dims, groups, eps, affine, dtype):
    block = ResnetBlock(groups=groups, eps=eps, affine=affine, dims=dims).eval().to(dtype)
    x = _randn(2, 8, *((3, 6, 5) if dims == 3 else (6, 5)), dtype=dtype)
    actual, expected, fused, backend = _compile(block, x)
    assert fused == 2  # norm1 and norm2; norm_out has no SiLU after it
    assert backend.report().matches["group_norm_silu"] == 2
    assert actual.stride() == expected.stride()
    assert_close(actual, expected)


def test_functional_group_norm_without_affine_arguments():
    def fn(x):
        return F.silu(F.group_norm(x, 2))

    x = _randn(3, 4, 7)
    actual, expected, fused, _ = _compile(fn, x)
    assert fused == 1
    assert_close(actual, expected)


@pytest.mark.parametrize("dims", [2, 3], ids=["channels_last", "channels_last_3d"])
def test_channels_last_input_fuses_in_its_layout(dims):
    block = ResnetBlock(dims=dims).eval()
    x = _randn(2, 8, *((3, 6, 5) if dims == 3 else (6, 5)))
    x = x.contiguous(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
    actual, expected, fused, _ = _compile(block, x)
    assert fused == 2
    assert actual.stride() == expected.stride()
    assert_close(actual, expected)


def test_switch_off_stays_aten():
    block = ResnetBlock().eval()
    x = _randn(2, 8, 6, 5)
    actual, expected, fused, backend = _compile(block, x.contiguous(), fusion_patterns={"enable_group_norm_silu": False})
    assert fused == 0 and backend.report().matches.get("group_norm_silu", 0) == 0
    assert_close(actual, expected)


def _count(backend, op):
    return sum(1 for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


class WanNormBlock(torch.nn.Module):
    """Wan's residual-block head: norm, SiLU, causal-style conv; then an attention-style norm without activation."""

    def __init__(self, channels, images, bias):
        super().__init__()
        wan = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_wan")
        self.norm1 = wan.WanRMS_norm(channels, images=images, bias=bias)
        self.conv = (torch.nn.Conv2d if images else torch.nn.Conv3d)(channels, channels, 3, padding=1)
        self.norm2 = wan.WanRMS_norm(channels, images=images, bias=bias)
        with torch.no_grad():
            for norm in (self.norm1, self.norm2):
                norm.gamma.uniform_(0.5, 1.5)
                if bias:
                    norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.norm2(self.conv(F.silu(self.norm1(x))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("images,bias,channels_last", [(False, False, False), (True, True, False),
                                                       (False, False, True)],
                         ids=["video", "images_bias", "video_channels_last"])
def test_wan_rms_norm_fuses_with_and_without_silu(images, bias, channels_last, dtype):
    block = WanNormBlock(24, images, bias).eval().to(dtype)
    x = _randn(1, 24, *((6, 5) if images else (2, 6, 5)), dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    backend = MindieSDBackend(CompilationConfig(), keep_graphs=True)
    with torch.no_grad():
        actual, expected = torch.compile(block, backend=backend, fullgraph=True)(x), block(x)
    op = torch.ops.mindiesd.channel_rms_norm.default
    assert _count(backend, op) == 2
    assert [n.args[5] for gm in backend.graphs for n in gm.graph.nodes if n.target is op] == [True, False]
    assert actual.stride() == expected.stride()
    assert_close(actual, expected)


def test_a_norm_over_another_dim_stays_aten():
    def fn(x):
        return F.silu(F.normalize(x, dim=2) * 2.0)

    backend = MindieSDBackend(CompilationConfig(), keep_graphs=True)
    x = _randn(2, 4, 6, 5)
    with torch.no_grad():
        actual = torch.compile(fn, backend=backend, fullgraph=True)(x)
    assert _count(backend, torch.ops.mindiesd.channel_rms_norm.default) == 0
    assert_close(actual, fn(x))


class Upsampler(torch.nn.Module):
    """A VAE decoder's up block in miniature: nearest upsampling, then a convolution."""

    def __init__(self, channels=4, **interpolate):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.interpolate = interpolate

    def forward(self, x):
        return self.conv(F.interpolate(x, **self.interpolate))


@pytest.mark.parametrize("interpolate,rule", [
    (dict(scale_factor=2.0, mode="nearest"), "nearest"),
    (dict(size=(10, 7), mode="nearest"), "nearest"),  # sizes that are no multiple: the tables still decide
    (dict(size=(8, 9), mode="nearest-exact"), "nearest_exact"),  # at x2 its tables are nearest's
], ids=["nearest_x2", "nearest_to_size", "nearest_exact"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_nearest_upsampling_gets_its_kernel_back(interpolate, rule, channels_last):
    block = Upsampler(**interpolate).eval()
    x = _randn(1, 4, 5, 6)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    backend = MindieSDBackend(CompilationConfig(strict=True), keep_graphs=True)
    with torch.no_grad():
        actual, expected = torch.compile(block, backend=backend, fullgraph=True)(x), block(x)
    assert backend.report().rule_hits.get(f"upsample_nearest:{rule}") == 1
    targets = {n.target for gm in backend.graphs for n in gm.graph.nodes}
    assert torch.ops.aten._unsafe_index.Tensor not in targets and torch.ops.aten.index.Tensor not in targets
    assert_close(actual, expected, torch.float32)
    assert actual.stride() == expected.stride()


def test_upsampling_switch_leaves_the_gather():
    block = Upsampler(scale_factor=2.0, mode="nearest").eval()
    backend = MindieSDBackend(CompilationConfig(strict=True, fusion_patterns={"enable_upsample_nearest": False}),
                              keep_graphs=True)
    x = _randn(1, 4, 5, 6)
    with torch.no_grad():
        actual = torch.compile(block, backend=backend, fullgraph=True)(x)
    assert backend.report().matches["upsample_nearest"] == 0
    assert torch.ops.aten._unsafe_index.Tensor in {n.target for gm in backend.graphs for n in gm.graph.nodes}
    assert_close(actual, block(x), torch.float32)
