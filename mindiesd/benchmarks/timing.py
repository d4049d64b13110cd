"""Interleaved timing: the one timing loop of the model bench (``mindiesd bench``), the op bench (``mindiesd bench
ops``) and the host bench (``mindiesd bench host``).

The candidates of one measurement run round-robin in one loop, so drift in clock speed or machine load hits them
alike, and the median of each is reported with its spread (the interquartile range over the median). Optionally
several rounds run and the one during which other processes used the least CPU is kept (read from /proc/stat on
Linux), so a disturbed measurement is visible and, on a shared machine, can be retried. :func:`unreliable` says
why timings just taken may not be trusted: a load average above the cores, or a wide spread.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from ..compilation.report import plural

__all__ = ["Medians", "interleaved_medians", "synchronize", "foreign_cpu_seconds", "QUIET_LOAD", "SPREAD_LIMIT",
           "relative_spread", "cores", "load_average", "unreliable"]

#: Other processes' CPU use (cores) below which a timing round counts as quiet.
QUIET_LOAD = 0.1

#: Spread (interquartile range over the median) of a runner's timed calls above which they count as unsteady.
SPREAD_LIMIT = 0.2


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu" and hasattr(torch, "npu"):
        torch.npu.synchronize()


def foreign_cpu_seconds() -> Optional[float]:
    """CPU seconds used so far by everything but this process (Linux), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    busy = sum(int(v) for v in fields[:8]) - int(fields[3]) - int(fields[4])  # minus idle, iowait
    return (busy - int(own[11]) - int(own[12])) / ticks  # utime, stime of all our threads


def relative_spread(samples: Sequence[float]) -> float:
    """The interquartile range of ``samples`` over their median (0 for fewer than two samples)."""
    median = statistics.median(samples) if samples else 0.0
    if len(samples) < 2 or median <= 0:
        return 0.0
    low, _, high = statistics.quantiles(samples, n=4, method="inclusive")
    return (high - low) / median


def cores() -> int:
    """The cores this process may run on: its affinity set where the OS has one, else the CPU count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> Optional[float]:
    """The machine's load average over the last minute, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def unreliable(spread: float, load: Optional[float] = None, cpus: Optional[int] = None) -> Optional[str]:
    """Why timings just taken may be unreliable, or None: the load average (``load``, default: the current one)
    above the cores (``cpus``, default: :func:`cores`), and/or a ``spread`` above :data:`SPREAD_LIMIT`."""
    load = load_average() if load is None else load
    cpus = cores() if cpus is None else cpus
    reasons = []
    if load is not None and load > cpus:
        reasons.append(f"load average {load:.1f} on {plural(cpus, 'core')}")
    if spread > SPREAD_LIMIT:
        reasons.append(f"timings spread {spread:.0%} around the median")
    return " and ".join(reasons) or None


class Medians(Dict[str, float]):
    """Runner name -> median milliseconds per call, of the round kept.

    ``foreign_load``: other processes' CPU use during that round, in cores (None where it cannot be read);
    ``rounds``: how many rounds ran; ``spreads``: runner name -> the :func:`relative_spread` of its calls in that
    round (0 where not given).
    """

    def __init__(self, medians: Dict[str, float], foreign_load: Optional[float], rounds: int = 1,
                 spreads: Optional[Dict[str, float]] = None):
        super().__init__(medians)
        self.foreign_load = foreign_load
        self.rounds = rounds
        self.spreads = {name: 0.0 for name in medians} if spreads is None else dict(spreads)

    @property
    def spread(self) -> float:
        """The widest spread of the runners (0 for none)."""
        return max(self.spreads.values(), default=0.0)

    def quieter_than(self, other: "Medians") -> bool:
        """Less disturbed by other processes than ``other`` (then: the lower total)."""
        a, b = self.foreign_load, other.foreign_load
        if a is not None and b is not None:
            a_quiet, b_quiet = a < QUIET_LOAD, b < QUIET_LOAD
            if a_quiet != b_quiet:
                return a_quiet
            if not a_quiet and abs(a - b) > 0.05:
                return a < b
        return sum(self.values()) < sum(other.values())


def _round(runners: Dict[str, Callable[[], Any]], iters: int, device: torch.device, calls: int) -> Medians:
    names = list(runners)
    samples: Dict[str, list] = {name: [] for name in names}
    foreign_start, wall_start = foreign_cpu_seconds(), time.perf_counter()
    for i in range(iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            run = runners[name]
            start = time.perf_counter()
            for _ in range(calls):
                run()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e3 / calls)
    foreign_end = foreign_cpu_seconds()
    load = None
    if foreign_start is not None and foreign_end is not None:
        load = max(0.0, foreign_end - foreign_start) / max(time.perf_counter() - wall_start, 1e-9)
    return Medians({name: statistics.median(values) for name, values in samples.items()}, load,
                   spreads={name: relative_spread(values) for name, values in samples.items()})


def interleaved_medians(
    runners: Dict[str, Callable[[], Any]],
    iters: int,
    warmup: int,
    device: torch.device | str = "cpu",
    *,
    rounds: int = 1,
    max_rounds: Optional[int] = None,
    calls_per_sample: int = 1,
) -> Medians:
    """Median milliseconds per call of each runner, timed round-robin in one loop.

    Each runner is first called ``warmup`` times. Each of ``iters`` iterations then times every runner once,
    rotating the starting runner so no runner always goes first (caches, clocks) and slow drift hits all alike.
    A sample is ``calls_per_sample`` consecutive calls and one ``synchronize(device)``, divided by the calls (on
    an accelerator that spreads the sync's latency). Of at least ``rounds`` such rounds the one during which
    other processes used the least CPU is kept (then the one with the lowest total); more rounds, up to
    ``max_rounds``, run while every round so far was disturbed.
    """
    if iters < 1 or rounds < 1 or calls_per_sample < 1:
        raise ValueError(f"iters, rounds and calls_per_sample must be at least 1, got {iters}, {rounds}, "
                         f"{calls_per_sample}")
    device = torch.device(device)
    max_rounds = rounds if max_rounds is None else max(rounds, max_rounds)
    for _ in range(warmup):
        for run in runners.values():
            run()
    synchronize(device)
    best: Optional[Medians] = None
    for index in range(max_rounds):
        if index >= rounds and (best.foreign_load is None or best.foreign_load < QUIET_LOAD):
            break
        timing = _round(runners, iters, device, calls_per_sample)
        if best is None or timing.quieter_than(best):
            best = timing
        best.rounds = index + 1
    return best
