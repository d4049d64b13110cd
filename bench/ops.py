"""CPU benchmark of the mindiesd operators: eager sequence vs kernel vs Inductor vs copy.

One row per op x dtype x shape:

* rms_norm, adalayernorm, fast_gelu, mul_add: x [2, 4096, 1024]
  (rms_norm weight [1024]; adalayernorm scale/shift [2, 1, 1024];
  mul_add x * y + z with y a gate [2, 1, 1024] and z a residual like x);
* rope: x [1, 4096, 24, 128] (Flux layout), cos/sin float32 [1, 4096, 1, 128].

Columns (milliseconds; per round, the median of ``--reps`` interleaved calls
of all candidates, in one process).  Of ``--rounds`` rounds (more, up to
``--max-rounds``, while other processes keep the CPU busy) the round during
which other processes used the least CPU is reported; "other load" is that
use in cores (from /proc/stat), so a disturbed row is visible:

* eager: the op sequence the fusion passes match, run op by op;
* mindiesd: ``torch.ops.mindiesd.<op>.default`` (the active CPU kernel);
* inductor: ``torch.compile(<eager function>)`` (default backend), compiled
  once per row before timing;
* clone: ``x.clone()``, the bandwidth floor (it allocates a fresh output
  like every candidate; ``copy_`` into a preallocated output is shown too).

Ratios: eager/kernel (speedup), kernel/inductor, kernel/clone and kernel/copy_.
max abs diff: largest difference of the kernel's output from eager's (for bf16
the eager sequences round after every op, the kernels once).

Run it with glibc's malloc tuned so that large tensors are reused instead of
returned to the OS and page-faulted in again on every op::

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184:glibc.malloc.top_pad=268435456 \\
        python bench/ops.py [--dtype fp32,bf16] [--ops rms_norm,rope,...] [--reps 20]
                            [--rounds 3] [--max-rounds 12] [--prefault-mib 1024]
                            [--no-inductor] [--markdown] [--threads N]

glibc caps mmap_threshold at 32 MiB, so a block of 32 MiB or more (fp32
[2, 4096, 1024] is exactly 32 MiB, the rope tensor 48 MiB) is still mmap-ed
fresh, and page-faulted on first touch (about 10 ms per 32 MiB here), unless
the top of the heap has room for it.  With the tunables set, the script
therefore first grows the heap by ``--prefault-mib`` MiB of touched memory
(blocks below the threshold, freed again; the trim threshold keeps them), so
that every candidate's outputs come from reused memory, as in a long-running
process.  ``--prefault-mib 0`` measures the page faults instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import mindiesd.ops
from mindiesd.ops import _cpp_kernels

OPS = torch.ops.mindiesd
EPS = 1e-6
TUNABLES = (
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184:"
    "glibc.malloc.top_pad=268435456"
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OP_NAMES = ("rms_norm", "adalayernorm", "rope", "fast_gelu", "mul_add")
# Other processes' CPU use (cores) below which a timing round counts as quiet.
QUIET_LOAD = 0.1


def eager_rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def eager_adalayernorm(x, scale, shift):
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale) + shift


def eager_rope(x, cos, sin):
    """Flux apply_rotary_emb: interleaved pairs, full-width float32 cos/sin."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def eager_fast_gelu(x):
    return F.gelu(x, approximate="tanh")


def eager_mul_add(x, y, z):
    return x * y + z


@dataclass
class Case:
    op: str
    shape: str
    eager: Callable[..., torch.Tensor]
    kernel: Callable[..., torch.Tensor]
    args: tuple
    source: torch.Tensor


def build_cases(dtype: torch.dtype, names: list[str]) -> list[Case]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator).to(dt)

    cases = []
    for name in names:
        if name == "rms_norm":
            x, w = randn(2, 4096, 1024), randn(1024)
            cases.append(Case(name, "x[2,4096,1024] w[1024]", eager_rms_norm,
                              lambda x, w: OPS.rms_norm.default(x, w, EPS), (x, w), x))
        elif name == "adalayernorm":
            x, scale, shift = randn(2, 4096, 1024), randn(2, 1, 1024), randn(2, 1, 1024)
            cases.append(Case(name, "x[2,4096,1024] mod[2,1,1024]", eager_adalayernorm,
                              lambda x, s, h: OPS.adalayernorm.default(x, s, h, EPS),
                              (x, scale, shift), x))
        elif name == "rope":
            x = randn(1, 4096, 24, 128)
            cos = randn(1, 4096, 1, 64, dt=torch.float32).repeat_interleave(2, dim=-1)
            sin = randn(1, 4096, 1, 64, dt=torch.float32).repeat_interleave(2, dim=-1)
            cases.append(Case(name, "x[1,4096,24,128] cos[1,4096,1,128]", eager_rope,
                              lambda x, c, s: OPS.rope.default(x, c, s, True, x.dtype),
                              (x, cos, sin), x))
        elif name == "fast_gelu":
            x = randn(2, 4096, 1024)
            cases.append(Case(name, "x[2,4096,1024]", eager_fast_gelu,
                              lambda x: OPS.fast_gelu.default(x), (x,), x))
        elif name == "mul_add":
            x, y, z = randn(2, 4096, 1024), randn(2, 1, 1024), randn(2, 4096, 1024)
            cases.append(Case(name, "x[2,4096,1024] y[2,1,1024] z", eager_mul_add,
                              lambda x, y, z: OPS.mul_add.default(x, y, z), (x, y, z), x))
        else:
            raise SystemExit(f"unknown op {name!r}; choose from {', '.join(OP_NAMES)}")
    return cases


def foreign_cpu_seconds() -> float | None:
    """CPU seconds used so far by everything but this process (Linux), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    busy = sum(int(v) for v in fields[:8]) - int(fields[3]) - int(fields[4])  # minus idle, iowait
    return (busy - int(own[11]) - int(own[12])) / ticks  # utime, stime of all our threads


@dataclass
class Timing:
    medians: dict[str, float]
    foreign_load: float | None  # other processes' CPU use during the kept round, in cores


def timed_medians(
    candidates: dict[str, Callable[[], object]], reps: int, rounds: int, max_rounds: int
) -> Timing:
    """Median seconds per candidate, calling them round-robin ``reps`` times per round.

    Of at least ``rounds`` rounds the one during which other processes used
    the least CPU is kept (then the one with the lowest total); more rounds,
    up to ``max_rounds``, run while every round so far was disturbed.
    """
    for run in candidates.values():
        run()
        run()
    best: Timing | None = None
    for index in range(max(rounds, max_rounds)):
        if index >= rounds and best.foreign_load is not None and best.foreign_load < QUIET_LOAD:
            break
        samples: dict[str, list[float]] = {name: [] for name in candidates}
        foreign_start, wall_start = foreign_cpu_seconds(), time.perf_counter()
        for _ in range(reps):
            for name, run in candidates.items():
                start = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - start)
        foreign_end = foreign_cpu_seconds()
        load = None
        if foreign_start is not None and foreign_end is not None:
            load = max(0.0, foreign_end - foreign_start) / (time.perf_counter() - wall_start)
        timing = Timing({name: statistics.median(v) for name, v in samples.items()}, load)
        if best is None or _quieter(timing, best):
            best = timing
    return best


def _quieter(a: Timing, b: Timing) -> bool:
    if a.foreign_load is not None and b.foreign_load is not None:
        a_quiet, b_quiet = a.foreign_load < QUIET_LOAD, b.foreign_load < QUIET_LOAD
        if a_quiet != b_quiet:
            return a_quiet
        if not a_quiet and abs(a.foreign_load - b.foreign_load) > 0.05:
            return a.foreign_load < b.foreign_load
    return sum(a.medians.values()) < sum(b.medians.values())


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    parser.add_argument("--ops", default=",".join(OP_NAMES), help="comma list of ops")
    parser.add_argument("--reps", type=int, default=20, help="interleaved calls per round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds per row; the least disturbed one is reported")
    parser.add_argument("--max-rounds", type=int, default=12,
                        help="more rounds while others load the CPU (shared machines)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-inductor", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--prefault-mib", type=int, default=1024,
                        help="heap to grow and touch first (with GLIBC_TUNABLES); 0: none")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.ops.split(",") if n.strip()]
    dtypes = []
    for tag in args.dtype.split(","):
        if tag.strip() not in DTYPES:
            raise SystemExit(f"unknown dtype {tag!r}; choose from {', '.join(DTYPES)}")
        dtypes.append(tag.strip())

    mindiesd.ops.build_cpu_kernels()
    tunables = os.environ.get("GLIBC_TUNABLES")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds}-{args.max_rounds} rounds x {args.reps} interleaved reps "
          f"(median; least disturbed round), "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"mindiesd CPU kernels: {_cpp_kernels.cpu_kernel_implementation()}")
    if tunables and "mmap_threshold" in tunables:
        print(f"GLIBC_TUNABLES set: {tunables}")
        if args.prefault_mib > 0:
            prefault_heap(args.prefault_mib)
            print(f"heap grown by {args.prefault_mib} MiB of touched memory (outputs reuse it)")
    else:
        print(f"GLIBC_TUNABLES not set (large outputs page-fault on every op); recommended:\n"
              f"  GLIBC_TUNABLES={TUNABLES}")
    print("floor: x.clone() (fresh output, like every candidate); "
          "copy_: into a preallocated output")
    if not args.no_inductor:
        print("inductor: torch.compile(eager function), compiled once per row before timing "
              "(the first compile takes ~20-40 s)")
    sys.stdout.flush()

    rows = []
    with torch.no_grad():
        for tag in dtypes:
            for case in build_cases(DTYPES[tag], names):
                candidates: dict[str, Callable[[], object]] = {
                    "eager": lambda c=case: c.eager(*c.args),
                    "mindiesd": lambda c=case: c.kernel(*c.args),
                }
                if not args.no_inductor:
                    print(f"  compiling {case.op} {tag} with Inductor ...", end="", flush=True)
                    start = time.perf_counter()
                    compiled = torch.compile(case.eager)
                    compiled(*case.args)
                    print(f" {time.perf_counter() - start:.1f} s", flush=True)
                    candidates["inductor"] = lambda c=case, f=compiled: f(*c.args)
                preallocated = torch.empty_like(case.source)
                candidates["clone"] = lambda c=case: c.source.clone()
                candidates["copy_"] = lambda c=case, out=preallocated: out.copy_(c.source)
                difference = check_agreement(case)
                timing = timed_medians(candidates, args.reps, args.rounds, args.max_rounds)
                rows.append((case, tag, timing, difference))
                del candidates, preallocated
    print_table(rows, args.markdown, not args.no_inductor)


def print_table(rows, markdown: bool, with_inductor: bool) -> None:
    headers = ["op", "dtype", "shape", "eager ms", "mindiesd ms"]
    if with_inductor:
        headers.append("inductor ms")
    headers += ["clone ms", "copy_ ms", "eager/kernel"]
    if with_inductor:
        headers.append("kernel/inductor")
    headers += ["kernel/clone", "kernel/copy_", "max abs diff", "other load"]
    lines = []
    for case, tag, timing, difference in rows:
        m = timing.medians
        kernel = m["mindiesd"]
        cells = [case.op, tag, case.shape, f"{m['eager'] * 1e3:.2f}", f"{kernel * 1e3:.2f}"]
        if with_inductor:
            cells.append(f"{m['inductor'] * 1e3:.2f}")
        cells += [f"{m['clone'] * 1e3:.2f}", f"{m['copy_'] * 1e3:.2f}"]
        cells.append(f"{m['eager'] / kernel:.2f}x")
        if with_inductor:
            cells.append(f"{kernel / m['inductor']:.2f}x")
        load = "n/a" if timing.foreign_load is None else f"{timing.foreign_load:.2f}"
        cells += [f"{kernel / m['clone']:.2f}x", f"{kernel / m['copy_']:.2f}x"]
        cells += [f"{difference:.1e}", load]
        lines.append(cells)
    if markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "|".join("---" for _ in headers) + "|")
        for cells in lines:
            print("| " + " | ".join(cells) + " |")
        return
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(headers)]
    def aligned(cells):
        # Names left-aligned, numbers right-aligned.
        return "  ".join(
            c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    print(aligned(headers))
    for cells in lines:
        print(aligned(cells))


if __name__ == "__main__":
    main()
