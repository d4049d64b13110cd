"""``mindiesd bench vae``: a pipeline's VAE decode, eager against mindiesd (and Inductor), in one process.

The VAEs are built from configs with seeded random weights, at the geometry of the models they serve: ``kl``, an
``AutoencoderKL`` with Flux's 16 latent channels and four levels (32, 32, 64, 64 channels wide, so the decode
upsamples 8x: a latent of 32 x 32 gives 256 x 256 pixels); ``wan``, an ``AutoencoderKLWan`` of base width 32 (its
four levels 32 to 128 wide; 16 latent channels, 3 latent frames give 9 frames, 16 x 16 latents 128 x 128 pixels).
Each backend compiles ``vae.decode`` whole; the table gives per VAE and backend the first call's seconds (the
compile), the steady ms (medians of interleaved calls), eager / backend, the largest error relative to eager's
output, and mindiesd's fused ops.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any, Callable, TextIO

import torch

from .common import (DTYPES, add_comparison_options, complain, footer, make_backend, max_relative_error, session,
                     warn_if_busy, write_json)
from .environment import environment
from .table import format_rows
from .timing import interleaved_medians

#: VAE name -> (diffusers class, config, latent shape of one decode).
VAES: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    "kl": ("AutoencoderKL", dict(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=1,
                                 block_out_channels=(32, 32, 64, 64), norm_num_groups=32,
                                 down_block_types=("DownEncoderBlock2D",) * 4,
                                 up_block_types=("UpDecoderBlock2D",) * 4),
           (1, 16, 32, 32)),
    "wan": ("AutoencoderKLWan", dict(base_dim=32, z_dim=16), (1, 16, 3, 16, 16)),
}

COLUMNS = ("vae", "backend", "first_s", "ms", "speedup", "error", "fused")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vae", choices=(*VAES, "all"), default="all", help="which VAE (default: all)")
    add_comparison_options(parser, calls="decodes", per="backend", subject="VAE and latent",
                           inductor_note=" (its compile takes minutes)")
    parser.add_argument("--channels-last", action="store_true",
                        help="convert the VAE and the latent to channels-last (channels_last_3d for video)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows (and environment) as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def build(name: str, dtype: torch.dtype, seed: int, channels_last: bool = False) -> tuple[Any, torch.Tensor]:
    """The VAE ``name`` (eval mode, seeded weights) and a seeded latent to decode."""
    import diffusers

    cls, config, latent = VAES[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = getattr(diffusers, cls)(**config).eval().to(dtype)
    z = torch.randn(*latent, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    if channels_last:
        layout = torch.channels_last if z.dim() == 4 else torch.channels_last_3d
        vae, z = vae.to(memory_format=layout), z.contiguous(memory_format=layout)
    return vae, z


#: The aten kernels the convolutional families put in a graph, by the family's name.
LOWERED = {"aten::mkldnn_convolution": "conv_channels_last", "aten::upsample_nearest2d": "upsample_nearest",
           "aten::_upsample_nearest_exact2d": "upsample_nearest"}


def fused_ops(graphs: list) -> dict[str, int]:
    """Calls of each mindiesd op in ``graphs``, and of the aten kernels that the convolutional families call
    (:data:`LOWERED`), by family."""
    counts: Counter = Counter()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if getattr(node.target, "namespace", None) == "mindiesd":
                counts[node.target._opname] += 1
            elif isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in LOWERED:
                counts[LOWERED[node.target._schema.name]] += 1
    return dict(counts)


def _first_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def bench_vae(name: str, vs: tuple, dtype: torch.dtype, seed: int, iters: int, warmup: int, channels_last: bool,
              progress: Any) -> list[dict[str, Any]]:
    """The rows of one VAE: eager, mindiesd and the ``vs`` backends."""
    with progress.step(f"building the {name} VAE"):
        vae, z = build(name, dtype, seed, channels_last)

    def decode(latent: torch.Tensor) -> torch.Tensor:
        return vae.decode(latent, return_dict=False)[0]

    torch._dynamo.reset()
    mindiesd = make_backend(None, keep_graphs=True)
    compiled = {"mindiesd": torch.compile(decode, backend=mindiesd)}
    if "inductor" in vs:
        compiled["inductor"] = torch.compile(decode)
    rows: dict[str, dict[str, Any]] = {"eager": {"vae": name, "backend": "eager"}}
    with torch.no_grad():
        expected = decode(z)
        for backend, fn in compiled.items():
            with progress.step(f"{name}: first call through {backend}"):
                out, seconds = _first_call(lambda: fn(z))
            rows[backend] = {"vae": name, "backend": backend, "first_s": seconds,
                             "error": max_relative_error(out, expected)}
        rows["mindiesd"]["fused"] = fused_ops(mindiesd.graphs)
        rows["mindiesd"]["fallbacks"] = len(mindiesd.report().fallbacks)
        runners = {"eager": lambda: decode(z), **{b: (lambda f=f: f(z)) for b, f in compiled.items()}}
        with progress.step(f"{name}: timing {', '.join(runners)}"):
            medians = interleaved_medians(runners, iters, warmup)
    for backend, row in rows.items():
        row["ms"] = medians[backend]
        row["speedup"] = medians["eager"] / medians[backend]
        row["spread"] = medians.spreads[backend]
    return list(rows.values())


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "fused":
        return " ".join(f"{k}={v}" for k, v in sorted(value.items())) or "none"
    if column == "speedup":
        return f"{value:.2f}x"
    if column == "error":
        return f"{value:.1e}"
    if column in ("ms", "first_s"):
        return f"{value:.2f}"
    return str(value)


def run(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Execute a parsed ``bench vae`` command; returns the process exit status."""
    stdout, stderr, progress = session(args, stdout, stderr)
    try:
        import diffusers  # noqa: F401
    except ImportError:
        complain(stderr, "bench vae needs diffusers (pip install diffusers)")
        return 2
    names = tuple(VAES) if args.vae == "all" else (args.vae,)
    rows: list[dict[str, Any]] = []
    for name in names:
        rows += bench_vae(name, tuple(args.vs), DTYPES[args.dtype], args.seed, args.iters, args.warmup,
                          args.channels_last, progress)
    warn_if_busy(stderr, [row["spread"] for row in rows], "vae decode")
    print(format_rows(rows, COLUMNS, left=("vae", "backend", "fused"), cell=_cell, markdown=args.markdown),
          file=stdout)
    env = environment("cpu")
    print(f"{footer(env)}; {torch.get_num_threads()} threads; torch {torch.__version__}", file=stdout)
    fallbacks = sum(row.get("fallbacks", 0) for row in rows)
    if args.json:
        write_json(args.json, {"rows": rows, "environment": env})
    return 1 if fallbacks else 0
