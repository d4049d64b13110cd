"""The convolutional families on small blocks. group_norm_silu: each group norm whose output feeds a SiLU becomes one
``mindiesd.group_norm_silu`` (counted in the final graph), for 2-D and 3-D convolutions, with and without the affine
parameters, any eps and group count, in fp32 and bf16, contiguous and channels-last; the output equals eager's, in
eager's layout. A norm without a SiLU after it stays aten's; the switch turns the family off. channel_rms_norm: diffusers'
own WanRMS_norm (Wan's and Qwen-Image's VAEs), with and without bias and SiLU, images and video, fp32 and bf16,
contiguous and channels-last. upsample_nearest: F.interpolate's nearest and nearest-exact modes, which aot decomposes
into a gather, call aten's upsampling kernel again (counted; no gather left), at integer scales and at sizes that are
none, contiguous and channels-last; the switch leaves the gather. conv_channels_last: float32 2-D and 3-D
convolutions become oneDNN's over channels-last operands (counted), through a VAE's attention (a view and an
attention read the changed layout back in the traced one) and a causal convolution's padding and frame cache; the
outputs keep eager's layout; the switch, and a graph where a changed layout cannot be given back, stay aten's."""

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
    # float32 convolutions run on oneDNN in channels-last (conv_channels_last); bf16 ones where the CPU has native
    # bfloat16 (this machine's branch; test_conv_channels_last_dtypes_follow_the_cpu covers both on any CPU)
    native = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert _count(backend, torch.ops.aten.mkldnn_convolution.default) == (2 if native else 0)
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


class ConvAttentionBlock(torch.nn.Module):
    """Convolutions around a VAE attention in miniature: a 3x3 conv, a 1x1 qkv conv whose output is viewed as tokens
    for scaled_dot_product_attention (whose CPU kernel reads its inputs' last dim as contiguous), the tokens back
    into an image and a 1x1 projection, a residual add; for video a causal 3-D conv: the first frame repeated in
    front, the last two frames kept as a cache and concatenated in front of the next chunk, whose first chunk is
    one frame (a size-1 dim, where aten's kernels and their traced values may lay an output out differently), a
    channel-wise norm before the attention."""

    def __init__(self, dims=2, channels=8):
        super().__init__()
        conv = torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d
        self.dims, self.channels = dims, channels
        self.conv_in = conv(channels, channels, 3, padding=(0, 1, 1) if dims == 3 else 1)
        self.qkv = torch.nn.Conv2d(channels, 3 * channels, 1)
        self.proj = torch.nn.Conv2d(channels, channels, 1)
        self.conv_out = conv(channels, 4, 3, padding=(0, 1, 1) if dims == 3 else 1)

    def causal(self, conv, x, cache=None):
        front = x[:, :, :1].expand(-1, -1, 2, -1, -1) if cache is None else cache
        padded = torch.cat([front, x], dim=2)
        return conv(padded), x[:, :, -2:].clone()

    def attention(self, x):
        n, c, h, w = x.shape
        q, k, v = self.qkv(x).view(n, 3 * c, h * w).permute(0, 2, 1).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.permute(0, 2, 1).reshape(n, c, h, w))

    def forward(self, x):
        if self.dims == 2:
            return self.conv_out(F.silu(self.attention(F.silu(self.conv_in(x)))))
        first, cache = self.causal(self.conv_in, x[:, :, :1])  # Wan's first chunk: one frame
        second, _ = self.causal(self.conv_in, x[:, :, 1:], cache)
        h = F.normalize(torch.cat([first, second], dim=2), dim=1)  # Wan's channel-wise norm: a broadcast divide
        n, c, t, height, width = h.shape
        frames = h.permute(0, 2, 1, 3, 4).reshape(n * t, c, height, width)
        frames = self.attention(frames).reshape(n, t, c, height, width).permute(0, 2, 1, 3, 4)
        return self.causal(self.conv_out, F.silu(frames))[0]


@pytest.mark.parametrize("dims", [2, 3], ids=["2d", "3d_causal"])
def test_convolutions_run_on_onednn_in_channels_last(dims):
    block = ConvAttentionBlock(dims).eval()
    x = _randn(1, 8, *((4, 6, 5) if dims == 3 else (6, 5)))
    actual, expected, _, backend = _compile(block, x)
    # video: conv_in on each of the two chunks, conv_out once (3-D), qkv and proj on the frames (2-D)
    rules = {"conv_channels_last:conv3d": 3, "conv_channels_last:conv2d": 2} if dims == 3 \
        else {"conv_channels_last:conv2d": 4}
    assert _count(backend, torch.ops.aten.mkldnn_convolution.default) == sum(rules.values())
    assert _count(backend, torch.ops.aten.convolution.default) == 0
    assert {k: v for k, v in backend.report().rule_hits.items() if k.startswith("conv_channels_last")} == rules
    assert actual.stride() == expected.stride()
    assert_close(actual, expected)
    # the layout reaches the attention only in the layout it was traced with: no wrong value from its kernel
    again, _, _, _ = _compile(block, x)
    assert_close(again, expected)


def test_conv_channels_last_switch_and_a_layout_that_cannot_be_given_back(monkeypatch):
    from mindiesd.compilation.passes import conv_channels_last

    def fn(x, weight):
        y = F.conv2d(x, weight, padding=1)
        return torch.flip(y[:, :, 1:], dims=[2])  # a slice of the convolution, read by an op that needs its layout

    x, weight = _randn(1, 8, 6, 5), _randn(4, 8, 3, 3)
    for config in ({"fusion_patterns": {"enable_conv_channels_last": False}}, {}):
        if not config:  # no view is given back: the slice's traced layout cannot be made from the changed one
            monkeypatch.setattr(conv_channels_last, "_VIEWS", frozenset())
        backend = MindieSDBackend(CompilationConfig(**config), keep_graphs=True)
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        with torch.no_grad():
            actual = compiled(x, weight)
        assert_close(actual, fn(x, weight))
        assert _count(backend, torch.ops.aten.mkldnn_convolution.default) == 0
        assert _count(backend, torch.ops.aten.convolution.default) == 1
        (record,) = backend.report().records
        if not config:
            assert "left in aten's layout" in record.skipped["conv_channels_last"]


@pytest.mark.parametrize("bf16", [True, False], ids=["native_bf16", "no_native_bf16"])
def test_conv_channels_last_dtypes_follow_the_cpu(monkeypatch, bf16):
    """Which dtypes the pass rewrites depends on the CPU (oneDNN's native bfloat16: AVX-512 BF16, AMX): both branches
    on the traced graph alone (no kernel runs, so on any CPU): float32 always, bfloat16 only where native."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mindiesd.compilation.passes import conv_channels_last

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16)

    def fn(x, weight):
        return F.silu(F.conv2d(x, weight, padding=1))

    for dtype in (torch.float32, torch.bfloat16):
        gm = make_fx(fn, tracing_mode="fake")(_randn(1, 8, 6, 5, dtype=dtype), _randn(4, 8, 3, 3, dtype=dtype))
        lowering = conv_channels_last.ConvChannelsLastPass()
        rewritten = lowering(gm)
        assert rewritten == _count_in(gm, torch.ops.aten.mkldnn_convolution.default)
        assert rewritten == (1 if dtype == torch.float32 or bf16 else 0)


def _count_in(gm, op):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)
