"""``mindiesd bench ops``: the fused operators on their own, eager sequence vs kernel vs Inductor vs copy.

One row per op x dtype x shape:

* rms_norm, adalayernorm, fast_gelu, mul_add: x [2, 4096, 1024]
  (rms_norm weight [1024]; adalayernorm scale/shift [2, 1, 1024];
  mul_add x * y + z with y a gate [2, 1, 1024] and z a residual like x);
* rope: x [1, 4096, 24, 128] (Flux layout), cos/sin float32 [1, 4096, 1, 128];
* norm_rope: Flux's joint attention query, text [1, 512, 24, 128] and image [1, 4096, 24, 128] each RMSNorm-ed
  with its weight [128], joined along the sequence and rotated (cos/sin float32 [1, 4608, 1, 128]);
* glu: a projection's output x [2, 4096, 2048] split in two halves, ``first * silu(second)`` (SwiGLU).

With ``--variants`` (implied by ``--quick``) also the other forms the passes match, one row each, named
``op:form``: adalayernorm with 1-D scale/shift [1024], interleaved rope with general full-width tables (not one
value per pair), half-rotated rope (``rotate_half``), fast_gelu against the written-out tanh formula, mul_add
with y as large as x, glu with the exact GELU (GEGLU), glu of two projections ``silu(a) * b`` (LLaMA-style) and
``gelu_tanh(a) * b``, and norm_rope of one stream (the image query of a single block) and of Wan's query
(normalised over all 24 heads' values, each head rotated).

Columns (milliseconds; per round, the median of ``--reps`` interleaved calls
of all candidates, in one process, timed by ``benchmarks.timing``, the loop the
model bench uses too).  Of ``--rounds`` rounds (more, up to ``--max-rounds``,
while other processes keep the CPU busy) the round during which other
processes used the least CPU is reported; "other load" is that use in cores
(from /proc/stat), so a disturbed row is visible:

* eager: the op sequence the fusion passes match, run op by op;
* mindiesd: ``torch.ops.mindiesd.<op>.default`` (the active kernel of the device);
* inductor: ``torch.compile(<eager function>)`` (default backend), compiled
  once per row before timing;
* clone: ``x.clone()``, the bandwidth floor (it allocates a fresh output
  like every candidate; ``copy_`` into a preallocated output is shown too).

Ratios: eager/kernel (speedup), kernel/inductor, kernel/clone and kernel/copy_.
max abs diff: largest difference of the kernel's output from eager's (for bf16
the eager sequences round after every op, the kernels once). spread: the widest
interquartile range of the row's candidates over their median; a run on a busy
machine (load average above the cores, or a spread above 20%) gets one warning
on stderr.

On CPU, run it with glibc's malloc tuned so that large tensors are reused instead of
returned to the OS and page-faulted in again on every op::

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184:glibc.malloc.top_pad=268435456 \\
        python -m mindiesd bench ops [--dtype fp32,bf16] [--ops rms_norm,rope,...] [--reps 20]
                                     [--rounds 3] [--max-rounds 12] [--prefault-mib 1024]
                                     [--no-inductor] [--variants] [--quick] [--markdown] [--threads N]
                                     [--device cpu|cuda|npu]

glibc caps mmap_threshold at 32 MiB, so a block of 32 MiB or more (fp32
[2, 4096, 1024] is exactly 32 MiB, the rope tensor 48 MiB) is still mmap-ed
fresh, and page-faulted on first touch (about 10 ms per 32 MiB here), unless
the top of the heap has room for it.  With the tunables set, the bench
therefore first grows the heap by ``--prefault-mib`` MiB of touched memory
(blocks below the threshold, freed again; the trim threshold keeps them), so
that every candidate's outputs come from reused memory, as in a long-running
process.  ``--prefault-mib 0`` measures the page faults instead.

``--quick``: fp32 only, no Inductor, one round per row, and the variants: a check of every form in well under a
minute on CPU. On an accelerator (``--device cuda``) each timed sample is ``--calls-per-sample`` consecutive calls
and one device sync (default 10; 1 on CPU).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, TextIO

import torch
import torch.nn.functional as F

from ..compilation.report import plural
from . import environment
from .common import DTYPES, positive_int, warn_if_busy, write_json
from .timing import Medians, interleaved_medians, synchronize

EPS = 1e-6
TUNABLES = (
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184:"
    "glibc.malloc.top_pad=268435456"
)
OP_NAMES = ("rms_norm", "adalayernorm", "rope", "norm_rope", "glu", "fast_gelu", "mul_add")
WARMUP = 2  # untimed calls of every candidate before the first round


def _ops():
    import mindiesd.ops  # noqa: F401  (registers torch.ops.mindiesd)

    return torch.ops.mindiesd


# -- the eager sequences the passes replace ------------------------------------------------------------------------


def eager_rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def eager_adalayernorm(x, scale, shift):
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale) + shift


def eager_rope(x, cos, sin):
    """Flux apply_rotary_emb: interleaved pairs, full-width float32 cos/sin."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def eager_rope_rotate_half(x, cos, sin):
    """Half-rotated RoPE: x * cos + rotate_half(x) * sin (upcast to the tables' float32, cast back)."""
    first, second = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-second, first), dim=-1).float() * sin).to(x.dtype)


def eager_joint_norm_rope(text, image, w_text, w_image, cos, sin):
    """Flux's joint attention query: each stream's RMSNorm, the streams joined along the sequence, the rotation."""
    return eager_rope(torch.cat([eager_rms_norm(text, w_text), eager_rms_norm(image, w_image)], dim=1), cos, sin)


def eager_norm_rope(x, weight, cos, sin):
    """A single block's query: its RMSNorm, then the rotation."""
    return eager_rope(eager_rms_norm(x, weight), cos, sin)


def eager_heads_norm_rope(x, weight, cos, sin):
    """Wan's query: its RMSNorm over all heads' values, the heads split off, each head rotated."""
    return eager_rope(eager_rms_norm(x, weight).unflatten(-1, (-1, cos.shape[-1])), cos, sin)


def eager_fast_gelu(x):
    return F.gelu(x, approximate="tanh")


def eager_gelu_formula(x):
    """tanh-GELU written out, as some model code does."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def eager_swiglu(x):
    """diffusers' SwiGLU after its projection: the second half is the gate."""
    value, gate = x.chunk(2, dim=-1)
    return value * F.silu(gate)


def eager_geglu(x):
    """diffusers' GEGLU after its projection (exact GELU)."""
    value, gate = x.chunk(2, dim=-1)
    return value * F.gelu(gate)


def eager_silu_gated(a, b):
    """LLaMA-style ``silu(w1(x)) * w3(x)`` after the projections."""
    return F.silu(a) * b


def eager_gelu_tanh_gated(a, b):
    """PRX's ``gelu_tanh(gate_proj(x)) * up_proj(x)`` after the projections."""
    return F.gelu(a, approximate="tanh") * b


def eager_mul_add(x, y, z):
    return x * y + z


@dataclass
class Case:
    op: str  # the op, or ``op:form`` for a variant
    shape: str
    eager: Callable[..., torch.Tensor]
    kernel: Callable[..., torch.Tensor]
    args: tuple
    source: torch.Tensor  # what clone and copy_ copy: the largest input


def build_cases(dtype: torch.dtype, names: List[str], variants: bool = False, device: Any = "cpu") -> List[Case]:
    """The rows of ``names`` in ``dtype`` on ``device`` (and their variants); seeded inputs."""
    ops = _ops()
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dt)

    cases = []
    for name in names:
        if name == "rms_norm":
            x, w = randn(2, 4096, 1024), randn(1024)
            cases.append(Case(name, "x[2,4096,1024] w[1024]", eager_rms_norm,
                              lambda x, w: ops.rms_norm.default(x, w, EPS), (x, w), x))
        elif name == "adalayernorm":
            x, scale, shift = randn(2, 4096, 1024), randn(2, 1, 1024), randn(2, 1, 1024)
            kernel = lambda x, s, h: ops.adalayernorm.default(x, s, h, EPS)  # noqa: E731
            cases.append(Case(name, "x[2,4096,1024] mod[2,1,1024]", eager_adalayernorm, kernel,
                              (x, scale, shift), x))
            if variants:
                cases.append(Case(f"{name}:1d_mod", "x[2,4096,1024] mod[1024]", eager_adalayernorm, kernel,
                                  (x, scale[0, 0], shift[0, 0]), x))
        elif name == "rope":
            x = randn(1, 4096, 24, 128)
            cos_pairs = randn(1, 4096, 1, 64, dt=torch.float32)
            sin_pairs = randn(1, 4096, 1, 64, dt=torch.float32)
            cos, sin = cos_pairs.repeat_interleave(2, dim=-1), sin_pairs.repeat_interleave(2, dim=-1)
            interleaved = lambda x, c, s: ops.rope.default(x, c, s, True, x.dtype)  # noqa: E731
            cases.append(Case(name, "x[1,4096,24,128] cos[1,4096,1,128]", eager_rope, interleaved,
                              (x, cos, sin), x))
            if variants:
                cos_general = randn(1, 4096, 1, 128, dt=torch.float32)
                sin_general = randn(1, 4096, 1, 128, dt=torch.float32)
                cases.append(Case(f"{name}:general_tables", "x[1,4096,24,128] cos[1,4096,1,128]", eager_rope,
                                  interleaved, (x, cos_general, sin_general), x))
                cos_half = torch.cat((cos_pairs, cos_pairs), dim=-1)
                sin_half = torch.cat((sin_pairs, sin_pairs), dim=-1)
                cases.append(Case(f"{name}:rotate_half", "x[1,4096,24,128] cos[1,4096,1,128]",
                                  eager_rope_rotate_half,
                                  lambda x, c, s: ops.rope.default(x, c, s, False, x.dtype),
                                  (x, cos_half, sin_half), x))
        elif name == "norm_rope":
            text, image, w_text, w_image = randn(1, 512, 24, 128), randn(1, 4096, 24, 128), randn(128), randn(128)
            cos = randn(1, 4608, 1, 64, dt=torch.float32).repeat_interleave(2, dim=-1)
            sin = randn(1, 4608, 1, 64, dt=torch.float32).repeat_interleave(2, dim=-1)
            joint = lambda t, i, wt, wi, c, s: ops.norm_rope.default(  # noqa: E731
                [t, i], 1, [wt, wi], EPS, t.dtype, 128, c, s, True, t.dtype)
            cases.append(Case(name, "x[1,512+4096,24,128] cos[1,4608,1,128]", eager_joint_norm_rope, joint,
                              (text, image, w_text, w_image, cos, sin), image))
            if variants:
                single = lambda x, w, c, s: ops.norm_rope.default(  # noqa: E731
                    [x], 1, [w], EPS, x.dtype, 128, c, s, True, x.dtype)
                cases.append(Case(f"{name}:one_stream", "x[1,4096,24,128] cos[1,4096,1,128]", eager_norm_rope,
                                  single, (image, w_image, cos[:, 512:], sin[:, 512:]), image))
                rows, w_rows = image.flatten(-2), randn(24 * 128)
                heads = lambda x, w, c, s: ops.norm_rope.default(  # noqa: E731
                    [x], 1, [w], EPS, x.dtype, 128, c, s, True, x.dtype).unflatten(-1, (-1, 128))
                cases.append(Case(f"{name}:heads", "x[1,4096,24*128] cos[1,4096,1,128]", eager_heads_norm_rope,
                                  heads, (rows, w_rows, cos[:, 512:], sin[:, 512:]), rows))
        elif name == "glu":
            x = randn(2, 4096, 2048)
            cases.append(Case(name, "x[2,4096,2048] halves", eager_swiglu,
                              lambda x: ops.glu.default(x, None, "silu", False), (x,), x))
            if variants:
                cases.append(Case(f"{name}:gelu", "x[2,4096,2048] halves", eager_geglu,
                                  lambda x: ops.glu.default(x, None, "gelu", False), (x,), x))
                a, b = randn(2, 4096, 1024), randn(2, 4096, 1024)
                cases.append(Case(f"{name}:two_tensors", "a,b[2,4096,1024]", eager_silu_gated,
                                  lambda a, b: ops.glu.default(a, b, "silu", True), (a, b), a))
                cases.append(Case(f"{name}:gelu_tanh", "a,b[2,4096,1024]", eager_gelu_tanh_gated,
                                  lambda a, b: ops.glu.default(a, b, "gelu_tanh", True), (a, b), a))
        elif name == "fast_gelu":
            x = randn(2, 4096, 1024)
            kernel = lambda x: ops.fast_gelu.default(x)  # noqa: E731
            cases.append(Case(name, "x[2,4096,1024]", eager_fast_gelu, kernel, (x,), x))
            if variants:
                cases.append(Case(f"{name}:formula", "x[2,4096,1024]", eager_gelu_formula, kernel, (x,), x))
        elif name == "mul_add":
            x, y, z = randn(2, 4096, 1024), randn(2, 1, 1024), randn(2, 4096, 1024)
            kernel = lambda x, y, z: ops.mul_add.default(x, y, z)  # noqa: E731
            cases.append(Case(name, "x[2,4096,1024] y[2,1,1024] z", eager_mul_add, kernel, (x, y, z), x))
            if variants:
                y_full = randn(2, 4096, 1024)
                cases.append(Case(f"{name}:full_y", "x,y,z[2,4096,1024]", eager_mul_add, kernel, (x, y_full, z), x))
        else:
            raise ValueError(f"unknown op {name!r}; choose from {', '.join(OP_NAMES)}")
    return cases


def prefault_heap(mib: int) -> None:
    """Grow the malloc heap by ``mib`` MiB of touched memory, then free it.

    Blocks stay below glibc's mmap threshold, so they come from the heap; the
    trim threshold of GLIBC_TUNABLES keeps the freed memory in the heap, where
    later large allocations find it (no fresh mmap, no first-touch faults).
    """
    block = 31 << 20
    count = max(0, mib << 20) // block
    blocks = [torch.empty(block, dtype=torch.uint8).fill_(0) for _ in range(count)]
    del blocks


def check_agreement(case: Case) -> float:
    """Max abs difference of kernel and eager output (sanity check of the row)."""
    expected = case.eager(*case.args).float()
    return (case.kernel(*case.args).float() - expected).abs().max().item()


# -- CLI -----------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``bench ops`` on ``parser``."""
    parser.add_argument("--dtype", default=None, help="comma list of fp32, bf16, fp16 (default: fp32,bf16; "
                                                     "--quick: fp32)")
    parser.add_argument("--ops", default=",".join(OP_NAMES), help="comma list of ops (default: all)")
    parser.add_argument("--reps", type=positive_int, default=20, help="interleaved calls per round (default: 20)")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="timing rounds per row; the least disturbed one is reported (default: 3; --quick: 1)")
    parser.add_argument("--max-rounds", type=positive_int, default=None,
                        help="more rounds while others load the CPU, shared machines (default: 12; --quick: 1)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads before running")
    parser.add_argument("--no-inductor", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--variants", action="store_true",
                        help="also the other forms the passes match (adaLN with 1-D modulation, rope with general "
                             "tables and rotate_half, the written-out GELU formula, mul_add with a full y, glu with "
                             "the exact GELU and of two tensors)")
    parser.add_argument("--quick", action="store_true",
                        help="fp32, no Inductor, one round, with the variants (--dtype, --rounds and --max-rounds "
                             "still apply)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as JSON: per op the kernel that ran, whether its family is fused by "
                             "default on the device, the milliseconds, and the bytes it moves per second against a "
                             "copy's")
    parser.add_argument("--prefault-mib", type=int, default=1024,
                        help="heap to grow and touch first (CPU, with GLIBC_TUNABLES); 0: none")
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu; e.g. cuda, npu)")
    parser.add_argument("--calls-per-sample", type=positive_int, default=None,
                        help="consecutive calls per timed sample, one device sync each (default: 1 on CPU, 10 on "
                             "an accelerator)")


def _device_line(device: torch.device) -> str:
    if device.type == "cpu":
        return (f"CPU capability {torch.backends.cpu.get_cpu_capability()}; "
                f"mindiesd CPU kernels: {environment.cpu_kernels()}")
    if device.type == "cuda":
        return (f"device {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, "
                f"triton {environment.package_version('triton') or '-'}: {environment.triton_kernels()}")
    return f"device {device}"


def _device_ok(device: torch.device) -> Optional[str]:
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if device.type == "npu" and not (hasattr(torch, "npu") and torch.npu.is_available()):
        return "no NPU visible to torch (torch_npu imported?)"
    return None


def run(args: argparse.Namespace, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> int:
    """Execute a parsed ``bench ops`` command; returns the process exit status."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr

    def say(text: str = "", end: str = "\n") -> None:
        stdout.write(text + end)
        stdout.flush()

    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    with_inductor = not (args.no_inductor or quick)
    variants = args.variants or quick
    rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
    max_rounds = args.max_rounds if args.max_rounds is not None else (rounds if quick else 12)
    device = torch.device(args.device)
    problem = _device_ok(device)
    if problem:
        stderr.write(f"mindiesd bench ops: {problem}\n")
        return 2
    calls = args.calls_per_sample or (1 if device.type == "cpu" else 10)
    names = [n.strip() for n in args.ops.split(",") if n.strip()]
    unknown = [n for n in names if n not in OP_NAMES]
    dtypes = [t.strip() for t in (args.dtype or ("fp32" if quick else "fp32,bf16")).split(",") if t.strip()]
    bad_dtypes = [t for t in dtypes if t not in DTYPES]
    if unknown or bad_dtypes or not names or not dtypes:
        stderr.write(f"mindiesd bench ops: unknown op {unknown} or dtype {bad_dtypes}; ops: {', '.join(OP_NAMES)}; "
                     f"dtypes: {', '.join(DTYPES)}\n")
        return 2

    import mindiesd.ops

    if device.type == "cpu":
        mindiesd.ops.build_cpu_kernels()
    round_range = plural(rounds, "round") if max_rounds <= rounds else f"{rounds}-{max_rounds} rounds"
    say(f"torch {torch.__version__}, {plural(torch.get_num_threads(), 'thread')}, "
        f"{round_range} x {plural(args.reps, 'interleaved rep')} "
        f"(median; least disturbed round), {_device_line(device)}")
    if device.type == "cpu":
        tunables = os.environ.get("GLIBC_TUNABLES")
        if tunables and "mmap_threshold" in tunables:
            say(f"GLIBC_TUNABLES set: {tunables}")
            if args.prefault_mib > 0:
                prefault_heap(args.prefault_mib)
                say(f"heap grown by {args.prefault_mib} MiB of touched memory (outputs reuse it)")
        else:
            say(f"GLIBC_TUNABLES not set (large outputs page-fault on every op); recommended:\n"
                f"  GLIBC_TUNABLES={TUNABLES}")
    else:
        say(f"{plural(calls, 'consecutive call')} and one device sync per timed sample")
    say("floor: x.clone() (fresh output, like every candidate); copy_: into a preallocated output")
    if with_inductor:
        say("inductor: torch.compile(eager function), compiled once per row before timing "
            "(the first compile takes ~20-40 s)")

    rows = []
    with torch.no_grad():
        for tag in dtypes:
            for case in build_cases(DTYPES[tag], names, variants=variants, device=device):
                candidates: dict = {
                    "eager": lambda c=case: c.eager(*c.args),
                    "mindiesd": lambda c=case: c.kernel(*c.args),
                }
                if with_inductor:
                    say(f"  compiling {case.op} {tag} with Inductor ...", end="")
                    start = time.perf_counter()
                    compiled = torch.compile(case.eager)
                    compiled(*case.args)
                    synchronize(device)
                    say(f" {time.perf_counter() - start:.1f} s")
                    candidates["inductor"] = lambda c=case, f=compiled: f(*c.args)
                preallocated = torch.empty_like(case.source)
                candidates["clone"] = lambda c=case: c.source.clone()
                candidates["copy_"] = lambda c=case, out=preallocated: out.copy_(c.source)
                difference = check_agreement(case)
                timing = interleaved_medians(candidates, iters=args.reps, warmup=WARMUP, device=device,
                                             rounds=rounds, max_rounds=max_rounds, calls_per_sample=calls)
                rows.append((case, tag, timing, difference))
                del candidates, preallocated
    say(format_table(rows, args.markdown, with_inductor))
    warn_if_busy(stderr, [timing.spread for _, _, timing, _ in rows])
    if args.json:
        write_json(args.json, {"device": _device_line(device), "torch": torch.__version__,
                               "rows": json_rows(rows, device)})
    return 0


def _bytes(values: Any) -> int:
    """Bytes of the distinct tensors among ``values`` (a tensor read twice is read once)."""
    seen, total = set(), 0
    for value in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(value, (tuple, list)):
            total += _bytes(value)
        elif isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            total += value.numel() * value.element_size()
    return total


def json_rows(rows, device: torch.device) -> List[dict]:
    """The rows ``(case, dtype tag, Medians, max abs diff)`` as JSON objects: ``op``, ``shape``, ``dtype``,
    ``kernel`` (the implementation registered for the op on the device), ``enabled`` (its family fused there by
    default), ``eager_ms``, ``fused_ms``, ``inductor_ms``, ``copy_ms``, ``copy_gbps`` (the largest input copied:
    read and written), ``fused_gbps`` (the op's inputs read and output written per second), ``pct_copy_bw``,
    ``max_abs_diff`` and ``spread`` (the widest interquartile range of the candidates over their median)."""
    from mindiesd.compilation.families import FAMILIES, skip_reason
    from mindiesd.ops import registry

    out = []
    for case, tag, timing, difference in rows:
        m: Medians = timing
        name = case.op.split(":")[0]
        registered = registry.DEVICE_KERNELS.get(device.type, {}).get(name)
        implementation = registered if registered is not None else None
        kernel = (f"{getattr(implementation, '__module__', '?')}.{getattr(implementation, '__qualname__', '?')}"
                  if implementation is not None else "reference")
        with torch.no_grad():
            moved = _bytes(case.args) + _bytes(case.kernel(*case.args))
        copy_bytes = 2 * _bytes(case.source)
        fused_gbps = moved / (m["mindiesd"] * 1e6)
        copy_gbps = copy_bytes / (m["copy_"] * 1e6)
        out.append({
            "op": case.op, "shape": case.shape, "dtype": tag, "kernel": kernel,
            "enabled": name in FAMILIES and skip_reason(name, device.type) is None,
            "eager_ms": m["eager"], "fused_ms": m["mindiesd"], "inductor_ms": m.get("inductor"),
            "copy_ms": m["copy_"], "copy_gbps": copy_gbps, "fused_gbps": fused_gbps,
            "pct_copy_bw": 100.0 * fused_gbps / copy_gbps, "max_abs_diff": difference, "spread": m.spread,
        })
    return out


def format_table(rows, markdown: bool, with_inductor: bool) -> str:
    """The rows ``(case, dtype tag, Medians, max abs diff)`` as an aligned table, or as Markdown."""
    headers = ["op", "dtype", "shape", "eager ms", "mindiesd ms"]
    if with_inductor:
        headers.append("inductor ms")
    headers += ["clone ms", "copy_ ms", "eager/kernel"]
    if with_inductor:
        headers.append("kernel/inductor")
    headers += ["kernel/clone", "kernel/copy_", "max abs diff", "spread", "other load"]
    lines = []
    for case, tag, timing, difference in rows:
        m: Medians = timing
        kernel = m["mindiesd"]
        cells = [case.op, tag, case.shape, f"{m['eager']:.2f}", f"{kernel:.2f}"]
        if with_inductor:
            cells.append(f"{m['inductor']:.2f}")
        cells += [f"{m['clone']:.2f}", f"{m['copy_']:.2f}"]
        cells.append(f"{m['eager'] / kernel:.2f}x")
        if with_inductor:
            cells.append(f"{kernel / m['inductor']:.2f}x")
        load = "n/a" if m.foreign_load is None else f"{m.foreign_load:.2f}"
        cells += [f"{kernel / m['clone']:.2f}x", f"{kernel / m['copy_']:.2f}x"]
        cells += [f"{difference:.1e}", f"{m.spread:.0%}", load]
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        out += ["| " + " | ".join(cells) + " |" for cells in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(headers)]

    def aligned(cells):
        # Names left-aligned, numbers right-aligned.
        return "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([aligned(headers)] + [aligned(cells) for cells in lines])
